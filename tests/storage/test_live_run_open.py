"""Reading a run that is being written and has sealed nothing yet says so, and how to seal,
instead of "not a hookline run directory" or "unknown field ... available: []"."""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from hookline.storage import FormatError, RunWriter, UnknownNameError, open_run
from hookline.storage.live import AUTOFLUSH_S, writer_state
from hookline.tracker import HookManager, Recorder, select


def _recorder(run_dir, register: bool) -> tuple[Recorder, torch.nn.Module]:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    rec = Recorder(run_dir, autoflush_s=None)
    if register:
        HookManager().register_forward_hook(rec.outputs, **select(model, "0"))
    return rec, model


def test_live_run_without_a_handle_says_it_is_being_written(run_dir):
    rec, _ = _recorder(run_dir, register=False)
    try:
        assert writer_state(run_dir) == "live"
        with pytest.raises(FormatError) as e:
            open_run(run_dir)
        text = str(e.value)
        assert "is being written" in text and "not a hookline run directory" not in text
        assert "rec.flush()" in text and "autoflush_s" in text
    finally:
        rec.close()
    assert writer_state(run_dir) is None  # a clean close leaves no lock


def test_field_of_a_live_run_with_nothing_sealed_says_how_to_seal(run_dir):
    rec, model = _recorder(run_dir, register=True)
    x = torch.randn(2, 4)
    with rec.step(0):
        y = model(x)
    deadline = time.monotonic() + 60
    while not (run_dir / "manifest.json").exists():  # (the writer thread writes it once the handle is declared)
        assert time.monotonic() < deadline
        time.sleep(0.01)
    run = open_run(run_dir)
    assert run.status == "open" and run.handles == ["outputs[0]"]
    with pytest.raises(UnknownNameError) as e:
        run["outputs[0]"]["outputs.0"]
    text = str(e.value)
    assert "no sealed record yet" in text and "is being written" in text and "rec.flush()" in text
    rec.flush()
    got = open_run(run_dir)["outputs[0]"]["outputs.0"]
    np.testing.assert_array_equal(got[0], y.detach().numpy())  # sealed: readable, nothing damaged
    rec.close()
    closed = open_run(run_dir)["outputs[0]"]
    with pytest.raises(UnknownNameError, match="unknown field 'outputs.9'.*available: \\['outputs.0'\\]"):
        closed["outputs.9"]


def test_writer_killed_before_sealing_is_told_apart(run_dir):
    code = textwrap.dedent(f"""
        import os, time
        import numpy as np
        from hookline.storage import RunWriter
        w = RunWriter({str(run_dir)!r}, autoflush_s=None)
        w.add_handle("outputs[a]", module_name="a")
        w.write("outputs[a]", 0, 0, {{"outputs.0": np.ones(3, np.float32)}})
        while not os.path.exists({str(run_dir / 'manifest.json')!r}):
            time.sleep(0.01)
        os._exit(0)  # killed: no seal, no close
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert writer_state(run_dir) == "stopped"
    with pytest.raises(UnknownNameError, match="writer stopped before sealing it"):
        open_run(run_dir)["outputs[a]"]["outputs.0"]


def test_recorder_and_writer_share_the_shorter_default():
    for cls in (Recorder, RunWriter):
        assert inspect.signature(cls).parameters["autoflush_s"].default == AUTOFLUSH_S <= 60
