"""One complete hookline handle file (a final ``.h5`` or a sealed ``.h5seg``): writing, opening,
merging. The layout is described in docs/format.md; the writer, reader and verify share this code.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

import h5py
import numpy as np

from . import dtypes
from .errors import FormatError, InvalidArgumentError, StorageError
from .format import (
    FILE_FORMAT,
    FORMAT_VERSION,
    INDEX_GROUP,
    flat_chunk,
    index_chunk,
    record_chunk,
)

__all__ = ["FieldSpec", "HandleFileWriter", "WRITEBACK_BYTES", "Writeback", "start_writeback", "Part", "PartField", "open_part",
           "merge_parts", "compression_kwargs"]

#: Bytes per read block when copying (merge): bounds merge memory.
COPY_BLOCK_BYTES = 64 << 20
#: Default bytes written to one file between two writeback kicks (see :func:`start_writeback`).
WRITEBACK_BYTES = 32 << 20


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
    """

    def __init__(self, nbytes: int | None = WRITEBACK_BYTES) -> None:
        self.nbytes = nbytes or 0
        self._unkicked = 0
        self._dirty: dict[int, h5py.File] = {}

    def wrote(self, f: h5py.File, nbytes: int) -> None:
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


#: Compression levels each leveled filter accepts (HDF5's deflate; zstd's range in hdf5plugin).
_LEVELS = {"gzip": range(0, 10), "zstd": range(1, 23)}


def compression_kwargs(spec: str | None) -> dict[str, Any]:
    """h5py ``create_dataset`` keyword arguments for a compression spec.

    Args:
        spec: ``None``/``"none"``, ``"gzip"`` (level 4) or ``"gzip-<level>"``, ``"lzf"``,
            ``"zstd"`` (level 1) or ``"zstd-<level>"``, ``"lz4"``.
    """
    from .errors import InvalidArgumentError

    if spec is None or spec == "none":
        return {}
    name, dash, level = spec.partition("-")
    levels = _LEVELS.get(name)
    if levels is not None and dash:
        if not (level.isdigit() and int(level) in levels):
            raise InvalidArgumentError(
                f"compression {spec!r}: the {name} level must be an integer from {levels[0]} to {levels[-1]}, "
                f"got {level!r} (e.g. '{name}-{levels[0]}')")
    elif name in ("lzf", "lz4") and dash:
        raise InvalidArgumentError(f"compression {spec!r}: {name} has no level; use {name!r}")
    if name == "gzip":
        return {"compression": "gzip", "compression_opts": int(level or 4), "shuffle": False}
    if name == "lzf":
        return {"compression": "lzf"}
    if name in ("zstd", "lz4"):
        import hdf5plugin

        if name == "zstd":
            return dict(hdf5plugin.Zstd(clevel=int(level or 1)))
        return dict(hdf5plugin.LZ4())

    raise InvalidArgumentError(
        f"unknown compression {spec!r}; use None, 'gzip', 'gzip-<0..9>', 'lzf', 'zstd', 'zstd-<1..22>' or 'lz4'"
    )


class FieldSpec:
    """Static description of a field inside one file being written."""

    __slots__ = ("name", "dtype_name", "info", "ragged", "shape", "ndim", "compression")

    def __init__(self, name: str, dtype_name: str, ragged: bool, shape: tuple[int, ...], compression: str | None):
        self.name = name
        self.dtype_name = dtype_name
        self.info = dtypes.info(dtype_name)
        self.ragged = ragged
        self.shape = shape  # per-record shape (fixed), or the first record's shape (ragged)
        self.ndim = len(shape)
        self.compression = compression


class _FieldOut:
    """A field dataset being appended to, plus its index lists (written at finish)."""

    def __init__(self, f: h5py.File, spec: FieldSpec, expected: int, owner: HandleFileWriter):
        self.owner = owner
        self.spec = spec
        st = spec.info.storage
        kw = compression_kwargs(spec.compression)
        self.direct = not kw
        if spec.ragged:  # expected counts elements
            self.chunk = flat_chunk(st.itemsize, expected)
            self.ds = f.create_dataset(spec.name, shape=(0,), maxshape=(None,), dtype=st, chunks=self.chunk, **kw)
        else:
            self.chunk = record_chunk(spec.shape, st.itemsize, expected)
            self.ds = f.create_dataset(
                spec.name, shape=(0, *spec.shape), maxshape=(None, *spec.shape), dtype=st, chunks=self.chunk, **kw
            )
            # Direct chunk writes only when a chunk holds whole records.
            self.direct = self.direct and tuple(self.chunk[1:]) == tuple(spec.shape)
        self.n = 0  # entries along axis 0 (records for fixed, elements for ragged)
        self._tail = () if spec.ragged else tuple(spec.shape)
        self.records: list[np.ndarray] = []
        self.norms: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        self.shapes: list[np.ndarray] = []

    def _extend(self, n: int) -> None:
        # Low-level set_extent: h5py's Dataset.resize re-reads shape, maxshape and chunks through
        # its Python layer on every call (tens of us holding the GIL, per block).
        self.ds.id.set_extent((n, *self._tail))

    def append(self, block: np.ndarray) -> None:
        """Append ``block`` (``(k, *shape)`` for fixed, 1-D for ragged) to the dataset."""
        k = block.shape[0]
        if k == 0:
            return
        a, b = self.n, self.n + k
        self._extend(b)
        c0 = self.chunk[0]
        if self.direct and a % c0 == 0 and block.flags.c_contiguous:
            full = (k // c0) * c0
            zeros = (0,) * (block.ndim - 1)
            for j in range(0, full, c0):
                self.ds.id.write_direct_chunk((a + j, *zeros), block[j : j + c0])
            if full < k:
                self.ds[a + full : b] = block[full:]
        else:
            self.ds[a:b] = block
        self.n = b
        self.owner.wrote(block.nbytes)


    def append_records(self, arrays: list[np.ndarray]) -> None:
        """Append records of a one-record-per-chunk field: one resize, one direct chunk write
        per record straight from its memory (no assembly copy)."""
        k = len(arrays)
        if k == 0:
            return
        a = self.n
        self._extend(a + k)
        zeros = (0,) * len(self.spec.shape)
        wdc = self.ds.id.write_direct_chunk
        nbytes = 0
        for j, arr in enumerate(arrays):
            wdc((a + j, *zeros), arr)
            nbytes += arr.nbytes
        self.n = a + k
        self.owner.wrote(nbytes)


class HandleFileWriter:
    """Writes one complete handle file; call :meth:`finish` to write the indexes and close it.

    Args:
        path: file to create (truncated).
        attrs: root attributes (see docs/format.md); ``records``/``record_start`` are set by finish.
        record_start: global record number of this file's first record.
        writeback: a :class:`Writeback` shared with the writer's other open files, or a byte
            count for one of this file's own; 0 or None leaves writeback to the kernel.
    """

    def __init__(self, path: Path, attrs: dict[str, Any], record_start: int,
                 writeback: Writeback | int | None = WRITEBACK_BYTES):
        self.path = Path(path)
        self.f = h5py.File(self.path, "w", rdcc_nbytes=0)
        self.writeback = writeback if isinstance(writeback, Writeback) else Writeback(writeback)
        self.attrs = attrs
        self.record_start = record_start
        self.steps: list[np.ndarray] = []
        self.calls: list[np.ndarray] = []
        self.n_records = 0
        self.fields: dict[str, _FieldOut] = {}

    def field(self, spec: FieldSpec, expected: int) -> _FieldOut:
        """Return the output of a field, creating its dataset on first use."""
        out = self.fields.get(spec.name)
        if out is None:
            out = self.fields[spec.name] = _FieldOut(self.f, spec, expected, self)
        return out

    def wrote(self, nbytes: int) -> None:
        """Count field bytes handed to HDF5 (writeback is kicked as they add up)."""
        self.writeback.wrote(self.f, nbytes)

    def add_index(self, steps: np.ndarray, calls: np.ndarray) -> None:
        """Append record index entries (one per record)."""
        self.steps.append(np.asarray(steps, dtype=np.int64))
        self.calls.append(np.asarray(calls, dtype=np.int64))
        self.n_records += len(steps)

    def finish(self, extra_attrs: dict[str, Any] | None = None) -> None:
        """Write ``step``/``call``, every field's index datasets and the attributes; close."""
        f = self.f
        n = self.n_records
        for name, parts in (("step", self.steps), ("call", self.calls)):
            arr = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            f.create_dataset(name, data=arr, maxshape=(None,), chunks=index_chunk(n))
        idx = f.create_group(INDEX_GROUP)
        for name, out in self.fields.items():
            spec = out.spec
            g = idx.create_group(name)
            rec = np.concatenate(out.records) if out.records else np.zeros(0, np.int64)
            m = len(rec)
            g.create_dataset("record", data=rec.astype(np.int64), maxshape=(None,), chunks=index_chunk(m))
            if spec.info.has_norm:
                nrm = np.concatenate(out.norms) if out.norms else np.zeros(0)
                g.create_dataset("norm", data=nrm.astype(np.float64), maxshape=(None,), chunks=index_chunk(m))
            ds = out.ds
            ds.attrs["dtype"] = spec.dtype_name
            ds.attrs["layout"] = "ragged" if spec.ragged else "fixed"
            ds.attrs["ndim"] = np.int64(spec.ndim)
            ds.attrs["records"] = np.int64(m)
            if spec.ragged:
                off = np.concatenate(out.offsets) if out.offsets else np.zeros(0, np.int64)
                shp = np.concatenate(out.shapes) if out.shapes else np.zeros((0, spec.ndim), np.int64)
                g.create_dataset("offset", data=off.astype(np.int64), maxshape=(None,), chunks=index_chunk(m))
                g.create_dataset("shape", data=shp.astype(np.int64).reshape(m, spec.ndim),
                                 maxshape=(None, spec.ndim), chunks=index_chunk(m, max(1, spec.ndim)))
            else:
                ds.attrs["shape"] = np.asarray(spec.shape, dtype=np.int64)
        a = f.attrs
        for k, v in self.attrs.items():
            a[k] = v
        a["hookline_format"] = FILE_FORMAT
        a["format_version"] = np.int64(FORMAT_VERSION)
        a["record_start"] = np.int64(self.record_start)
        a["records"] = np.int64(n)
        a["fields"] = json.dumps(list(self.fields))
        for k, v in (extra_attrs or {}).items():
            a[k] = v
        self.writeback.forget(f)
        f.close()

    def abort(self) -> None:
        """Close without finishing (best effort; the file stays a ``.partial``)."""
        self.writeback.forget(self.f)
        try:
            self.f.close()
        except Exception:
            pass


# --- reading -------------------------------------------------------------------------------------

def _attr_str(a: Any) -> str:
    if isinstance(a, bytes):
        return a.decode("utf-8")
    return str(a)


_BUILTIN_FILTERS = {"gzip", "lzf", "shuffle", "fletcher32", "scaleoffset", "szip"}


class PartField:
    """One field inside one complete file; index arrays load on first use."""

    def __init__(self, part: Part, name: str, ds: h5py.Dataset):
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
        filters = getattr(ds, "_filters", None) or {}
        if any(k not in _BUILTIN_FILTERS for k in filters):
            ensure_filters()
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
        if self._norms is None:
            g = self._g()
            if "norm" not in g:
                return None
            self._norms = g["norm"][: self.count].astype(np.float64)
        return self._norms

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._offsets = self._g()["offset"][: self.count].astype(np.int64)
        return self._offsets

    @property
    def shapes(self) -> np.ndarray:
        if self._shapes is None:
            self._shapes = self._g()["shape"][: self.count].astype(np.int64).reshape(self.count, self.ndim)
        return self._shapes

    def record_shape(self, j: int) -> tuple[int, ...]:
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
        with self._lock:
            self._open.pop(id(part), None)


class Part:
    """One complete handle file opened read-only (``rdcc_nbytes=0``: no chunk cache, so random
    access to one record reads only that record's chunks' bytes).

    With an ``lru``, the file may be closed between uses (see :class:`FileLRU`); metadata and the
    step/call indexes stay in memory.
    """

    def __init__(self, path: Path, f: h5py.File, lru: FileLRU | None = None):
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
        self._compressed: bool | None = None
        if lru is not None:
            lru.touch(self)

    @property
    def steps(self) -> np.ndarray:
        if self._steps is None:
            self._steps = self.f["step"][: self.n].astype(np.int64)
            if len(self._steps) != self.n:
                raise FormatError(f"{str(self.path)!r}: 'step' has {len(self._steps)} entries, expected {self.n}")
        return self._steps

    @property
    def calls(self) -> np.ndarray:
        if self._calls is None:
            self._calls = self.f["call"][: self.n].astype(np.int64)
            if len(self._calls) != self.n:
                raise FormatError(f"{str(self.path)!r}: 'call' has {len(self._calls)} entries, expected {self.n}")
        return self._calls

    def field(self, name: str) -> PartField:
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


def ensure_filters() -> None:
    """Import hdf5plugin (registers Zstd/LZ4 filters) if installed; a no-op otherwise."""
    try:
        import hdf5plugin  # noqa: F401
    except ImportError:
        pass


# --- merging -------------------------------------------------------------------------------------

#: Most files one merge opens at once; merging more goes through intermediate files of this many
#: each (a handle can have hundreds of segments: see RunWriter's max_open_files).
MERGE_MAX_FILES = 32


def open_parts(paths: Iterable[Path]) -> list[Part]:
    """Open complete files; if one fails, close the ones already open and re-raise."""
    parts: list[Part] = []
    try:
        for path in paths:
            parts.append(open_part(path))
    except BaseException:
        for p in parts:
            p.close()
        raise
    return parts


def merge_files(paths: list[Path], out_path: Path, attrs: dict[str, Any],
                compression_for: Callable[[str], str | None] | None = None, record_start: int = 0,
                writeback: Writeback | int | None = WRITEBACK_BYTES,
                mid_path: Callable[[int, int], Path] | None = None) -> int:
    """:func:`merge_parts` of the complete files ``paths``, with at most :data:`MERGE_MAX_FILES` of
    them open at once. Beyond that, groups are merged first into intermediate files at
    ``mid_path(start, end)`` (name them like merge outputs, :func:`~.format.merge_output_name`,
    so that one left by a crash is recognised as a leftover), which are removed at the end.

    Returns:
        The number of records written.
    """
    limit = MERGE_MAX_FILES
    if len(paths) <= limit:
        parts = open_parts(paths)
        try:
            return merge_parts(parts, out_path, attrs, compression_for, record_start=record_start,
                               writeback=writeback)
        finally:
            for p in parts:
                p.close()
    if mid_path is None:
        raise ValueError(f"merging {len(paths)} files (> {limit}) needs mid_path for intermediate files")
    mids: list[Path] = []  # intermediate files, removed at the end
    level: list[Path] = []  # the next level's inputs
    try:
        start = record_start
        for i in range(0, len(paths), limit):
            group = paths[i : i + limit]
            parts = open_parts(group)
            try:
                n = sum(p.n for p in parts)
                if len(group) == 1 or n == 0:  # nothing to merge (a single file keeps its name)
                    level.extend(group if n else [])
                else:
                    mid = mid_path(start, start + n)
                    mids.append(mid)  # before writing: a failed merge's output is removed too
                    merge_parts(parts, mid, attrs, compression_for, record_start=start, writeback=writeback)
                    level.append(mid)
            finally:
                for p in parts:
                    p.close()
            start += n
        return merge_files(level, out_path, attrs, compression_for, record_start, writeback, mid_path)
    finally:
        for m in mids:
            m.unlink(missing_ok=True)


def merge_parts(parts: list[Part], out_path: Path, attrs: dict[str, Any],
                compression_for: Callable[[str], str | None] | None = None,
                record_start: int = 0, writeback: Writeback | int | None = WRITEBACK_BYTES) -> int:
    """Copy the records of ``parts`` (in order) into one new complete file at ``out_path``.

    Records are renumbered contiguously from ``record_start``. A field is stored ragged in the
    output if it is ragged in any input or its per-record shape differs between inputs. Memory is
    bounded by :data:`COPY_BLOCK_BYTES`.

    Returns:
        The number of records written.
    """
    w = HandleFileWriter(out_path, attrs, record_start, writeback)
    try:
        bases = []
        base = record_start
        for p in parts:
            bases.append(base - p.record_start)  # add to a part's record number -> output number
            w.add_index(p.steps, p.calls)
            base += p.n
        names: list[str] = []
        for p in parts:
            for nm in p.field_names:
                if nm not in names:
                    names.append(nm)
        for nm in names:
            pfs = [(p.field(nm), shift) for p, shift in zip(parts, bases) if nm in p.field_names]
            dnames = {pf.dtype_name for pf, _ in pfs}
            if len(dnames) != 1:
                raise FormatError(f"field {nm!r} has different dtypes across segments: {sorted(dnames)}")
            first = pfs[0][0]
            shapes = {pf.shape for pf, _ in pfs}
            ragged = None in shapes or len(shapes) > 1
            total = sum(pf.count for pf, _ in pfs)
            if ragged:
                total = sum(int(np.prod(pf.shapes, axis=1).sum()) if pf.shape is None and pf.ndim
                            else pf.count * math.prod(pf.shape or ()) for pf, _ in pfs)
            shape0 = first.shape if first.shape is not None else (
                first.record_shape(0) if first.count else (0,) * first.ndim)
            spec = FieldSpec(nm, first.dtype_name, ragged, tuple(shape0),
                             compression_for(nm) if compression_for else None)
            out = w.field(spec, total)
            elem_off = 0
            for pf, shift in pfs:
                if pf.count == 0:
                    continue
                out.records.append(pf.records + shift)
                if spec.info.has_norm:
                    sn = pf.stored_norms
                    out.norms.append(sn if sn is not None else np.full(pf.count, np.nan))
                if pf.shape is not None:
                    per = max(1, math.prod(pf.shape) * spec.info.storage.itemsize)
                    step = max(1, COPY_BLOCK_BYTES // per)
                    for a in range(0, pf.count, step):
                        blk = pf.read_block(a, min(pf.count, a + step))
                        out.append(blk.reshape(-1) if ragged else blk)
                    if ragged:
                        size = math.prod(pf.shape)
                        out.offsets.append(elem_off + np.arange(pf.count, dtype=np.int64) * size)
                        out.shapes.append(np.tile(np.asarray(pf.shape, np.int64), (pf.count, 1)).reshape(pf.count, pf.ndim))
                        elem_off += size * pf.count
                else:
                    offs, shps = pf.offsets, pf.shapes
                    sizes = np.prod(shps, axis=1, dtype=np.int64) if pf.ndim else np.ones(pf.count, np.int64)
                    lo = int(offs[0]) if pf.count else 0
                    hi = int(offs[-1] + sizes[-1]) if pf.count else 0
                    step_el = max(1, COPY_BLOCK_BYTES // spec.info.storage.itemsize)
                    for a in range(lo, hi, step_el):
                        out.append(pf.ds[a : min(hi, a + step_el)])
                    out.offsets.append(offs - lo + elem_off)
                    out.shapes.append(shps)
                    elem_off += hi - lo
        w.finish()
    except BaseException:
        w.abort()
        raise
    return w.n_records


def iter_close(parts: Iterable[Part]) -> None:
    """Close every part (best effort)."""
    for p in parts:
        p.close()
