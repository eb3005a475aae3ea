"""Packing captured records into chunk-sized host blocks, handed to the writer a block at a time.

Each firing of a recorder hook copies its tensors straight into the next row of its handle's
open *block*: host buffers of shape ``(cap, *record_shape)``, one per field, sized so that a full
block is a whole number of storage chunks (up to :data:`BLOCK_BYTES`, fewer when many handles
share the open-block budget; see docs/format.md for chunks). A full block goes to
:meth:`RunWriter.write_block` as one queue entry, which the writer thread hands to HDF5 without
another copy. Per record the training thread pays one ``copy_`` per field and two list appends;
the writer's per-record Python work (validation, staging, packing copy, buffer recycling) is paid
once per block. Measured: docs/performance.md (Capture).

CUDA tensors are copied with ``non_blocking=True`` into pinned blocks and an event is recorded per
record; a block goes to the writer only once its events have completed, checked without blocking
on later captures and waited for in :meth:`BlockPacker.drain`. This keeps
``torch.cuda.synchronize`` out of the training loop.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

import numpy as np
import torch

from hookline.storage.errors import WriterClosedError
from hookline.storage.format import RECORD_CHUNK_MIN, chunk_records

from .convert import BufferPool, storage_dtype, to_field
from .stats import SCALAR_STATS, split_stats

__all__ = ["BlockPacker", "BLOCK_BYTES", "BLOCK_MAX_RECORDS", "MAX_AGE_S"]

#: A block holds whole chunks up to about this many bytes: every block costs the training thread
#: ~50-150 us (new buffers, hand-over, queueing), so 4 chunks of ~1 MiB per block cost a quarter
#: of what one chunk per block costs (docs/performance.md, Capture).
BLOCK_BYTES = 4 << 20
#: Most records one block holds (tiny records such as stats would otherwise wait for thousands).
BLOCK_MAX_RECORDS = 256
#: Most records one shared block holds (records of many handles: see ``_join_shared``).
SHARED_MAX_RECORDS = 1 << 16
#: Row views of a block made at once (see ``_Block.rows``).
ROW_WINDOW = 16
#: A partly filled block is handed to the writer at the next step boundary once its first record
#: is this old, so a slow loop's records reach the writer (and its autoflush) within seconds.
MAX_AGE_S = 1.0
#: Most the age limit grows (x MAX_AGE_S) while hand-overs by age find blocks of about one record:
#: a step of thousands of handles that takes longer than the limit would otherwise hand over every
#: block at every step, one record each (2,000 handles of 64-byte records: ~1 ms a record; issue
#: 34, case 9). The limit grows 4x after each such hand-over and is back to MAX_AGE_S after one
#: that finds fuller blocks.
MAX_AGE_BACKOFF = 32
#: After this many shape/field changes a handle counts as ragged: its blocks hold one record
#: (a block sized for one shape would be handed over after one record anyway).
RAGGED_AFTER = 2
#: ... and counts as fixed again after this many consecutive records of one shape.
RAGGED_RESET = 64


class _Block:
    """Records of one handle with the same field names, shapes, dtypes and devices."""

    __slots__ = ("names", "srcs", "bufs", "rows", "steps", "calls", "n", "cap", "nbytes", "events",
                 "cuda", "since", "stats", "hids", "sig", "members")

    def __init__(self, names: list[str], srcs: list[tuple], bufs: list[torch.Tensor], cap: int,
                 cuda: bool, stats: bool, sig: tuple | None = None) -> None:
        self.names = names
        self.srcs = srcs  # (shape, dtype, is_cuda) of each source tensor
        self.bufs = bufs
        # Row views made a window at a time (one unbind call per ROW_WINDOW records instead of
        # one indexing per record; views of every row of every open block at once would be
        # ~0.5 KB of tensor objects per row, more than tiny records themselves).
        self.rows: list[tuple[torch.Tensor, ...]] = []
        self.steps: list[int] = []
        self.calls: list[int] = []
        self.n = 0
        self.cap = cap
        self.nbytes = sum(b.nbytes for b in bufs)
        self.events: list[Any] = []
        self.cuda = cuda
        self.since = time.monotonic()
        self.stats = stats
        #: A shared block (records of several handles with one layout, :data:`SHARED_BELOW`):
        #: its layout key, and the handle of each record.
        self.sig = sig
        self.hids: list[str] | None = [] if sig is not None else None
        self.members: set[str] = set()  # handles whose records go to this shared block now

    def matches(self, names: list[str], tensors: list[torch.Tensor]) -> bool:
        if names != self.names:
            return False
        for t, (shape, dtype, cuda) in zip(tensors, self.srcs):
            if t.shape != shape or t.dtype != dtype or t.is_cuda != cuda:
                return False
        return True


class _Lane:
    """Shared blocks of one record layout: the one being filled (None between blocks) and what a
    new one is made of. A handle of shared blocks keeps its lane, so its next record finds the
    block without hashing the layout."""

    __slots__ = ("sig", "block", "dtypes", "record_bytes")

    def __init__(self, sig: tuple, dtypes: list[torch.dtype], record_bytes: int) -> None:
        self.sig = sig
        self.block: _Block | None = None
        self.dtypes = dtypes
        self.record_bytes = record_bytes


class BlockPacker:
    """Per-handle blocks of captured records, handed to the writer when full (or on demand).

    Args:
        write_block: ``RunWriter.write_block``-compatible callable ``(handle_id, steps, calls,
            fields) -> bool``.
        pool: host buffers reused across blocks (warm pages; pinned for CUDA sources).
        max_open_bytes: when the blocks being filled hold more than this, all of them are handed
            over (partly filled): bounds the memory held outside the writer's budget.
        event_factory: creates an object with ``record()``, ``query()`` and ``synchronize()``;
            defaults to ``torch.cuda.Event``. Injectable so the pending logic is testable on CPU.
        max_age_s: see :data:`MAX_AGE_S`.
        block_bytes: see :data:`BLOCK_BYTES`.
        check_fields: ``RunWriter.reserve_fields``-compatible callable ``(handle_id, {name:
            (dtype_name, record_shape)})``, called when a handle's record layout changes,
            before the record is taken: a record the writer would refuse fails in its own hook
            and costs no other record.
        write_rows: ``RunWriter.write_rows``-compatible callable ``(handle_ids, steps, calls,
            fields) -> bool``: enables shared blocks (records of many handles with one layout in
            one block, when a handle's share of the open-block budget holds less than a chunk).
            Without it such handles get blocks as small as their share.
        make_room: ``RunWriter.make_room``-compatible callable ``(handle_id, nbytes) -> bool``,
            called before a block bigger than ``max_open_bytes`` (one big record) is filled, so
            the writer has finished the previous one first: memory holds one such record, not
            two. False: the writer counted the record as dropped (policy ``"drop"``).
    """

    def __init__(
        self,
        write_block: Callable[[str, list[int], list[int], dict[str, Any]], bool],
        pool: BufferPool,
        *,
        max_open_bytes: int = 128 << 20,
        event_factory: Callable[[], Any] | None = None,
        max_age_s: float = MAX_AGE_S,
        block_bytes: int = BLOCK_BYTES,
        check_fields: Callable[[str, dict[str, tuple[str, tuple[int, ...]]]], None] | None = None,
        write_rows: Callable[[list[str], list[int], list[int], dict[str, Any]], bool] | None = None,
        make_room: Callable[[str, int], bool] | None = None,
    ) -> None:
        self._write_block = write_block
        self._write_rows = write_rows
        self._make_room = make_room
        self._check_fields = check_fields
        self._closed = False
        self.block_bytes = block_bytes
        #: Handles expected to fill blocks at once (the recorder keeps it at its number of bound
        #: handles): each block gets at most an even share of the open-block budget.
        self.handles = 0
        self.pool = pool
        self.max_open_bytes = max_open_bytes
        # Free buffers kept for reuse and the blocks being filled share max_open_bytes: the pool
        # keeps what the open blocks leave (at most its own bound).
        self._pool_cap = min(pool.max_bytes, max_open_bytes)
        pool.shrink(self._pool_cap)
        self.max_age_s = max_age_s
        self._event_factory = event_factory or (lambda: torch.cuda.Event())
        self._open: dict[str, _Block] = {}  # handle -> the block its next record goes to
        self._open_bytes = 0
        self._oldest: float | None = None
        self._backoff = 1  # the age limit is max_age_s times this (see MAX_AGE_BACKOFF)
        self._changes: dict[str, int] = {}
        self._checked: dict[str, tuple] = {}  # handle -> the record layout check_fields accepted last
        # Shared blocks: each layout's lane, and the lane of each handle whose records go there.
        self._lanes: dict[tuple, _Lane] = {}
        self._member_of: dict[str, _Lane] = {}
        self._last_sig: dict[str, tuple[Any, int]] = {}  # ragged handles: last signature, repeats
        # Blocks handed over but waiting for device copies (or behind such a block: order kept).
        self._pending: deque[tuple[str, _Block]] = deque()
        # Backward hooks of CUDA tensors run on autograd's device threads (one per device), so
        # records may arrive from several threads; uncontended, the lock costs well under 1 us.
        self._lock = threading.RLock()

    @property
    def pending(self) -> int:
        """Blocks whose device copies have not completed yet."""
        return len(self._pending)

    @property
    def open_records(self) -> int:
        """Records captured but not yet handed to the writer."""
        return sum(b.n for b in self._blocks()) + sum(b.n for _, b in self._pending)

    def _blocks(self) -> list[_Block]:
        """The open blocks, each once (a shared block is the open block of all its members)."""
        return list({id(b): b for b in self._open.values()}.values())

    def add(self, handle_id: str, step: int, call: int, names: list[str], tensors: list[torch.Tensor],
            cast: torch.dtype | None = None, stats: bool = False) -> None:
        """Copy one record's tensors into its handle's open block.

        Args:
            handle_id: the writer handle.
            step, call: the record's step and call index.
            names: field names, one per tensor.
            tensors: detached tensors (CPU or CUDA); copied, so the caller may modify them later.
            cast: store floating tensors in this dtype (the copy converts; bit-identical to
                ``tensor.to(cast)``).
            stats: the tensors are packed stats (:func:`compute_stats`), split into fields when
                the block is handed over.
        """
        with self._lock:
            self._add(handle_id, step, call, names, tensors, cast, stats)

    def _add(self, handle_id: str, step: int, call: int, names: list[str], tensors: list[torch.Tensor],
             cast: torch.dtype | None, stats: bool) -> None:
        if self._closed:
            raise WriterClosedError(
                f"{handle_id} fired while its recorder was closing; the record was not taken")
        blk = self._open.get(handle_id)
        if blk is None:
            # A handle of shared blocks (the hot path of many handles): _rejoin checks the layout.
            if handle_id in self._member_of:
                blk = self._rejoin(handle_id, names, tensors, cast, stats)
            fits = blk is not None
        else:
            fits = blk.matches(names, tensors)
        if not fits:
            sig = (tuple(names), tuple((t.shape, t.dtype, t.is_cuda) for t in tensors), cast, stats)
            # Before anything changes (refused means untouched); once per layout of a handle, not
            # per block (a handle of a shared block starts a new block every few records).
            if self._check_fields is not None and self._checked.get(handle_id) != sig:
                self._check_fields(handle_id, _layout(names, tensors, cast, stats))
                self._checked[handle_id] = sig
            if blk is not None:
                self._changes[handle_id] = self._changes.get(handle_id, 0) + 1
                self._hand_over(handle_id)
            blk = self._new_block(handle_id, names, tensors, cast, stats)
            if blk is None:
                return  # dropped by the writer's policy before it was copied (counted there)
        i = blk.n
        w = i % ROW_WINDOW
        if not w:
            blk.rows = [b[i:i + ROW_WINDOW].unbind(0) for b in blk.bufs]
        for rows, t in zip(blk.rows, tensors):
            rows[w].copy_(t, non_blocking=blk.cuda)
        if blk.cuda:
            ev = self._event_factory()
            ev.record()
            blk.events.append(ev)
        if blk.hids is not None:
            blk.hids.append(handle_id)
        blk.steps.append(step)
        blk.calls.append(call)
        blk.n = i + 1
        if blk.n == blk.cap:
            self._hand_over(handle_id)
        elif self._pending:
            self._poll()

    def _new_block(self, handle_id: str, names: list[str], tensors: list[torch.Tensor],
                   cast: torch.dtype | None, stats: bool) -> _Block | None:
        srcs = [(t.shape, t.dtype, t.is_cuda) for t in tensors]  # what _Block.matches compares
        cuda = any(c for _, _, c in srcs)
        dtypes = [cast if cast is not None and t.is_floating_point() else t.dtype for t in tensors]
        record_bytes = sum(t.numel() * dt.itemsize for t, dt in zip(tensors, dtypes))
        self._member_of.pop(handle_id, None)  # (joining a shared block sets it again)
        if self._changes.get(handle_id, 0) >= RAGGED_AFTER:
            cap = 1
            # Ragged handles whose shape settles (one short last batch per epoch made them
            # ragged) get full blocks again after RAGGED_RESET records of one signature.
            sig = (tuple(names), tuple(srcs))
            last, same = self._last_sig.get(handle_id, (None, 0))
            same = same + 1 if sig == last else 1
            self._last_sig[handle_id] = (sig, same)
            if same >= RAGGED_RESET:
                self._changes[handle_id] = 0
                del self._last_sig[handle_id]
        else:
            cap = self._block_records(max(1, record_bytes))
            if cap == 0:
                sig = (tuple(names), tuple(srcs), cast, stats)
                lane = self._lanes.get(sig)
                if lane is None:
                    lane = self._lanes[sig] = _Lane(sig, dtypes, max(1, record_bytes))
                return self._join_shared(handle_id, lane, tensors)
        nbytes = cap * record_bytes
        if nbytes > self.max_open_bytes and self._make_room is not None:
            if not self._make_room(handle_id, nbytes):
                return None
        return self._open_block(handle_id, _Block(list(names), srcs, self._buffers(cap, tensors, dtypes, cuda),
                                                  cap, cuda, stats))

    def _buffers(self, cap: int, tensors: list[torch.Tensor], dtypes: list[torch.dtype],
                 cuda: bool) -> list[torch.Tensor]:
        return [self.pool.take(torch.Size((cap, *t.shape)), dt, pin=cuda) for t, dt in zip(tensors, dtypes)]

    def _open_block(self, handle_id: str, blk: _Block) -> _Block:
        """Make ``blk`` the open block of ``handle_id`` (a new block: counted against the budget)."""
        self._open[handle_id] = blk
        self._open_bytes += blk.nbytes
        self._fit_pool()
        if self._oldest is None:
            self._oldest = blk.since
        if self._open_bytes > self.max_open_bytes:
            self.hand_over_all(keep=handle_id)
        return blk

    def _fit_pool(self) -> None:
        """Let the pool keep what the open blocks leave of ``max_open_bytes`` (freeing buffers
        only when it holds more: the usual call is one comparison and an assignment)."""
        room = max(0, min(self._pool_cap, self.max_open_bytes - self._open_bytes))
        if self.pool.nbytes > room:
            self.pool.shrink(room)
        else:
            self.pool.max_bytes = room

    def _rejoin(self, handle_id: str, names: list[str], tensors: list[torch.Tensor], cast: torch.dtype | None,
                stats: bool) -> _Block | None:
        """The shared block for a record of a handle whose last records went to shared blocks,
        if the record has their layout (the hot path of many handles: a shared block fills with
        records of hundreds of handles, so each starts a new block every record or two)."""
        lane = self._member_of[handle_id]
        sig = lane.sig
        if sig[2] != cast or sig[3] != stats:
            return None
        blk = lane.block
        if blk is None:
            if not self._matches_sig(sig, names, tensors):
                return None
            return self._join_shared(handle_id, lane, tensors)
        if not blk.matches(names, tensors):
            return None
        blk.members.add(handle_id)
        self._open[handle_id] = blk
        return blk

    @staticmethod
    def _matches_sig(sig: tuple, names: list[str], tensors: list[torch.Tensor]) -> bool:
        if tuple(names) != sig[0] or len(tensors) != len(sig[1]):
            return False
        return all(t.shape == shape and t.dtype == dt and t.is_cuda == c for t, (shape, dt, c) in zip(tensors, sig[1]))

    def _join_shared(self, handle_id: str, lane: _Lane, tensors: list[torch.Tensor]) -> _Block:
        """The shared block of ``lane``'s layout (opened if none is), as ``handle_id``'s open block.

        Per-handle blocks need a chunk's worth of records per handle to pay for themselves; with
        more handles than the open-block budget has chunks for, records of every handle with the
        same layout share blocks instead, so a record costs the same whatever the number of
        handles (the writer sorts the records into their handles' files)."""
        self._member_of[handle_id] = lane
        blk = lane.block
        if blk is not None:
            blk.members.add(handle_id)
            self._open[handle_id] = blk
            return blk
        filling = sum(1 for other in self._lanes.values() if other.block is not None)
        room = min(self.block_bytes, self.max_open_bytes // (2 * (filling + 1)))
        # (not BLOCK_MAX_RECORDS: the block is shared, so it holds a step of every member,
        # and the writer keeps a view per handle and block: few rows per handle would cost
        # more memory in views than the rows themselves)
        cap = max(1, min(SHARED_MAX_RECORDS, room // lane.record_bytes))
        names, srcs, _, stats = lane.sig
        cuda = any(c for _, _, c in srcs)
        blk = _Block(list(names), list(srcs), self._buffers(cap, tensors, lane.dtypes, cuda), cap, cuda, stats,
                     lane.sig)
        blk.members.add(handle_id)
        lane.block = blk
        return self._open_block(handle_id, blk)

    def _block_records(self, record_bytes: int) -> int:
        """Records per block: whole chunks (the writer hands them to HDF5 without a copy), up to
        :attr:`block_bytes` and :data:`BLOCK_MAX_RECORDS`, and at most an even share of half the
        open-block budget among :attr:`handles` (or the blocks open now, if more), but at least a
        chunk. 0 when the budget cannot give every handle a chunk of its records (under 1 MiB):
        the handle joins a shared block (:meth:`_join_shared`; without ``write_rows``, tiny
        records get blocks of what fits). Blocks that outgrow the budget would be handed over
        partly filled, one record each: the cliff this avoids (128 handles of 4 KiB records cost
        1.2 ms per record that way)."""
        per_chunk = min(chunk_records(record_bytes), BLOCK_MAX_RECORDS)
        crowd = max(self.handles, len(self._open) + 1)
        if self.max_open_bytes // crowd < per_chunk * record_bytes:  # not a chunk each
            if self._write_rows is not None and record_bytes < RECORD_CHUNK_MIN:
                return 0
            if per_chunk == BLOCK_MAX_RECORDS:  # tiny records, no shared blocks: what fits
                return max(1, self.max_open_bytes // crowd // record_bytes)
        if per_chunk == BLOCK_MAX_RECORDS:  # tiny records: the writer packs the chunks
            return BLOCK_MAX_RECORDS
        share = self.max_open_bytes // (2 * crowd)
        chunks = min(self.block_bytes, share) // (per_chunk * record_bytes)
        return per_chunk * max(1, min(chunks, BLOCK_MAX_RECORDS // per_chunk))

    def _hand_over(self, handle_id: str) -> None:
        blk = self._open.pop(handle_id)
        if blk.sig is not None:  # a shared block: the open block of every member
            for hid in blk.members:
                self._open.pop(hid, None)
            lane = self._lanes.get(blk.sig)
            if lane is not None and lane.block is blk:
                lane.block = None
        self._open_bytes -= blk.nbytes
        self._fit_pool()
        if not self._open:
            self._oldest = None
        if blk.n == 0:
            for buf in blk.bufs:
                self.pool.give(buf)
            return
        if blk.events or self._pending:
            self._pending.append((handle_id, blk))
            self._poll()
        else:
            self._write(handle_id, blk)

    def hand_over_all(self, keep: str | None = None) -> None:
        """Hand every open block to the writer (or the device-copy queue), partly filled or not."""
        with self._lock:
            failure: Exception | None = None
            kept = self._open.get(keep) if keep is not None else None
            for hid in list(self._open):
                blk = self._open.get(hid)
                if blk is None or blk is kept:  # (gone with a shared block handed over before)
                    continue
                e = _failure_of(self._hand_over, hid)  # called for every handle: the others still go
                failure = failure or e
            self._oldest = min((b.since for b in self._open.values()), default=None)
            if failure is not None:
                raise failure

    def hand_over_stale(self) -> None:
        """Hand over the open blocks if the oldest waited :attr:`max_age_s` (times the backoff of
        :data:`MAX_AGE_BACKOFF`; call per step)."""
        with self._lock:
            if self._oldest is not None and time.monotonic() - self._oldest >= self.max_age_s * self._backoff:
                blocks = {id(b): b.n for b in self._open.values()}
                thin = sum(blocks.values()) < 2 * len(blocks)  # (about one record a block)
                self._backoff = min(MAX_AGE_BACKOFF, 4 * self._backoff) if thin else 1
                self.hand_over_all()
            if self._pending:
                self._poll()

    def _poll(self) -> None:
        while self._pending and all(ev.query() for ev in self._pending[0][1].events):
            hid, blk = self._pending.popleft()
            self._write(hid, blk)

    def drain(self, final: bool = False) -> None:
        """Hand over every block and wait for pending device copies (flush/close).

        Args:
            final: take no record afterwards (:meth:`add` raises WriterClosedError): a record
                arriving from another thread while the recorder closes fails in its hook
                instead of landing in a block nobody hands over.
        """
        with self._lock:
            self._closed = self._closed or final
            failure = _failure_of(self.hand_over_all)
            while self._pending:
                hid, blk = self._pending.popleft()
                for ev in blk.events:
                    ev.synchronize()
                e = _failure_of(self._write, hid, blk)
                failure = failure or e
            if failure is not None:
                raise failure

    def _write(self, handle_id: str, blk: _Block) -> None:
        n = blk.n
        fields: dict[str, Any] = {}
        if blk.stats:
            for name, buf in zip(blk.names, blk.bufs):
                fields.update(split_stats(name, buf[:n].numpy()))  # copies: buffer free now
            for buf in blk.bufs:
                self.pool.give(buf)
        elif 2 * n <= blk.cap:
            # A block handed over less than half full (its age, a flush, the open-block budget):
            # its filled rows are copied out and the buffer goes back to the pool now. The writer
            # counts the rows' bytes against the budget, so a view would pin memory it does not
            # count (the whole buffer), up to ~250x that of tiny records handed over one by one.
            for name, buf in zip(blk.names, blk.bufs):
                fields[name] = to_field(buf[:n].clone())
                self.pool.give(buf)
        else:
            give = self.pool.give
            for name, buf in zip(blk.names, blk.bufs):
                value = to_field(buf[:n] if n < blk.cap else buf)
                # Back to the pool once the writer dropped every numpy view of the buffer: views
                # chain to the array whose base is the tensor (numpy collapses view bases to it),
                # so its finalizer runs only after the last view is gone.
                owner = value[0] if isinstance(value, tuple) else value
                while isinstance(owner.base, np.ndarray):
                    owner = owner.base
                weakref.finalize(owner, give, buf)
                fields[name] = value
        if blk.hids is not None:
            self._write_rows(blk.hids, blk.steps, blk.calls, fields)  # type: ignore[misc]
        else:
            self._write_block(handle_id, blk.steps, blk.calls, fields)  # drops are counted by the writer


def _layout(names: list[str], tensors: list[torch.Tensor], cast: torch.dtype | None,
            stats: bool) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The storage fields a record makes: name -> (dtype name, record shape)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, t in zip(names, tensors):
        if stats:  # one packed float64 vector -> scalar stats + a histogram (split_stats)
            dn = storage_dtype(t.dtype)
            out.update({f"{name}.{s}": (dn, ()) for s in SCALAR_STATS})
            out[f"{name}.hist"] = (dn, (t.shape[-1] - len(SCALAR_STATS),))
        else:
            dt = cast if cast is not None and t.is_floating_point() else t.dtype
            out[name] = (storage_dtype(dt), tuple(t.shape))
    return out


def _failure_of(fn: Callable[..., Any], *args: Any) -> Exception | None:
    """Call ``fn``; return its exception instead of raising it. Hand-overs go on past a block
    the writer refused (a bad record of one handle must not lose the others' records)."""
    try:
        fn(*args)
    except Exception as e:
        return e
    return None
