"""Turning a failure of the writer's background threads into the StorageError callers see."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from ..errors import StorageError

__all__ = ["background_error"]

_ERRNO_RE = re.compile(r"errno\s*=\s*(\d+)")

#: What to do about a background failure, by errno (the message quotes the cause either way).
_FIXES = {
    errno.ENOSPC: "free disk space",
    errno.EDQUOT: "free space within your disk quota",
    errno.EMFILE: ("raise the open-file limit (ulimit -n), or pass a smaller max_open_files to "
                   "RunWriter (the writer keeps one file per handle written since the last flush "
                   "open, up to max_open_files)"),
    errno.ENFILE: "close other files (the system's open-file table is full)",
    errno.EIO: "check the device (an I/O error)",
    errno.EROFS: "record to a writable file system",
    errno.EACCES: "make the run directory writable",
}


def background_error(e: BaseException, path: Path | None, run_dir: Path) -> StorageError:
    """The :class:`StorageError` that ``write()``, ``flush()`` and ``close()`` raise for ``e``.

    Args:
        e: what the writer thread (or its compactor) raised; a StorageError is kept as it is.
        path: the file it was working on, if known (named in the message).
        run_dir: the run directory (named when no file is known).

    Returns:
        An error naming the file, the errno and what to do about it, with ``e`` as its cause.
    """
    if isinstance(e, StorageError):
        return e
    n = _errno_of(e)
    where = f" writing {str(path)!r}" if path else f" in {str(run_dir)!r}"
    code = f" [errno {n} {errno.errorcode.get(n, '?')}: {os.strerror(n)}]" if n else ""
    err = StorageError(
        f"hookline writer failed{where}{code}: {type(e).__name__}: {_short(e)}. Records flushed before this "
        f"error are safe; {_FIXES.get(n, 'fix the cause')} and start a new writer",
    )
    if n:
        err.errno = n
    err.__cause__ = e
    return err


def _errno_of(e: BaseException) -> int | None:
    """The errno of an OSError, or the one quoted in an HDF5 error message."""
    n = getattr(e, "errno", None)
    if isinstance(n, int):
        return n
    m = _ERRNO_RE.search(str(e))
    return int(m[1]) if m else None


def _short(e: BaseException, limit: int = 240) -> str:
    """One line of an exception message (HDF5's are multi-line and long)."""
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
