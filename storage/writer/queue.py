"""The writer's queue: messages from callers to the writer thread, within the memory budget.

``write()`` appends a :class:`Record` and returns; when the accepted bytes would exceed the
budget it waits (policy ``"block"``) or drops the record (``"drop"``). The writer thread takes
messages in batches and returns each record's bytes (:meth:`WriteQueue.release`) once they are
written. :class:`Flush` and :class:`Close` are answered through their event; :class:`Close` is
the shutdown sentinel, the last message the writer thread takes.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np

from .._memory import Trimmer
from ..budget import Budget
from ..errors import StorageError, WriterClosedError
from .handle import WriterHandle
from .stats import WriterStats

__all__ = ["WAKE_LATENCY_S", "Close", "Control", "Flush", "Message", "NewHandle", "Record", "WriteQueue"]

#: Longest time a record waits in the queue before the writer thread takes it.
WAKE_LATENCY_S = 0.2
#: How often a waiting caller checks that the writer thread is still alive.
ALIVE_CHECK_S = 0.5


@dataclass(eq=False, slots=True)
class Record:
    """A block of ``len(steps)`` records (arrays ``(k, *record_shape)``) of one handle, or of
    several: record ``j`` belongs to ``rows[j]`` when ``rows`` is given (``handle`` is then the
    first of them)."""

    handle: WriterHandle
    steps: list[int]
    calls: list[int]
    fields: dict[str, tuple[np.ndarray, str]]
    nbytes: int
    rows: list[WriterHandle] | None = None


@dataclass(eq=False, slots=True)
class NewHandle:
    """A handle declared by ``add_handle()``: find its parts on disk before its first record."""

    handle: WriterHandle


@dataclass(eq=False)
class Control:
    """A message a caller waits for: the writer thread sets :attr:`done` (with :attr:`error` if
    it failed)."""

    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def answer(self, error: BaseException | None = None) -> None:
        """Wake the waiting caller (raising ``error`` there, if any)."""
        self.error = error
        self.done.set()


@dataclass(eq=False)
class Flush(Control):
    """Seal every open part (durably with ``fsync``) and write the manifest."""


@dataclass(eq=False)
class Close(Control):
    """The shutdown sentinel: flush, merge, write the final manifest; the writer thread ends."""


Message = Union[Record, NewHandle, Flush, Close]


class WriteQueue:
    """Messages to the writer thread, the bytes they hold (backpressure) and its wake-ups.

    Its lock (:attr:`cond`, re-entrant) also guards the writer's handle registry and counters,
    so that a handle is queued before any record of it.

    Args:
        budget: the writer's memory budget.
        policy: ``"block"`` or ``"drop"`` (see :class:`~hookline.storage.RunWriter`).
        stats: the writer's counters (updated here under the lock).
        where: the run directory, for messages.
        max_bytes: most bytes queued and staged (default: the whole budget; a writer keeps
            what its open files cost out of it, :meth:`Budget.queue_bytes`).
    """

    def __init__(self, budget: Budget, policy: str, stats: WriterStats, where: str,
                 max_bytes: int | None = None) -> None:
        self.cond = threading.Condition()
        self._items: deque[Message] = deque()
        self._max_bytes = budget.bytes if max_bytes is None else max_bytes
        self._floor = min(self._max_bytes, budget.bytes // 2)  # what charge() always leaves
        #: Queued bytes that wake the writer thread, and how long the first record queued below
        #: them waits at most (the writer's batches; settable for a measurement of larger bursts,
        #: tests/benchmarks/bench_contention.py ``burst``).
        self.wake_bytes = budget.wake_bytes
        self.wake_latency_s = WAKE_LATENCY_S
        self._policy = policy
        self._stats = stats
        self._where = where
        self.pending = 0  # accepted bytes not yet written
        #: Gives memory freed by the writer back to the kernel (storage/_memory.py).
        self.trimmer = Trimmer.for_budget(budget.bytes)
        self._queued_bytes = 0  # bytes queued since the writer thread last took a batch
        self._wake_sent = False
        self._urgent = 0  # control messages, and drops, that want the writer thread now
        self._since: float | None = None  # when the oldest queued message was queued
        self._waiting = 0  # callers blocked for budget
        #: The writer's background failure (raised by every later call).
        self.error: StorageError | None = None
        #: Set when close() begins: records are refused from then on.
        self.closing = False

    # --- callers ----------------------------------------------------------------------------------
    def put_record(self, rec: Record, alive: Callable[[], bool]) -> bool:
        """Queue a record within the budget; returns False if policy ``"drop"`` dropped it.

        A record larger than the budget is accepted when nothing else is pending.

        Raises:
            StorageError: the writer failed (also while waiting, or its thread died).
            WriterClosedError: the writer began closing.
        """
        n = len(rec.steps)
        nbytes = rec.nbytes
        h = rec.handle
        with self.cond:
            if self.error is not None:
                raise self.error
            if self.closing:  # close() began after the caller's unlocked check
                raise WriterClosedError(f"RunWriter for {self._where!r} was closed during write(); "
                                        f"the record was not queued")
            if self.pending and self.pending + nbytes > self._max_bytes:
                if self._policy == "drop":
                    if rec.rows is None:
                        h.stats.dropped += n
                    else:
                        for r in rec.rows:
                            r.stats.dropped += 1
                    if not self._wake_sent:  # the budget is full: the writer must drain now
                        self._wake_sent = True
                        self._urgent += 1
                        self.cond.notify_all()
                    return False
                self._wait_for_room(nbytes, alive)
            self.pending += nbytes
            if self.pending > self._stats.peak_buffer_bytes:
                self._stats.peak_buffer_bytes = self.pending
            if rec.rows is None:
                h.stats.records += n
                h.stats.bytes += nbytes
            else:
                per = nbytes // n
                for r in rec.rows:
                    r.stats.records += 1
                    r.stats.bytes += per
            if not self._items:
                self._since = time.monotonic()
            self._items.append(rec)
            # Wake the writer thread per batch, not per record: every wake-up is a GIL hand-off
            # that stalls the training thread (see Budget.wake_bytes).
            self._queued_bytes += nbytes
            if self._queued_bytes >= self.wake_bytes and not self._wake_sent:
                self._wake_sent = True
                self.cond.notify_all()
        return True

    def make_room(self, h: WriterHandle, nbytes: int, alive: Callable[[], bool]) -> bool:
        """Before a caller builds a block of ``nbytes`` (that it would then hold while waiting):
        policy ``"block"`` waits until it would be accepted at once; ``"drop"`` counts one
        dropped record of ``h`` and returns False when it would not.

        Raises:
            StorageError, WriterClosedError: as :meth:`put_record`.
        """
        with self.cond:
            if self.error is not None:
                raise self.error
            if not (self.pending and self.pending + nbytes > self._max_bytes):
                return True
            if self._policy == "drop":
                h.stats.dropped += 1
                return False
            self._wait_for_room(nbytes, alive)
            return True

    def _wait_for_room(self, nbytes: int, alive: Callable[[], bool]) -> None:
        """Policy ``"block"``: wait (holding :attr:`cond`) until ``nbytes`` fit in the budget."""
        t0 = time.monotonic()
        self._waiting += 1
        self.cond.notify_all()
        try:
            while self.pending and self.pending + nbytes > self._max_bytes:
                if self.error is not None:
                    raise self.error
                if not alive():
                    raise StorageError(f"the writer thread of {self._where!r} died")
                self.cond.wait(ALIVE_CHECK_S)
        finally:
            self._waiting -= 1
            self._stats.blocked_seconds += time.monotonic() - t0
        if self.closing:
            raise WriterClosedError(f"RunWriter for {self._where!r} was closed while write() waited")

    def charge(self, nbytes: int) -> None:
        """Take ``nbytes`` of memory held elsewhere (per-handle state) out of what the queue and
        staging may hold, leaving at least half the budget."""
        with self.cond:
            self._max_bytes = max(self._floor, self._max_bytes - nbytes)

    def put_urgent(self, msg: NewHandle | Control) -> None:
        """Queue a message the writer thread takes at once."""
        with self.cond:
            self._items.append(msg)
            self._urgent += 1
            self.cond.notify_all()

    def submit_and_wait(self, msg: Control, alive: Callable[[], bool]) -> None:
        """Queue ``msg`` and wait until the writer thread answered it.

        Raises:
            StorageError: the writer failed, or its thread died.
        """
        self.put_urgent(msg)
        while not msg.done.wait(ALIVE_CHECK_S):
            if not alive():
                raise self.error or StorageError(f"the writer thread of {self._where!r} died")
        if msg.error is not None:
            raise msg.error

    # --- the writer thread ------------------------------------------------------------------------
    def take(self, flush_at: float | None, has_staged: Callable[[], bool]) -> deque[Message]:
        """Wait for a batch and take it (the writer thread).

        Returns at once for control messages, drops and blocked callers; otherwise once
        :attr:`wake_bytes` are queued or the oldest record waited :attr:`wake_latency_s`;
        and at ``flush_at`` (``time.monotonic()``; the batch may then be empty). With a caller
        blocked and nothing queued, returns when ``has_staged()`` (staged data must be written).
        """
        with self.cond:
            while True:
                if self._items and (self._urgent or self._waiting or self._queued_bytes >= self.wake_bytes):
                    break
                timeout = None
                if flush_at is not None:
                    timeout = max(0.0, flush_at - time.monotonic())
                    if timeout == 0.0:
                        break
                if self._waiting and has_staged():
                    break
                # Records below the batch size are taken wake_latency_s after the first
                # of them was queued (put_record() does not wake us for them: it stamps the time).
                since = self._since if self._items else None
                wait = self.wake_latency_s
                left = wait if since is None else since + wait - time.monotonic()
                if self._items and left <= 0:
                    break
                left = max(left, 0.001)
                self.cond.wait(left if timeout is None else min(timeout, left))
            items = self._items
            self._items = deque()
            self._queued_bytes = 0
            self._wake_sent = False
            self._urgent = 0
            self._since = None
        return items

    def release(self, nbytes: int) -> None:
        """Return the bytes of written (or discarded) records to the budget."""
        if nbytes:
            # Their memory was freed: it goes back to the kernel (per eighth of the budget) before
            # a waiting caller is told there is room, so new records do not add to memory kept.
            self.trimmer.note(nbytes)
            self.trimmer.maybe_trim()
            with self.cond:
                self.pending -= nbytes
                self.cond.notify_all()

    def has_waiters(self) -> bool:
        """Whether a caller is blocked for budget."""
        with self.cond:
            return bool(self._waiting)

    def fail(self, err: StorageError) -> None:
        """Record the writer's failure (the first one wins) and wake every waiter."""
        with self.cond:
            if self.error is None:
                self.error = err
            self.cond.notify_all()

    def abandon(self) -> None:
        """The writer thread is gone: answer every queued control message with the failure,
        drop the rest and free the budget."""
        with self.cond:
            for msg in self._items:
                if isinstance(msg, Control):
                    msg.answer(self.error)
            self._items.clear()
            self.pending = 0
            self.cond.notify_all()
