"""``writer_priority``: the writer's background threads at nice 19 by default, the caller's own
priority with ``"normal"``; bad values refused before anything is created."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest
import torch

from hookline.storage import RunWriter, open_run
from hookline.storage.errors import InvalidArgumentError
from hookline.storage.priority import NICE, lower_this_thread
from hookline.tracker import HookManager, Recorder

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("hookline-writer", "hookline-compactor"))]


def _nice(t: threading.Thread, want: int | None = None) -> int:
    """The thread's nice value (polled up to 10 s for ``want``: a thread lowers itself as it starts)."""
    deadline = time.monotonic() + 10
    while True:
        got = os.getpriority(os.PRIO_PROCESS, t.native_id)
        if want is None or got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)


def _record_two_steps(rec: Recorder) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    mgr = HookManager()
    mgr.register_forward_hook(rec.outputs, **{"0": model[0]})
    for s in range(2):
        with rec.step(s):
            model(torch.ones(2, 4))
    mgr.remove_all_hooks()


@linux
def test_a_recorders_writer_threads_run_at_nice_19_and_the_training_thread_keeps_its_own(tmp_path):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(_writer_threads())
    rec = Recorder(tmp_path / "run")
    try:
        new = [t for t in _writer_threads() if t not in before]
        assert {t.name.split("[")[0] for t in new} == {"hookline-writer", "hookline-compactor"}
        assert [_nice(t, max(NICE, mine)) for t in new] == [max(NICE, mine)] * len(new)
        assert os.getpriority(os.PRIO_PROCESS, 0) == mine
        _record_two_steps(rec)
    finally:
        rec.close()
    with open_run(tmp_path / "run") as r:
        assert list(r["outputs[0]"].steps) == [0, 1]


@linux
def test_normal_keeps_the_callers_priority(tmp_path):
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    before = set(_writer_threads())
    w = RunWriter(tmp_path / "run", writer_priority="normal")
    try:
        w.flush()  # (the writer thread has run)
        new = [t for t in _writer_threads() if t not in before]
        assert len(new) == 2 and [_nice(t) for t in new] == [mine, mine]
    finally:
        w.close()


def test_a_runwriter_at_nice_writes_what_it_is_given(tmp_path):
    w = RunWriter(tmp_path / "run", writer_priority="nice")
    w.add_handle("h", module_name="m", module_type="torch.nn.Linear", category="forward_hook", hook_fn_name="f")
    for s in range(3):
        w.write("h", s, 0, {"x": np.full((2, 3), s, np.float32)})
    w.close()
    with open_run(tmp_path / "run") as r:
        assert np.array_equal(r["h"]["x"][2], np.full((2, 3), 2, np.float32))


@pytest.mark.parametrize("bad", ["idle", "low", 19, None])
def test_a_bad_priority_is_refused_before_anything_is_created(tmp_path, bad):
    for make in (lambda p: Recorder(p, writer_priority=bad), lambda p: RunWriter(p, writer_priority=bad)):
        path = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
        with pytest.raises(InvalidArgumentError) as ei:
            make(path)
        assert isinstance(ei.value, ValueError)
        assert repr(bad) in str(ei.value) and "'nice'" in str(ei.value) and "'normal'" in str(ei.value)
        assert not path.exists()


@linux
def test_lowering_a_thread_leaves_the_others_alone():
    got: dict[str, int] = {}

    def low() -> None:
        assert lower_this_thread("nice")
        got["low"] = os.getpriority(os.PRIO_PROCESS, 0)

    mine = os.getpriority(os.PRIO_PROCESS, 0)
    t = threading.Thread(target=low)
    t.start()
    t.join()
    assert got["low"] == max(NICE, mine)
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    assert not lower_this_thread("normal")
