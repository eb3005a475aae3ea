"""Reading one complete handle part: :func:`open_part` -> :class:`Part` -> :class:`PartField`.

Parts are opened read-only without a chunk cache; :class:`FileLRU` bounds how many a reader keeps
open. The layout is described in docs/format.md; the reader, verify and merges read through here.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from . import dtypes
from ._filters import ensure_filters
from .errors import FormatError, StorageError
from .format import FILE_FORMAT, FORMAT_VERSION, INDEX_GROUP

__all__ = ["FileLRU", "Part", "PartField", "open_part"]


def _attr_str(a: Any) -> str:
    if isinstance(a, bytes):
        return a.decode("utf-8")
    return str(a)


class PartField:
    """One field inside one complete file; index arrays load on first use."""

    def __init__(self, part: Part, name: str, ds: h5py.Dataset) -> None:
        self.part = part
        self.name = name
        self._ds = ds
        self._gen = part.generation
        at = ds.attrs
        try:
            self.dtype_name = _attr_str(at["dtype"])
            self.layout = _attr_str(at["layout"])
            self.ndim = int(at["ndim"])
            self.count = int(at["records"])
        except KeyError as e:
            raise FormatError(f"{str(part.path)!r}: field {name!r} lacks attribute {e}") from None
        self.info = dtypes.info(self.dtype_name)
        ensure_filters(getattr(ds, "_filters", None) or {})
        if self.layout == "fixed":
            self.shape: tuple[int, ...] | None = tuple(int(x) for x in at["shape"])
            if ds.shape[1:] != self.shape or ds.shape[0] < self.count:
                raise FormatError(f"{str(part.path)!r}: field {name!r} dataset shape {ds.shape} != attrs")
        elif self.layout == "ragged":
            self.shape = None
        else:
            raise FormatError(f"{str(part.path)!r}: field {name!r} has unknown layout {self.layout!r}")
        self._records: np.ndarray | None = None
        self._norms: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self._shapes: np.ndarray | None = None

    @property
    def ds(self) -> h5py.Dataset:
        """The field's dataset (looked up again after the part's file was closed and reopened)."""
        f = self.part.f
        if self._gen != self.part.generation:
            self._ds = f[self.name]
            self._gen = self.part.generation
        return self._ds

    def _g(self) -> h5py.Group:
        return self.part.f[INDEX_GROUP][self.name]

    @property
    def records(self) -> np.ndarray:
        """Global record numbers of this field's entries (ascending)."""
        if self._records is None:
            self._records = self._g()["record"][: self.count].astype(np.int64)
        return self._records

    @property
    def stored_norms(self) -> np.ndarray | None:
        """L2 norm of every entry as the writer stored it; None for dtypes without norms."""
        if self._norms is None:
            g = self._g()
            if "norm" not in g:
                return None
            self._norms = g["norm"][: self.count].astype(np.float64)
        return self._norms

    @property
    def offsets(self) -> np.ndarray:
        """Ragged field: offset of every entry in the flat dataset."""
        if self._offsets is None:
            self._offsets = self._g()["offset"][: self.count].astype(np.int64)
        return self._offsets

    @property
    def shapes(self) -> np.ndarray:
        """Ragged field: shape of every entry, ``(count, ndim)``."""
        if self._shapes is None:
            self._shapes = self._g()["shape"][: self.count].astype(np.int64).reshape(self.count, self.ndim)
        return self._shapes

    def record_shape(self, j: int) -> tuple[int, ...]:
        """Shape of entry ``j`` (0-based within this part)."""
        if self.shape is not None:
            return self.shape
        return tuple(int(x) for x in self.shapes[j])

    def read_stored(self, j: int) -> np.ndarray:
        """Entry ``j`` (0-based within this file) in its stored dtype."""
        if self.shape is not None:
            return self.ds[j]
        shp = self.record_shape(j)
        off = int(self.offsets[j])
        return self.ds[off : off + math.prod(shp)].reshape(shp)

    def read_block(self, a: int, b: int) -> np.ndarray:
        """Entries ``[a, b)`` of a fixed field, stacked, stored dtype."""
        return self.ds[a:b]


class FileLRU:
    """Keeps at most ``capacity`` parts' files open: using one more closes the least recently
    used one, which reopens on its next use (a reader of thousands of files stays under the
    open-file limit). Not for parts being merged: only readers use it."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._open: OrderedDict[int, Part] = OrderedDict()
        self._lock = threading.Lock()
        self.reopened = 0  # statistics (tests)

    def touch(self, part: Part) -> None:
        """Mark ``part`` used now (its file is open); close the least recently used beyond capacity."""
        with self._lock:
            key = id(part)
            if key in self._open:
                self._open.move_to_end(key)
                return
            self._open[key] = part
            while len(self._open) > self.capacity:
                _, old = self._open.popitem(last=False)
                old._close_file()

    def forget(self, part: Part) -> None:
        """Stop tracking ``part`` (it is being closed)."""
        with self._lock:
            self._open.pop(id(part), None)


class Part:
    """One complete handle file opened read-only (``rdcc_nbytes=0``: no chunk cache, so random
    access to one record reads only that record's chunks' bytes).

    With an ``lru``, the file may be closed between uses (see :class:`FileLRU`); metadata and the
    step/call indexes stay in memory.
    """

    def __init__(self, path: Path, f: h5py.File, lru: FileLRU | None = None) -> None:
        self.path = Path(path)
        self._f: h5py.File | None = f
        self._lru = lru
        # Reopened by absolute path (the working directory may change) and only if it is still the
        # same file: a live run's writer may merge or replace it after the run was opened.
        self._abs = Path(os.path.abspath(path))
        self._ident = _identity(self._abs) if lru is not None else None
        self._closed = False
        self.generation = 0  # bumped at every reopen (PartField looks its dataset up again)
        a = f.attrs
        try:
            if _attr_str(a["hookline_format"]) != FILE_FORMAT:
                raise FormatError(f"{str(path)!r} is not a hookline handle file")
            version = int(a["format_version"])
            self.record_start = int(a["record_start"])
            self.n = int(a["records"])
            self.handle_id = _attr_str(a["handle_id"])
        except KeyError as e:
            raise FormatError(f"{str(path)!r} is not a hookline handle file (missing attribute {e})") from None
        if version > FORMAT_VERSION:
            raise FormatError(
                f"{str(path)!r} has format_version {version}; this hookline reads <= {FORMAT_VERSION}: upgrade hookline"
            )
        self.attrs = {k: (_attr_str(v) if isinstance(v, (bytes, str)) else v) for k, v in a.items()}
        self.field_names: list[str] = json.loads(self.attrs.get("fields", "[]"))
        self._steps: np.ndarray | None = None
        self._calls: np.ndarray | None = None
        self._fields: dict[str, PartField] = {}
        if lru is not None:
            lru.touch(self)

    @property
    def steps(self) -> np.ndarray:
        """Step of every record of the part (loaded on first use)."""
        if self._steps is None:
            self._steps = self.f["step"][: self.n].astype(np.int64)
            if len(self._steps) != self.n:
                raise FormatError(f"{str(self.path)!r}: 'step' has {len(self._steps)} entries, expected {self.n}")
        return self._steps

    @property
    def calls(self) -> np.ndarray:
        """Call index of every record of the part (loaded on first use)."""
        if self._calls is None:
            self._calls = self.f["call"][: self.n].astype(np.int64)
            if len(self._calls) != self.n:
                raise FormatError(f"{str(self.path)!r}: 'call' has {len(self._calls)} entries, expected {self.n}")
        return self._calls

    def field(self, name: str) -> PartField:
        """The field ``name`` of this part (one of :attr:`field_names`)."""
        pf = self._fields.get(name)
        if pf is None:
            pf = self._fields[name] = PartField(self, name, self.f[name])
        return pf

    @property
    def f(self) -> h5py.File:
        """The open file (reopened if its LRU closed it).

        Raises:
            StorageError: the part was closed (its run was closed).
        """
        f = self._f
        if f is None:
            if self._closed:
                raise StorageError(f"{str(self.path)!r} was closed with its run; open the run again (open_run)")
            try:
                same = _identity(self._abs) == self._ident
                if same:
                    f = h5py.File(self._abs, "r", rdcc_nbytes=0)
            except FileNotFoundError as e:
                raise StorageError(
                    f"{str(self._abs)!r} is gone since the run was opened (the writer of a live run merges "
                    f"segments); open the run again (open_run)") from e
            except OSError as e:
                raise StorageError(f"cannot reopen {str(self._abs)!r}: {e}") from e
            if not same:
                raise StorageError(
                    f"{str(self._abs)!r} changed since the run was opened (the writer of a live or "
                    f"continued run merged or rewrote it); open the run again (open_run)")
            self._f = f
            self.generation += 1
            if self._lru is not None:
                self._lru.reopened += 1
        if self._lru is not None:
            self._lru.touch(self)
        return f

    def _close_file(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            try:
                f.close()
            except Exception:
                pass

    def close(self) -> None:
        """Close the file for good (a later use raises :class:`StorageError`)."""
        self._closed = True
        if self._lru is not None:
            self._lru.forget(self)
        self._close_file()


def _identity(path: Path) -> tuple[int, int, int, int]:
    """What tells one file from another at the same path: device, inode, size, mtime."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def open_part(path: Path, lru: FileLRU | None = None) -> Part:
    """Open a complete handle file read-only (kept open at most as ``lru`` allows).

    Raises:
        FormatError: not a hookline handle file / unsupported version.
        OSError: HDF5 cannot open it.
    """
    f = h5py.File(path, "r", rdcc_nbytes=0)
    try:
        return Part(path, f, lru)
    except Exception:
        f.close()
        raise
