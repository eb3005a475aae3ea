"""Lazy labelled arrays of recorded fields: dask arrays and xarray objects that read on compute.

:class:`FieldSource` is what a dask array of a field reads from: the field's files by absolute
path, opened on first read inside the process that computes (a ``dask.distributed`` worker, or
this one) and never pickled open, so the arrays compute on process workers. The graph has one
task per dask chunk plus one for the source, whatever the number of records. Dask chunks are
whole storage chunks along records (about dask's ``array.chunk-size`` each) and never span two
files. Needs ``pip install "hookline[analysis]"`` (dask, xarray).
"""

from __future__ import annotations

import bisect
import os
import threading
from itertools import accumulate
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .. import dtypes
from .._h5read import FileLRU, PartField, open_part
from ..errors import FormatError, InvalidArgumentError, StorageError
from .deps import require

__all__ = ["FieldSource", "stored_range", "record_chunks", "check_fixed", "field_dask", "field_xarray",
           "handle_xarray"]

#: Files one :class:`FieldSource` keeps open at once (a field of a live run may span many segments).
MAX_OPEN = 16


def stored_range(piece: Callable[[int], PartField], bounds: Sequence[int], a: int, b: int) -> list[np.ndarray]:
    """Entries ``[a, b)`` of a fixed field in their stored dtype, one block per file they lie in
    (``bounds``: the first entry of each file, then the total; ``piece(s)``: file ``s``'s field)."""
    blocks = []
    s = max(0, bisect.bisect_right(bounds, a) - 1)
    while s < len(bounds) - 1 and bounds[s] < b:
        lo, hi = bounds[s], bounds[s + 1]
        x, y = max(a, lo), min(b, hi)
        if x < y:
            blocks.append(piece(s).read_block(x - lo, y - lo))
        s += 1
    return blocks


def check_fixed(field: Any, use: str) -> None:
    """Raise when ``field`` has no array form (its records' shapes vary).

    Raises:
        InvalidArgumentError: ``field`` is ragged; the message says what reads it instead.
    """
    if field.shape is None:
        raise InvalidArgumentError(
            f"field {field.name!r} of handle {field.handle.id!r} is ragged (its records' shapes vary), so "
            f"{use} cannot make one array of it: read it record by record (field[i], field.read() gives a "
            f"list of arrays, field.to_torch() a list of tensors), or pass fields= without it")


class FieldSource:
    """The records of one fixed-shape field, read by absolute file path: what a dask array of the
    field slices (``source[a:b]``, numpy semantics). Picklable: files open on first read in the
    process that reads, are bounded by :data:`MAX_OPEN`, and are left behind when it is pickled.

    Attributes:
        handle_id, name, dtype_name: the field's handle, name and logical dtype.
        files: ``(absolute path, entries of the field in that file)``, in entry order.
        shape, dtype, ndim: of the whole array (numpy read dtype: bfloat16 reads as float32).
    """

    def __init__(self, handle_id: str, name: str, dtype_name: str, record_shape: tuple[int, ...],
                 files: list[tuple[str, int]]) -> None:
        self.handle_id, self.name, self.dtype_name = handle_id, name, dtype_name
        self.files = files
        self.bounds = [0, *accumulate(n for _, n in files)]
        self.shape = (self.bounds[-1], *record_shape)
        self.dtype = dtypes.info(dtype_name).read
        self.ndim = len(self.shape)
        # (what tells a rewritten file from the one the array was made of: size and mtime)
        self.stamps = [(st.st_size, st.st_mtime_ns) for st in (os.stat(p) for p, _ in files)]
        self._pieces: list[PartField | None] = [None] * len(files)
        self._lru: FileLRU | None = None
        self._lock = threading.RLock()

    @classmethod
    def of(cls, field: Any) -> FieldSource:
        """The source of a fixed-shape reader :class:`~hookline.storage.Field`."""
        check_fixed(field, "to_dask()")
        files = [(os.path.abspath(pf.part.path), pf.count) for pf in field.pieces]
        return cls(field.handle.id, field.name, field.dtype_name, field.shape, files)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_pieces=[None] * len(self.files), _lru=None)
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __dask_tokenize__(self) -> tuple:
        return ("hookline.FieldSource", self.handle_id, self.name, self.dtype_name, self.shape,
                tuple(self.files), tuple(self.stamps))

    def piece(self, s: int) -> PartField:
        """File ``s``'s part of the field, opened now on first use in this process.

        Raises:
            StorageError: the file is not there (workers must see the run directory at the same
                path) or changed since the array was made.
            FormatError: it is not the handle's file, or lacks the field.
        """
        with self._lock:
            pf = self._pieces[s]
            if pf is None:
                pf = self._pieces[s] = self._open(s)
            return pf

    def _open(self, s: int) -> PartField:
        path, count = self.files[s]
        if self._lru is None:
            self._lru = FileLRU(MAX_OPEN)
        try:
            part = open_part(Path(path), self._lru)
        except OSError as e:
            raise StorageError(f"cannot open {path!r} of handle {self.handle_id!r} ({e}): every process that "
                               f"computes the array must see the run directory at this path") from e
        if part.handle_id != self.handle_id or self.name not in part.field_names:
            part.close()
            raise FormatError(f"{path!r} is not the file of field {self.name!r} of {self.handle_id!r}")
        pf = part.field(self.name)
        if pf.count != count:
            raise StorageError(f"{path!r} changed since the array was made ({pf.count} entries of {self.name!r}, "
                               f"expected {count}); open the run again and make the array again")
        return pf

    def read(self, a: int, b: int) -> np.ndarray:
        """Entries ``[a, b)`` (0 <= a <= b <= len), decoded as numpy reads return them."""
        with self._lock:  # (h5py serialises its calls anyway; this keeps the LRU from closing a file being read)
            blocks = stored_range(self.piece, self.bounds, a, b)
        if not blocks:
            return np.zeros((0, *self.shape[1:]), self.dtype)
        stored = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
        return dtypes.decode(stored, self.dtype_name)

    def __getitem__(self, index: Any) -> np.ndarray:
        index = index if isinstance(index, tuple) else (index,)
        first, rest = (index[0], index[1:]) if index and index[0] is not Ellipsis else (slice(None), index)
        if isinstance(first, slice) and first.step in (None, 1):
            a, b, _ = first.indices(self.shape[0])
            return self.read(a, max(a, b))[(slice(None), *rest)]
        if first is None:
            raise InvalidArgumentError("a field's array takes no new axis in front of its records")
        rows = np.arange(self.shape[0])[first]  # (ints, negative ones, steps, masks: numpy's rules)
        if rows.size == 0:
            return np.zeros((0, *self.shape[1:]), self.dtype)[(rows, *rest)]
        lo = int(rows.min())
        return self.read(lo, int(rows.max()) + 1)[(rows - lo, *rest)]

    def __len__(self) -> int:
        return self.shape[0]


def record_chunks(field: Any, chunks: int | str) -> tuple[int, ...]:
    """Dask chunk lengths along records: whole storage chunks of one file each, about ``chunks``
    records (``"auto"``: about dask's ``array.chunk-size`` config of bytes, 128 MiB by default).

    Raises:
        InvalidArgumentError: ``chunks`` is neither ``"auto"`` nor an int >= 1.
    """
    if chunks == "auto":
        dask = require("dask", "to_dask()")
        target = dask.utils.parse_bytes(dask.config.get("array.chunk-size"))
        per = max(1, target // max(1, field.dtype.itemsize * int(np.prod(field.shape))))
    elif isinstance(chunks, (int, np.integer)) and not isinstance(chunks, bool) and chunks >= 1:
        per = int(chunks)
    else:
        raise InvalidArgumentError(f"chunks must be 'auto' or a number of records >= 1, got {chunks!r}; "
                                   f"e.g. to_dask(chunks=1024)")
    out: list[int] = []
    for pf in field.pieces:
        rows = (pf.ds.chunks or (pf.count,))[0]
        k = max(rows, per // rows * rows)  # (whole storage chunks: a dask chunk never splits one)
        out += [k] * (pf.count // k) + ([pf.count % k] if pf.count % k else [])
    return tuple(out) or (0,)


def field_dask(field: Any, chunks: int | str = "auto") -> Any:
    """The dask array of :meth:`hookline.storage.Field.to_dask`."""
    da = require("dask.array", "to_dask()")
    src = FieldSource.of(field)
    along = record_chunks(field, chunks)
    name = f"hookline-{field.name}-{require('dask.base', 'to_dask()').tokenize(src, along)}"
    return da.from_array(src, chunks=(along, *((d,) for d in src.shape[1:])), name=name, lock=False,
                         asarray=False, fancy=False, inline_array=False, meta=np.empty((0,) * src.ndim, src.dtype))


def _record_coords(xr: Any, field: Any) -> Any:
    """The ``record`` coordinates of a field's entries: a (step, call, rank) multi-index, so that
    ``.sel(step=3)`` selects a step's records."""
    pd = require("pandas", "to_xarray()")
    ranks = field.handle.ranks[field.records]
    index = pd.MultiIndex.from_arrays([field.steps, field.calls, ranks], names=["step", "call", "rank"])
    return xr.Coordinates.from_pandas_multiindex(index, "record")


def _attrs(field: Any) -> dict[str, str]:
    h = field.handle
    return {"handle": h.id, "module": h.module_name, "field": field.name, "dtype": field.dtype_name}


def field_xarray(field: Any, chunks: int | str = "auto", dims: Sequence[str] | None = None) -> Any:
    """The ``xarray.DataArray`` of :meth:`hookline.storage.Field.to_xarray`.

    Raises:
        InvalidArgumentError: ``dims`` does not name each per-record axis once.
    """
    xr = require("xarray", "to_xarray()")
    check_fixed(field, "to_xarray()")
    names = tuple(f"dim_{k}" for k in range(len(field.shape))) if dims is None else tuple(dims)
    if len(names) != len(field.shape) or len(set(names)) != len(names) or "record" in names:
        raise InvalidArgumentError(f"dims={dims!r}: give one distinct name per axis of a record of shape "
                                   f"{field.shape} (not 'record'), e.g. dims={tuple(f'd{k}' for k in range(len(field.shape)))}")
    return xr.DataArray(field_dask(field, chunks), dims=("record", *names), coords=_record_coords(xr, field),
                        attrs=_attrs(field), name=field.name)


def handle_xarray(handle: Any, fields: str | Iterable[str] | None = None, chunks: int | str = "auto") -> Any:
    """The ``xarray.Dataset`` of :meth:`hookline.storage.Handle.to_xarray`.

    Raises:
        InvalidArgumentError: a field asked for by name is ragged or has no entry in some of the
            handle's records.
    """
    xr = require("xarray", "to_xarray()")
    asked = [fields] if isinstance(fields, str) else None if fields is None else list(fields)
    skipped: list[str] = []
    arrays = {}
    for name in handle.fields if asked is None else asked:
        f = handle[name]
        if f.shape is not None and len(f) == len(handle):
            dims = tuple(f"{name}.dim_{k}" for k in range(len(f.shape)))
            arrays[name] = field_xarray(f, chunks, dims).drop_vars(["record", "step", "call", "rank"])
        elif asked is None:
            skipped.append(name)
        else:
            check_fixed(f, "Handle.to_xarray()")
            raise InvalidArgumentError(
                f"field {name!r} of handle {handle.id!r} has {len(f)} entries for the handle's {len(handle)} "
                f"records (a None gradient records none), so it has no 'record' axis in common with the others: "
                f"use handle[{name!r}].to_xarray()")
    coords = _record_coords(xr, _AllRecords(handle))
    return xr.Dataset(arrays, coords=coords, attrs={"handle": handle.id, "module": handle.module_name,
                                                    "skipped": skipped})


class _AllRecords:
    """Every record of a handle, shaped like a field for :func:`_record_coords`."""

    def __init__(self, handle: Any) -> None:
        self.handle, self.steps, self.calls = handle, handle.steps, handle.calls
        self.records = np.arange(len(handle))
