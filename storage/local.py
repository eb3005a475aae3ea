"""A run directory on the local file system, as the reader's source: :class:`LocalSource`.

Its manifests are parsed and checked once per process while their bytes stay the same (shared,
read-only, with every reader of the run: :meth:`LocalSource.shared_manifests`), every path taken
from them is confined to the run directory (:mod:`.confine`), and :meth:`LocalSource.settled`
tells the reader when a closed run's manifest names all of a handle's files, so that nothing is
listed (see docs/storage.md, Reader).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence

from ._parts import Discovery, discover_files
from .confine import RunRoot
from .errors import FormatError
from .format import MANIFEST_RE, check_manifest, manifest_name, read_manifest
from .live import not_sealed_yet
from .synthesise import synthesise_manifests

__all__ = ["LocalSource", "names_hint"]


def names_hint(names: Sequence[str], limit: int = 30) -> str:
    shown = ", ".join(repr(n) for n in list(names)[:limit])
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return f"[{shown}{more}]"


#: Manifests parsed and checked in this process, by resolved path: the file's bytes and what
#: they parse to (reused while the bytes are equal: JSON parsing and checking cost more than
#: reading; least recently used dropped beyond the bound). Shared read-only with every Run.
_MANIFESTS: OrderedDict[str, tuple[bytes, dict[str, Any]]] = OrderedDict()
_MANIFESTS_MAX = 64
_MANIFESTS_LOCK = threading.Lock()


def _read_bytes(path: str) -> tuple[bytes, int]:
    """The whole file at ``path``, and its modification time (ns)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        chunks = [os.read(fd, st.st_size + 1)]
        while chunks[-1]:
            chunks.append(os.read(fd, 1 << 20))
        return b"".join(chunks), st.st_mtime_ns
    finally:
        os.close(fd)


def _shared_manifest(path: Path, real: str) -> tuple[dict[str, Any], int | None]:
    """The parsed, checked manifest at ``path`` (``real``: its resolved path), shared: never
    modify it; and when it was written (ns; None when not known).

    Raises:
        FileNotFoundError: there is no file. FormatError: what :func:`read_manifest` raises.
    """
    try:
        raw, written = _read_bytes(real)
    except FileNotFoundError:
        raise
    except OSError:
        return read_manifest(path), None  # (raises the error that names the file)
    with _MANIFESTS_LOCK:
        hit = _MANIFESTS.get(real)
        if hit is not None and hit[0] == raw:
            _MANIFESTS.move_to_end(real)
            return hit[1], written
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return read_manifest(path), None  # (raises the error that names the file)
    check_manifest(obj, str(path))
    with _MANIFESTS_LOCK:
        _MANIFESTS[real] = (raw, obj)
        while len(_MANIFESTS) > _MANIFESTS_MAX:
            _MANIFESTS.popitem(last=False)
    return obj, written


class LocalSource:
    """A run directory on the local file system.

    Args:
        root: the run directory.
    """

    def __init__(self, root: str | os.PathLike[str]):
        self.root = Path(root)
        self._root = str(self.root)
        self._confined = RunRoot(self.root)  # (resolved once: every path of the run is checked against it)
        #: ids of the manifests :meth:`manifests` returned already checked (read_manifest checks them)
        self.checked: set[int] = set()
        #: when each manifest :meth:`shared_manifests` returned was written (ns), by id
        self._written: dict[int, int | None] = {}

    def manifests(self) -> list[dict[str, Any]]:
        """Parsed manifests (``manifest.json`` / ``manifest.rank<r>.json``); synthesised from the
        files' attributes when there is none. The caller owns them.

        Raises:
            FormatError: no manifest and no hookline file: not a run directory (perhaps a folder
                of runs, which the message names).
        """
        found = sorted(nm for nm in os.listdir(self.root) if MANIFEST_RE.fullmatch(nm))
        if found:
            out = [read_manifest(self._confined.file(n, what="manifest")) for n in found]
            self.checked = {id(m) for m in out}  # (read_manifest checked them: Run need not again)
            return out
        return self._synthesised()

    def shared_manifests(self) -> list[dict[str, Any]]:
        """The manifests as :meth:`manifests` finds them, checked, shared with every reader of
        the same bytes in this process (never modify them). A single-process run's
        ``manifest.json`` (``world_size`` null or 1) is its only manifest: the directory is
        listed only for a distributed run's ``manifest.rank<r>.json``.

        Raises:
            FormatError: as :meth:`manifests`.
        """
        self._written.clear()
        try:
            m, written = _shared_manifest(*self._confined.located(manifest_name(None, None), what="manifest"))
        except FileNotFoundError:
            m = None
        if m is not None and (m.get("world_size") or 1) <= 1:
            self._written[id(m)] = written
            return [m]
        found = sorted(nm for nm in os.listdir(self.root) if MANIFEST_RE.fullmatch(nm))
        if not found:
            return self._synthesised()
        out = []
        for n in found:
            path, real = self._confined.located(n, what="manifest")
            try:
                m, written = _shared_manifest(path, real)
            except FileNotFoundError:
                m, written = read_manifest(path), None  # (gone since listed: raises the error naming it)
            self._written[id(m)] = written
            out.append(m)
        return out

    def settled(self, manifest: dict[str, Any], rel: str) -> bool:
        """Whether nothing in the folder of file ``rel`` was added, renamed or removed at or after
        the time ``manifest`` (one :meth:`shared_manifests` returned) was written: then a closed
        run's manifest names all the handle's files. A continued run's writer creates its
        segments there, and the manifest that lists them comes later (or never: killed), so a
        folder changed since is listed. One ``stat``."""
        written = self._written.get(id(manifest))
        if written is None:
            return False
        folder = rel.rpartition("/")[0]
        try:
            changed = os.stat(os.path.join(self._root, folder) if folder else self._root).st_mtime_ns
        except OSError:
            return False
        return changed < written

    def _synthesised(self) -> list[dict[str, Any]]:
        manifests = synthesise_manifests(self.root)
        if not manifests:
            raise _not_a_run(self.root)
        self.checked = set()
        return manifests

    def path(self, rel: str) -> Path:
        """Local path of a file of the run.

        Raises:
            FormatError: ``rel`` leads outside the run directory or names something other than a
                regular file (:mod:`.confine`).
        """
        return self._confined.file(rel, what="file")

    def size(self, rel: str) -> int | None:
        """Size in bytes of a file of the run, or None when it is not there (or not a file of the run)."""
        try:
            return os.path.getsize(self._confined.file(rel, what="file"))
        except (OSError, FormatError):
            return None

    def files_bytes(self) -> int:
        """Bytes of every complete handle file (``.h5``, ``.h5seg``) in the run directory, its
        quarantine left out: one listing per folder, no path resolved per file (a run of 100,000
        handles is summed in about a second). Symlinks are not followed."""
        total = 0
        stack = [self._root]
        while stack:
            with os.scandir(stack.pop()) as it:
                for item in it:
                    if item.is_dir(follow_symlinks=False):
                        if item.name != ".quarantine":
                            stack.append(item.path)
                    elif item.name.endswith((".h5", ".h5seg")) and item.is_file(follow_symlinks=False):
                        total += item.stat(follow_symlinks=False).st_size
        return total

    def discover(self, key: str, suffix: str) -> Discovery:
        """The handle's complete files (final and sealed segments) in record order.

        Raises:
            FormatError: ``key`` leads outside the run directory.
        """
        return discover_files(self._confined, key, suffix)


def _not_a_run(root: Path) -> FormatError:
    """The error for a directory with no manifest and no hookline file of its own: perhaps a
    folder of runs (the demo's), which the message then names."""
    nested = sorted({p.parent for p in root.rglob("*.json") if MANIFEST_RE.fullmatch(p.name)
                     and ".quarantine" not in p.relative_to(root).parts} - {root})
    if nested:
        names = [str(p.relative_to(root)) for p in nested]
        return FormatError(f"{str(root)!r} is not a run directory (no manifest.json) but contains runs: "
                           f"{names_hint(names, 10)}; pass one of them")
    live = not_sealed_yet(root, f"{str(root)!r} has no manifest.json yet (written once a handle is declared)")
    return FormatError(live or (
        f"{str(root)!r} is not a hookline run directory: it has no manifest.json and no hookline "
        "handle files (a run directory is what a Recorder or RunWriter was given)"))
