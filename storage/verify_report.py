"""What :func:`~hookline.storage.verify` reports: :class:`VerifyReport` per run, :class:`HandleReport` per handle."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .words import plural

__all__ = ["VerifyReport", "HandleReport", "QUARANTINE_DIR"]

#: Where repair moves files it cannot use (relative to the run directory).
QUARANTINE_DIR = ".quarantine"


@dataclass
class HandleReport:
    """What verify found for one handle (of one rank).

    Attributes:
        handle_id: the handle id.
        rank: its rank (None when not distributed).
        records: records readable.
        fields: field name -> number of readable entries.
        files: the complete files holding them, in order.
        problems: what is wrong (empty when fine).
        repaired: what repair did.
        lost: what repair could not recover (also the manifest entry's ``lost``).
        damage: damage repair fixed without moving files (manifest entries that led outside the
            run, reset); a run with any is not :attr:`VerifyReport.clean`.
        blocked: some of its files could not be read for a reason that is not damage
            (permission denied, a read-only file system): repair leaves the handle as it is.
    """

    handle_id: str
    rank: int | None
    records: int = 0
    fields: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    damage: list[str] = field(default_factory=list)
    blocked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass
class VerifyReport:
    """Result of :func:`verify`.

    Attributes:
        path: the run directory.
        handles: one report per handle and rank.
        problems: run-level problems (manifest).
        repaired: run-level repairs.
        moved: files moved to the quarantine directory.
        writing: a RunWriter holds the run's lock: the run is open (a state, not a problem: its
            segments are not merged yet, and files being written are not checked).
        pending: files the writer is still writing (``.partial`` segments: their records are
            sealed, and then read and verified, at the writer's next flush).
    """

    path: str
    handles: list[HandleReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)
    writing: bool = False
    pending: int = 0

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (after repair, if repair ran and fixed everything)."""
        return not self.problems and all(h.ok for h in self.handles)

    @property
    def clean(self) -> bool:
        """True when verify found nothing at all: :attr:`ok`, no file moved to the quarantine and
        no record lost. A repair that had to move files aside or give records up is ``ok`` (the
        run is consistent now) but not ``clean``; ``hookline verify`` exits 0 only when clean."""
        return self.ok and not self.moved and not any(h.lost or h.damage for h in self.handles)

    @property
    def records(self) -> int:
        return sum(h.records for h in self.handles)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        d = asdict(self)
        d["ok"] = self.ok
        d["clean"] = self.clean
        return d

    def damage_found(self) -> str:
        """What a repair found and fixed, one phrase per kind (empty when :attr:`clean`)."""
        lost = sum(len(h.lost) for h in self.handles)
        shown = ", ".join(self.moved[:3]) + (", ..." if len(self.moved) > 3 else "")
        what = [f"{plural(len(self.moved), 'file')} moved to {QUARANTINE_DIR}/ ({shown})"] if self.moved else []
        what += [f"{plural(lost, 'loss')} recorded in the manifest"] if lost else []
        what += [d for h in self.handles for d in h.damage]
        return ", ".join(what)

    def _verdict(self) -> str:
        if not self.ok:
            return "PROBLEMS"
        if self.clean:
            return "OK, OPEN" if self.writing else "OK"
        return f"REPAIRED, DAMAGE FOUND ({self.damage_found()})"

    def __str__(self) -> str:
        lines = [f"{self.path}: {self._verdict()} ({plural(len(self.handles), 'handle')}, "
                 f"{plural(self.records, 'record')}" + (" sealed" if self.writing else "") + ")"]
        if self.writing:
            lines.append(f"  run: open, a RunWriter is writing it: {plural(self.records, 'record')} sealed in "
                         f"complete files (checked), {plural(self.pending, 'segment')} still being written "
                         f"(pending: sealed at its next flush, e.g. rec.flush() or autoflush_s)")
        lines += [f"  run: {p}" for p in self.problems]
        lines += [f"  run repaired: {p}" for p in self.repaired]
        for h in self.handles:
            tag = h.handle_id + (f" (rank {h.rank})" if h.rank is not None else "")
            lines.append(f"  {tag}: {plural(h.records, 'record')}, {plural(len(h.fields), 'field')}"
                         + ("" if h.ok else " - PROBLEMS"))
            lines += [f"    problem: {p}" for p in h.problems]
            lines += [f"    repaired: {p}" for p in h.repaired]
        return "\n".join(lines)
