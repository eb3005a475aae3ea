"""Helpers shared by the storage tests (imported as a top-level module: tests have no packages)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np

from hookline.storage import RunWriter

#: Python source for a child process measuring its own memory: ``rss_now()`` and ``rss_peak()``
#: (its high-water mark from /proc; ru_maxrss would keep the forking parent's).
RSS_CODE = """
import resource
def rss_now():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
def rss_peak():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
"""

HID = "outputs[blocks.0]"
GID = "grads[blocks.0]"


def add_std_handles(w: RunWriter) -> None:
    """Declare the two handles most tests use."""
    w.add_handle(HID, module_name="blocks.0", module_type="torch.nn.modules.linear.Linear",
                 category="forward_hook", hook_fn_name="outputs", meta={"kind": "outputs"})
    w.add_handle(GID, module_name="blocks.0", module_type="torch.nn.modules.linear.Linear",
                 category="backward_hook", hook_fn_name="grads")


def record_value(i: int, shape: tuple[int, ...] = (8, 16)) -> np.ndarray:
    """Deterministic float32 content of record ``i``."""
    return (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 0.5 + i).astype(np.float32)


def write_std_run(run_dir: Path, n: int = 20, flush_every: int | None = None, **kw) -> RunWriter:
    """Write ``n`` records to both handles (grad field only on even records); returns the open writer."""
    w = RunWriter(run_dir, **kw)
    add_std_handles(w)
    for i in range(n):
        w.write(HID, i, 0, {"outputs.0": record_value(i), "outputs.1": np.arange(i % 5 + 1, dtype=np.int64)})
        w.write(GID, i, 0, {"grad_out.0": record_value(-i)} if i % 2 == 0 else {})
        if flush_every and (i + 1) % flush_every == 0:
            w.flush()
    return w


def slow_disk(monkeypatch, s_per_mb: float) -> None:
    """Make every writer created from now on as slow as a disk of ``1 / s_per_mb`` MB/s: its
    thread sleeps ``s_per_mb`` per MiB written before it returns those bytes to the budget."""
    import time

    from hookline.storage.writer.queue import WriteQueue

    release = WriteQueue.release

    def slow_release(queue: WriteQueue, nbytes: int) -> None:
        time.sleep(s_per_mb * nbytes / (1 << 20))
        release(queue, nbytes)

    monkeypatch.setattr(WriteQueue, "release", slow_release)


def wait_for_partial(run_dir: Path, timeout: float = 10.0) -> None:
    """Wait until the writer started a ``.partial`` segment (it takes small records in batches,
    within ``WAKE_LATENCY_S``), so a snapshot of the directory shows unflushed records on disk."""
    import time

    deadline = time.monotonic() + timeout
    while not any(p.name.endswith(".partial") for p in run_dir.rglob("*")):
        assert time.monotonic() < deadline, f"no .partial segment appeared in {run_dir}"
        time.sleep(0.02)


def open_files_under(run_dir: Path, suffix: str = "") -> int:
    """Files under ``run_dir`` (ending in ``suffix``) this process holds open, from /proc/self/fd."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        n += target.startswith(str(run_dir)) and target.endswith(suffix)
    return n


def wait_for_progress(progress: Path, lines: int, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait until the writer ``proc`` has added a line to ``progress`` (beyond ``lines``): it got
    past its start-up and flushed once; polled, so a slow start costs only its own time."""
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end and proc.poll() is None:
        if progress.exists() and len(progress.read_text().split()) > lines:
            return
        time.sleep(0.01)
