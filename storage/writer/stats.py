"""The counters a :class:`~hookline.storage.RunWriter` reports: :class:`WriterStats`, :class:`HandleStats`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["HandleStats", "WriterStats"]


@dataclass
class HandleStats:
    """Counters of one handle.

    Attributes:
        records: records accepted by :meth:`RunWriter.write` (queued or on disk).
        bytes: field bytes of those records.
        dropped: records dropped by policy ``"drop"``.
        flushed: records durably on disk (sealed by a flush / auto-flush / close), including
            ``start``.
        start: records a continued run held before this writer opened it (0 for a new run).
    """

    records: int = 0
    bytes: int = 0
    dropped: int = 0
    flushed: int = 0
    start: int = 0


@dataclass
class WriterStats:
    """What a :class:`RunWriter` did; returned by :meth:`RunWriter.close` and :meth:`RunWriter.stats`.

    Attributes:
        handles: per handle id counters.
        peak_buffer_bytes: largest amount of accepted-but-not-written data held in memory.
        max_buffer_bytes: the budget (``max_buffer_mb``).
        blocked_seconds: total time ``write()`` waited for buffer space (policy ``"block"``).
        parked_files: times a segment file was closed to stay within ``max_open_files`` (it is
            reopened when its handle writes again; no segment is sealed early).
        index_seals: flushes made because the open parts' index entries reached their share of
            the budget (:attr:`~hookline.storage.budget.Budget.index_bytes`).
        error: the background error message, if the writer failed.
    """

    handles: dict[str, HandleStats] = field(default_factory=dict)
    peak_buffer_bytes: int = 0
    max_buffer_bytes: int = 0
    blocked_seconds: float = 0.0
    parked_files: int = 0
    index_seals: int = 0
    error: str | None = None

    @property
    def records(self) -> int:
        """Total accepted records."""
        return sum(h.records for h in self.handles.values())

    @property
    def bytes(self) -> int:
        """Total accepted field bytes."""
        return sum(h.bytes for h in self.handles.values())

    @property
    def dropped(self) -> int:
        """Total dropped records."""
        return sum(h.dropped for h in self.handles.values())

    def __str__(self) -> str:
        return (f"WriterStats(handles={len(self.handles)}, records={self.records}, bytes={self.bytes}, "
                f"dropped={self.dropped}, peak_buffer_bytes={self.peak_buffer_bytes}"
                + (f", error={self.error!r}" if self.error else "") + ")")
