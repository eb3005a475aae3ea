"""The memory budget ``max_buffer_mb``: checked once, and every share it is split into, named.

A :class:`~hookline.storage.RunWriter` keeps what ``write()`` accepted but did not write yet
within its budget (backpressure). A tracker ``Recorder`` also holds the blocks of records it is
filling before it hands them to its writer, so it splits its budget between those blocks and its
writer. SPEC §8: memory stays within the budget + 64 MB.
"""

from __future__ import annotations

import numbers
from typing import Any

from .errors import HookTypeError, InvalidArgumentError

__all__ = ["Budget", "MIB"]

MIB = 1 << 20


class Budget:
    """``max_buffer_mb``, validated, in bytes; its shares are the properties below.

    Args:
        max_buffer_mb: the budget in MB (2**20 bytes), a positive finite number.

    Raises:
        HookTypeError: ``max_buffer_mb`` is not a number.
        InvalidArgumentError: it is not positive and finite.

    Example:
        >>> b = Budget(8)
        >>> b.open_blocks_bytes // MIB, b.writer_share_mb
        (2, 6.0)
    """

    #: Largest share of a recorder's open blocks, whatever the budget; its pool of free buffers
    #: keeps only what the open blocks leave of this share (``BlockPacker``).
    OPEN_BLOCKS_MAX = 64 << 20
    #: Bounds of :attr:`wake_bytes`: at least 64 KiB per wake-up of the writer thread (each
    #: wake-up is a GIL hand-off to it), at most 16 MiB (a batch must not wait for long).
    WAKE_MIN = 64 << 10
    WAKE_MAX = 16 << 20

    #: HDF5's own memory per file open for writing (measured 0.52-0.60 MB per file, whatever its
    #: contents: the library's per-file structures), rounded up. Counted against the budget.
    FILE_BYTES = 640 << 10
    #: Fewest files a writer keeps open by default, whatever the budget.
    FILES_MIN = 4
    #: Python state of one handle with a segment being written (its part, staging lists and
    #: counters; measured 6.5 KB with tracemalloc at 5,000 handles), rounded up, plus a recorder's
    #: per-handle tables. Counted against the budget for every declared handle.
    HANDLE_BYTES = 8 << 10

    def __init__(self, max_buffer_mb: Any) -> None:
        if isinstance(max_buffer_mb, bool) or not isinstance(max_buffer_mb, numbers.Real):
            raise HookTypeError(f"max_buffer_mb must be a number of MB, got {type(max_buffer_mb).__name__} "
                                f"{max_buffer_mb!r:.60}")
        if not 0 < max_buffer_mb < float("inf"):
            raise InvalidArgumentError(f"max_buffer_mb must be a positive number, got {max_buffer_mb!r}")
        #: The budget in MB, as given.
        self.mb = float(max_buffer_mb)
        #: The budget in bytes.
        self.bytes = int(self.mb * MIB)

    def __repr__(self) -> str:
        return f"Budget({self.mb!r})"

    # --- a recorder's split: its open blocks, and its writer ------------------------------------
    @property
    def open_blocks_bytes(self) -> int:
        """A recorder's blocks being filled and its pool of free buffers, together: a quarter of the
        budget, at most :attr:`OPEN_BLOCKS_MAX`. The writer gets the other three quarters: its
        queue absorbs the disk's stalls, while blocks only need room for a block per handle."""
        return min(self.bytes // 4, self.OPEN_BLOCKS_MAX)

    @property
    def writer_share_mb(self) -> float:
        """The ``max_buffer_mb`` a recorder gives its writer: what its open blocks leave."""
        return (self.bytes - self.open_blocks_bytes) / MIB

    # --- a writer's queue and staging -----------------------------------------------------------
    @property
    def wake_bytes(self) -> int:
        """Queued bytes that wake the writer thread: an eighth of the budget (between
        :attr:`WAKE_MIN` and :attr:`WAKE_MAX`). Records are taken in batches, not one by one
        (waking per record cost 10-15% of a 25 ms training step on 2 cores), and an eighth leaves
        the budget room for several batches before ``write()`` has to wait or drop."""
        return max(self.WAKE_MIN, min(self.bytes // 8, self.WAKE_MAX))

    @property
    def staged_high(self) -> int:
        """Staged bytes (taken off the queue, waiting for a full chunk) above which the writer
        thread writes partial chunks: half the budget, so the queue always keeps the other half
        for new records."""
        return self.bytes // 2

    @property
    def staged_low(self) -> int:
        """What writing partial chunks brings staged bytes down to: a quarter of the budget (half
        of :attr:`staged_high`), so the writer does not write partial chunks at every batch."""
        return self.staged_high // 2

    @property
    def index_bytes(self) -> int:
        """What the open parts' index entries (steps, calls, record numbers, norms: ~50 bytes a
        record, written when a part is sealed) may hold: an eighth of the budget, kept out of
        what the queue may hold. The writer seals every part when they reach it, so records of a
        few bytes each (thousands of handles, stats) keep memory bounded between flushes."""
        return self.bytes // 8

    # --- a writer's open files ------------------------------------------------------------------
    def open_files(self, limit: int) -> int:
        """Files a writer keeps open at once by default: as many as an eighth of the budget pays
        for at :attr:`FILE_BYTES` each (at least :attr:`FILES_MIN`), at most ``limit`` (the
        open-file share of ``ulimit -n``). 89 files at 448 MB, 9 at 48 MB."""
        return max(1, min(limit, max(self.FILES_MIN, self.bytes // 8 // self.FILE_BYTES)))

    def queue_bytes(self, open_files: int) -> int:
        """What a writer's queue and staged records may hold: the budget less the open parts'
        :attr:`index_bytes` and the memory of its ``open_files`` beyond the first
        :attr:`FILES_MIN` (~2.5 MB: those lie within the 64 MB that SPEC §8 allows over the
        budget, so a small budget keeps all of itself), the files leaving at least half the
        budget."""
        charge = max(0, open_files - self.FILES_MIN) * self.FILE_BYTES
        return self.bytes - min(charge, self.bytes // 2) - self.index_bytes
