"""What a reader says about a run that is still being written and has sealed nothing yet.

A writer makes records readable by *sealing* them (docs/storage.md, "Crash safety"): at every
``flush()``, every ``autoflush_s`` seconds (:data:`AUTOFLUSH_S` by default) and at ``close()``.
Until then a live run has no manifest (no handle declared yet) or handles without records; the
reader says so, and how to seal, instead of "not a run" or "unknown field".
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["AUTOFLUSH_S", "writer_state", "not_sealed_yet"]

#: The default ``autoflush_s`` of a RunWriter and a Recorder: seconds between automatic seals
#: (cost measured in docs/performance.md, "Sealing while training runs").
AUTOFLUSH_S = 60.0

_HOW = (f"records become readable when the writer seals them: at rec.flush() (RunWriter.flush()), every "
        f"autoflush_s seconds (Recorder(autoflush_s=...), default {AUTOFLUSH_S:g}) and at close()")


def writer_state(run_dir: str | os.PathLike[str]) -> str | None:
    """``"live"`` when a writer holds one of the run's ``.writer*.lock`` files, ``"stopped"`` when
    such a file is left but nobody holds it (its writer died), None when there is none.

    The lock is probed with a shared, non-blocking ``flock`` that is released at once (only
    called when a read found nothing sealed)."""
    import fcntl

    state = None
    try:
        names = sorted(n for n in os.listdir(run_dir) if n.startswith(".writer") and n.endswith(".lock"))
    except OSError:
        return None
    for name in names:
        try:  # (never through a symlink, never blocking on a FIFO)
            fd = os.open(Path(run_dir) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return "live"
            state = "stopped"
        finally:
            os.close(fd)  # (releases the probe's lock)
    return state


def not_sealed_yet(run_dir: str | os.PathLike[str] | None, what: str, *, open_manifest: bool = False) -> str | None:
    """The message for ``what`` (e.g. ``"'runs/x' has no manifest yet"``) of a run that has sealed
    nothing: why, and how to seal; None when nothing shows that the run is open.

    Args:
        run_dir: the local run directory, whose writer lock is probed (None: not local).
        what: what was found missing, as the start of the message.
        open_manifest: the run's manifest says ``open`` (a live run, or one whose writer was
            killed: only the lock tells them apart).
    """
    state = writer_state(run_dir) if run_dir is not None else None
    if state is None and not open_manifest:
        return None
    if state == "stopped":
        return (f"{what}: its writer stopped before sealing it (a .writer*.lock file is left, held by no "
                "process); records it had not sealed are lost; `hookline verify` reports what survived")
    if state == "live":
        return f"{what}: the run is being written (a RunWriter holds its .writer*.lock) and has not sealed it yet; {_HOW}"
    return f"{what}: the run is open (still being written, or its writer was killed) and nothing of it is sealed; {_HOW}"
