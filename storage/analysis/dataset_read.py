"""Reading a dataset plan's units as numpy batches, on a prefetch thread: units are taken in
*windows* of rows, each window's rows handed out in a seeded random order (or in order), and
every row is copied once, straight into its batch's buffer.

Fields stored as plain chunks (hookline's default: no compression) are gathered from mapped
files (:mod:`.dataset_map`); other fields (compressed, ragged) are read through HDF5 into a
reusable window first (one block read per field and unit), then gathered from it.

A *block* is a dict ``key -> array`` whose arrays share their first dimension (rows): the field
references hold the stored bits (bfloat16 as ``uint16``...; ragged whole records as an object
array of per-record arrays), the index keys (:data:`~.dataset_plan.INDEX_KEYS`) int64. A block's
buffers are reused for a later batch only once nothing refers to them any more (a tensor made
from a block keeps it). Needs only numpy (torch tensors are made by :mod:`.dataset`).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from .. import dtypes
from ..errors import StorageError
from ..reader import Field, Run
from .dataset_map import BufferPool, MapCache, MappedRows, map_fields
from .dataset_plan import INDEX_KEYS, Plan

__all__ = ["Block", "Window", "WindowRows", "MappedWindow", "Batcher", "Reuse", "prefetched", "window_spans",
           "iter_blocks"]

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


class WindowRows:
    """The rows of a filled :class:`Window`, for :class:`Batcher`."""

    def __init__(self, window: Window) -> None:
        self.arrays = window.arrays

    def take(self, key: str, rows: np.ndarray | slice, out: np.ndarray) -> None:
        """Copy rows ``rows`` of ``key`` into ``out``."""
        src = self.arrays[key]
        if isinstance(rows, slice):
            out[...] = src[rows]
        else:
            np.take(src, rows, axis=0, out=out, mode="clip")  # (rows are in range; "raise" copies via scratch)


class MappedWindow:
    """A window of rows left where they are (in mapped files): row references per field and the
    index keys' values, for :class:`Batcher`."""

    def __init__(self, fields: list[MappedRows], plan: Plan, spans: list[tuple[int, int]], index: bool) -> None:
        self.fields = dict(zip(plan.keys, fields))
        self.refs: Block = {}
        for key, rows in self.fields.items():
            j = plan.keys.index(key)
            entries = np.concatenate([plan.entries[a:b, j] for a, b in spans])
            rows.will_need(entries)
            self.refs[key] = rows.refs(entries, np.concatenate([plan.counts[a:b] for a, b in spans]))
        if index:
            parts = [_index(plan, a, b) for a, b in spans]
            self.refs.update({k: np.concatenate([p[k] for p in parts]) for k in INDEX_KEYS})

    def take(self, key: str, rows: np.ndarray | slice, out: np.ndarray) -> None:
        """Copy rows ``rows`` of ``key`` into ``out``."""
        if key in self.fields:
            self.fields[key].gather(self.refs[key][rows], out)
        else:
            out[...] = self.refs[key][rows]


class Batcher:
    """Batches of exactly ``batch_rows`` rows gathered out of successive windows (the last
    batch of an epoch may be shorter), each window's rows in a random order drawn from ``rng``
    (None: in order). Rows are copied once, straight into the batch's buffers (``alloc``); a
    batch not full at the end of a window is completed from the next one, so each row is handed
    out exactly once. With ``sort``, the rows a batch takes from a window (a random sample of
    it) come in the order they lie in the window (units in the epoch's unit order, a unit's rows
    in storage order): the same rows, read in the order that copies fastest."""

    def __init__(self, batch_rows: int, rng: np.random.Generator | None, alloc: Callable[[], Block],
                 sort: bool = False) -> None:
        self.batch_rows = batch_rows
        self.rng = rng
        self.sort = sort
        self.alloc = alloc
        self.cur: Block | None = None
        self.filled = 0

    def feed(self, src: WindowRows | MappedWindow, n: int) -> Iterator[Block]:
        """The batches the first ``n`` rows of ``src`` complete (``src`` may be refilled once
        this generator is exhausted)."""
        order = self.rng.permutation(n) if self.rng is not None else None
        pos = 0
        while pos < n:
            if self.cur is None:
                self.cur, self.filled = self.alloc(), 0
            k = min(n - pos, self.batch_rows - self.filled)
            rows: np.ndarray | slice = slice(pos, pos + k)
            if order is not None:
                rows = np.sort(order[pos : pos + k]) if self.sort else order[pos : pos + k]
            for key, buf in self.cur.items():
                src.take(key, rows, buf[self.filled : self.filled + k])
            pos, self.filled = pos + k, self.filled + k
            if self.filled == self.batch_rows:
                yield self.cur
                self.cur = None

    def flush(self) -> Iterator[Block]:
        """The last, shorter batch (if rows are left)."""
        if self.cur is not None and self.filled:
            yield {k: v[: self.filled] for k, v in self.cur.items()}
        self.cur = None


class Reuse:
    """What a dataset keeps between epochs (fresh memory costs a page fault per page): the
    window of the HDF5 path, file mappings and batch buffers.

    Attributes:
        windows: windows given back by finished epochs.
        maps: file mappings of the mapped path.
        buffers: batch buffers (reused once nothing refers to them).
    """

    def __init__(self, buffers: int = 8) -> None:
        self.windows: list[Window] = []
        self.maps = MapCache()
        self.buffers = BufferPool(buffers)


def _spec(plan: Plan, rows: int, index: bool) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """key -> (dtype, shape) of a batch buffer of ``rows`` rows."""
    spec = {k: (np.dtype(object) if shape is None else np.dtype(dtypes.info(name).storage), (rows, *(shape or ())))
            for k, name, shape in zip(plan.keys, plan.dtype_names, plan.row_shapes)}
    if index:
        spec.update({k: (np.dtype(np.int64), (rows,)) for k in INDEX_KEYS})
    return spec


def _window(plan: Plan, cap: int, index: bool, reuse: Reuse) -> Window:
    """A window of ``cap`` rows: one of an earlier epoch where it fits, else new."""
    keys = set(plan.keys) | (set(INDEX_KEYS) if index else set())
    for w in list(reuse.windows):
        if w.capacity == cap and set(w.arrays) == keys:
            reuse.windows.remove(w)
            return w
    return Window(plan, cap, index)


def window_spans(plan: Plan, units: np.ndarray, unit_rows: np.ndarray, cap: int
                 ) -> Iterator[tuple[list[tuple[int, int]], int]]:
    """The units in order, grouped into windows of at most ``cap`` rows (at least one unit):
    (aligned-record spans, rows) per window."""
    spans: list[tuple[int, int]] = []
    n = 0
    for u in units:
        rows = int(unit_rows[u])
        if spans and n + rows > cap:
            yield spans, n
            spans, n = [], 0
        spans.append((int(plan.units[u]), int(plan.units[u + 1])))
        n += rows
    if spans:
        yield spans, n


def iter_blocks(opener: Callable[[], Run], plan: Plan, units: np.ndarray, *, capacity: int,
                rng: np.random.Generator | None, batch_rows: int, index: bool, depth: int = 2,
                reuse: Reuse | None = None, sort: bool = False) -> Iterator[Block]:
    """Batches of ``batch_rows`` rows of ``units`` (in that order), made on a prefetch thread
    (at most ``depth`` ahead) that opens the run itself (``opener``) and closes it at the end:
    units are taken in windows of ``capacity`` rows (at least one unit), each window's rows in a
    random order from ``rng`` (None: in order; ``sort``: see :class:`Batcher`). Fields stored
    as plain chunks are gathered straight from mapped files (:mod:`.dataset_map`); others are
    read through HDF5 into a window first. Windows, mappings and buffers come from and go back
    to ``reuse``."""
    reuse = reuse if reuse is not None else Reuse()
    cum = np.concatenate([[0], np.cumsum(plan.counts)])
    unit_rows = cum[plan.units[1:]] - cum[plan.units[:-1]]
    mine_rows = unit_rows[units]
    cap = max(min(int(capacity), int(mine_rows.sum())), int(mine_rows.max()) if len(units) else 1, 1)
    spec = _spec(plan, batch_rows, index)

    def alloc() -> Block:
        return reuse.buffers.take(lambda: {k: np.empty(s, dt) for k, (dt, s) in spec.items()},
                                  lambda b: all(k in b and b[k].shape == s and b[k].dtype == dt
                                                for k, (dt, s) in spec.items()) and len(b) == len(spec))

    def produce(stop: threading.Event) -> Iterator[Block]:
        run = opener()
        win: Window | None = None
        try:
            fields = _fields(run, plan)
            mapped = map_fields(fields, plan.row_shapes, reuse.maps)
            batcher = Batcher(batch_rows, rng, alloc, sort)
            for spans, n in window_spans(plan, units, unit_rows, cap):
                if mapped is not None:
                    src: WindowRows | MappedWindow = MappedWindow(mapped, plan, spans, index)
                else:
                    win = win or _window(plan, cap, index, reuse)
                    win.n = 0
                    for a, b in spans:
                        win.add(fields, plan, a, b, int(cum[b] - cum[a]))
                    src = WindowRows(win)
                yield from batcher.feed(src, n)
                if stop.is_set():
                    return
            yield from batcher.flush()
        finally:
            run.close()
            if win is not None:
                reuse.windows.append(win)

    yield from prefetched(produce, depth=depth)
