"""Check a run directory and optionally repair it: :func:`verify` -> :class:`VerifyReport`.

Checks every handle's complete files (final ``.h5`` and sealed ``.h5seg`` segments): they open,
their indexes are consistent, the last record of every field reads. With ``repair=True``:

* files still being written when the writer died (``*.partial``) and files that do not open or
  are inconsistent are **moved** to ``<run>/.quarantine/`` (never deleted);
* each handle's readable files are merged into one ``<key>.h5`` (written as ``.h5.partial``,
  fsynced, renamed); segments are deleted only after the merged file was re-opened and holds
  all their records;
* the manifest is rewritten (records, fields, ``status: "closed"``).

Nothing is ever deleted that is not also in a verified file.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._h5file import Part, merge_parts, open_part
from ._segments import discover_files
from .errors import FormatError, StorageError
from .format import (
    atomic_write_json,
    final_name,
    fsync_dir,
    fsync_file,
    manifest_name,
    now_iso,
    rank_suffix,
)
from .reader import LocalSource, _synthesise_manifests

__all__ = ["verify", "VerifyReport", "HandleReport", "QUARANTINE_DIR"]

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
    """

    handle_id: str
    rank: int | None
    records: int = 0
    fields: dict[str, int] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)

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
    """

    path: str
    handles: list[HandleReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)
    moved: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (after repair, if repair ran and fixed everything)."""
        return not self.problems and all(h.ok for h in self.handles)

    @property
    def records(self) -> int:
        return sum(h.records for h in self.handles)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form."""
        d = asdict(self)
        d["ok"] = self.ok
        return d

    def __str__(self) -> str:
        lines = [f"{self.path}: {'OK' if self.ok else 'PROBLEMS'} ({len(self.handles)} handles, {self.records} records)"]
        lines += [f"  run: {p}" for p in self.problems]
        lines += [f"  run repaired: {p}" for p in self.repaired]
        for h in self.handles:
            tag = h.handle_id + (f" (rank {h.rank})" if h.rank is not None else "")
            lines.append(f"  {tag}: {h.records} records, {len(h.fields)} fields" + ("" if h.ok else " - PROBLEMS"))
            lines += [f"    problem: {p}" for p in h.problems]
            lines += [f"    repaired: {p}" for p in h.repaired]
        return "\n".join(lines)


def _check_part(p: Part) -> dict[str, int]:
    """Consistency checks of one complete file; returns field -> entries. Raises on problems."""
    if len(p.steps) != p.n or len(p.calls) != p.n:
        raise FormatError(f"index length mismatch (records={p.n})")
    counts = {}
    for nm in p.field_names:
        pf = p.field(nm)
        rec = pf.records
        if len(rec) != pf.count:
            raise FormatError(f"field {nm!r}: {len(rec)} record numbers for {pf.count} entries")
        if pf.count:
            if rec[0] < p.record_start or rec[-1] >= p.record_start + p.n or np.any(np.diff(rec) <= 0):
                raise FormatError(f"field {nm!r}: record numbers out of range or unsorted")
            if pf.info.has_norm and (pf.stored_norms is None or len(pf.stored_norms) != pf.count):
                raise FormatError(f"field {nm!r}: norm index missing or short")
            if pf.shape is None:
                sizes = np.prod(pf.shapes, axis=1) if pf.ndim else np.ones(pf.count, np.int64)
                if int(pf.offsets[-1] + sizes[-1]) > pf.ds.shape[0] or np.any(pf.offsets < 0):
                    raise FormatError(f"field {nm!r}: ragged offsets beyond the data")
            pf.read_stored(pf.count - 1)  # the data is readable
        counts[nm] = pf.count
    return counts


def _check_locks(run_dir: Path, repair: bool, report: VerifyReport) -> list[str]:
    """Writers hold ``.writer*.lock`` with flock. Returns the held ones; removes stale ones on repair."""
    import fcntl

    held = []
    for lock in sorted(run_dir.glob(".writer*.lock")):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held.append(lock.name)
            report.problems.append(f"a writer is active ({lock.name} is locked): this is a live run")
            os.close(fd)
            continue
        try:
            if repair:
                os.unlink(lock)
                report.repaired.append(f"removed stale writer lock {lock.name} (its writer died)")
        finally:
            os.close(fd)
    return held


def _quarantine(run_dir: Path, rel: str, report: VerifyReport) -> str:
    src = run_dir / rel
    dst = run_dir / QUARANTINE_DIR / rel
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst = dst.with_name(dst.name + f".{int(os.path.getmtime(src))}")
    os.replace(src, dst)
    report.moved.append(rel)
    return str(dst.relative_to(run_dir))


def verify(path: str | os.PathLike[str], repair: bool = False) -> VerifyReport:
    """Report per handle what is readable; with ``repair=True`` make the run clean.

    Args:
        path: a local run directory.
        repair: move unusable files aside, merge segments into one ``.h5`` per handle, rewrite
            the manifest. Never deletes data.

    Returns:
        The :class:`VerifyReport` (``report.ok``, ``str(report)`` for humans, ``to_dict()``).

    Raises:
        StorageError: ``path`` is not a directory.
    """
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise StorageError(f"no run directory {str(path)!r}")
    report = VerifyReport(str(path))
    held = _check_locks(run_dir, repair, report)
    if held and repair:
        raise StorageError(
            f"a RunWriter is still writing {str(path)!r} (lock {held[0]!r} is held): close it (or let it "
            f"finish) before verify(repair=True); verify without repair reads a live run safely")
    src = LocalSource(run_dir)
    try:
        manifests = src.manifests()
    except FormatError as e:
        report.problems.append(f"manifest unreadable: {e}")
        manifests = _synthesise_manifests(run_dir)
        if repair:
            for p in run_dir.iterdir():
                if p.name.startswith("manifest") and p.suffix == ".json":
                    _quarantine(run_dir, p.name, report)
            report.repaired.append("manifest rebuilt from the files' attributes")
    # Files of handles the manifest does not know (e.g. manifest lost): add them.
    known = {(m.get("rank"), hid) for m in manifests for hid in m["handles"]}
    for sm in _synthesise_manifests(run_dir):
        target = next((m for m in manifests if m.get("rank") == sm.get("rank")), None)
        for hid, e in sm["handles"].items():
            if (sm.get("rank"), hid) in known:
                continue
            report.problems.append(f"handle {hid!r} has files but no manifest entry")
            if target is None:
                target = dict(sm, handles={})
                manifests.append(target)
            target["handles"][hid] = e
    if not manifests:
        report.problems.append("no manifest and no hookline files")
        return report
    for tmp in sorted(run_dir.glob("manifest*.json.tmp")):  # a manifest write that never finished
        if repair:
            report.repaired.append(f"moved interrupted manifest write {tmp.name} to "
                                   f"{_quarantine(run_dir, tmp.name, report)}")
        else:
            report.problems.append(f"interrupted manifest write {tmp.name} (the manifest itself is intact)")
    for m in manifests:
        rank, ws = m.get("rank"), m.get("world_size")
        suffix = rank_suffix(rank, ws)
        for hid, entry in m["handles"].items():
            hr = _verify_handle(run_dir, m, hid, entry, suffix, repair, report)
            report.handles.append(hr)
        if repair:
            m["status"] = "closed" if all(h.ok for h in report.handles if h.rank == rank) else m.get("status", "open")
            m["updated"] = now_iso()
            m["verified"] = now_iso()
            atomic_write_json(run_dir / manifest_name(rank, ws), m)
            report.repaired.append(f"rewrote {manifest_name(rank, ws)}")
    return report


def _verify_handle(run_dir: Path, m: dict, hid: str, entry: dict, suffix: str, repair: bool,
                   report: VerifyReport) -> HandleReport:
    hr = HandleReport(hid, m.get("rank"))
    key = entry.get("key")
    if not key:
        hr.problems.append("manifest entry has no 'key'")
        return hr
    while True:
        d = discover_files(run_dir, key, suffix)
        bad: list[tuple[str, str]] = list(d.broken)
        parts: list[Part] = []
        for fe in d.cover:
            try:
                p = open_part(run_dir / fe.name)
            except Exception as e:
                bad.append((fe.name, f"{type(e).__name__}: {e}"))
                continue
            try:
                if p.handle_id != hid:
                    raise FormatError(f"belongs to handle {p.handle_id!r}")
                _check_part(p)
                parts.append(p)
            except Exception as e:
                p.close()
                bad.append((fe.name, f"{type(e).__name__}: {e}"))
        if not bad or not repair:
            break
        for p in parts:
            p.close()
        for rel, why in bad:
            dst = _quarantine(run_dir, rel, report)
            hr.repaired.append(f"moved unreadable {rel} to {dst} ({why})")
    try:
        for rel, why in bad:
            hr.problems.append(f"unreadable file {rel}: {why}")
        for rel in d.partials:
            if repair:
                dst = _quarantine(run_dir, rel, report)
                hr.repaired.append(f"moved unflushed partial file {rel} to {dst}")
            else:
                hr.problems.append(f"unflushed partial file {rel} (written when the writer stopped; "
                                   f"its records were never flushed)")
        for a, b in d.gaps:
            hr.problems.append(f"records [{a}, {b}) are missing (no file holds them)")
        hr.files = [p.path.relative_to(run_dir).as_posix() for p in parts]
        hr.records = sum(p.n for p in parts)
        for p in parts:
            for nm in p.field_names:
                hr.fields[nm] = hr.fields.get(nm, 0) + p.field(nm).count
        claimed = entry.get("records")
        if isinstance(claimed, int) and claimed > hr.records:
            hr.problems.append(f"manifest says {claimed} records, {hr.records} readable")
        final_rel = final_name(key, suffix)
        clean = len(parts) == 1 and hr.files == [final_rel] and not d.superseded
        if not clean and not repair and (len(parts) > 1 or d.superseded or (parts and hr.files != [final_rel])):
            hr.problems.append(f"not merged: {len(parts)} complete files, {len(d.superseded)} redundant "
                               f"(run verify with repair=True to merge into {final_rel})")
        if repair and not clean:
            _merge_handle(run_dir, parts, final_rel, hid, entry, m, hr)
            parts = []
            hr.problems = [p for p in hr.problems if not p.startswith("records [")]
            for fe in d.superseded:
                _remove_if_contained(run_dir, fe.name, hr, report)
        if repair:
            entry["records"] = hr.records
            fields = entry.setdefault("fields", {})
            fp = open_part(run_dir / final_rel) if (run_dir / final_rel).exists() else None
            if fp is not None:
                for nm in fp.field_names:
                    pf = fp.field(nm)
                    fields[nm] = {"dtype": pf.dtype_name, "shape": list(pf.shape) if pf.shape is not None else None}
                fp.close()
            entry["segments"] = 0
            entry["file"] = final_rel
            hr.problems = [p for p in hr.problems if p.startswith("manifest says")]
            if hr.problems:
                entry["lost"] = hr.problems
                hr.repaired.append("manifest updated to the readable records")
                hr.problems = []
    finally:
        for p in parts:
            p.close()
    return hr


def _merge_handle(run_dir: Path, parts: list[Part], final_rel: str, hid: str, entry: dict, m: dict,
                  hr: HandleReport) -> None:
    final = run_dir / final_rel
    tmp = final.with_name(final.name + ".partial")
    final.parent.mkdir(parents=True, exist_ok=True)
    if parts:
        attrs = {k: v for k, v in parts[0].attrs.items()
                 if k not in ("records", "record_start", "fields", "hookline_format", "format_version")}
    else:
        attrs = {"handle_id": hid, "key": entry["key"], "module_name": entry.get("module_name", ""),
                 "module_type": entry.get("module_type", ""), "category": entry.get("category", ""),
                 "hook_fn_name": entry.get("hook_fn_name", ""), "meta": json.dumps(entry.get("meta", {})),
                 "rank": np.int64(-1 if m.get("rank") is None else m["rank"]),
                 "world_size": np.int64(-1 if m.get("world_size") is None else m["world_size"])}
    comp = {}
    for p in parts:
        for nm in p.field_names:
            ds = p.field(nm).ds
            comp.setdefault(nm, ds.compression if ds.compression in ("gzip", "lzf") else None)
    n = merge_parts(parts, tmp, attrs, lambda nm: comp.get(nm))
    merged = [p.path for p in parts]
    for p in parts:
        p.close()
    fsync_file(tmp)
    check = open_part(tmp)
    try:
        if check.n != n or n != hr.records:
            raise StorageError(f"merged file {str(tmp)!r} has {check.n} records, expected {hr.records}; nothing removed")
        _check_part(check)
    finally:
        check.close()
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for path in merged:
        if path != final and path.exists():
            os.unlink(path)
    hr.repaired.append(f"merged {len(merged)} file(s) into {final_rel} ({n} records)")
    hr.files = [final_rel]


def _remove_if_contained(run_dir: Path, rel: str, hr: HandleReport, report: VerifyReport) -> None:
    """A superseded file (left by a merge interrupted before its inputs were removed) holds
    records that are also in the merged file; move it aside rather than delete it."""
    if (run_dir / rel).exists():
        dst = _quarantine(run_dir, rel, report)
        hr.repaired.append(f"moved redundant {rel} to {dst} (its records are in the merged file)")
