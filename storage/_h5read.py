"""Reading one complete handle part: :func:`open_part` -> :class:`Part` -> :class:`PartField`.

Parts are opened read-only without a chunk cache; :class:`FileLRU` bounds how many a reader keeps
open. The layout is described in docs/format.md; the reader, verify and merges read through here,
so this is where a file that hookline did not write is refused: :func:`open_part` runs
:func:`~._h5check.check_structure` first (no data read), :class:`Part` and :class:`PartField`
check the attributes and index shapes at open, and every index array is checked when loaded.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np

from . import dtypes
from ._filters import ensure_filters
from ._h5check import HINT, Structure, attr_str, checked_structure, damaged
from .errors import FormatError, HooklineError, StorageError
from .format import FILE_FORMAT, FORMAT_VERSION, INDEX_GROUP, MAX_STEP, check_field_name

__all__ = ["FileLRU", "Part", "PartField", "open_part"]

#: Most dimensions a field's entries may have (torch allows 64).
_MAX_NDIM = 64


def _int_attr(attrs: Any, key: str, where: str, lo: int = 0, hi: int = MAX_STEP) -> int:
    """Attribute ``key`` as an int in ``[lo, hi]``."""
    v = attrs[key]
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        raise damaged(where, f"attribute {key!r} is {v!r:.60}, expected an integer from {lo} to {hi}")
    return int(v)


def _str_attr(attrs: Any, key: str, where: str) -> str:
    v = attrs[key]
    if not isinstance(v, (str, bytes)):
        raise damaged(where, f"attribute {key!r} is {v!r:.60}, expected a string")
    return attr_str(v)


#: Root attributes that are strings when present (docs/format.md section 3.1).
_STR_ATTRS = ("key", "module_name", "module_type", "category", "hook_fn_name", "hookline_version", "created",
              "run_uuid", "run_created")


def _check_root_attrs(a: dict[str, Any], where: str) -> None:
    """The registration attributes have their types; ``meta``/``run_meta`` are JSON objects."""
    for k in _STR_ATTRS:
        if k in a:
            _str_attr(a, k, where)
    for k in ("rank", "world_size"):
        if k in a:
            _int_attr(a, k, where, -1, 1 << 31)
    for k in ("meta", "run_meta"):
        if k in a:
            try:
                obj = json.loads(_str_attr(a, k, where))
            except (ValueError, RecursionError):
                obj = None
            if not isinstance(obj, dict):
                raise damaged(where, f"attribute {k!r} is {a[k]!r:.60}, expected a JSON object")


def _index_ds(st: Structure, name: str, count: int, where: str, cols: int | None = None) -> None:
    """Check index dataset ``name``: 1-D (2-D with ``cols`` columns) with at least ``count`` rows."""
    shape = st.shapes.get(name)
    want = (count,) if cols is None else (count, cols)
    if shape is None or len(shape) != len(want) or shape[0] < count or shape[1:] != want[1:]:
        got = "missing" if shape is None else f"of shape {shape}"
        raise damaged(where, f"index dataset {name!r} is {got}, expected {want}")


def _field_names(text: Any, where: str, st: Structure) -> list[str]:
    """The root attribute ``fields``: a JSON list of distinct field names, each a dataset."""
    try:
        names = json.loads(text)
    except (TypeError, ValueError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise damaged(where, f"attribute 'fields' is {text!r:.80}, expected a JSON list of distinct field names")
    for nm in names:
        try:
            check_field_name(nm)
        except HooklineError:
            raise damaged(where, f"attribute 'fields' lists {nm!r:.80}, which is not a field name") from None
        if nm not in st.shapes:
            raise damaged(where, f"field {nm!r} (in attribute 'fields') has no dataset")
    return names


def _ragged_sizes(offs: np.ndarray, shps: np.ndarray, extent: int, where: str, name: str) -> np.ndarray:
    """Elements of every entry of a ragged field, after checking its whole index: shapes are
    non-negative, entries lie one after another (``offset[j+1] == offset[j] + size[j]``, as every
    hookline writer and merge stores them) and inside the field's ``extent`` elements."""
    n = len(offs)
    if n == 0:
        return np.zeros(0, np.int64)
    what = f"field {name!r}: ragged index:"
    neg = np.nonzero((shps < 0).any(axis=1))[0]
    if neg.size:
        raise damaged(where, f"{what} entry {int(neg[0])} has shape {tuple(shps[neg[0]].tolist())}")
    # (float first: a product of corrupt dimensions must not wrap around in int64)
    fsz = np.prod(shps.astype(np.float64), axis=1) if shps.shape[1] else np.ones(n)
    big = np.nonzero(fsz > extent)[0]
    if big.size:
        j = int(big[0])
        raise damaged(where, f"{what} entry {j} has shape {tuple(shps[j].tolist())}, more elements than the "
                              f"field's data ({extent})")
    sizes = np.prod(shps, axis=1) if shps.shape[1] else np.ones(n, np.int64)
    ends = offs + sizes
    gap = np.nonzero(offs[1:] != ends[:-1])[0]
    if offs[0] < 0 or gap.size:
        j = int(gap[0]) + 1 if offs[0] >= 0 else 0
        expected = int(ends[j - 1]) if j else 0
        raise damaged(where, f"{what} entry {j} starts at element {int(offs[j])}, expected {expected} "
                              f"(entries are stored one after another; shape or offset corrupt)")
    if int(ends[-1]) > extent:
        raise damaged(where, f"{what} entries end at element {int(ends[-1])}, beyond the field's data ({extent})")
    return sizes


class PartField:
    """One field inside one complete file; index arrays load (and are checked) on first use.

    Raises:
        FormatError: (constructor) the field's attributes or index datasets are inconsistent.
    """

    def __init__(self, part: Part, name: str, st: Structure) -> None:
        self.part = part
        self.name = name
        self._ds: h5py.Dataset | None = None
        self._gen = part.generation
        w = self._where = str(part.path)
        at = st.attrs[name]
        try:
            self.dtype_name = _str_attr(at, "dtype", w)
            self.layout = _str_attr(at, "layout", w)
            self.ndim = _int_attr(at, "ndim", w, 0, _MAX_NDIM)
            self.count = _int_attr(at, "records", w, 0, part.n)
            shape_attr = at["shape"] if self.layout == "fixed" else None
        except KeyError as e:
            raise FormatError(f"{w!r}: field {name!r} lacks attribute {e} {HINT}") from None
        info = dtypes.lookup(self.dtype_name)
        if info is None:
            raise damaged(w, f"field {name!r} has unknown dtype {self.dtype_name!r:.60}")
        self.info = info
        stored = st.dtypes[name]
        if stored.newbyteorder("=") != info.storage:
            raise damaged(w, f"field {name!r} ({self.dtype_name}) is stored as {stored}, expected {info.storage}")
        ensure_filters(st.filters[name])
        shape = st.shapes[name]
        idx = f"{INDEX_GROUP}/{name}/"
        _index_ds(st, idx + "record", self.count, w)
        if self.layout == "fixed":
            shp = np.asarray(shape_attr)
            if shp.shape != (self.ndim,) or (shp.size and shp.dtype.kind not in "iu") or (shp < 0).any():
                raise damaged(w, f"field {name!r} has attribute shape {shape_attr!r:.60} for ndim {self.ndim}")
            self.shape: tuple[int, ...] | None = tuple(int(x) for x in shp)
            if shape[1:] != self.shape or shape[0] < self.count:
                raise damaged(w, f"field {name!r}: dataset shape {shape} != attributes (shape {self.shape}, "
                                  f"{self.count} records)")
        elif self.layout == "ragged":
            self.shape = None
            if len(shape) != 1:
                raise damaged(w, f"field {name!r}: ragged data of shape {shape}, expected 1-D")
            _index_ds(st, idx + "offset", self.count, w)
            _index_ds(st, idx + "shape", self.count, w, self.ndim)
        else:
            raise damaged(w, f"field {name!r} has unknown layout {self.layout!r:.60}")
        self._has_norm = idx + "norm" in st.shapes
        if self._has_norm:
            _index_ds(st, idx + "norm", self.count, w)
        self._records: np.ndarray | None = None
        self._norms: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self._shapes: np.ndarray | None = None

    @property
    def ds(self) -> h5py.Dataset:
        """The field's dataset (looked up again after the part's file was closed and reopened)."""
        f = self.part.f
        if self._ds is None or self._gen != self.part.generation:
            self._ds, self._gen = f[self.name], self.part.generation
        return self._ds

    def _g(self) -> h5py.Group:
        return self.part.f[INDEX_GROUP][self.name]

    def _load(self, name: str) -> np.ndarray:
        """Index dataset ``name``'s first :attr:`count` rows, as int64 (float64 for norms)."""
        with _reading(self._where, f"field {self.name!r}: index {name!r}"):
            arr = self._g()[name][: self.count]
        if len(arr) != self.count:
            raise damaged(self._where, f"field {self.name!r}: index {name!r} has {len(arr)} entries, "
                                        f"expected {self.count}")
        return arr.astype(np.float64 if name == "norm" else np.int64)

    @property
    def records(self) -> np.ndarray:
        """Global record numbers of this field's entries (checked: strictly increasing, inside
        the part's records)."""
        if self._records is None:
            rec = self._load("record")
            start, n = self.part.record_start, self.part.n
            if rec.size and (rec[0] < start or rec[-1] >= start + n or np.any(np.diff(rec) <= 0)):
                raise damaged(self._where, f"field {self.name!r}: record numbers out of range "
                                            f"[{start}, {start + n}) or not increasing")
            self._records = rec
        return self._records

    @property
    def stored_norms(self) -> np.ndarray | None:
        """L2 norm of every entry as the writer stored it; None for dtypes without norms."""
        if self._norms is None:
            if not self._has_norm:
                return None
            self._norms = self._load("norm")
        return self._norms

    def _ragged_index(self) -> None:
        """Load and check the ragged index (every entry's offset and shape) once."""
        offs = self._load("offset")
        shps = self._load("shape").reshape(self.count, self.ndim)
        _ragged_sizes(offs, shps, int(self.ds.shape[0]), self._where, self.name)
        self._offsets, self._shapes = offs, shps

    @property
    def offsets(self) -> np.ndarray:
        """Ragged field: offset of every entry in the flat dataset (checked with :attr:`shapes`)."""
        if self._offsets is None:
            self._ragged_index()
        return self._offsets  # type: ignore[return-value]

    @property
    def shapes(self) -> np.ndarray:
        """Ragged field: shape of every entry, ``(count, ndim)`` (checked with :attr:`offsets`)."""
        if self._shapes is None:
            self._ragged_index()
        return self._shapes  # type: ignore[return-value]

    def record_shape(self, j: int) -> tuple[int, ...]:
        """Shape of entry ``j`` (0-based within this part)."""
        if self.shape is not None:
            return self.shape
        return tuple(int(x) for x in self.shapes[j])

    def read_stored(self, j: int) -> np.ndarray:
        """Entry ``j`` (0-based within this file) in its stored dtype."""
        if self.shape is not None:
            try:  # (no context manager on the one-record path: it costs as much as a small read)
                return self.ds[j]
            except OSError as e:
                _raise_damage(e, self._where, f"field {self.name!r}: entry {j}")
        with _reading(self._where, f"field {self.name!r}: entry {j}"):
            shp = self.record_shape(j)
            off = int(self.offsets[j])
            return self.ds[off : off + math.prod(shp)].reshape(shp)

    def read_block(self, a: int, b: int) -> np.ndarray:
        """Entries ``[a, b)`` of a fixed field, stacked, stored dtype."""
        with _reading(self._where, f"field {self.name!r}: entries [{a}, {b})"):
            return self.ds[a:b]


@contextmanager
def _reading(where: str, what: str) -> Iterator[None]:
    """Turn HDF5's own read errors (a damaged chunk index, a chunk address beyond the file: an
    ``OSError`` without an errno) into the damage error naming the file; the machine's I/O errors
    (with an errno) pass unchanged."""
    try:
        yield
    except HooklineError:
        raise  # (already says what is wrong: a closed run, a refused file)
    except OSError as e:
        _raise_damage(e, where, what)


def _raise_damage(e: OSError, where: str, what: str) -> None:
    """Raise what :func:`_reading` makes of an ``OSError`` (a hookline error passes unchanged)."""
    if e.errno is not None or isinstance(e, HooklineError):
        raise e
    raise damaged(where, f"{what} does not read ({e})") from e


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
        key = id(part)
        with self._lock:
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
    access to one record reads only that record's chunks' bytes). Open it with
    :func:`open_part`, which checks the file's structure first.

    With an ``lru``, the file may be closed between uses (see :class:`FileLRU`); metadata and the
    step/call indexes stay in memory.

    Raises:
        FormatError: (constructor) not a hookline handle file, a newer format version, or
            attributes and index datasets that do not fit together.
    """

    def __init__(self, path: Path, f: h5py.File, st: Structure, lru: FileLRU | None = None) -> None:
        self.path = Path(path)
        self._f: h5py.File | None = f
        self._lru = lru
        # Reopened by absolute path (the working directory may change) and only if it is still the
        # same file: a live run's writer may merge or replace it after the run was opened.
        self._abs = Path(os.path.abspath(path))
        self._ident = _identity(self._abs) if lru is not None else None
        self._closed = False
        self.generation = 0  # bumped at every reopen (PartField looks its dataset up again)
        w = str(path)
        a = st.attrs[""]
        if a.get("hookline_format") != FILE_FORMAT:
            raise FormatError(f"{w!r} is not a hookline handle file (root attribute hookline_format is "
                              f"{a.get('hookline_format')!r:.60}, expected {FILE_FORMAT!r})")
        try:
            version = _int_attr(a, "format_version", w, 0, 1 << 31)
            self.record_start = _int_attr(a, "record_start", w)
            self.n = _int_attr(a, "records", w, 0, MAX_STEP - self.record_start)
            self.handle_id = _str_attr(a, "handle_id", w)
        except KeyError as e:
            raise FormatError(f"{w!r} is not a hookline handle file (missing attribute {e})") from None
        if version > FORMAT_VERSION:
            raise FormatError(
                f"{w!r} has format_version {version}; this hookline reads <= {FORMAT_VERSION}: upgrade hookline"
            )
        _check_root_attrs(a, w)
        self.attrs = dict(a)  # (the structure may be shared: see checked_structure)
        self.field_names: list[str] = _field_names(a.get("fields", "[]"), w, st)
        _index_ds(st, "step", self.n, w)
        _index_ds(st, "call", self.n, w)
        self._steps: np.ndarray | None = None
        self._calls: np.ndarray | None = None
        # Every field's attributes and index shapes are checked now (a damaged field is a
        # damaged file at open, not an error at some later read).
        self._fields: dict[str, PartField] = {nm: PartField(self, nm, st) for nm in self.field_names}
        if lru is not None:
            lru.touch(self)

    def _index(self, name: str) -> np.ndarray:
        with _reading(str(self.path), f"index {name!r}"):
            arr = self.f[name][: self.n].astype(np.int64)
        if len(arr) != self.n:
            raise damaged(str(self.path), f"{name!r} has {len(arr)} entries, expected {self.n}")
        return arr

    @property
    def steps(self) -> np.ndarray:
        """Step of every record of the part (loaded on first use)."""
        if self._steps is None:
            self._steps = self._index("step")
        return self._steps

    @property
    def calls(self) -> np.ndarray:
        """Call index of every record of the part (loaded on first use)."""
        if self._calls is None:
            self._calls = self._index("call")
        return self._calls

    def field(self, name: str) -> PartField:
        """The field ``name`` of this part (one of :attr:`field_names`)."""
        return self._fields[name]

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
    """Open a complete handle file read-only (kept open at most as ``lru`` allows), after
    :func:`~._h5check.checked_structure` (the structure walk, once per file per process):
    nothing outside the file is ever followed or read.

    Raises:
        FormatError: not a hookline handle file, an unsupported version, or damaged (anything
            :func:`check_structure` or :class:`Part` refuses, or HDF5 fails to read its metadata).
        OSError: HDF5 cannot open it (not HDF5, truncated, unreadable).
    """
    f = h5py.File(path, "r", rdcc_nbytes=0)
    try:
        return Part(path, f, checked_structure(f, str(path)), lru)
    except BaseException as e:
        f.close()
        if isinstance(e, (HooklineError, MemoryError)) or not isinstance(e, Exception):
            raise
        # (HDF5 reading damaged metadata: OSError, RuntimeError, KeyError, UnicodeDecodeError...)
        raise damaged(str(path), f"cannot read its structure: {type(e).__name__}: {e}") from e
