"""Recorded activations as training data: :class:`RecordDataset`, a torch ``IterableDataset``
of aligned rows of one run's fields (SPEC §14).

``import hookline.storage`` stays numpy + h5py: the class is made on first access (this
module's ``__getattr__``, PEP 562) as a subclass of :class:`RecordRows` (everything but torch:
the plan, sharding, shuffling, numpy blocks) and ``torch.utils.data.IterableDataset``, so
``isinstance(ds, IterableDataset)`` holds and pickling finds the class by name in ``DataLoader``
workers started with ``spawn``. The design and the mixing of the shuffle are in
docs/analysis.md, "Training on recorded activations".
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .. import dtypes
from ..errors import HookTypeError, InvalidArgumentError
from ..local import LocalSource
from ..reader import Run, open_run
from .dataset_plan import INDEX_KEYS, UNIT_BYTES, Plan, make_plan, parse_refs, unit_order
from .dataset_read import Block, Reuse, iter_blocks

__all__ = ["RecordDataset", "RecordRows", "records_per_batch", "BUFFER_BYTES"]

#: The default shuffle buffer (a window) holds this many bytes of rows (at most 65536 rows).
BUFFER_BYTES = 128 << 20
#: Rows per block handed from the reader to the per-row iteration when ``batch_rows`` is None.
ROW_BLOCK = 1024


def _count(name: str, value: Any, *, low: int = 1, none: bool = True) -> int | None:
    """``value`` checked as an int >= ``low`` (or None where allowed)."""
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidArgumentError(f"{name} must be an int >= {low}{' or None' if none else ''}, got {value!r}")
    return int(value)


def records_per_batch(batch: int, buffer_rows: int, rows_per_record: int) -> float:
    """The expected number of distinct records ``batch`` shuffled rows come from, with a
    shuffle window of ``buffer_rows`` rows and records of ``rows_per_record`` rows each.

    A batch is a uniform sample (without replacement) of one window's rows, and a record has at
    most ``rows_per_record`` (``R``) rows in a window; with ``buffer_rows // R`` whole records
    of ``R`` rows in the window, a record is missed by a batch with the hypergeometric
    probability ``C(buffer - R, batch) / C(buffer, batch)``. Records cut by a unit or window
    boundary only add records, so this is also a lower bound (a batch that straddles two
    windows draws from both).
    """
    cap, r = int(buffer_rows), max(1, int(rows_per_record))
    groups = cap // r
    if groups <= 1:
        return 1.0
    cap, b = groups * r, min(int(batch), groups * r)
    if b > cap - r:
        return float(groups)
    log_miss = (math.lgamma(cap - r + 1) - math.lgamma(cap - r - b + 1)
                - math.lgamma(cap + 1) + math.lgamma(cap - b + 1))
    return groups * (1.0 - math.exp(log_miss))


class RecordRows:
    """Aligned rows of several fields of one run, read in blocks, shuffled, shared out among
    workers and ranks; the torch-free part of :class:`RecordDataset` (its :meth:`blocks` are
    numpy, in the stored representation: bfloat16 as ``uint16`` bits).

    Args:
        run: a run directory, a ``runs:/`` URI, or an opened :class:`~hookline.storage.Run`
            (it is reopened by path in every worker; the dataset keeps no file open).
        fields: ``"handle/field"`` references (e.g. ``"outputs[blocks.3]/outputs.0"``), one or
            several handles; their k-th rows come from the same record (rank, step, call) and
            the same sample. Records that not every field has are left out.
        rows: ``"sample"``: a record of shape ``(d0, ..., dk)`` gives ``d0 * ... * d(k-1)`` rows
            of shape ``(dk,)`` (tokens of a ``(batch, seq, d)`` output are rows); ``"record"``:
            whole records.
        shuffle: read units (chunk-aligned blocks of consecutive records) in a seeded random
            order into windows of ``buffer_rows`` rows, and hand each window's rows out in a
            seeded random order (:func:`records_per_batch` says how well a batch mixes).
        seed: the shuffle's seed; the order depends only on (seed, epoch, workers x ranks).
        buffer_rows: rows in a window (the shuffle buffer; at least one unit's rows). None: as
            many as fit in :data:`BUFFER_BYTES`, at most 65536. Memory per worker: one window of
            ``buffer_rows`` rows for fields read through HDF5 (none for fields stored as plain
            chunks: their rows are gathered from the page cache) and up to ``prefetch + 6``
            batches' buffers.
        batch_rows: yield batches of this many rows (dicts of ``(batch_rows, ...)`` tensors; use
            ``DataLoader(ds, batch_size=None)``) instead of single rows; the fast path. A batch
            holds the same rows as without it (``batch_rows`` consecutive rows of the shuffled
            order), ordered as they lie in the window (a cheaper copy; a batch's gradient does
            not depend on the order of its rows).
        steps: only records of these steps.
        sample_dims: leading dimensions that index rows with ``rows="sample"`` (an int, or a
            dict reference -> int); default: all but the last. E.g. 2 for ``(batch, seq)`` token
            ids that label ``(batch, seq, d)`` activations.
        index: items also carry ``"step"``, ``"call"``, ``"rank"`` (-1: not distributed) and
            ``"sample"`` (the row's position within its record) as int64.
        rank, world_size: this process's share of the rows; default: ``torch.distributed``'s
            rank and world size when it is initialised, else 0 and 1.
        tracking_uri, cache_dir: for ``runs:/`` runs, as in :func:`~hookline.storage.open_run`.
        unit_bytes: bytes of the widest field read per unit.
        prefetch: batches the reading thread prepares ahead of the one being handed out.

    Raises:
        UnknownNameError: an unknown handle or field (the message lists the available ones).
        InvalidArgumentError: a malformed reference, bad option values, fields without common
            records, steps selecting nothing, rows that do not line up across fields.
    """

    def __init__(self, run: str | os.PathLike[str] | Run, fields: str | Sequence[str], *, rows: str = "sample",
                 shuffle: bool = False, seed: int = 0, buffer_rows: int | None = None,
                 batch_rows: int | None = None, steps: Iterable[int] | None = None,
                 sample_dims: int | Mapping[str, int] | None = None, index: bool = False,
                 rank: int | None = None, world_size: int | None = None, tracking_uri: str | None = None,
                 cache_dir: str | os.PathLike[str] | None = None, unit_bytes: int = UNIT_BYTES,
                 prefetch: int = 1) -> None:
        self.seed = _count("seed", seed, low=0, none=False)
        self.batch_rows = _count("batch_rows", batch_rows)
        self.prefetch = _count("prefetch", prefetch, none=False)
        unit_bytes = _count("unit_bytes", unit_bytes, none=False)  # type: ignore[assignment]
        self._dist = self._check_dist(rank, world_size)
        self.shuffle = bool(shuffle)
        self.index = bool(index)
        self.epoch = 0
        self._reuse = Reuse(self.prefetch + 6)  # (windows, mappings, buffers kept between epochs)
        opened = not isinstance(run, Run)
        r = open_run(run, tracking_uri=tracking_uri, cache_dir=cache_dir) if opened else run  # type: ignore[arg-type]
        try:
            self.plan: Plan = make_plan(r, parse_refs(fields, r), rows=rows, steps=steps, sample_dims=sample_dims,
                                        unit_bytes=unit_bytes)
            if isinstance(r.source, LocalSource):
                self._where, self._open_kw = str(Path(r.source.root).resolve()), {}
            else:  # (a runs:/ URI: workers read the same download cache)
                self._where = r.path
                self._open_kw = {"tracking_uri": tracking_uri,
                                 "cache_dir": cache_dir or getattr(r.source, "cache_dir", None)}
        finally:
            if opened:
                r.close()
        if self.batch_rows is not None and None in self.plan.row_shapes:
            raise InvalidArgumentError("batch_rows needs fixed-shape rows, but a field's records are ragged with "
                                       "rows='record'; use rows='sample' or batch_rows=None")
        self.buffer_rows = _count("buffer_rows", buffer_rows) or self._default_buffer()

    @staticmethod
    def _check_dist(rank: Any, world_size: Any) -> tuple[int, int] | None:
        if rank is None and world_size is None:
            return None
        r, w = _count("rank", rank, low=0, none=False), _count("world_size", world_size, none=False)
        if r >= w:  # type: ignore[operator]
            raise InvalidArgumentError(f"rank {rank!r} must be below world_size {world_size!r}")
        return r, w  # type: ignore[return-value]

    def _default_buffer(self) -> int:
        row = sum((math.prod(shape) if shape is not None else 1 << 18) * dtypes.info(name).storage.itemsize
                  for shape, name in zip(self.plan.row_shapes, self.plan.dtype_names))  # (ragged records: a guess)
        return int(max(1, min(65536, BUFFER_BYTES // max(1, row))))

    # --- what it holds -------------------------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        """Item keys: the field references (then the index keys with ``index=True``)."""
        return list(self.plan.keys) + (list(INDEX_KEYS) if self.index else [])

    @property
    def num_rows(self) -> int:
        """Rows per epoch over all workers and ranks (records with ``rows="record"``)."""
        return self.plan.num_rows

    @property
    def num_records(self) -> int:
        """Aligned records the rows come from."""
        return self.plan.num_records

    def set_epoch(self, epoch: int) -> None:
        """Use the shuffle order of ``epoch`` from the next iteration on (call it before each
        epoch, in the process that creates the ``DataLoader`` iterator; workers made with
        ``persistent_workers=True`` keep the epoch they started with)."""
        self.epoch = _count("epoch", epoch, low=0, none=False)  # type: ignore[assignment]

    # --- reading -------------------------------------------------------------------------------
    def _open(self) -> Run:
        return open_run(self._where, **self._open_kw)

    def shard(self, worker: int = 0, num_workers: int = 1) -> tuple[int, int]:
        """``(shard, num_shards)`` of a worker of this process's rank: the rank's workers take
        consecutive shards (``rank * num_workers + worker``)."""
        rank, world = self._dist if self._dist is not None else _torch_dist()
        return rank * num_workers + worker, world * num_workers

    def shard_rows(self, shard: int, num_shards: int) -> int:
        """Rows (batches: divide by ``batch_rows``, rounding up) shard ``shard`` of ``num_shards``
        gets this epoch; e.g. the fewest over all ranks' shards is how many steps every DDP rank
        can run."""
        units = self._units(shard, num_shards)
        cum = np.concatenate([[0], np.cumsum(self.plan.counts)])
        b = self.plan.units
        return int((cum[b[units + 1]] - cum[b[units]]).sum())

    def _units(self, shard: int, num_shards: int) -> np.ndarray:
        num_shards = _count("num_shards", num_shards, none=False)  # type: ignore[assignment]
        if _count("shard", shard, low=0, none=False) >= num_shards:  # type: ignore[operator]
            raise InvalidArgumentError(f"shard {shard!r} must be below num_shards {num_shards!r}")
        return unit_order(self.plan.num_units, self.shuffle, self.seed, self.epoch)[shard::num_shards]

    def blocks(self, shard: int = 0, num_shards: int = 1) -> Iterator[Block]:
        """The numpy batches of shard ``shard`` of ``num_shards`` for this epoch (``batch_rows``
        rows each, or :data:`ROW_BLOCK` without it; the last may be shorter): every
        ``num_shards``-th unit of the epoch's unit order, from ``shard`` on, so every row is in
        exactly one shard."""
        units = self._units(shard, num_shards)
        rng = np.random.default_rng([self.seed, self.epoch, num_shards, shard]) if self.shuffle else None
        return iter_blocks(self._open, self.plan, units, capacity=self.buffer_rows, rng=rng,
                           batch_rows=self.batch_rows or ROW_BLOCK, index=self.index, depth=self.prefetch + 1,
                           reuse=self._reuse, sort=self.batch_rows is not None)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        del state["_reuse"]  # (buffers and mappings of this process: a worker makes its own)
        if state["_dist"] is None and "torch.distributed" in sys.modules:
            # (a spawned DataLoader worker has no process group: it keeps its parent's rank)
            dist = _torch_dist()
            state["_dist"] = dist if dist != (0, 1) else None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reuse = Reuse(self.prefetch + 6)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self._where!r}, {self.plan.keys!r}, rows={self.plan.rows!r}, "
                f"num_rows={self.num_rows}, shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch})")


def _torch_dist() -> tuple[int, int]:
    """``(rank, world_size)`` of the initialised ``torch.distributed`` group, else ``(0, 1)``."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _tensor(arr: np.ndarray, name: str) -> Any:
    """A stored block as a torch tensor of the exact dtype, sharing its memory (a list of
    tensors for an object array of ragged records)."""
    import torch

    if arr.dtype == object:
        return [_tensor(np.asarray(a), name) for a in arr]
    arr = np.ascontiguousarray(arr)
    info = dtypes.info(name)
    if not info.is_bits:
        return torch.from_numpy(arr)
    tdt = getattr(torch, name, None)
    if tdt is None:
        raise HookTypeError(f"this torch ({torch.__version__}) has no dtype {name!r}; read the field with numpy")
    # (the raw bits viewed as the signed int of their width, which every torch has, then as the dtype)
    return torch.from_numpy(arr.view(f"i{info.storage.itemsize}")).view(tdt)


def _iter_tensors(ds: RecordRows) -> Iterator[dict[str, Any]]:
    """The items of ``ds`` for this process and ``DataLoader`` worker: dicts of tensors, one row
    each, or one batch each with ``batch_rows``."""
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    shard, num = ds.shard(info.id, info.num_workers) if info is not None else ds.shard()
    names = dict(zip(ds.plan.keys, ds.plan.dtype_names))
    for block in ds.blocks(shard, num):
        t = {k: _tensor(v, names.get(k, "int64")) for k, v in block.items()}
        if ds.batch_rows is not None:
            yield t
            continue
        keys = list(t)
        for i in range(len(t[keys[0]])):
            yield {k: t[k][i] for k in keys}


def _build() -> type:
    """The ``RecordDataset`` class (imports torch)."""
    from torch.utils.data import IterableDataset

    class RecordDataset(RecordRows, IterableDataset):  # type: ignore[misc]
        __doc__ = ("A ``torch.utils.data.IterableDataset`` of aligned rows of recorded fields; items are dicts "
                   "reference -> tensor of the exact recorded dtype (bfloat16 too).\n\n"
                   + (RecordRows.__doc__ or "").split("\n\n", 1)[1])

        def __iter__(self) -> Iterator[dict[str, Any]]:
            return _iter_tensors(self)

    RecordDataset.__module__ = __name__
    RecordDataset.__qualname__ = "RecordDataset"
    return RecordDataset


def __getattr__(name: str) -> Any:
    if name == "RecordDataset":
        cls = globals()["RecordDataset"] = _build()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
