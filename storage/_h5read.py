"""Reading one complete handle part: :func:`open_part` -> :class:`Part` -> :class:`PartField`.

Parts are opened read-only without a chunk cache; :class:`FileLRU` bounds how many a reader keeps
open. The layout is described in docs/format.md; the reader, verify and merges read through here,
so this is where a file that hookline did not write is refused: :func:`open_part` runs
:func:`~._h5check.check_structure` first (no data read), :class:`Part` checks the attributes
and index shapes at open (:mod:`._h5meta`: once per unchanged file and process), and every
index array is checked when loaded.
"""

from __future__ import annotations

import math
import os
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import h5py
import numpy as np
from h5py import h5d, h5f, h5p, h5s

from .hashes import check_entries
from ._h5check import Structure, checked_structure, damaged
from ._h5meta import FieldMeta, part_meta
from .errors import HooklineError, StorageError
from .format import INDEX_GROUP

__all__ = ["FileLRU", "Part", "PartField", "open_part", "open_file_id", "first_rows"]

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

    Attributes:
        dtype_name, layout, ndim, count, shape, info: the field's checked attributes
            (:class:`FieldMeta`).
    """

    def __init__(self, part: Part, meta: FieldMeta) -> None:
        self.part = part
        self.name = meta.name
        self._ds: h5py.Dataset | None = None
        self._gen = part.generation
        self._where = str(part.path)
        self.dtype_name = meta.dtype_name
        self.layout = meta.layout
        self.ndim = meta.ndim
        self.count = meta.count
        self.shape = meta.shape
        self.info = meta.info
        self._stored = meta.stored
        self._has_norm = meta.has_norm
        # One-record reads of a fixed field (of records with elements: h5py returns a scalar
        # for 0-d records, and an empty selection is its own case) go through _read_record.
        self._first = bool(self.shape) and all(self.shape)  # type: ignore[arg-type]
        #: Whether block reads may go through :meth:`_read_rows` (records with elements).
        self._lowlevel = self._first
        if self._first:
            self._mspace = h5s.create_simple(self.shape)
            self._bname = self.name.encode("utf-8")
            self._zeros = (0,) * len(self.shape)  # type: ignore[arg-type]
            self._count = (1, *self.shape)  # type: ignore[misc]
        self._records: np.ndarray | None = None
        self._norms: np.ndarray | None = None
        self._offsets: np.ndarray | None = None
        self._shapes: np.ndarray | None = None
        lru = part._lru
        #: hash blocks already checked (reads check the blocks they touch when the run verifies)
        self._checked: set[int] | None = set() if lru is not None and lru.verify_checksums else None

    def _read_record(self, j: int) -> np.ndarray:
        """Entry ``j`` of a fixed field with records of at least one element, read through
        HDF5's low-level calls: what ``ds[j]`` does, without building h5py's ``Dataset`` object
        (its lookup and construction cost several times a small record's read). For the first
        read of the field from this part; later reads use :attr:`ds` (h5py's compiled reader
        is the faster once the object exists)."""
        dsid = h5d.open(self.part.fid, self._bname)
        try:
            fspace = dsid.get_space()
            fspace.select_hyperslab((j,) + self._zeros, self._count)
            out = np.empty(self.shape, self._stored)  # type: ignore[arg-type]
            dsid.read(self._mspace, fspace, out)
        finally:
            dsid.close()
        return out

    @property
    def ds(self) -> h5py.Dataset:
        """The field's dataset (looked up again after the part's file was closed and reopened)."""
        f = self.part.f
        if self._ds is None or self._gen != self.part.generation:
            self._ds, self._gen = f[self.name], self.part.generation
        return self._ds

    def _load(self, name: str) -> np.ndarray:
        """Index dataset ``name``'s first :attr:`count` rows, as int64 (float64 for norms)."""
        path = f"{INDEX_GROUP}/{self.name}/{name}"
        arr = first_rows(self.part, path, self.count, f"field {self.name!r}: index {name!r}")
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
        """Entry ``j`` (0-based within this file) in its stored dtype.

        Raises:
            FormatError: the entry's data is damaged (also: it fails its chunk hash, when the
                run was opened with ``verify_checksums=True``).
        """
        if self._checked is not None:
            self._check(j, j + 1)
        if self.shape is not None:
            try:  # (no context manager on the one-record path: it costs as much as a small read)
                if self._first:
                    self._first = False  # (the next read builds the Dataset)
                    return self._read_record(j)
                return self.ds[j]
            except OSError as e:
                _raise_damage(e, self._where, f"field {self.name!r}: entry {j}")
        with _reading(self._where, f"field {self.name!r}: entry {j}"):
            shp = self.record_shape(j)
            off = int(self.offsets[j])
            return self.ds[off : off + math.prod(shp)].reshape(shp)

    def read_block(self, a: int, b: int, out: np.ndarray | None = None) -> np.ndarray:
        """Entries ``[a, b)`` of a fixed field, stacked, stored dtype; into ``out`` (C-contiguous,
        shape ``(b - a, *shape)``) when given, without an intermediate array."""
        if self._checked is not None:
            self._check(a, b)
        with _reading(self._where, f"field {self.name!r}: entries [{a}, {b})"):
            if (self._ds is None and self._lowlevel and 0 <= a < b <= self.count
                    and (out is None or out.flags.c_contiguous)):
                return self._read_rows(a, b, out)
            if out is None:
                return self.ds[a:b]
            self.ds.read_direct(out, np.s_[a:b])
            return out

    def _read_rows(self, a: int, b: int, out: np.ndarray | None) -> np.ndarray:
        """Entries ``[a, b)`` through HDF5's low-level calls (see :meth:`_read_record`): a merge
        reads each part's field once, and h5py's ``File`` and ``Dataset`` objects (and closing
        the file through them) cost more than a small part's whole read."""
        count = (b - a, *self.shape)  # type: ignore[misc]
        if out is None:
            out = np.empty(count, self._stored)
        dsid = h5d.open(self.part.fid, self._bname)
        try:
            fspace = dsid.get_space()
            fspace.select_hyperslab((a,) + self._zeros, count)
            dsid.read(h5s.create_simple(count), fspace, out)
        finally:
            dsid.close()
        return out

    def _check(self, a: int, b: int) -> None:
        """Check the chunk hashes of the blocks holding entries ``[a, b)`` (once per block)."""
        if self.shape is None and b > a:  # (ragged: the entries' elements)
            sizes = np.prod(self.shapes[a:b], axis=1) if self.ndim else np.ones(b - a, np.int64)
            a, b = int(self.offsets[a]), int(self.offsets[b - 1] + sizes[-1])
        with _reading(self._where, f"field {self.name!r}: entries [{a}, {b})"):
            check_entries(self, a, b, self._checked)


def first_rows(part: Part, name: str, n: int, what: str) -> np.ndarray:
    """The first ``n`` rows (fewer if the dataset is shorter: the caller checks) of the index
    dataset ``name`` of ``part``'s file, in its stored dtype: what ``part.f[name][:n]`` reads,
    through HDF5's low-level calls. Building h5py's ``File``, ``Group`` and ``Dataset`` objects
    (and closing the ``File``) costs several times reading a small index, and a table reads
    four indexes from each of thousands of files.

    Raises:
        FormatError: HDF5 fails to read it (a damaged file; see :func:`_reading`).
    """
    with _reading(str(part.path), what):
        dsid = h5d.open(part.fid, name.encode("utf-8"))
        try:
            fspace = dsid.get_space()
            dims = fspace.shape
            count = (min(n, dims[0]), *dims[1:])  # (index datasets are 1-D or 2-D: checked at open)
            dtype = part.stored_dtypes.get(name)
            out = np.empty(count, dsid.dtype if dtype is None else dtype)
            if out.size:
                fspace.select_hyperslab((0,) * len(count), count)
                dsid.read(h5s.create_simple(count), fspace, out)
        finally:
            dsid.close()
    return out


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
    open-file limit). Not for parts being merged: only readers use it.

    ``verify_checksums``: the run's reads check the chunk hashes (:mod:`.hashes`) of what they
    read (``open_run(..., verify_checksums=True)``)."""

    def __init__(self, capacity: int, verify_checksums: bool = False) -> None:
        self.capacity = max(1, capacity)
        self.verify_checksums = verify_checksums
        self._open: OrderedDict[int, Part] = OrderedDict()
        self._lock = threading.Lock()
        self.reopened = 0  # statistics (tests)
        self._last: Part | None = None  # the part touched last (it is at the end of _open)

    def touch(self, part: Part) -> None:
        """Mark ``part`` used now (its file is open); close the least recently used beyond capacity."""
        if self._last is part:  # (the usual case, read again: no lock; only set under it)
            return
        key = id(part)
        with self._lock:
            self._last = part
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
            if self._last is part:
                self._last = None


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

    def __init__(self, path: Path, fid: h5f.FileID, st: Structure, lru: FileLRU | None = None) -> None:
        self.path = path if isinstance(path, Path) else Path(path)
        self._fid: h5f.FileID | None = fid
        self._f: h5py.File | None = None  # (h5py's File object, made when a read needs it)
        self._lru = lru
        # Reopened by absolute path (the working directory may change) and only if it is still the
        # same file: a live run's writer may merge or replace it after the run was opened.
        self._abs = os.path.abspath(path)
        self._ident = _fd_identity(fid, self._abs) if lru is not None else None
        self._closed = False
        self.generation = 0  # bumped at every reopen (PartField looks its dataset up again)
        meta = part_meta(st, str(path))
        self._meta = meta
        self.stored_dtypes = st.dtypes  # (the checked structure's, shared: read-only)
        self.record_start = meta.record_start
        self.n = meta.n
        self.handle_id = meta.handle_id
        self.field_names: list[str] = meta.field_names
        self._steps: np.ndarray | None = None
        self._calls: np.ndarray | None = None
        self._fields: dict[str, PartField] = {}  # (made on first use: a read needs one field)
        if lru is not None:
            lru.touch(self)

    @property
    def attrs(self) -> dict[str, Any]:
        """The file's root attributes (a copy)."""
        return dict(self._meta.attrs)

    def _index(self, name: str) -> np.ndarray:
        arr = first_rows(self, name, self.n, f"index {name!r}").astype(np.int64, copy=False)
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
        """The field ``name`` of this part (one of :attr:`field_names`).

        Raises:
            KeyError: not a field of the part.
        """
        pf = self._fields.get(name)
        if pf is None:
            pf = self._fields[name] = PartField(self, self._meta.fields[name])
        return pf

    @property
    def fid(self) -> h5f.FileID:
        """The open file's low-level id (reopened if its LRU closed it).

        Raises:
            StorageError: the part was closed (its run was closed), or its file is gone or
                changed since (it is not reopened then).
        """
        fid = self._fid
        if fid is None:
            if self._closed:
                raise StorageError(f"{str(self.path)!r} was closed with its run; open the run again (open_run)")
            try:
                same = _identity(self._abs) == self._ident
                if same:
                    fid = open_file_id(self._abs)
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
            self._fid = fid
            self.generation += 1
            if self._lru is not None:
                self._lru.reopened += 1
        if self._lru is not None:
            self._lru.touch(self)
        return fid

    @property
    def f(self) -> h5py.File:
        """The open file as h5py's ``File`` (reopened if its LRU closed it).

        Raises:
            StorageError: as :attr:`fid`.
        """
        fid = self.fid
        f = self._f
        if f is None:
            f = self._f = h5py.File(fid)
        return f

    def _close_file(self) -> None:
        f, fid = self._f, self._fid
        self._f = self._fid = None
        try:
            _close_id(fid, f)
        except Exception:
            pass

    def close(self) -> None:
        """Close the file for good (a later use raises :class:`StorageError`)."""
        self._closed = True
        if self._lru is not None:
            self._lru.forget(self)
        self._close_file()
        # (each PartField refers back to its Part: left as a cycle, thousands of closed parts wait
        # for a full collection and slow every later HDF5 call of the process 1.5-2x)
        self._fields = {}


_FAPL: h5p.PropFAID | None = None


def open_file_id(path: str | os.PathLike[str]) -> h5f.FileID:
    """The low-level id of the file at ``path`` opened as ``h5py.File(path, "r",
    rdcc_nbytes=0)`` opens it, with its file-access property list built once (h5py builds one
    per open: a quarter of a small file's open) and no ``File`` object (:attr:`Part.f` makes it
    when a read needs it; a one-record read does not).

    Raises:
        OSError: HDF5 cannot open it (missing, not HDF5, truncated, unreadable).
    """
    global _FAPL
    fapl = _FAPL
    if fapl is None:  # (what h5py.File's make_fapl builds for these arguments)
        fapl = h5p.create(h5p.FILE_ACCESS)
        fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)
        fapl.set_alignment(1, 1)
        cache = list(fapl.get_cache())
        cache[2] = 0
        fapl.set_cache(*cache)
        _FAPL = fapl
    return h5f.open(os.fsencode(path), h5f.ACC_RDONLY, fapl=fapl)


def _close_id(fid: h5f.FileID | None, f: h5py.File | None = None) -> None:
    """Close a file opened by :func:`open_file_id`: through h5py's ``File`` (which closes every
    object still open in it first) when one was made or objects are open, else the id alone."""
    if f is None and fid is not None and fid.valid and h5f.get_obj_count(fid, h5f.OBJ_ALL) > 1:
        f = h5py.File(fid)  # (objects still open: closed with the file, as h5py does)
    if f is not None:
        f.close()
    elif fid is not None and fid.valid:
        fid.close()


def _identity(path: str | os.PathLike[str]) -> tuple[int, int, int, int]:
    """What tells one file from another at the same path: device, inode, size, mtime."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _fd_identity(fid: h5f.FileID, path: str) -> tuple[int, int, int, int]:
    """:func:`_identity` of the file ``fid`` has open (its descriptor: the file opened, even if
    ``path`` names another one by now)."""
    try:
        st = os.fstat(fid.get_vfd_handle())
    except Exception:  # (a driver without a descriptor)
        return _identity(path)
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
    fid = open_file_id(path)
    try:
        return Part(path, fid, checked_structure(fid, str(path)), lru)
    except BaseException as e:
        _close_id(fid, h5py.File(fid) if fid.valid else None)  # (and whatever the walk left open)
        if isinstance(e, (HooklineError, MemoryError)) or not isinstance(e, Exception):
            raise
        # (HDF5 reading damaged metadata: OSError, RuntimeError, KeyError, UnicodeDecodeError...)
        raise damaged(str(path), f"cannot read its structure: {type(e).__name__}: {e}") from e
