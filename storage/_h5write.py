"""Writing one complete handle part (a final ``.h5`` or a sealed ``.h5seg``): :class:`HandleFileWriter`.

The layout is described in docs/format.md; the writer thread and merges write through this code.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from . import dtypes
from ._filters import compression_kwargs
from ._fs import WRITEBACK_BYTES, Writeback
from .confine import clear_for_new_file
from .format import (
    FILE_FORMAT,
    FORMAT_VERSION,
    INDEX_GROUP,
    flat_chunk,
    index_chunk,
    record_chunk,
)

__all__ = ["FieldSpec", "FieldOut", "HandleFileWriter"]


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
    """

    def __init__(self, f: h5py.File, spec: FieldSpec, expected: int, owner: HandleFileWriter) -> None:
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
        attrs: root attributes (see docs/format.md), written by :meth:`finish` with
            ``records``, ``record_start`` and ``fields``.
        record_start: global record number of this file's first record.
        writeback: a :class:`Writeback` shared with the writer's other open files, or a byte
            count for one of this file's own; 0 or None leaves writeback to the kernel.
    """

    def __init__(self, path: Path, attrs: dict[str, Any], record_start: int,
                 writeback: Writeback | int | None = WRITEBACK_BYTES) -> None:
        self.path = Path(path)
        clear_for_new_file(self.path)  # (a symlink or FIFO left at this name is not written through)
        self.f: h5py.File | None = h5py.File(self.path, "w", rdcc_nbytes=0)
        self.writeback = writeback if isinstance(writeback, Writeback) else Writeback(writeback)
        self.attrs = attrs
        self.record_start = record_start
        self.steps: list[np.ndarray] = []
        self.calls: list[np.ndarray] = []
        self.n_records = 0
        self.fields: dict[str, FieldOut] = {}

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
        f.close()

    def resume(self) -> None:
        """Reopen a parked file for appending (~0.3 ms)."""
        if self.f is not None:
            return
        self.f = h5py.File(self.path, "r+", rdcc_nbytes=0)
        for name, out in self.fields.items():
            out.ds = self.f[name]

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
        for name, parts in (("step", self.steps), ("call", self.calls)):
            arr = np.concatenate(parts) if parts else np.zeros(0, np.int64)
            f.create_dataset(name, data=arr, maxshape=(None,), chunks=index_chunk(n))
        idx = f.create_group(INDEX_GROUP)
        for out in self.fields.values():
            _write_field_index(idx, out)
        a = f.attrs
        for k, v in self.attrs.items():
            a[k] = v
        a["hookline_format"] = FILE_FORMAT
        a["format_version"] = np.int64(FORMAT_VERSION)
        a["record_start"] = np.int64(self.record_start)
        a["records"] = np.int64(n)
        a["fields"] = json.dumps(list(self.fields))
        self.writeback.forget(f)
        self.f = None
        f.close()

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


def _write_field_index(idx: h5py.Group, out: FieldOut) -> None:
    """Write a field's index datasets (``_index/<field>/record``, ``norm``, ``offset``,
    ``shape``) and its dataset's attributes."""
    spec = out.spec
    g = idx.create_group(spec.name)
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
