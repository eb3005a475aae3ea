"""What a recorder reports at close: per-handle records, bytes, drops and time spent in hooks."""

from __future__ import annotations

from dataclasses import dataclass, field

from hookline.storage import WriterStats
from hookline.storage.words import human_bytes

__all__ = ["HandleSummary", "RecorderSummary"]


@dataclass
class HandleSummary:
    """What one hook handle recorded (counts from the storage writer) and what it cost."""

    handle_id: str
    records: int = 0
    bytes: int = 0
    dropped: int = 0
    hook_seconds: float = 0.0
    skipped_fields: list[str] = field(default_factory=list)
    #: Records of this recorder durably on disk (flushed); equals ``records`` after a successful
    #: close (a resumed run's earlier records are not counted, as in ``records``).
    on_disk: int = 0


@dataclass
class RecorderSummary:
    """Returned by :meth:`Recorder.close`: per-handle records, bytes, drops and hook time.

    ``storage`` holds the writer's own counters (totals, peak buffer, time blocked on the disk).
    """

    run_dir: str
    handles: dict[str, HandleSummary]
    storage: WriterStats
    mlflow_run_id: str | None = None
    mlflow_error: str | None = None

    @property
    def records(self) -> int:
        """Records the writer took, all handles together."""
        return self.storage.records

    @property
    def bytes(self) -> int:
        """Bytes of those records."""
        return self.storage.bytes

    @property
    def dropped(self) -> int:
        """Records dropped under policy ``"drop"``."""
        return self.storage.dropped

    @property
    def failed(self) -> bool:
        """Whether writing failed: then only :attr:`HandleSummary.on_disk` records per handle
        (those flushed before the failure) reached the disk, not :attr:`records`."""
        return self.storage.error is not None

    def __str__(self) -> str:
        lines = []
        if self.failed:
            lines.append(f"hookline run {self.run_dir}: WRITING FAILED: {self.storage.error}; of {self.records} "
                         f"records captured, {sum(h.on_disk for h in self.handles.values())} reached the disk "
                         f"(those flushed before the failure)")
        else:
            lines.append(f"hookline run {self.run_dir}: {self.records} records, {human_bytes(self.bytes)}"
                         + (f", {self.dropped} DROPPED (policy 'drop')" if self.dropped else "")
                         + f", {self.storage.blocked_seconds:.2f} s blocked on the disk")
        for h in self.handles.values():
            lines.append(
                f"  {h.handle_id:<40} {h.records:>7} rec {human_bytes(h.bytes):>10}"
                f" {h.dropped:>5} dropped {h.hook_seconds * 1e3:>8.1f} ms in hooks"
                + (f" {h.on_disk:>7} on disk" if self.failed else "")
            )
        if self.mlflow_run_id:
            lines.append(f"  mlflow run {self.mlflow_run_id}" + (f": ERROR {self.mlflow_error}" if self.mlflow_error else ""))
        return "\n".join(lines)
