"""The bounds every fuzz case runs under: time (:func:`bounded`, :class:`Hang`), memory
(``RLIMIT_AS``), FIFOs that would block forever (:func:`fifo_unblocker`) and process isolation
(:func:`in_child`: HDF5 crashes the process on a few damaged files; a case runs in a forked child so
such a crash is one failed case, not the end of the test session)."""

from __future__ import annotations

import faulthandler
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

#: Seconds one operation of one case may take (each takes milliseconds on the small base runs).
BOUND_S = 5.0
#: Memory one operation may allocate beyond what the process has mapped when it starts.
MEMORY_MARGIN = 3 << 30


class Hang(BaseException):
    """An operation ran past :data:`BOUND_S` (a BaseException, so no ``except Exception`` in the
    code under test swallows it)."""


#: The FIFO helper (a separate process: a thread blocked in HDF5 holds the GIL, so no thread of
#: this process could run): from ``delay`` seconds on, every 0.2 s, open every FIFO under ``root``
#: read-write and close it, so an ``open()`` blocked on one returns and a ``read()`` sees EOF.
_FIFO_HELPER = """
import os, stat, sys, time
root, delay = sys.argv[1], float(sys.argv[2])
time.sleep(delay)
while True:
    for d, dirs, files in os.walk(root):
        for n in dirs + files:
            p = os.path.join(d, n)
            try:
                if stat.S_ISFIFO(os.lstat(p).st_mode):
                    os.close(os.open(p, os.O_RDWR | os.O_NONBLOCK))
            except OSError:
                pass
    time.sleep(0.2)
"""


@contextmanager
def fifo_unblocker(root: Path, delay: float = BOUND_S + 1) -> Iterator[None]:
    """While the block runs, a helper process unblocks anything stuck on a FIFO under ``root``
    after ``delay`` seconds. The default is a second past the time bound of the first operation,
    so the bound has fired (and is pending if the blocked thread did not get the signal) before
    the FIFO returns: a case stuck on a FIFO is reported as a hang, never as a normal result."""
    proc = subprocess.Popen([sys.executable, "-c", _FIFO_HELPER, str(root), str(delay)])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def bounded(what: str, seconds: float = BOUND_S) -> Iterator[None]:
    """Run the block under a time bound and a memory bound; raises :class:`Hang`.

    Time: SIGALRM after ``seconds`` (``setitimer``); its handler raises in the main thread as
    soon as that thread runs Python code again (a system call it is blocked in returns EINTR when
    the signal lands on it; a FIFO is unblocked by :func:`fifo_unblocker`). A hang in C code that
    holds the GIL cannot be interrupted from inside the process: ``faulthandler`` then dumps every
    thread's stack and ends the process ``seconds + 60`` s in (a crash, never a stuck CI job).
    Memory: ``RLIMIT_AS`` at what the process maps now plus :data:`MEMORY_MARGIN`, so allocating
    a declared huge size fails with MemoryError instead of taking the machine.
    """
    raised = []

    def on_alarm(signum: int, frame: Any) -> None:
        if not raised:
            raised.append(1)
            raise Hang(f"{what} still running after {seconds:.0f} s")

    old_handler = signal.signal(signal.SIGALRM, on_alarm)
    old_limit = resource.getrlimit(resource.RLIMIT_AS)
    limit = _mapped_bytes() + MEMORY_MARGIN
    if old_limit[1] == resource.RLIM_INFINITY or limit < old_limit[1]:
        resource.setrlimit(resource.RLIMIT_AS, (limit, old_limit[1]))
    faulthandler.dump_traceback_later(seconds + 60, exit=True)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        raised.append(1)  # (from here on a late SIGALRM raises nothing)
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        resource.setrlimit(resource.RLIMIT_AS, old_limit)
        signal.signal(signal.SIGALRM, old_handler)


def in_child(fn: Callable[[], Any], timeout: float) -> tuple[Any, str | None]:
    """``(fn(), None)`` computed in a forked child process, or ``(None, why)`` when the child
    died (``"killed by SIGSEGV"``: HDF5 crashes on some damaged files) or ran past ``timeout``
    seconds (it is then killed). ``fn`` returns something JSON can carry; an exception it raises
    comes back as ``why``. The child ends with ``os._exit`` (no pytest teardown, no atexit)."""
    r, w = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork in a process with threads)
        pid = os.fork()
    if pid == 0:  # the child
        os.close(r)
        try:
            payload = json.dumps({"value": fn()})
        except BaseException as e:  # noqa: BLE001 - everything goes back to the parent
            payload = json.dumps({"error": f"{type(e).__name__}: {e}"})
        with os.fdopen(w, "w") as fh:
            fh.write(payload)
        os._exit(0)
    os.close(w)
    chunks, deadline = [], time.monotonic() + timeout
    try:
        with os.fdopen(r, "rb") as fh:
            while True:
                ready, _, _ = select.select([fh], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    return None, f"did not finish in {timeout:.0f} s (killed)"
                chunk = os.read(fh.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    except BaseException:  # (e.g. the caller's own time bound): no child is left behind
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return None, f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    data = json.loads(b"".join(chunks) or b"{}")
    if "value" not in data:
        return None, data.get("error", f"exited with status {os.WEXITSTATUS(status)} and no result")
    return data["value"], None


def _mapped_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()
