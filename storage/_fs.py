"""File system helpers of the storage layer: fsync, atomic publish, file creation ahead, the run lock, writeback, open-file limits.

Everything here talks to the operating system about files, never to HDF5: durability (fsync of
files and directories, atomic renames), the writer's exclusive lock on a run directory, kernel
writeback hints, and the share of ``ulimit -n`` a writer or reader may keep open.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterable

import h5py

from .confine import clear_for_new_file
from .errors import InvalidArgumentError, StorageError

__all__ = [
    "WRITEBACK_BYTES",
    "CreateAhead",
    "make_folder",
    "run_dir_gone",
    "Writeback",
    "atomic_write_json",
    "check_max_open_files",
    "fsync_dir",
    "fsync_file",
    "lock_run",
    "open_files_share",
    "publish",
    "start_writeback",
    "unlock_run",
]

#: Default bytes written to one file between two writeback kicks (see :func:`start_writeback`).
WRITEBACK_BYTES = 32 << 20


# --- durability ----------------------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames/creations inside it are durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # pragma: no cover - e.g. platforms without O_DIRECTORY
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """fsync a closed file's data and metadata."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_json(path: Path, obj: Any, *, fsync: bool = True) -> None:
    """Write JSON atomically: ``<path>.tmp`` + fsync + rename + fsync of the directory."""
    tmp = path.with_name(path.name + ".tmp")
    clear_for_new_file(tmp)  # (a symlink left at this name is not written through)
    data = json.dumps(obj, indent=1, sort_keys=False, allow_nan=True).encode("utf-8")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        fsync_dir(path.parent)


def publish(pairs: list[tuple[Path, Path]], fsync: bool) -> None:
    """Make complete files visible under their final names: (fsync each,) atomic renames, (fsync
    each directory once: a flush of many handles mostly shares one or two directories).

    Args:
        pairs: ``(temporary path, final path)`` of each file.
        fsync: make the files and the renames durable.
    """
    if fsync:
        for tmp, _ in pairs:
            fsync_file(tmp)
    for tmp, final in pairs:
        os.replace(tmp, final)
    if fsync:
        for d in {final.parent for _, final in pairs}:
            fsync_dir(d)


def make_folder(root: Path, folder: Path) -> None:
    """Create ``folder`` and the folders between it and the run directory ``root``, never ``root``
    itself: a run directory deleted while its writer runs is not re-created.

    Raises:
        StorageError: ``root`` does not exist (any more).
    """
    cur = root
    parts = folder.relative_to(root).parts
    if not parts and not root.is_dir():
        raise run_dir_gone(root)
    for part in parts:
        cur = cur / part
        try:
            os.mkdir(cur)
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise run_dir_gone(root) from None


def run_dir_gone(root: Path) -> StorageError:
    """The error of a writer whose run directory was deleted (or moved) while it wrote."""
    return StorageError(
        f"the run directory {str(root)!r} was deleted (or moved) while the writer was recording into it; "
        "the writer does not re-create it: records not flushed before are lost; start a new run (or restore "
        "the directory and resume)")


class CreateAhead:
    """Creates empty files on a thread of its own, ahead of the thread that will write them.

    Creating a file is kernel work that does not need the GIL nor HDF5's lock, and it can cost
    far more than writing a small file's bytes (measured on ext4 under churn: ~1 ms per file, of
    which ~0.6 ms CPU, against ~0.1 ms to write a 44 KB handle file's bytes). Sealing a flush of
    a thousand handles whose parts have no file yet creates them here while the writer thread
    does the HDF5 work of the ones before.

    A file is created only where nothing is (``O_CREAT | O_EXCL``): one the writer already made
    (or a symlink left at the name) is never truncated or written through; the writer still
    creates (truncating) every file itself, so a file made here is only ever the empty file the
    writer would have started from. Failures are ignored (the writer meets them again and
    reports them).

    Args:
        paths: the files, in the order the writer will want them.
        root: the run directory (folders are made inside it, never it: :func:`make_folder`).
    """

    def __init__(self, paths: Iterable[Path], root: Path | None = None) -> None:
        self._paths = list(paths)
        self._root = root
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="hookline-create-ahead", daemon=True)
        try:
            self._thread.start()
        except RuntimeError:  # (no new threads at interpreter exit: the writer creates them)
            self._thread = None

    def _run(self) -> None:
        made: set[Path] = set()
        for path in self._paths:
            if self._stop:
                return
            try:
                if path.parent not in made:
                    if self._root is None:
                        path.parent.mkdir(parents=True, exist_ok=True)
                    else:
                        make_folder(self._root, path.parent)
                    made.add(path.parent)
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
            except OSError:
                pass

    def stop(self) -> None:
        """Stop creating and wait for the thread (no file is created after this returns)."""
        self._stop = True
        if self._thread is not None:
            self._thread.join()


# --- the run lock --------------------------------------------------------------------------------

def _lock_path(run_dir: Path, suffix: str) -> Path:
    return run_dir / f".writer{suffix}.lock"


def lock_run(run_dir: Path, suffix: str) -> int:
    """Take an exclusive ``flock`` on ``<run_dir>/.writer<suffix>.lock`` (released on close or
    process death) so two writers never write the same rank of a run at once.

    Returns:
        The lock file's descriptor, for :func:`unlock_run`.

    Raises:
        StorageError: the lock file cannot be created, or another writer holds the lock.
    """
    import fcntl

    path = _lock_path(run_dir, suffix)
    try:
        clear_for_new_file(path)  # (a symlink left at this name is not followed)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        raise StorageError(f"cannot create lock file {str(path)!r}: {e}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return fd  # file system without flock (e.g. some NFS): run unlocked
        os.close(fd)
        raise StorageError(
            f"another RunWriter is writing {str(run_dir)!r}{' (' + suffix[1:] + ')' if suffix else ''} "
            f"(lock {str(path)!r} is held): close it first, or use another run directory / rank"
        ) from None
    return fd


def unlock_run(run_dir: Path, suffix: str, fd: int) -> None:
    """Remove the lock file of :func:`lock_run` (a clean close leaves nothing behind) and release
    the lock (best effort: called while closing)."""
    try:
        os.unlink(_lock_path(run_dir, suffix))
    except OSError:
        pass
    try:
        os.close(fd)  # releases the flock
    except OSError:
        pass


# --- writeback -----------------------------------------------------------------------------------

def start_writeback(fd: int) -> None:
    """Ask the kernel to start writing a file's dirty pages now, without waiting for them.

    ``posix_fadvise(POSIX_FADV_DONTNEED)`` starts asynchronous writeback of the dirty pages
    and drops the file's pages that are already clean. Done every few tens of MB, the disk
    works while the writer goes on (instead of the whole run landing at the final fsync), the
    page cache held by a long run stays bounded, and the user's data loader keeps its cache.
    Advisory: a platform without it, or an error, changes nothing but speed.
    """
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is None:
        return
    try:
        fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except OSError:
        pass


class Writeback:
    """Kicks writeback (:func:`start_writeback`) every ``nbytes`` written, over a set of files.

    One instance is shared by all files a writer has open, so a run of many small handle files
    (each far below ``nbytes``) still has its data on its way to the disk as it goes, not all
    of it at the final fsync. Every kick covers each file written to since the previous one.
    Used from one thread (the writer's).

    Args:
        nbytes: bytes between two kicks; 0 or None leaves writeback to the kernel.
    """

    def __init__(self, nbytes: int | None = WRITEBACK_BYTES) -> None:
        self.nbytes = nbytes or 0
        self._unkicked = 0
        self._dirty: dict[int, h5py.File] = {}

    def wrote(self, f: h5py.File, nbytes: int) -> None:
        """Count ``nbytes`` written to ``f``; kick every dirty file once enough added up."""
        if not self.nbytes:
            return
        self._dirty[id(f)] = f
        self._unkicked += nbytes
        if self._unkicked >= self.nbytes:
            self._unkicked = 0
            for g in self._dirty.values():
                if g.id.valid:
                    start_writeback(g.id.get_vfd_handle())
            self._dirty.clear()

    def forget(self, f: h5py.File) -> None:
        """Stop tracking a file (before it is closed)."""
        self._dirty.pop(id(f), None)


# --- open-file limits ----------------------------------------------------------------------------

def open_files_share(divisor: int, most: int) -> int:
    """``(soft open-file limit - 64) // divisor``, between 8 and ``most`` (64 files are left to
    torch, sockets and the rest of the process); ``most // 2`` where the limit cannot be read."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return most // 2
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return most
    return max(8, min(most, (soft - 64) // divisor))


def check_max_open_files(value: Any, divisor: int, most: int) -> int:
    """A ``max_open_files`` argument: a positive int, or None for :func:`open_files_share`.

    Raises:
        InvalidArgumentError: anything else.
    """
    if value is None:
        return open_files_share(divisor, most)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"max_open_files must be a positive int or None (from ulimit -n), got {value!r}")
    return value
