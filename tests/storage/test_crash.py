"""Crash safety: SIGKILL at random moments, full disk, failing writes."""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hookline.storage import RunWriter, StorageError, open_run, verify

sys.path.insert(0, str(Path(__file__).parent))
from _crash_writer import HID, fields  # noqa: E402
from _storage_support import wait_for_progress  # noqa: E402

HERE = Path(__file__).parent


def _check_survivors(run_dir: Path, flushed: int) -> int:
    if flushed == 0 and not (run_dir / "manifest.json").exists():
        return 0  # killed before the writer existed
    for p in run_dir.rglob("*.h5"):
        with h5py.File(p, "r") as f:  # plain open, no SWMR, no h5clear
            assert "step" in f
    run = open_run(run_dir)
    h = run[HID]
    n = len(h)
    assert n >= flushed, (n, flushed)
    assert h.steps.tolist() == list(range(n))
    o0, o1, g = h["outputs.0"], h["outputs.1"], h["grad_out.0"]
    assert len(o0) == n and len(o1) == n and len(g) == (n + 1) // 2
    check = sorted(set(range(min(n, 8))) | set(random.Random(n).sample(range(n), min(n, 25))) | {n - 1} if n else set())
    for i in check:
        ref = fields(i)
        assert np.array_equal(o0[i], ref["outputs.0"])
        assert np.array_equal(o1[i], ref["outputs.1"])
    gi = g.steps
    assert gi.tolist() == list(range(0, n, 2))
    if len(g):
        j = len(g) - 1
        assert g.to_torch(j).view(__import__("torch").int16).numpy().view(np.uint16).tolist() == [(2 * j) % 65536] * 33
    assert np.allclose(o0.norms()[check], [np.linalg.norm(fields(i)["outputs.0"]) for i in check])
    run.close()
    return n


#: (most trials, seconds, fewest trials): the default run kills a few writers; the ``slow`` variant
#: (CI) more of them, at more random points. Each kill comes a random moment after the writer's
#: first flush of the trial.
ROUNDS = [pytest.param(5, 60, 4, id="5-kills"), pytest.param(12, 90, 8, id="12-kills", marks=pytest.mark.slow)]


@pytest.mark.parametrize("most, seconds, fewest", ROUNDS)
def test_sigkill_at_random_points_keeps_every_flushed_record(tmp_path, most, seconds, fewest):
    rng = random.Random(1234)
    run_dir, progress = tmp_path / "run", tmp_path / "progress.txt"
    totals = []
    t_end = time.monotonic() + seconds
    trials = 0
    while trials < most and time.monotonic() < t_end:
        trials += 1
        before = progress.read_text().split() if progress.exists() else []
        # Each trial continues the same run (the writer resumes after the killed one).
        p = subprocess.Popen([sys.executable, str(HERE / "_crash_writer.py"), str(run_dir), str(progress),
                              str(rng.randrange(1 << 30))], cwd=tmp_path)
        wait_for_progress(progress, len(before), p)  # (a kill before the writer runs tests nothing)
        time.sleep(rng.uniform(0.0, 1.0))  # then a random moment: writing, flushing, closing, merging
        p.send_signal(signal.SIGKILL)
        p.wait()
        lines = progress.read_text().split() if progress.exists() else []
        flushed = int(lines[-1]) if lines else 0
        # the resumed writer starts after what was readable; its flush counts are absolute
        n = _check_survivors(run_dir, flushed)
        totals.append((flushed, n, len(lines) - len(before)))
    assert trials >= fewest
    assert totals[-1][1] > 0
    # verify(repair) makes the run clean: one .h5 per handle, everything readable stays readable
    n_before = len(open_run(run_dir)[HID])
    rep = verify(run_dir, repair=True)
    assert rep.ok, str(rep)
    assert sorted(p.name for p in (run_dir / "outputs").iterdir()) == ["blocks.0.h5"]
    assert _check_survivors(run_dir, n_before) == n_before
    assert verify(run_dir).ok


def _progress_flushes(progress: Path) -> list[int]:
    return [int(x) for x in progress.read_text().split()] if progress.exists() else []


def test_simulated_write_error_surfaces_and_keeps_flushed(run_dir, monkeypatch):
    from hookline.storage import _h5write

    w = RunWriter(run_dir, max_buffer_mb=1)
    w.add_handle(HID)
    for i in range(10):
        w.write(HID, i, 0, fields(i))
    w.flush()
    real = _h5write.FieldOut.append

    def failing(self, block):
        raise OSError(errno.EIO, "Input/output error (simulated)")

    monkeypatch.setattr(_h5write.FieldOut, "append", failing)
    with pytest.raises(StorageError) as ei:
        for i in range(10, 2000):  # blocks on the 1 MB budget until the failure wakes it
            w.write(HID, i, 0, fields(i))
        w.flush()
    msg = str(ei.value)
    assert "errno 5" in msg and "blocks.0" in msg and ".partial" in msg
    with pytest.raises(StorageError):
        w.flush()
    with pytest.raises(StorageError):
        w.close()
    assert w.close() is not None  # idempotent after the error was reported
    monkeypatch.setattr(_h5write.FieldOut, "append", real)
    h = open_run(run_dir)[HID]
    assert len(h) == 10 and np.array_equal(h["outputs.0"][9], fields(9)["outputs.0"])


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return r.returncode == 0


def test_full_disk_raises_storage_error_and_keeps_flushed(tmp_path, monkeypatch):
    mnt = tmp_path / "small"
    mounted = _mount_tmpfs(mnt, "2m")  # a real 2 MiB file system (needs root, as in CI)
    armed = [False]
    if not mounted:
        # Without root: the same scenario with ENOSPC raised where HDF5 writes the data.
        from hookline.storage import _h5write

        real = _h5write.FieldOut.append

        def append(self, block):
            if armed[0]:
                raise OSError(errno.ENOSPC, "No space left on device (simulated)")
            return real(self, block)

        monkeypatch.setattr(_h5write.FieldOut, "append", append)
    try:
        run_dir = mnt / "run"
        w = RunWriter(run_dir, max_buffer_mb=1)
        w.add_handle(HID)
        for i in range(5):
            w.write(HID, i, 0, fields(i))
        w.flush()
        armed[0] = True
        t0 = time.monotonic()
        with pytest.raises(StorageError) as ei:
            for i in range(5, 100000):
                w.write(HID, i, 0, fields(i))
                if i % 50 == 0:
                    w.flush()
        assert time.monotonic() - t0 < 30
        msg = str(ei.value)
        assert "errno 28" in msg or "No space" in msg, msg
        assert str(run_dir) in msg
        with pytest.raises(StorageError):
            w.close()
        monkeypatch.undo()
        h = open_run(run_dir)[HID]
        assert len(h) >= 5
        for i in range(len(h)):
            assert np.array_equal(h["outputs.0"][i], fields(i)["outputs.0"])
        for p in run_dir.rglob("*.h5"):
            h5py.File(p, "r").close()
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)
