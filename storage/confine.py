"""Every path derived from run content stays inside the run directory and names a regular file.

A run directory travels (colleagues share it, MLflow serves it back), so its manifest and file
names are untrusted input. Whatever hookline builds from them (a manifest's ``key`` or ``file``, a
name listed from the directory) goes through :class:`RunRoot` before anything is opened, read,
written, moved or uploaded:

* the name is relative, without ``..`` components, NUL or backslash characters;
* after symlinks it resolves inside the run directory (the run directory itself may be a
  symlink: it is resolved once);
* what is there is a regular file (checked with ``stat`` before opening: opening a FIFO blocks;
  a directory, socket or device is not data). A name with nothing behind it passes: the caller's
  open reports it as missing.

Anything else is a :class:`~.errors.FormatError` that names the entry, the run and the fix. The
checks cost a ``realpath`` and a ``stat`` per file (microseconds; opening an HDF5 file costs
hundreds).
"""

from __future__ import annotations

import os
import stat
from functools import cached_property
from pathlib import Path

from .errors import FormatError, StorageError

__all__ = ["RunRoot", "run_path", "check_relative", "clear_for_new_file"]

#: What to do about a refused entry (every message ends with it).
_FIX = ("hookline only reads, repairs and uploads regular files inside the run directory; "
        "`hookline verify --repair` on the run moves such entries aside and rewrites the manifest")

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def check_relative(rel: object, *, what: str, where: str) -> str:
    """The name ``rel`` if it is a relative path that stays below its base by its letters alone.

    Args:
        rel: a name from run content (a manifest's ``key`` or ``file``, a listed file name).
        what: what the name is, for the message (``"file of handle 'outputs[fc1]'"``).
        where: the run, for the message (a directory, or an MLflow run).

    Raises:
        FormatError: not a non-empty str, absolute, with a ``..`` component, a NUL or a backslash.
    """
    if not isinstance(rel, str) or not rel:
        why = f"is not a relative path (got {type(rel).__name__})"
    elif rel.startswith("/") or os.path.isabs(rel):
        why = "is an absolute path"
    elif ".." in rel.split("/"):
        why = "leads out of the run directory ('..')"
    elif "\x00" in rel or "\\" in rel:
        why = "contains a NUL or backslash character"
    else:
        return rel
    raise FormatError(f"{what} {rel!r} of run {where!r} {why}; {_FIX}")


class RunRoot:
    """A run directory, resolved once, that checks the paths derived from its content.

    Args:
        run_dir: the run directory (it may itself be a symlink).

    Attributes:
        path: the run directory as given (returned paths are below it).
        real: its resolved absolute path (resolved on first use).
    """

    def __init__(self, run_dir: str | os.PathLike[str]) -> None:
        self.path = run_dir if isinstance(run_dir, Path) else Path(run_dir)
        self._given = str(self.path)

    @cached_property
    def real(self) -> str:
        return os.path.realpath(self.path)

    @cached_property
    def _prefix(self) -> str:
        return self.real.rstrip(os.sep) + os.sep

    def resolve(self, rel: object, *, what: str) -> Path:
        """The resolved path of a name that stays inside the run after symlinks (whatever it
        names, if anything).

        Raises:
            FormatError: the name leads outside the run directory.
        """
        return Path(self._resolve(rel, what=what)[0])

    def _resolve(self, rel: object, *, what: str) -> tuple[str, os.stat_result | None]:
        """:meth:`resolve` as a str, with the ``lstat`` of what it names when the name was
        resolved without meeting a symlink (then it is also its ``stat``), else None."""
        rel = check_relative(rel, what=what, where=str(self.path))
        real, st = self._walk(self.real, rel)
        if real is None:
            real = os.path.realpath(self.path / rel)
        if not real.startswith(self._prefix):
            raise FormatError(f"{what} {rel!r} of run {str(self.path)!r} leads outside the run directory "
                              f"(through a symbolic link, to {real!r}); {_FIX}")
        return real, st

    @staticmethod
    def _walk(base: str, rel: str) -> tuple[str | None, os.stat_result | None]:
        """Follow ``rel`` below the directory ``base`` by one ``lstat`` per component
        (``realpath`` of the whole path costs one per component of the run directory's path
        too): ``(path, lstat)`` when every component exists and none is a symlink, else
        ``(None, None)`` (the caller resolves with ``realpath``). ``rel`` has no ``..``
        (:func:`check_relative`), so joining plain components cannot leave ``base``."""
        cur = base
        st = None
        for part in rel.split("/"):
            if part in ("", "."):
                continue
            cur = cur + os.sep + part if cur != os.sep else os.sep + part
            try:
                st = os.lstat(cur)
            except OSError:
                return None, None
            if stat.S_ISLNK(st.st_mode):
                return None, None
        return cur, st

    def file(self, rel: object, *, what: str) -> Path:
        """The path of a file of the run: inside it after symlinks, a regular file if present.

        Args:
            rel: the name relative to the run directory (``/``-separated).
            what: what the name is, for the message.

        Returns:
            ``run_dir / rel`` (not resolved; missing files are returned too).

        Raises:
            FormatError: the name leads outside the run, or names something other than a
                regular file (a FIFO, directory, socket, device).
            StorageError: what is there cannot be examined (permissions, I/O error).
        """
        return self.located(rel, what=what)[0]

    def located(self, rel: object, *, what: str) -> tuple[Path, str]:
        """:meth:`file`, and the path to open it by (inside the run: no component below the run
        directory is a symlink, or it is the resolved path).

        Raises:
            FormatError, StorageError: as :meth:`file`.
        """
        rel = check_relative(rel, what=what, where=str(self.path))
        # Below the run directory as given (whatever it resolves to: the run directory itself
        # may be a symlink): no component a symlink, so nothing leads out of it. Else resolved.
        real, st = self._walk(self._given, rel)
        if real is None:
            real, st = self._resolve(rel, what=what)
        path = self.path / rel
        try:
            mode = st.st_mode if st is not None else os.stat(real).st_mode
        except (FileNotFoundError, NotADirectoryError):
            return path, real  # (nothing there: the caller's open says so)
        except OSError as e:
            err = StorageError(f"cannot examine {what} {rel!r} of run {str(self.path)!r}: {e}")
            err.errno = e.errno
            raise err from e
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
            raise FormatError(f"{what} {rel!r} of run {str(self.path)!r} is {kind}, not a regular file; {_FIX}")
        return path, real

    def folder(self, rel: object, *, what: str) -> Path:
        """The path of a folder of the run (a key's directory): inside it after symlinks.

        Raises:
            FormatError: the name leads outside the run, or names something that is not a folder.
        """
        real = self.resolve(rel, what=what)
        if real.exists() and not real.is_dir():
            raise FormatError(f"{what} {rel!r} of run {str(self.path)!r} is not a directory; {_FIX}")
        return self.path / rel

    def key(self, key: object, *, what: str) -> str:
        """A handle key (file names are ``<key><suffix>.h5``...): relative, without ``..``, and
        its folder inside the run after symlinks.

        Raises:
            FormatError: the key, or its folder, leads outside the run.
        """
        key = check_relative(key, what=what, where=str(self.path))
        folder, _, _ = key.rpartition("/")
        if folder:
            self.folder(folder, what=f"{what} {key!r}: its folder")
        return key

    def entry(self, rel: object, *, what: str) -> Path:
        """The path of a name to move or remove (the entry itself, not what a symlink points
        to): its folder is inside the run after symlinks.

        Raises:
            FormatError: the name, or the folder holding it, leads outside the run.
        """
        rel = check_relative(rel, what=what, where=str(self.path))
        parent, _, _ = rel.rpartition("/")
        if parent:
            self.resolve(parent, what=what)
        return self.path / rel

    def inside(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` resolves (after symlinks) inside the run directory."""
        return os.path.realpath(path).startswith(self._prefix)


def run_path(run_dir: str | os.PathLike[str], rel: object, *, what: str) -> Path:
    """``RunRoot(run_dir).file(rel, what=what)``: one file of a run, checked (see :class:`RunRoot`)."""
    return RunRoot(run_dir).file(rel, what=what)


def clear_for_new_file(path: str | os.PathLike[str]) -> None:
    """Remove what is at ``path`` unless it is a regular file, before a new file is created
    there: a writer never writes through a symlink left in its place (into a file outside the
    run) nor blocks opening a FIFO.

    Raises:
        OSError: it cannot be removed (a directory is not removed).
    """
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISREG(mode):
        os.unlink(path)
