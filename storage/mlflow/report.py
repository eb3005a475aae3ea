"""SyncReport: what one or more MLflow sync passes uploaded, skipped, logged and failed to do."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import TrackingError, TrackingUnreachableError

__all__ = ["SyncReport"]


@dataclass
class SyncReport:
    """What one or more sync passes did.

    Attributes:
        run_id: the MLflow run.
        uploaded: artifact paths uploaded (``hookline/...``).
        skipped: artifact paths already present with the same size and SHA-256.
        metrics: number of metric points sent.
        tags: number of tags sent.
        errors: one line per failure (empty when everything succeeded).
        seconds: wall time of the pass(es).
        pending: files not uploaded yet because the writer has not finished them (mid-run passes).
        unreachable: a pass found the tracking server not answering (:meth:`error` is then a
            :class:`TrackingUnreachableError`, also a ``ConnectionError``).
        bad_run: the run itself was refused (unknown, deleted, holding another run directory).
        summary: the run's summary page (``hookline/summary.html``) when a final pass made it
            current (uploaded, or already there unchanged); not listed in ``uploaded``/``skipped``,
            which name the run's own files.
    """

    run_id: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    metrics: int = 0
    tags: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    pending: list[str] = field(default_factory=list)
    unreachable: bool = False
    bad_run: bool = False
    summary: str | None = None

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.errors

    def merge(self, other: SyncReport) -> None:
        """Add ``other``'s counts and errors to this report."""
        self.uploaded += other.uploaded
        self.skipped += other.skipped
        self.metrics += other.metrics
        self.tags += other.tags
        self.errors += other.errors
        self.seconds += other.seconds
        self.pending += other.pending
        self.unreachable = self.unreachable or other.unreachable
        self.bad_run = self.bad_run or other.bad_run
        self.summary = other.summary or self.summary

    def error(self, run_dir: Path | str | None = None) -> TrackingError:
        """A :class:`TrackingError` describing the failures, with the command that repairs them.

        Args:
            run_dir: the run directory, for the repair command (default: ``RUN_DIR``).

        Returns:
            The error (not raised); its ``report`` attribute is this report.
        """
        where = str(run_dir) if run_dir is not None else "RUN_DIR"
        unique = list(dict.fromkeys(self.errors))  # (each failed pass reports the same dead server)
        lines = "; ".join(unique[:5]) + (f"; ... ({len(unique)} errors)" if len(unique) > 5 else "")
        target = "<an existing run id>" if self.bad_run else self.run_id
        err = (TrackingUnreachableError if self.unreachable else TrackingError)(
            f"MLflow upload to run {self.run_id!r} failed: {lines}. Local files are complete; "
            f"upload later with `hookline sync {where} --run-id {target}`"
        )
        err.report = self  # type: ignore[attr-defined]
        return err
