"""Bounded, checked arguments (issue 34, cases 5, 7 and 8): each bad value is a hookline error
that quotes it, raised before anything is created or recorded; a run directory deleted while
its writer records is never re-created (docs/storage.md, "Argument limits")."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from hookline.storage import HookTypeError, InvalidArgumentError, RunWriter, StorageError, compare_runs, open_run
from hookline.tracker import HookManager, Recorder, StatsSpec, select


@pytest.mark.parametrize("bins", [10**9, 65537, 0, True, 2.0])
def test_stats_bins_are_bounded(bins):
    with pytest.raises(InvalidArgumentError, match=repr(bins)):
        StatsSpec(bins=bins)


def test_stats_bins_at_the_limit_are_accepted():
    assert StatsSpec(bins=65536).bins == 65536


@pytest.mark.parametrize("resume", ["yes", "false", 1, None])
def test_recorder_resume_must_be_a_bool(tmp_path, resume):
    with pytest.raises(HookTypeError, match=repr(resume)):
        Recorder(tmp_path / "run", resume=resume)
    assert not (tmp_path / "run" / "manifest.json").exists()


def test_recording_hook_refuses_an_empty_module_name(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    with Recorder(tmp_path / "run") as rec:
        with pytest.raises(InvalidArgumentError, match="module name '' is empty"):
            HookManager().register_forward_hook(rec.outputs, **select(model, "*"))
        HookManager().register_forward_hook(rec.outputs, **select(model, "?*"))  # the suggested fix works
        with rec.step(0):
            model(torch.ones(1, 2))
    with open_run(tmp_path / "run") as run:
        assert run.handles == ["outputs[0]"]


def test_step_indices_wants_an_int(tmp_path):
    with RunWriter(tmp_path / "run") as w:
        w.add_handle("h")
        w.write("h", 3, 0, {"x": np.zeros(2)})
    with open_run(tmp_path / "run") as run:
        f = run["h"]["x"]
        assert f.step_indices(3).tolist() == [0] and f.step_indices(np.int64(3)).tolist() == [0]
        for bad in ("a", 3.0, None, True):
            with pytest.raises(InvalidArgumentError, match=repr(bad)):
                f.step_indices(bad)


def test_add_handle_checks_the_category(tmp_path):
    with RunWriter(tmp_path / "run") as w:
        with pytest.raises(InvalidArgumentError, match="'sideways_hook'"):
            w.add_handle("h", category="sideways_hook")
        for ok in ("forward_hook", "forward_pre_hook", "backward_hook", ""):
            w.add_handle(f"h-{ok}", category=ok)
    with open_run(tmp_path / "run") as run:
        assert "h" not in run and len(run.handles) == 4


def test_compare_runs_refuses_an_empty_selection(tmp_path):
    for name in ("a", "b"):
        with RunWriter(tmp_path / name) as w:
            w.add_handle("h")
            w.write("h", 0, 0, {"x": np.ones(3)})
    for kw in ({"fields": []}, {"handles": []}, {"fields": [3]}):
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(next(iter(kw.values()))))):
            compare_runs(tmp_path / "a", tmp_path / "b", **kw)
    assert compare_runs(tmp_path / "a", tmp_path / "b", fields=None)


def test_deleted_run_directory_is_not_recreated(tmp_path):
    run = tmp_path / "run"
    w = RunWriter(run)
    w.add_handle("outputs[fc]")
    w.write("outputs[fc]", 0, 0, {"outputs.0": np.zeros(4, np.float32)})
    w.flush()
    w.write("outputs[fc]", 1, 0, {"outputs.0": np.zeros(4, np.float32)})
    shutil.rmtree(run)
    with pytest.raises(StorageError, match="was deleted"):
        w.close()
    assert not run.exists()
