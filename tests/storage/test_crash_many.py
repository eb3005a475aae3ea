"""Crash safety with many handles: SIGKILL at random moments of a writer whose flushes and
close() seal dozens of parts, most of them without an open file (more handles than
``max_open_files``: their files are created at the flush, ahead on another thread)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from hookline.storage import RunWriter, open_run, verify
from hookline.storage._fs import CreateAhead

from _storage_support import wait_for_progress

N_HANDLES = 40

#: The killed writer: sessions continuing the run, each writing a record to every handle per
#: step, flushing at random and closing; after each flush/close it logs the durable step count.
CHILD = textwrap.dedent("""
    import os, random, sys
    import numpy as np
    from hookline.storage import RunWriter, open_run
    run_dir, progress, seed, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    i = 0
    if os.path.exists(os.path.join(run_dir, "manifest.json")):
        run = open_run(run_dir)
        i = min(len(run[f"outputs[m{k}]"]) for k in range(n))
        run.close()
    with open(progress, "a") as prog:
        while True:
            w = RunWriter(run_dir, max_buffer_mb=8, fsync=False, max_open_files=4)
            for k in range(n):
                w.add_handle(f"outputs[m{k}]", module_name=f"m{k}", category="forward_hook",
                             hook_fn_name="outputs")
            for _ in range(rng.randint(3, 12)):
                for k in range(n):
                    w.write(f"outputs[m{k}]", i, 0, {"outputs.0": np.full((4, 8), i * 100 + k, np.float32)})
                i += 1
                if rng.random() < 0.3:
                    w.flush()
                    prog.write(f"{i}\\n"); prog.flush()
            w.close()
            prog.write(f"{i}\\n"); prog.flush()
""")


def _check(run_dir: Path, flushed: int) -> int:
    """Every handle holds at least the flushed steps, each record intact; returns the fewest."""
    if not (run_dir / "manifest.json").exists():
        assert flushed == 0
        return 0
    run = open_run(run_dir)
    fewest = None
    for k in range(N_HANDLES):
        h = run[f"outputs[m{k}]"]
        n = len(h)
        assert n >= flushed, (k, n, flushed)
        assert h.steps.tolist() == list(range(n))
        if n:
            vals = h["outputs.0"].read()
            assert vals.shape == (n, 4, 8)
            assert np.array_equal(vals[:, 0, 0], np.arange(n) * 100 + k)
        fewest = n if fewest is None else min(fewest, n)
    run.close()
    return fewest or 0


@pytest.mark.parametrize("most, seconds, fewest", [
    pytest.param(4, 60, 3, id="4-kills"),
    pytest.param(10, 90, 6, id="10-kills", marks=pytest.mark.slow),  # (CI: more kills, at more points)
])
def test_sigkill_while_sealing_many_parts_keeps_every_flushed_record(tmp_path: Path, most: int, seconds: float,
                                                                     fewest: int) -> None:
    rng = random.Random(24)
    run_dir, progress = tmp_path / "run", tmp_path / "progress.txt"
    trials, t_end, last = 0, time.monotonic() + seconds, 0
    while trials < most and time.monotonic() < t_end:
        trials += 1
        p = subprocess.Popen([sys.executable, "-c", CHILD, str(run_dir), str(progress),
                              str(rng.randrange(1 << 30)), str(N_HANDLES)], cwd=tmp_path)
        wait_for_progress(progress, len(progress.read_text().split()) if progress.exists() else 0, p)
        time.sleep(rng.uniform(0.0, 1.5))  # a random moment after the first flush: writing, sealing, closing
        p.send_signal(signal.SIGKILL)
        p.wait()
        lines = progress.read_text().split() if progress.exists() else []
        last = _check(run_dir, int(lines[-1]) if lines else 0)
    assert trials >= fewest
    assert last > 0
    rep = verify(run_dir, repair=True)
    assert rep.ok, str(rep)
    assert sorted(p.name for p in (run_dir / "outputs").iterdir()) == sorted(f"m{k}.h5" for k in range(N_HANDLES))
    assert _check(run_dir, last) >= last
    assert verify(run_dir).ok


def test_many_handles_through_few_open_files_close_to_one_file_each(tmp_path: Path) -> None:
    """A flush and a close of 64 parts with 4 open files: every record reads back, one ``.h5``
    per handle, no ``.partial`` or segment left."""
    w = RunWriter(tmp_path / "run", max_buffer_mb=8, fsync=True, max_open_files=4)
    for k in range(64):
        w.add_handle(f"outputs[m{k}]", module_name=f"m{k}", category="forward_hook", hook_fn_name="outputs")
    for step in range(6):
        for k in range(64):
            w.write(f"outputs[m{k}]", step, 0, {"outputs.0": np.full(5, step * 1000 + k, np.int32)})
        if step == 2:
            w.flush()
    w.close()
    names = sorted(p.name for p in (tmp_path / "run" / "outputs").iterdir())
    assert names == sorted(f"m{k}.h5" for k in range(64))
    run = open_run(tmp_path / "run")
    for k in range(64):
        assert run[f"outputs[m{k}]"]["outputs.0"].read()[:, 0].tolist() == [s * 1000 + k for s in range(6)]
    run.close()
    assert verify(tmp_path / "run").ok


def test_create_ahead_creates_missing_files_and_touches_no_existing_one(tmp_path: Path) -> None:
    outside = tmp_path / "outside.txt"
    outside.write_text("not the writer's")
    run = tmp_path / "run"
    (run / "a").mkdir(parents=True)
    kept = run / "a" / "kept.partial"
    kept.write_bytes(b"HDF5 bytes already written")
    link = run / "a" / "link.partial"
    os.symlink(outside, link)
    fresh = [run / "a" / "x.partial", run / "b" / "c" / "y.partial"]
    ahead = CreateAhead([kept, fresh[0], link, fresh[1]])
    t_end = time.monotonic() + 10
    while not fresh[1].exists() and time.monotonic() < t_end:  # (the last one: all were tried)
        time.sleep(0.01)
    ahead.stop()
    assert [p.stat().st_size for p in fresh] == [0, 0]  # (made, with their directories)
    assert kept.read_bytes() == b"HDF5 bytes already written"  # never truncated
    assert link.is_symlink() and outside.read_text() == "not the writer's"  # never followed
    assert not any(t.name == "hookline-create-ahead" and t.is_alive() for t in threading.enumerate())


def test_create_ahead_stops_before_the_rest(tmp_path: Path) -> None:
    """stop() returns with the thread gone: no file appears after it (a failed flush)."""
    paths = [tmp_path / f"{i}.partial" for i in range(20000)]
    ahead = CreateAhead(paths)
    ahead.stop()
    made = sum(p.exists() for p in paths)
    time.sleep(0.2)
    assert sum(p.exists() for p in paths) == made
    assert made < len(paths)  # (it did stop early)
