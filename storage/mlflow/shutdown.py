"""Interpreter exit: run the final MLflow uploads (and close recorders) once the main thread ends.

Callbacks registered with :func:`at_main_exit` run, last registered first, on a non-daemon thread
of their own that waits for the main thread to finish. Python waits for that thread before it
runs ``atexit`` handlers, and new threads can still be started there, so the final uploads
still run in parallel (on plain threads: ``concurrent.futures`` executors refuse new work once
the main thread has finished; Python 3.12 starts no thread at all then, and uploads go one at a
time). Other non-daemon threads may still be running when the callbacks run. Adapters register
with :func:`close_at_exit`; the Recorder registers its own closer after its adapter's, so it
finishes its files before the adapters' final uploads.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - see below
import logging
import os
import threading
import weakref
from typing import Callable, Protocol

__all__ = ["exit_timeout", "at_main_exit", "close_at_exit", "forget"]

log = logging.getLogger("hookline.mlflow")

# (The import above: mlflow imports concurrent.futures.thread, which registers a threading exit
# hook when imported, and Python refuses that once shutdown has begun. An adapter's first pass,
# which imports mlflow, may run then (a submit() just before the main thread returned), so the
# module is imported while an adapter is created.)


class ClosesAtExit(Protocol):
    """What :func:`close_at_exit` closes (an :class:`~.adapter.MlflowAdapter`)."""

    def close_at_exit(self) -> None:
        """Close within :func:`exit_timeout` seconds; log failures, never raise."""


_live: weakref.WeakSet[ClosesAtExit] = weakref.WeakSet()
_live_hooked = False
_calls: list[Callable[[], None]] = []  # at_main_exit callbacks, in registration order
_watcher: threading.Thread | None = None
_exiting = False  # the watcher has taken the callbacks: later ones go to atexit
_lock = threading.Lock()


def exit_timeout() -> float:
    """Seconds the uploads at interpreter exit may take: ``$HOOKLINE_MLFLOW_EXIT_TIMEOUT``,
    default (and for a value that is not a positive number) 120."""
    try:
        t = float(os.environ.get("HOOKLINE_MLFLOW_EXIT_TIMEOUT") or 120)
    except ValueError:
        return 120.0
    return t if t > 0 else 120.0


def at_main_exit(fn: Callable[[], None]) -> None:
    """Run ``fn`` at interpreter exit, as soon as the main thread has finished (see the module
    docstring); callbacks run last registered first. Registered once the main thread has
    finished (from another thread), ``fn`` goes to ``atexit`` instead.

    Args:
        fn: a callable without arguments; its exceptions are logged.
    """
    global _watcher
    with _lock:
        if not _exiting and threading.main_thread().is_alive():
            _calls.append(fn)
            if _watcher is None:
                _watcher = threading.Thread(target=_run_at_main_exit, name="hookline-exit", daemon=False)
                _watcher.start()
            return
    atexit.register(fn)


def close_at_exit(obj: ClosesAtExit) -> None:
    """Call ``obj.close_at_exit()`` at interpreter exit unless :func:`forget` was called for it
    first (``obj`` is held weakly)."""
    global _live_hooked
    with _lock:
        _live.add(obj)
        first, _live_hooked = not _live_hooked, True
    if first:
        at_main_exit(_close_live)


def forget(obj: ClosesAtExit) -> None:
    """``obj`` is closed: nothing to do for it at exit."""
    _live.discard(obj)


def _close_live() -> None:
    for obj in list(_live):
        obj.close_at_exit()


def _run_at_main_exit() -> None:
    global _exiting
    threading.main_thread().join()
    with _lock:
        _exiting = True
        calls = _calls[::-1]
        _calls.clear()
    for fn in calls:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - never raise at interpreter exit
            log.error("hookline: an exit hook failed: %s", e)


def _forget_after_fork() -> None:
    """A forked child (a DataLoader worker...) inherits the parent's callbacks but not the thread
    that runs them: it must neither close nor upload the parent's runs."""
    global _watcher, _exiting, _live_hooked, _lock
    _lock = threading.Lock()
    _calls.clear()
    _live.clear()
    _watcher, _exiting, _live_hooked = None, False, False


if hasattr(os, "register_at_fork"):  # (not on Windows)
    os.register_at_fork(after_in_child=_forget_after_fork)
