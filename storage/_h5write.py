"""Writing one complete handle part (a final ``.h5`` or a sealed ``.h5seg``): :class:`HandleFileWriter`.

The layout is described in docs/format.md; the writer thread and merges write through this code.
Datasets, groups and attributes are made through h5py's low-level API with the types and
property lists h5py's high-level API would use (the files are byte-identical to what
``create_dataset``/``create_group``/``attrs[...] = ...`` write): a handle file holds ~25
attributes and ~8 objects, and the high-level calls' Python work was ~40% of sealing a small
part (a 1,000-handle run seals 1,000 files at ``close()``).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from h5py import h5a, h5d, h5f, h5g, h5p, h5s, h5t

from . import dtypes
from ._filters import compression_kwargs
from ._h5check import Structure, filter_names
from ._fs import WRITEBACK_BYTES, Writeback
from .confine import clear_for_new_file
from .hashes import HASH_DATASET, ChunkHasher
from .format import (
    FILE_FORMAT,
    FORMAT_VERSION,
    INDEX_GROUP,
    flat_chunk,
    index_chunk,
    record_chunk,
)

__all__ = ["FieldSpec", "FieldOut", "HandleFileWriter"]

#: h5py's types for the attribute values hookline writes (``attrs[k] = "text"`` and
#: ``attrs[k] = np.int64(v)``), made once.
_STR_NP = h5py.string_dtype("utf-8")
_STR_T = h5t.py_create(_STR_NP, logical=True)  # (in the file)
_STR_M = h5t.py_create(_STR_NP)  # (in memory: Python str objects)
_I64_NP = np.dtype(np.int64)
_I64_T = h5t.py_create(_I64_NP, logical=True)
_F64_T = h5t.py_create(np.dtype(np.float64), logical=True)
_U64_T = h5t.py_create(np.dtype(np.uint64), logical=True)
_SCALAR = h5s.create(h5s.SCALAR)


def _plists() -> tuple[h5p.PropFAID, h5p.PropFCID, dict[int, h5p.PropLCID], h5p.PropGCID]:
    """The property lists ``h5py.File(path, "w", rdcc_nbytes=0)``, ``create_group`` and link
    creation use, made once (HDF5 copies a list it is given: sharing them is safe)."""
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_libver_bounds(h5f.LIBVER_EARLIEST, h5f.LIBVER_LATEST)
    fapl.set_alignment(1, 1)
    cache = list(fapl.get_cache())
    cache[2] = 0  # (rdcc_nbytes=0: chunks go straight to the file)
    fapl.set_cache(*cache)
    fcpl = h5p.create(h5p.FILE_CREATE)
    fcpl.set_obj_track_times(False)
    lcpls = {}
    for cset in (h5t.CSET_ASCII, h5t.CSET_UTF8):
        lcpl = lcpls[cset] = h5p.create(h5p.LINK_CREATE)
        lcpl.set_create_intermediate_group(True)
        lcpl.set_char_encoding(cset)
    gcpl = h5p.create(h5p.GROUP_CREATE)
    gcpl.set_obj_track_times(False)
    return fapl, fcpl, lcpls, gcpl


_FAPL, _FCPL, _LCPLS, _GCPL = _plists()


def _name(name: str) -> tuple[bytes, h5p.PropLCID]:
    """A link name as h5py encodes it (ASCII, else UTF-8) with its link creation list."""
    try:
        return name.encode("ascii"), _LCPLS[h5t.CSET_ASCII]
    except UnicodeEncodeError:
        return name.encode("utf8"), _LCPLS[h5t.CSET_UTF8]


@lru_cache(maxsize=256)
def _dcpl(chunks: tuple[int, ...]) -> h5p.PropDCID:
    """h5py's dataset creation list for an unfiltered dataset with chunks ``chunks``."""
    dcpl = h5p.create(h5p.DATASET_CREATE)
    dcpl.set_chunk(chunks)
    dcpl.set_obj_track_times(False)
    dcpl.set_attr_creation_order(0)
    return dcpl


def _create_file(path: Path) -> h5py.File:
    """``h5py.File(path, "w", rdcc_nbytes=0)`` (truncating) with property lists made once."""
    return h5py.File(h5f.create(os.fsencode(path), h5f.ACC_TRUNC, fapl=_FAPL, fcpl=_FCPL))


def _open_file(path: Path) -> h5py.File:
    """``h5py.File(path, "r+", rdcc_nbytes=0)`` with property lists made once."""
    return h5py.File(h5f.open(os.fsencode(path), h5f.ACC_RDWR, fapl=_FAPL))


def _set_attrs(oid: h5py.h5o.ObjectID, items: dict[str, Any]) -> dict[str, Any] | None:
    """Write new attributes on the object ``oid`` as ``h5py``'s ``attrs[name] = value`` would:
    str and int64 values (scalars and 1-D arrays) directly, others through h5py. The object is
    one this module just created: none of them exists yet (HDF5 refuses a second one).

    Returns:
        The attributes as :func:`~._h5check.check_structure` reads them back (strings as str,
        int64 scalars as ``np.int64``, arrays as int64 arrays); None when one went through h5py
        (its value read back is not foreseen here).
    """
    back: dict[str, Any] | None = {}
    for name, v in items.items():
        if isinstance(v, str):
            tid, mtype, space, data = _STR_T, _STR_M, _SCALAR, np.array(v, dtype=_STR_NP)
            seen: Any = v
        elif isinstance(v, np.int64):
            tid, mtype, space, data = _I64_T, _I64_T, _SCALAR, np.array(v)
            seen = v
        elif isinstance(v, np.ndarray) and v.dtype == _I64_NP and v.ndim == 1:
            tid, mtype, space, data = _I64_T, _I64_T, h5s.create_simple(v.shape), np.ascontiguousarray(v)
            seen = data.copy()
        else:
            h5py.AttributeManager(h5py.Group(oid) if isinstance(oid, h5g.GroupID) else h5py.Dataset(oid))[name] = v
            back = None
            continue
        attr = h5a.create(oid, name.encode("utf8"), tid, space)
        try:
            attr.write(data, mtype=mtype)
        finally:
            attr.close()
        if back is not None:
            back[name] = seen
    return back


def _create_dataset(loc: h5g.GroupID, name: str, tid: h5t.TypeID, shape: tuple[int, ...],
                    chunks: tuple[int, ...], data: np.ndarray | None = None) -> h5d.DatasetID:
    """``loc.create_dataset(name, shape, maxshape=(None, *shape[1:]), chunks=chunks,
    data=data)`` of an unfiltered dataset, as h5py makes it."""
    space = h5s.create_simple(shape, (h5s.UNLIMITED, *shape[1:]))
    ds = h5d.create(loc, _name(name)[0], tid, space, dcpl=_dcpl(tuple(chunks)))
    if data is not None:
        ds.write(h5s.ALL, h5s.ALL, data)
    return ds


def _create_group(loc: h5g.GroupID, name: str) -> h5g.GroupID:
    """``loc.create_group(name)`` as h5py makes it."""
    raw, lcpl = _name(name)
    return h5g.create(loc, raw, lcpl=lcpl, gcpl=_GCPL)


class FieldSpec:
    """Static description of a field inside one file being written.

    Args:
        name: the field name (its dataset's name).
        dtype_name: logical dtype name (see :mod:`~hookline.storage.dtypes`).
        ragged: stored as flat 1-D data plus per-record offsets and shapes.
        shape: per-record shape (fixed), or the first record's shape (ragged).
        compression: compression spec (see :func:`~hookline.storage._filters.compression_kwargs`).
    """

    __slots__ = ("name", "dtype_name", "info", "ragged", "shape", "ndim", "compression")

    def __init__(self, name: str, dtype_name: str, ragged: bool, shape: tuple[int, ...],
                 compression: str | None) -> None:
        self.name = name
        self.dtype_name = dtype_name
        self.info = dtypes.info(dtype_name)
        self.ragged = ragged
        self.shape = shape
        self.ndim = len(shape)
        self.compression = compression


class FieldOut:
    """A field dataset being appended to, plus its index lists (written by
    :meth:`HandleFileWriter.finish`); made by :meth:`HandleFileWriter.field`.

    Attributes:
        chunk: the dataset's chunk shape.
        direct: whether whole chunks may be written with ``write_direct_chunk`` (no filter, and
            a chunk holds whole records).
        n: entries along axis 0 (records for a fixed field, elements for a ragged one).
        records, norms, offsets, shapes: index arrays appended by the caller, in record order.
        hasher: the field's chunk hashes (:mod:`.hashes`), fed what is appended; None when the
            file has none.
    """

    def __init__(self, f: h5py.File, spec: FieldSpec, expected: int, owner: HandleFileWriter) -> None:
        self.owner = owner
        self.spec = spec
        st = spec.info.storage
        kw = compression_kwargs(spec.compression)
        self.direct = not kw
        shape = (0,) if spec.ragged else (0, *spec.shape)
        #: A record larger than a chunk, written straight from its memory chunk by chunk (no
        #: filter): ``(lead, axis, step)``, see :func:`_split_of`; None: not such a field.
        self.split: tuple[tuple[int, ...], int, int] | None = None
        if spec.ragged:  # expected counts elements
            self.chunk = flat_chunk(st.itemsize, expected)
        else:
            self.chunk = record_chunk(spec.shape, st.itemsize, expected)
            if self.direct and tuple(self.chunk[1:]) != tuple(spec.shape):
                self.split = _split_of(tuple(spec.shape), tuple(self.chunk))
            # Direct chunk writes of whole records only when a chunk holds whole records.
            self.direct = self.direct and tuple(self.chunk[1:]) == tuple(spec.shape)
        #: The dataset (low-level: h5py's ``Dataset`` wrapper costs more than a small write).
        self.ds: h5d.DatasetID | None
        if kw:  # (filters: h5py's own checks and property list)
            self.ds = f.create_dataset(spec.name, shape=shape, maxshape=(None, *shape[1:]), dtype=st,
                                       chunks=self.chunk, **kw).id
        else:
            self.ds = _create_dataset(f.id, spec.name, h5t.py_create(st, logical=True), shape, self.chunk)
        #: The dataset's filters and type as a structure walk names them (:attr:`HandleFileWriter.structure`).
        self.filters = filter_names(self.ds.get_create_plist()) if kw else []
        self.stored = self.ds.dtype
        self.n = 0  # entries along axis 0 (records for fixed, elements for ragged)
        self._tail = () if spec.ragged else tuple(spec.shape)
        row_bytes = st.itemsize * (1 if spec.ragged else int(np.prod(spec.shape, dtype=np.int64)))
        self.hasher = ChunkHasher(row_bytes, self.chunk[0]) if owner.hashes else None
        self.records: list[np.ndarray] = []
        self.norms: list[np.ndarray] = []
        self.offsets: list[np.ndarray] = []
        self.shapes: list[np.ndarray] = []

    def _extend(self, n: int) -> None:
        self.ds.set_extent((n, *self._tail))

    def _write(self, a: int, block: np.ndarray) -> None:
        """Write ``block`` at entries ``[a, a + len(block))`` (as ``ds[a:b] = block``)."""
        block = np.ascontiguousarray(block)
        fspace = self.ds.get_space()
        fspace.select_hyperslab((a, *(0,) * (block.ndim - 1)), block.shape)
        self.ds.write(h5s.create_simple(block.shape), fspace, block)

    def append(self, block: np.ndarray) -> None:
        """Append ``block`` (``(k, *shape)`` for fixed, 1-D for ragged) to the dataset."""
        k = block.shape[0]
        if k == 0:
            return
        if self.hasher is not None:  # (from the memory handed to HDF5: nothing is read back)
            self.hasher.update(block)
        a, b = self.n, self.n + k
        self._extend(b)
        c0 = self.chunk[0]
        if self.split is not None and block.flags.c_contiguous:
            self._write_split(a, block)
        elif self.direct and a % c0 == 0 and block.flags.c_contiguous:
            full = (k // c0) * c0
            zeros = (0,) * (block.ndim - 1)
            for j in range(0, full, c0):
                self.ds.write_direct_chunk((a + j, *zeros), block[j : j + c0])
            if full < k:
                self._write(a + full, block[full:])
        else:
            self._write(a, block)
        self.n = b
        self.owner.wrote(block.nbytes)

    def _write_split(self, a: int, block: np.ndarray) -> None:
        """Write records larger than a chunk chunk by chunk, each straight from the record's
        memory (``write_direct_chunk``: no gather into HDF5's conversion buffer, which a
        hyperslab write of an 8 MiB record costs)."""
        lead, axis, step = self.split
        wdc = self.ds.write_direct_chunk
        n_axis = self.spec.shape[axis]
        n_lead = int(np.prod(lead, dtype=np.int64))
        rest = (0,) * (len(self.spec.shape) - axis - 1)
        for i in range(block.shape[0]):
            rows = block[i].reshape(n_lead, n_axis, -1)  # (a view: the block is C-contiguous)
            for li in range(n_lead):
                at = np.unravel_index(li, lead) if lead else ()
                for j in range(0, n_axis, step):
                    wdc((a + i, *map(int, at), j, *rest), rows[li, j:j + step])

    def append_records(self, arrays: list[np.ndarray]) -> None:
        """Append records of a one-record-per-chunk field: one resize, one direct chunk write
        per record straight from its memory (no assembly copy)."""
        k = len(arrays)
        if k == 0:
            return
        a = self.n
        self._extend(a + k)
        zeros = (0,) * len(self.spec.shape)
        wdc = self.ds.write_direct_chunk
        nbytes = 0
        hasher = self.hasher
        for j, arr in enumerate(arrays):
            if hasher is not None:
                hasher.update(arr)
            wdc((a + j, *zeros), arr)
            nbytes += arr.nbytes
        self.n = a + k
        self.owner.wrote(nbytes)


def _split_of(shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[tuple[int, ...], int, int] | None:
    """How a chunk of :func:`~.format.record_chunk` cuts a record larger than it: chunk
    ``(1, 1.., c, full..)`` (record axis ``axis`` cut in steps of ``c``, the axes before it one
    index at a time, the ones after it whole) makes every chunk a contiguous slice of the
    record. Returns ``(shape[:axis], axis, c)``, or None for another chunk shape or when ``c``
    does not divide the axis (an edge chunk would need padding: such records keep the hyperslab
    write)."""
    cut = chunk[1:]
    if chunk[0] != 1 or len(cut) != len(shape):
        return None
    diff = [i for i, (c, d) in enumerate(zip(cut, shape)) if c != d]
    if not diff:
        return None
    axis = diff[-1]
    if any(c != 1 for c in cut[:axis]) or tuple(cut[axis + 1:]) != tuple(shape[axis + 1:]):
        return None
    if shape[axis] % cut[axis]:
        return None
    return tuple(shape[:axis]), axis, cut[axis]


class HandleFileWriter:
    """Writes one complete handle file; call :meth:`finish` to write the indexes and close it.

    Args:
        path: file to create (truncated).
        attrs: root attributes (see docs/format.md), written by :meth:`finish` with
            ``records``, ``record_start`` and ``fields``.
        record_start: global record number of this file's first record.
        writeback: a :class:`Writeback` shared with the writer's other open files, or a byte
            count for one of this file's own; 0 or None leaves writeback to the kernel.
        hashes: store every field's chunk hashes (:mod:`.hashes`).
    """

    def __init__(self, path: Path, attrs: dict[str, Any], record_start: int,
                 writeback: Writeback | int | None = WRITEBACK_BYTES, hashes: bool = True) -> None:
        self.path = Path(path)
        self.hashes = hashes
        clear_for_new_file(self.path)  # (a symlink or FIFO left at this name is not written through)
        self.f: h5py.File | None = _create_file(self.path)
        self.writeback = writeback if isinstance(writeback, Writeback) else Writeback(writeback)
        self.attrs = attrs
        self.record_start = record_start
        self.steps: list[np.ndarray] = []
        self.calls: list[np.ndarray] = []
        self.n_records = 0
        self.fields: dict[str, FieldOut] = {}
        #: What the file holds, as :func:`~._h5check.check_structure` would find it, once
        #: :meth:`finish` wrote it (None before, or when an attribute's read-back is not foreseen).
        self.structure: Structure | None = None

    def field(self, spec: FieldSpec, expected: int) -> FieldOut:
        """Return the output of a field, creating its dataset on first use."""
        out = self.fields.get(spec.name)
        if out is None:
            out = self.fields[spec.name] = FieldOut(self.f, spec, expected, self)
        return out

    @property
    def is_open(self) -> bool:
        """Whether the HDF5 file is open now (see :meth:`park`)."""
        return self.f is not None

    def park(self) -> None:
        """Close the HDF5 file for now, keeping everything needed to go on (:meth:`resume`).

        An open HDF5 file costs ~0.55 MB of HDF5's own memory and a file descriptor; a writer of
        thousands of handles keeps only a few open and parks the rest. The file stays where it
        is (a ``.partial`` that nobody reads); nothing is sealed or published.
        """
        if self.f is None:
            return
        self.writeback.forget(self.f)
        for out in self.fields.values():
            out.ds = None
        f, self.f = self.f, None
        f.close()  # (closes the datasets too)

    def resume(self) -> None:
        """Reopen a parked file for appending (~0.3 ms)."""
        if self.f is not None:
            return
        self.f = _open_file(self.path)
        for name, out in self.fields.items():
            out.ds = h5d.open(self.f.id, _name(name)[0])

    def wrote(self, nbytes: int) -> None:
        """Count field bytes handed to HDF5 (writeback is kicked as they add up)."""
        self.writeback.wrote(self.f, nbytes)

    def add_index(self, steps: np.ndarray, calls: np.ndarray) -> None:
        """Append record index entries (one per record)."""
        self.steps.append(np.asarray(steps, dtype=np.int64))
        self.calls.append(np.asarray(calls, dtype=np.int64))
        self.n_records += len(steps)

    def finish(self) -> None:
        """Write ``step``/``call``, every field's index datasets and the attributes; close."""
        self.resume()
        f = self.f
        n = self.n_records
        st = Structure()
        for name, parts in (("step", self.steps), ("call", self.calls)):
            arr = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            _create_dataset(f.id, name, _I64_T, (n,), index_chunk(n), arr).close()
            st.add(name, {}, (n,), _I64_NP)
        idx = _create_group(f.id, INDEX_GROUP)
        st.add(INDEX_GROUP, {})
        whole = True
        try:
            for out in self.fields.values():
                whole = _write_field_index(idx, out, st) and whole
        finally:
            idx.close()
        root = _set_attrs(f.id, {**self.attrs, "hookline_format": FILE_FORMAT,
                                "format_version": np.int64(FORMAT_VERSION),
                                "record_start": np.int64(self.record_start), "records": np.int64(n),
                                "fields": json.dumps(list(self.fields))})
        self.writeback.forget(f)
        self.f = None
        f.close()
        self._release()
        if whole and root is not None:
            st.attrs[""] = root
            self.structure = st

    def abort(self) -> None:
        """Close without finishing (best effort; the file stays a ``.partial``)."""
        f, self.f = self.f, None
        if f is None:
            return
        self.writeback.forget(f)
        try:
            f.close()
        except Exception:
            pass
        self._release()

    def _release(self) -> None:
        """Drop the fields' dataset ids and their link back here once the file is closed: left
        as a cycle, thousands of finished writers wait for a full collection, and their ids
        stay in h5py's registry, which every file close walks (1.2 ms a close at 1,000 handles,
        against 0.2-0.5 ms)."""
        for out in self.fields.values():
            out.ds = None
            out.owner = None


def _write_field_index(idx: h5g.GroupID, out: FieldOut, st: Structure) -> bool:
    """Write a field's index datasets (``_index/<field>/record``, ``norm``, ``offset``,
    ``shape``) and its dataset's attributes, noting them in ``st``; returns whether every
    attribute's read-back is foreseen (see :func:`_set_attrs`)."""
    spec = out.spec
    g = _create_group(idx, spec.name)
    at = f"{INDEX_GROUP}/{spec.name}"
    st.add(at, {})
    try:
        rec = np.concatenate(out.records) if out.records else np.zeros(0, np.int64)
        m = len(rec)
        _create_dataset(g, "record", _I64_T, (m,), index_chunk(m), rec.astype(np.int64)).close()
        st.add(f"{at}/record", {}, (m,), _I64_NP)
        if spec.info.has_norm:
            nrm = np.concatenate(out.norms) if out.norms else np.zeros(0)
            _create_dataset(g, "norm", _F64_T, (m,), index_chunk(m), nrm.astype(np.float64)).close()
            st.add(f"{at}/norm", {}, (m,), np.float64)
        rows: dict[str, Any] | None = {}  # (the hash dataset's attribute, as read back)
        if out.hasher is not None:
            hashes = out.hasher.finish()
            hds = _create_dataset(g, HASH_DATASET, _U64_T, (len(hashes),), index_chunk(len(hashes)), hashes)
            rows = _set_attrs(hds, {"rows": np.int64(out.hasher.rows)})
            hds.close()
            st.add(f"{at}/{HASH_DATASET}", rows or {}, (len(hashes),), np.uint64)
        # (attributes before the ragged index's datasets, the shape after: h5py's order)
        back = _set_attrs(out.ds, {"dtype": spec.dtype_name, "layout": "ragged" if spec.ragged else "fixed",
                                   "ndim": np.int64(spec.ndim), "records": np.int64(m)})
        if spec.ragged:
            off = np.concatenate(out.offsets) if out.offsets else np.zeros(0, np.int64)
            shp = np.concatenate(out.shapes) if out.shapes else np.zeros((0, spec.ndim), np.int64)
            _create_dataset(g, "offset", _I64_T, (m,), index_chunk(m), off.astype(np.int64)).close()
            _create_dataset(g, "shape", _I64_T, (m, spec.ndim), index_chunk(m, max(1, spec.ndim)),
                            shp.astype(np.int64).reshape(m, spec.ndim)).close()
            st.add(f"{at}/offset", {}, (m,), _I64_NP)
            st.add(f"{at}/shape", {}, (m, spec.ndim), _I64_NP)
        else:
            more = _set_attrs(out.ds, {"shape": np.asarray(spec.shape, dtype=np.int64)})
            back = None if back is None or more is None else {**back, **more}
        st.add(spec.name, back or {}, (out.n, *out._tail), out.stored, out.filters)
        return back is not None and rows is not None
    finally:
        g.close()
