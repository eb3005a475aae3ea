"""Reading a dataset plan's units as numpy blocks: one block read per field and unit on a
prefetch thread, a vectorised shuffle buffer, and re-batching into fixed-size batches.

A *block* is a dict ``key -> array`` whose arrays share their first dimension (rows): the field
references hold the stored bits (bfloat16 as ``uint16``...; ragged whole records as an object
array of per-record arrays), the index keys (:data:`~.dataset_plan.INDEX_KEYS`) int64. Needs
only numpy (torch tensors are made by :mod:`.dataset`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ..errors import StorageError
from ..reader import Field, Run
from .dataset_plan import Plan

__all__ = ["Block", "read_unit", "prefetched", "ShuffleBuffer", "shuffled", "rebatch", "iter_blocks"]

Block = dict[str, np.ndarray]


def _as_rows(stored: np.ndarray | list[np.ndarray], row_shape: tuple[int, ...] | None, rows: str) -> np.ndarray:
    """A field's read records as rows: ``(rows, *row_shape)``, or an object array of records."""
    if row_shape is None:  # ragged whole records: one object per record
        out = np.empty(len(stored), object)
        for i, rec in enumerate(stored):
            out[i] = rec
        return out
    if isinstance(stored, list):  # (ragged records as rows: a unit holds at least one record)
        return np.concatenate([np.asarray(r).reshape(-1, *row_shape) for r in stored])
    return stored.reshape(-1, *row_shape) if rows == "sample" else stored


def _index(plan: Plan, a: int, b: int) -> Block:
    """Step, call, rank and sample position of every row of aligned records ``[a, b)``."""
    counts = plan.counts[a:b]
    starts = np.cumsum(counts) - counts
    total = int(counts.sum())
    return {"step": np.repeat(plan.steps[a:b], counts), "call": np.repeat(plan.calls[a:b], counts),
            "rank": np.repeat(plan.ranks[a:b], counts),
            "sample": np.arange(total, dtype=np.int64) - np.repeat(starts, counts)}


def read_unit(fields: list[Field], plan: Plan, u: int, index: bool = False) -> Block:
    """Unit ``u`` of ``plan``: one block read per field (a unit's entries are consecutive in
    every field), as rows."""
    a, b = int(plan.units[u]), int(plan.units[u + 1])
    out: Block = {}
    for j, (fld, key) in enumerate(zip(fields, plan.keys)):
        lo = int(plan.entries[a, j])
        out[key] = _as_rows(fld.read_stored(lo, lo + b - a), plan.row_shapes[j], plan.rows)
    if index:
        out.update(_index(plan, a, b))
    return out


class _Failure:
    """An exception raised on the prefetch thread, handed to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


def prefetched(produce: Callable[[], Iterable[Any]], depth: int = 2) -> Iterator[Any]:
    """Iterate ``produce()`` on a background thread, at most ``depth`` items ahead, so that the
    consumer (the training loop, or a ``DataLoader`` worker's collation) does not wait for the
    disk. h5py releases the GIL while HDF5 reads. An exception on the thread is raised here;
    closing this generator early stops the thread."""
    q: queue.Queue[Any] = queue.Queue(max(1, depth))
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def work() -> None:
        try:
            for item in produce():
                if not put(item):
                    return
            put(_END)
        except BaseException as e:  # (handed to the consumer, raised there)
            put(_Failure(e))

    thread = threading.Thread(target=work, name="hookline-dataset-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.exc
            yield item
    finally:
        stop.set()
        thread.join()


class ShuffleBuffer:
    """A shuffle buffer of ``capacity`` rows, vectorised: a block of ``r`` incoming rows replaces
    ``r`` residents chosen at random, which leave in random order (the classic buffer's rule,
    one fancy-index copy per block instead of a Python step per row). Every row that enters
    leaves exactly once; :meth:`drain` empties it in random order.

    Each emitted batch is a uniform sample of the buffer's rows, and no record has more rows in
    the buffer than it gives (``R``), so ``B`` emitted rows come from at least about
    ``(capacity / R) * (1 - (1 - R / capacity) ** B)`` distinct records (docs/analysis.md).
    """

    def __init__(self, capacity: int, rng: np.random.Generator) -> None:
        self.capacity = capacity
        self.rng = rng
        self.pool: Block | None = None
        self.n = 0

    def push(self, block: Block) -> Iterator[Block]:
        """Take ``block``'s rows in; yield the rows they displace (none while filling)."""
        n = len(next(iter(block.values())))
        cap = self.capacity
        if self.pool is None:
            self.pool = {k: np.empty((cap, *v.shape[1:]), v.dtype) for k, v in block.items()}
        pool = self.pool
        start = min(n, cap - self.n)
        for k, v in block.items():
            pool[k][self.n : self.n + start] = v[:start]
        self.n += start
        while start < n:
            r = min(n - start, cap)
            slots = self.rng.choice(cap, r, replace=False)
            out = {k: p[slots] for k, p in pool.items()}
            for k, p in pool.items():
                p[slots] = block[k][start : start + r]
            yield out
            start += r

    def drain(self) -> Iterator[Block]:
        """The rows left, in random order."""
        if self.pool is not None and self.n:
            order = self.rng.permutation(self.n)
            yield {k: p[: self.n][order] for k, p in self.pool.items()}
        self.pool, self.n = None, 0


def shuffled(blocks: Iterable[Block], buffer: ShuffleBuffer) -> Iterator[Block]:
    """``blocks`` passed through ``buffer`` (all rows, each once)."""
    for block in blocks:
        yield from buffer.push(block)
    yield from buffer.drain()


def _rows_of(block: Block) -> int:
    return len(next(iter(block.values())))


def rebatch(blocks: Iterable[Block], batch_rows: int) -> Iterator[Block]:
    """Blocks of exactly ``batch_rows`` rows (the last one may be shorter): slices of the
    incoming blocks where they hold a whole batch, one concatenation where a batch spans two."""
    pending: list[Block] = []
    have = 0
    for block in blocks:
        n, s = _rows_of(block), 0
        if pending:
            s = min(batch_rows - have, n)
            pending.append({k: v[:s] for k, v in block.items()})
            have += s
            if have == batch_rows:
                yield {k: np.concatenate([p[k] for p in pending]) for k in block}
                pending, have = [], 0
        while n - s >= batch_rows:
            yield {k: v[s : s + batch_rows] for k, v in block.items()}
            s += batch_rows
        if s < n:
            pending.append({k: v[s:] for k, v in block.items()})
            have += n - s
    if pending:
        yield {k: np.concatenate([p[k] for p in pending]) for k in pending[0]}


def _fields(run: Run, plan: Plan) -> list[Field]:
    """The plan's fields in a reopened run.

    Raises:
        StorageError: the run no longer holds what the plan was made of (files removed or
            replaced since the dataset was made).
    """
    need = plan.entries.max(axis=0) + 1 if plan.num_records else np.zeros(len(plan.refs), np.int64)
    out = []
    for (h, f), key, n in zip(plan.refs, plan.keys, need):
        fld = run[h][f] if h in run and f in run[h].fields else None
        if fld is None or len(fld) < n:
            have = "is gone" if fld is None else f"holds {len(fld)} records"
            raise StorageError(f"run {run.path!r} changed since the dataset was made: {key!r} {have}, the "
                               f"dataset reads {int(n)}; make the dataset again (or run `hookline verify`)")
        out.append(fld)
    return out


def iter_blocks(opener: Callable[[], Run], plan: Plan, units: np.ndarray, *, buffer: ShuffleBuffer | None,
                batch_rows: int | None, index: bool, prefetch: int = 2) -> Iterator[Block]:
    """The blocks of ``units`` (in that order): read on a prefetch thread that opens the run
    itself (``opener``) and closes it at the end, shuffled through ``buffer`` (None: in order),
    in batches of ``batch_rows`` (None: as read)."""

    def reads() -> Iterator[Block]:
        run = opener()
        try:
            fields = _fields(run, plan)
            for u in units:
                yield read_unit(fields, plan, int(u), index)
        finally:
            run.close()

    blocks: Iterator[Block] = prefetched(reads, prefetch)
    if buffer is not None:
        blocks = shuffled(blocks, buffer)
    if batch_rows is not None:
        blocks = rebatch(blocks, batch_rows)
    return blocks
