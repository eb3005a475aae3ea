"""Reading a dataset plan's units as numpy batches: units are read into reusable *windows* of
rows on a prefetch thread (one block read per field and unit, straight into the window), and
batches are gathered out of each window in a seeded random order (or in order).

A *block* is a dict ``key -> array`` whose arrays share their first dimension (rows): the field
references hold the stored bits (bfloat16 as ``uint16``...; ragged whole records as an object
array of per-record arrays), the index keys (:data:`~.dataset_plan.INDEX_KEYS`) int64. Every
block handed out is fresh memory (the windows are reused, so nothing handed out is overwritten
later). Needs only numpy (torch tensors are made by :mod:`.dataset`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .. import dtypes
from ..errors import StorageError
from ..reader import Field, Run
from .dataset_plan import INDEX_KEYS, Plan

__all__ = ["Block", "Window", "prefetched", "Batcher", "iter_blocks"]

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


class _Failure:
    """An exception raised on the prefetch thread, handed to the consumer."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


_END = object()


def prefetched(produce: Callable[[threading.Event], Iterable[Any]], depth: int = 2) -> Iterator[Any]:
    """Iterate ``produce(stop)`` on a background thread, at most ``depth`` items ahead, so that
    the consumer (the training loop, or a ``DataLoader`` worker's collation) does not wait for
    the disk. h5py releases the GIL while HDF5 reads. An exception on the thread is raised here;
    closing this generator early sets ``stop`` (a producer that waits must watch it) and joins
    the thread."""
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
            for item in produce(stop):
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




class Window:
    """A reusable buffer of ``capacity`` rows of every key of a plan that whole units are read
    into (fixed-shape fields: straight from HDF5 into its memory, no intermediate array).

    Attributes:
        arrays: key -> ``(capacity, *row_shape)`` array (made on first use).
        n: rows filled.
    """

    def __init__(self, plan: Plan, capacity: int, index: bool) -> None:
        self.capacity = capacity
        self.n = 0
        self.arrays: Block = {}
        for key, name, shape in zip(plan.keys, plan.dtype_names, plan.row_shapes):
            dt = np.dtype(object) if shape is None else dtypes.info(name).storage
            self.arrays[key] = np.empty((capacity, *(shape or ())), dt)
        if index:
            self.arrays.update({k: np.empty(capacity, np.int64) for k in INDEX_KEYS})

    def add(self, fields: list[Field], plan: Plan, a: int, b: int, rows: int) -> None:
        """Read aligned records ``[a, b)`` (``rows`` rows; consecutive entries in every field)
        into the next ``rows`` rows."""
        end = self.n + rows
        for j, (fld, key) in enumerate(zip(fields, plan.keys)):
            dst = self.arrays[key][self.n : end]
            lo = int(plan.entries[a, j])
            if fld.shape is not None:  # (rows are contiguous: the records' view of them)
                fld.read_stored(lo, lo + b - a, out=dst.reshape(b - a, *fld.shape))
            else:
                dst[...] = _as_rows(fld.read_stored(lo, lo + b - a), plan.row_shapes[j], plan.rows)
        if INDEX_KEYS[0] in self.arrays:
            for k, v in _index(plan, a, b).items():
                self.arrays[k][self.n : end] = v
        self.n = end


def _rows_of(block: Block) -> int:
    return len(next(iter(block.values())))


class Batcher:
    """Batches of exactly ``batch_rows`` rows gathered out of successive windows (the last
    batch of an epoch may be shorter), each window's rows in a random order drawn from ``rng``
    (None: in order). Rows left over at the end of a window are copied and begin the next
    batch, so each row is handed out exactly once."""

    def __init__(self, batch_rows: int, rng: np.random.Generator | None) -> None:
        self.batch_rows = batch_rows
        self.rng = rng
        self.carry: Block | None = None

    def feed(self, arrays: Block, n: int) -> Iterator[Block]:
        """The batches the first ``n`` rows of ``arrays`` complete (copies: the window may be
        reused once this generator is exhausted)."""
        order = self.rng.permutation(n) if self.rng is not None else None

        def pick(x: int, y: int) -> Block:
            if order is None:
                return {k: v[x:y].copy() for k, v in arrays.items()}
            return {k: np.take(v, order[x:y], axis=0) for k, v in arrays.items()}

        pos, size = 0, self.batch_rows
        if self.carry is not None:
            pos = min(size - _rows_of(self.carry), n)
            more = pick(0, pos)
            merged = {k: np.concatenate([v, more[k]]) for k, v in self.carry.items()}
            self.carry = None
            if _rows_of(merged) < size:
                self.carry = merged
                return
            yield merged
        while n - pos >= size:
            yield pick(pos, pos + size)
            pos += size
        if pos < n:
            self.carry = pick(pos, n)

    def flush(self) -> Iterator[Block]:
        """The last, shorter batch (if rows are left)."""
        if self.carry is not None:
            yield self.carry
            self.carry = None


def _windows(plan: Plan, cap: int, index: bool, count: int, pool: list[Window] | None) -> list[Window]:
    """``count`` windows of ``cap`` rows: taken from ``pool`` (windows of an earlier epoch,
    whose memory is already mapped) where they fit, else new."""
    keys = set(plan.keys) | (set(INDEX_KEYS) if index else set())
    out: list[Window] = []
    for w in list(pool or ()):
        if len(out) < count and w.capacity == cap and set(w.arrays) == keys:
            pool.remove(w)  # type: ignore[union-attr]
            out.append(w)
    return out + [Window(plan, cap, index) for _ in range(count - len(out))]


def iter_blocks(opener: Callable[[], Run], plan: Plan, units: np.ndarray, *, capacity: int,
                rng: np.random.Generator | None, batch_rows: int, index: bool, windows: int = 2,
                pool: list[Window] | None = None) -> Iterator[Block]:
    """Batches of ``batch_rows`` rows of ``units`` (in that order): read into ``windows``
    reusable windows of ``capacity`` rows (at least one unit) on a prefetch thread that opens the
    run itself (``opener``) and closes it at the end; each window's rows come out in a random
    order from ``rng`` (None: in order). Windows come from and go back to ``pool`` (reused by
    the next epoch: fresh memory costs a page fault per page)."""
    cum = np.concatenate([[0], np.cumsum(plan.counts)])
    bounds = plan.units
    unit_rows = cum[bounds[1:]] - cum[bounds[:-1]]
    # (a window holds at least one unit, and no more rows than the shard has)
    mine_rows = unit_rows[units]
    cap = max(min(int(capacity), int(mine_rows.sum())), int(mine_rows.max()) if len(units) else 1, 1)
    mine = _windows(plan, cap, index, max(1, windows), pool)
    free: queue.Queue[Window] = queue.Queue()
    for w in mine:
        free.put(w)

    def fill(stop: threading.Event) -> Iterator[Window]:
        run = opener()
        try:
            fields = _fields(run, plan)
            win: Window | None = None
            for u in units:
                a, b, rows = int(bounds[u]), int(bounds[u + 1]), int(unit_rows[u])
                if win is None or win.n + rows > cap:
                    if win is not None:
                        yield win
                    win = _next_free(free, stop)
                    if win is None:
                        return
                    win.n = 0
                win.add(fields, plan, a, b, rows)
            if win is not None and win.n:
                yield win
        finally:
            run.close()

    batcher = Batcher(batch_rows, rng)
    reads = prefetched(fill, depth=1)
    try:
        for win in reads:
            yield from batcher.feed(win.arrays, win.n)
            free.put(win)
        yield from batcher.flush()
    finally:
        reads.close()  # (stops and joins the reading thread: the windows are free again)
        if pool is not None:
            pool.extend(mine)


def _next_free(free: queue.Queue[Window], stop: threading.Event) -> Window | None:
    """A window the consumer is done with (None once ``stop`` is set)."""
    while not stop.is_set():
        try:
            return free.get(timeout=0.1)
        except queue.Empty:
            continue
    return None
