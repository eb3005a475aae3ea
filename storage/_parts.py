"""Finding a handle's parts in a run directory and choosing which ones hold its records.

A handle's records ``[0, n)`` may be spread over its parts: its final file and sealed segments;
compaction or a crash in the middle of a merge can leave overlapping parts. The *cover* takes,
from record 0 on, the complete part that starts at the current record and reaches furthest;
records in a superseded (overlapped) part are also in a chosen one, so nothing is read twice.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .confine import RunRoot
from .errors import FormatError
from ._h5check import records_end
from .identity import access_problem

__all__ = ["PartEntry", "Discovery", "discover_files", "cover"]


@dataclass(frozen=True)
class PartEntry:
    """A complete part of a handle (found on disk, or sealed by the writer).

    Attributes:
        name: path relative to the run directory (``/``-separated).
        kind: ``"final"`` or ``"segment"``.
        start: first global record number.
        end: one past the last record number.
        nbytes: the file's size where known (the writer's compaction picks parts by size), else 0.
    """

    name: str
    kind: str
    start: int
    end: int
    nbytes: int = 0


@dataclass
class Discovery:
    """What :func:`discover_files` found for one handle."""

    cover: list[PartEntry] = field(default_factory=list)
    end: int = 0
    gaps: list[tuple[int, int]] = field(default_factory=list)
    superseded: list[PartEntry] = field(default_factory=list)
    #: segments being written when the writer stopped (their records were never flushed)
    partials: list[str] = field(default_factory=list)
    #: outputs of merges that were interrupted (copies: their records are in other files)
    leftovers: list[str] = field(default_factory=list)
    broken: list[tuple[str, str]] = field(default_factory=list)
    #: files that exist but may not be read (permission denied, ...): not damage, never moved
    blocked: list[tuple[str, str]] = field(default_factory=list)


def cover(entries: list[PartEntry]) -> tuple[list[PartEntry], list[PartEntry], list[tuple[int, int]], int]:
    """Choose non-overlapping parts covering as many records as possible, in order.

    Returns:
        ``(chosen, superseded, gaps, end)``.
    """
    todo = sorted(entries, key=lambda e: (e.start, -e.end, e.kind != "final"))
    chosen: list[PartEntry] = []
    superseded: list[PartEntry] = []
    gaps: list[tuple[int, int]] = []
    cur = 0
    for e in todo:
        if e.end <= cur and not (e.start == e.end == cur == 0 and e.kind == "final" and not chosen):
            superseded.append(e)  # (the final file of a handle with no records is its file)
            continue
        if e.start < cur:  # partial overlap: cannot happen with hookline's merges; skip it
            superseded.append(e)
            continue
        if e.start > cur:
            gaps.append((cur, e.start))
        chosen.append(e)
        cur = e.end
    return chosen, superseded, gaps, cur


def _records_of_final(path: Path) -> int:
    return records_end(path)  # (checked: a damaged file must not allocate without bound)


def discover_files(run_dir: Path | RunRoot, key: str, suffix: str) -> Discovery:
    """List a handle's parts (by name; the final file is opened to read its record count).

    Only names inside the run directory count (:mod:`.confine`): a hookline-looking name that is
    a symlink leading out of the run, a FIFO, a directory or a device is listed in ``broken``,
    never opened.

    Args:
        run_dir: the run directory (a :class:`~.confine.RunRoot` when the caller has one: it is
            resolved once).
        key: the handle's key (from the manifest: checked too).
        suffix: the rank suffix of the file names.

    Raises:
        FormatError: ``key`` leads outside the run directory (absolute, ``..``, or its folder is a
            symlink leading out).
    """
    root = run_dir if isinstance(run_dir, RunRoot) else RunRoot(run_dir)
    sub, _, last = root.key(key, what="handle key").rpartition("/")
    d = root.path / sub if sub else root.path
    base = last + suffix
    prefix = (sub + "/") if sub else ""
    out = Discovery()
    try:
        with os.scandir(d) as it:
            listing = list(it)
    except (FileNotFoundError, NotADirectoryError):
        return out
    seg_re = re.compile(re.escape(base) + r"\.r(\d{12})-(\d{12})\.h5seg")
    part_re = re.compile(re.escape(base) + r"\.r\d{12}\.h5seg\.partial")
    leftover_re = re.compile(re.escape(base) + r"(\.h5|\.r\d{12}-\d{12}\.h5seg)\.partial")
    entries: list[PartEntry] = []
    for item in listing:
        nm = item.name
        if not nm.startswith(base + "."):
            continue
        rel = prefix + nm
        if part_re.fullmatch(nm):
            out.partials.append(rel)  # (never opened: moved aside or ignored by name)
            continue
        if leftover_re.fullmatch(nm):
            out.leftovers.append(rel)
            continue
        m = seg_re.fullmatch(nm)
        if nm != base + ".h5" and not m:
            continue
        if not item.is_file(follow_symlinks=False):  # (a symlink, FIFO, ...: check it, never open it)
            try:
                root.file(rel, what="handle file")
            except FormatError as e:
                out.broken.append((rel, str(e)))
                continue
        if m:
            a, b = int(m[1]), int(m[2])
            if b > a:
                entries.append(PartEntry(rel, "segment", a, b))
            continue
        try:
            entries.append(PartEntry(rel, "final", 0, _records_of_final(d / nm)))
        except Exception as e:
            why = access_problem(e)
            if why is not None:
                out.blocked.append((rel, why))
            else:
                out.broken.append((rel, f"{type(e).__name__}: {e}"))
    out.cover, out.superseded, out.gaps, out.end = cover(entries)
    return out
