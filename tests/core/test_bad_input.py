"""Bad input to the public entry points gets a hookline error that quotes the value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hookline.storage import (
    HooklineError,
    HookTypeError,
    InvalidArgumentError,
    RecordIndexError,
    RunWriter,
    UnknownNameError,
    open_run,
)
from hookline.tracker import HookManager, Recorder


@pytest.fixture
def run(tmp_path):
    model = torch.nn.Linear(2, 3)
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, lin=model)
        for step in (0, 5):
            with rec.step(step):
                model(torch.randn(1, 2))
    return open_run(tmp_path / "run")


@pytest.mark.parametrize("bad", [None, 123, 4.5])
def test_recorder_and_open_run_reject_non_paths(tmp_path, bad):
    with pytest.raises(HookTypeError, match=repr(bad)):
        Recorder(bad)
    with pytest.raises(HookTypeError, match=repr(bad)):
        open_run(bad)


def test_record_index_out_of_range(run):
    f = run["outputs[lin]"]["outputs.0"]
    with pytest.raises(RecordIndexError, match=r"record 10 .* 2 records") as e:
        f[10]
    assert isinstance(e.value, IndexError) and isinstance(e.value, HooklineError)
    with pytest.raises(RecordIndexError, match="99"):
        f.to_torch(99)
    np.testing.assert_array_equal(f[-1], f[1])


def test_at_step_rejects_unrecorded_and_non_int_steps(run):
    f = run["outputs[lin]"]["outputs.0"]
    assert f.at_step(5).shape == (1, 1, 3)
    with pytest.raises(UnknownNameError, match=r"step 99.*recorded steps: 0, 5"):
        f.at_step(99)
    with pytest.raises(InvalidArgumentError, match="'a'"):
        f.at_step("a")


def test_writer_rejects_negative_step(tmp_path):
    w = RunWriter(tmp_path / "w")
    w.add_handle("h[m]")
    with pytest.raises(InvalidArgumentError, match="step=-1"):
        w.write("h[m]", -1, 0, {"outputs.0": np.zeros(2)})
    w.close()


def test_register_source_refuses_bad_arguments_and_registers_nothing():
    from hookline.storage import HookTypeError, InvalidArgumentError
    from hookline.storage import sources

    before = list(sources._SOURCES)
    with pytest.raises(InvalidArgumentError, match="'no_colon'.*package.module:function"):
        sources.register_source(lambda text, uri: False, "no_colon")
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        sources.register_source(lambda text, uri: False, 42)
    with pytest.raises(HookTypeError, match="callable"):
        sources.register_source("runs:/", "a.b:c")
    assert sources._SOURCES == before
