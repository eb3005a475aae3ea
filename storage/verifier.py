"""Check a run directory and optionally repair it: :func:`verify` -> :class:`VerifyReport`.

Checks every handle's complete files (final ``.h5`` and sealed ``.h5seg`` segments): they open,
their indexes are consistent, the last record of every field reads. With ``repair=True``:

* files still being written when the writer died (``<key>.rSTART.h5seg.partial``), outputs of
  interrupted merges (``<key>.rSTART-END.h5seg.partial``, ``<key>.h5.partial``: copies) and files
  that do not open or are inconsistent are **moved** to ``<run>/.quarantine/`` (never deleted);
* each handle's readable files are merged into one ``<key>.h5`` (written as ``.h5.partial``,
  fsynced, renamed); segments are deleted only after the merged file was re-opened and holds
  all their records;
* the manifest is rewritten (records, fields, ``status: "closed"``).

Nothing is ever deleted that is not also in a verified file. Files are checked one at a time and
merged with a bounded number open, so handles with thousands of segments verify under any
open-file limit; running out of file handles raises instead of quarantining good files.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._filters import spec_of_dataset
from ._fs import atomic_write_json, fsync_dir, fsync_file
from ._h5read import open_part
from ._merge import merge_files
from ._parts import Discovery, discover_files
from .confine import RunRoot
from .errors import FormatError, StorageError
from .format import (
    MANIFEST_RE,
    final_name,
    manifest_name,
    merge_output_name,
    now_iso,
    rank_suffix,
)
from .identity import ACCESS_HINT, access_problem, foreign, missing_fields
from .keys import handle_key
from .partcheck import check_part, raise_if_environment, unreadable_data
from .reader import LocalSource
from .synthesise import synthesise_manifests
from .verify_report import QUARANTINE_DIR, HandleReport, VerifyReport
from .words import plural

__all__ = ["verify", "VerifyReport", "HandleReport", "QUARANTINE_DIR"]

def _check_locks(run_dir: Path, repair: bool, report: VerifyReport) -> list[str]:
    """Writers hold ``.writer*.lock`` with flock. Returns the held ones; removes stale ones on repair."""
    import fcntl

    held = []
    for lock in sorted(run_dir.glob(".writer*.lock")):
        try:  # (never through a symlink, never blocking on a FIFO; only a regular file is a lock)
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held.append(lock.name)  # (a live run: a state, not a problem; its unmerged files are normal)
            report.writing = True
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
    """Move the entry ``rel`` itself (a symlink is moved, not followed) to the quarantine folder.

    Raises:
        FormatError: ``rel`` or the quarantine folder leads outside the run directory.
    """
    root = RunRoot(run_dir)
    src = root.entry(rel, what="entry to quarantine")
    dst = root.entry(f"{QUARANTINE_DIR}/{rel}", what="quarantine destination")
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        dst = dst.with_name(dst.name + f".{int(os.lstat(src).st_mtime)}")
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
        FormatError: with ``repair``, the run's ``.quarantine`` leads outside it (nothing is moved).
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
    if repair:  # before anything moves: a quarantine leading outside refuses the whole repair
        RunRoot(run_dir).folder(QUARANTINE_DIR, what="quarantine folder")
    manifests = _load_manifests(run_dir, repair, report)
    _add_unlisted_handles(run_dir, manifests, report)
    if not manifests:
        report.problems.append("no manifest and no hookline files")
        return report
    _check_manifest_writes(run_dir, repair, report)
    for m in manifests:
        _verify_rank(run_dir, m, repair, report)
    return report


def _load_manifests(run_dir: Path, repair: bool, report: VerifyReport) -> list[dict[str, Any]]:
    """The run's manifests; rebuilt from the files' attributes when missing or unreadable (an
    unreadable one is quarantined on repair)."""
    damage = None
    manifests: list[dict[str, Any]] = []
    if not any(MANIFEST_RE.fullmatch(p.name) for p in run_dir.iterdir()):
        damage = "manifest.json is missing"
    else:
        try:
            manifests = LocalSource(run_dir).manifests()
        except FormatError as e:
            damage = f"manifest unreadable: {e}"
            if repair:
                for p in run_dir.iterdir():
                    if p.name.startswith("manifest") and p.suffix == ".json":
                        _quarantine(run_dir, p.name, report)
    if damage is None:
        return manifests
    # Rebuilt from the files' attributes (handles, run metadata); the record counts follow from
    # the files (_verify_handle).
    if repair:
        report.repaired.append(f"{damage}: rebuilt from the files' attributes")
    else:
        report.problems.append(f"{damage} (repair rebuilds it from the files' attributes)")
    return synthesise_manifests(run_dir)


def _add_unlisted_handles(run_dir: Path, manifests: list[dict[str, Any]], report: VerifyReport) -> None:
    """Add the handles that have files but no manifest entry (e.g. the manifest was lost)."""
    known = {(m.get("rank"), hid) for m in manifests for hid in m["handles"]}
    for sm in synthesise_manifests(run_dir):
        target = next((m for m in manifests if m.get("rank") == sm.get("rank")), None)
        for hid, e in sm["handles"].items():
            if (sm.get("rank"), hid) in known:
                continue
            report.problems.append(f"handle {hid!r} has files but no manifest entry")
            if target is None:
                target = dict(sm, handles={})
                manifests.append(target)
            target["handles"][hid] = e


def _check_manifest_writes(run_dir: Path, repair: bool, report: VerifyReport) -> None:
    """Report (repair: quarantine) manifest writes that never finished (``manifest*.json.tmp``)."""
    for tmp in sorted(run_dir.glob("manifest*.json.tmp")):
        if repair:
            report.repaired.append(f"moved interrupted manifest write {tmp.name} to "
                                   f"{_quarantine(run_dir, tmp.name, report)}")
        else:
            report.problems.append(f"interrupted manifest write {tmp.name} (the manifest itself is intact)")


def _verify_rank(run_dir: Path, m: dict[str, Any], repair: bool, report: VerifyReport) -> None:
    """Verify every handle of one rank's manifest; on repair, rewrite that manifest."""
    rank, ws = m.get("rank"), m.get("world_size")
    suffix = rank_suffix(rank, ws)
    for hid, entry in m["handles"].items():
        try:
            hr = _verify_handle(run_dir, m, hid, entry, suffix, repair, report)
        except Exception as e:  # noqa: BLE001 - one handle's damage must not stop the others
            raise_if_environment(e, hid)
            if (why := access_problem(e)) is None:
                hr = HandleReport(hid, rank, problems=[f"verify of this handle stopped: {type(e).__name__}: {e}"])
            else:
                hr = HandleReport(hid, rank, problems=[f"cannot read its files: {why} ({ACCESS_HINT})"])
                hr.blocked = True
        report.handles.append(hr)
    if repair:
        m["status"] = "closed" if all(h.ok for h in report.handles if h.rank == rank) else m.get("status", "open")
        m["updated"] = now_iso()
        m["verified"] = now_iso()
        atomic_write_json(run_dir / manifest_name(rank, ws), m)
        report.repaired.append(f"rewrote {manifest_name(rank, ws)}")


def _verify_handle(run_dir: Path, m: dict, hid: str, entry: dict, suffix: str, repair: bool,
                   report: VerifyReport) -> HandleReport:
    """Check one handle's parts and report; on repair, merge them into its final file and update
    its manifest entry."""
    hr = HandleReport(hid, m.get("rank"))
    key = _confined_key(run_dir, hid, entry, repair, hr, report)
    if key is None:
        return hr
    _check_file_entry(run_dir, hid, entry, repair, hr)
    d, good = _check_parts(run_dir, key, suffix, hid, m.get("run_uuid"), repair, hr, report)
    if hr.blocked:  # (files it cannot read: nothing of the handle is changed, nothing counted lost)
        return hr
    if not report.writing:  # (a live writer's .partial files are its work in progress)
        _report_leftovers(run_dir, d, repair, hr, report)
    for a, b in d.gaps:
        hr.problems.append(f"records [{a}, {b}) are missing (no file holds them)")
    hr.files = [c.rel for c in good]
    hr.records = sum(c.n for c in good)
    for c in good:
        for nm, count in c.counts.items():
            hr.fields[nm] = hr.fields.get(nm, 0) + count
    claimed = entry.get("records")
    if isinstance(claimed, int) and claimed > hr.records:
        hr.problems.append(f"manifest says {plural(claimed, 'record')}, {hr.records} readable")
    damaged = (any(p.startswith("unreadable file") for p in hr.problems)  # (its fields are missing too)
               or any(r.startswith("moved unreadable") for r in hr.repaired))
    for nm in [] if damaged else missing_fields(m, entry, hr.fields):
        hr.problems.append(f"{MISSING_FIELD} {nm!r} is in none of the handle's files (removed or replaced)")
    final_rel = final_name(key, suffix)
    clean = len(good) == 1 and hr.files == [final_rel] and not d.superseded
    if report.writing:  # (a live run's writer seals segments and merges them itself)
        report.pending += len(d.partials)
        return hr
    if not clean and not repair and (len(good) > 1 or d.superseded or (good and hr.files != [final_rel])):
        hr.problems.append(f"not merged: {len(good)} complete files, {len(d.superseded)} redundant "
                           f"(repair merges them into {final_rel})")
    if repair and not clean:
        _merge_or_drop(run_dir, good, final_rel, hid, entry, m, hr, suffix, report)
        hr.problems = [p for p in hr.problems if not p.startswith("records [")]
        for fe in d.superseded:
            if fe.name != final_rel:  # (the merge just replaced that file with the merged one)
                _remove_if_contained(run_dir, fe.name, hr, report)
    if repair:
        _update_entry(run_dir, entry, final_rel, hr)
    return hr


def _confined_key(run_dir: Path, hid: str, entry: dict, repair: bool, hr: HandleReport,
                  report: VerifyReport) -> str | None:
    """The handle's manifest key if it stays inside the run directory (its files are found by
    it). A key that leads outside (absolute, ``..``, a symlinked folder) is a problem; repair
    resets it to the handle id's key (moving a symlinked folder aside). None: skip the handle."""
    key = entry.get("key")
    if not key:
        hr.problems.append("manifest entry has no 'key'")
        return None
    root = RunRoot(run_dir)
    what = f"manifest key of handle {hid!r}"
    try:
        return root.key(key, what=what)
    except FormatError as e:
        fixed = handle_key(hid)
        if not repair:
            hr.problems.append(f"{e} (repair " + (f"resets it to {fixed!r})" if fixed != key else
                                                  "moves the folder aside)"))
            return None
        folder = fixed.rpartition("/")[0]
        p = run_dir / folder
        if folder and ((p.is_symlink() and not root.inside(p)) or (p.exists() and not p.is_dir())):
            hr.repaired.append(f"moved {folder} aside (a link leading outside the run directory, or not a "
                               f"folder) to {_quarantine(run_dir, folder, report)}")
        try:
            root.key(fixed, what=what)
        except FormatError as e2:
            hr.problems.append(str(e2))
            return None
    if fixed != key:
        entry["key"] = fixed
        hr.repaired.append(f"reset manifest key {key!r} (it led outside the run directory) to {fixed!r}")
        hr.damage.append(f"manifest key {key!r} led outside the run directory")
    return fixed


def _check_file_entry(run_dir: Path, hid: str, entry: dict, repair: bool, hr: HandleReport) -> None:
    """Report a manifest ``file`` that leads outside the run directory (repair rewrites it)."""
    rel = entry.get("file")
    if rel is None:
        return
    try:  # (what the name holds is checked with the handle's files)
        RunRoot(run_dir).resolve(rel, what=f"manifest file of handle {hid!r}")
    except FormatError as e:
        if repair:
            hr.repaired.append(f"replaced manifest file {rel!r}: it led outside the run directory")
            hr.damage.append(f"manifest file {rel!r} led outside the run directory")
        else:
            hr.problems.append(str(e))


def _check_parts(run_dir: Path, key: str, suffix: str, hid: str, run_uuid: Any, repair: bool, hr: HandleReport,
                 report: VerifyReport) -> tuple[Discovery, list[_Checked]]:
    """List and check a handle's complete parts, one open at a time (a handle may have thousands
    of segments); on repair, quarantine the unreadable ones and list again. A file it cannot
    read for a reason that is not damage (:func:`.identity.access_problem`) marks the handle
    ``blocked``: nothing of it is moved. A live run's writer renames files while they are
    checked: a file gone since it was listed makes it list again."""
    tries = 0
    while True:
        tries += 1
        d = discover_files(run_dir, key, suffix)
        bad: list[tuple[str, str]] = list(d.broken)
        blocked: list[tuple[str, str]] = list(d.blocked)
        good: list[_Checked] = []
        for fe in d.cover:
            checked = _check_file(run_dir, fe.name, hid, run_uuid)
            if isinstance(checked, _Checked):
                good.append(checked)
            elif checked.startswith(_BLOCKED):
                blocked.append((fe.name, checked[len(_BLOCKED):]))
            else:
                bad.append((fe.name, checked))
        gone = report.writing and any(not (run_dir / rel).exists() for rel, _ in bad)
        if gone and tries < 5:
            continue
        if blocked:
            hr.blocked = True
            hr.problems += [f"cannot read {rel}: {why} ({ACCESS_HINT})" for rel, why in blocked]
            break
        if not bad or not repair:
            break
        for rel, why in bad:
            dst = _quarantine(run_dir, rel, report)
            hr.repaired.append(f"moved unreadable {rel} to {dst} ({why})")
    for rel, why in bad:
        hr.problems.append(f"unreadable file {rel}: {why}")
    return d, good


def _report_leftovers(run_dir: Path, d: Discovery, repair: bool, hr: HandleReport, report: VerifyReport) -> None:
    """Report (repair: quarantine) unflushed ``.partial`` files and outputs of interrupted merges."""
    for rels, what, why in (
        (d.partials, "unflushed partial file", "written when the writer stopped; its records were never flushed"),
        (d.leftovers, "interrupted merge output",
         "a copy: its records are in other files; the next writer or a repair removes it"),
    ):
        for rel in rels:
            if repair:
                dst = _quarantine(run_dir, rel, report)
                hr.repaired.append(f"moved {what} {rel} to {dst}")
            else:
                hr.problems.append(f"{what} {rel} ({why})")


def _update_entry(run_dir: Path, entry: dict[str, Any], final_rel: str, hr: HandleReport) -> None:
    """After repair: the manifest entry lists the readable records and the final file's fields;
    what could not be recovered moves from the problems to the entry's ``lost``."""
    entry["records"] = hr.records
    fields = entry.setdefault("fields", {})
    fp = open_part(run_dir / final_rel) if (run_dir / final_rel).exists() else None
    if fp is not None:
        for nm in fp.field_names:
            pf = fp.field(nm)
            fields[nm] = {"dtype": pf.dtype_name, "shape": list(pf.shape) if pf.shape is not None else None,
                          "ndim": pf.ndim}  # as the writer's manifest: a continued run checks it
        for nm in set(fields) - set(fp.field_names):  # (listed, never sealed, or lost: reported)
            del fields[nm]
        fp.close()
    entry["segments"] = 0
    entry["file"] = final_rel
    lost = [p for p in hr.problems if p.startswith(("manifest says", MISSING_FIELD))]
    hr.problems = [p for p in hr.problems if not p.startswith(("manifest says", MISSING_FIELD))]
    if lost or hr.lost:
        entry["lost"] = hr.lost = hr.lost + lost
        hr.repaired.append("manifest updated to the readable records")


@dataclass
class _Checked:
    """What verify keeps of a complete file that passed its checks (the file itself is closed)."""

    rel: str
    n: int
    counts: dict[str, int]
    attrs: dict[str, Any]
    compression: dict[str, str | None]


#: The start of the problem of a field the manifest lists and no file holds (repair: a loss).
MISSING_FIELD = "manifest field"
#: The start of what :func:`_check_file` returns for a file it may not read (not damage).
_BLOCKED = "\x00blocked:"


def _check_file(run_dir: Path, rel: str, hid: str, run_uuid: Any) -> _Checked | str:
    """Open, check and close one complete file: its summary, or why it is unreadable (starting
    with ``_BLOCKED`` when the cause is not damage: permission denied, a read-only file system).
    A file of another handle or another run (:func:`.identity.foreign`) is unreadable as this
    handle's.

    Raises:
        StorageError: the machine, not the file, failed (out of file handles or memory).
    """
    try:
        p = open_part(run_dir / rel)
    except Exception as e:
        raise_if_environment(e, rel)
        why = access_problem(e)
        return f"{type(e).__name__}: {e}" if why is None else _BLOCKED + why
    try:
        if (why := foreign(p.attrs, hid, run_uuid)) is not None:
            raise FormatError(why)
        counts = check_part(p)
        compression = {nm: spec_of_dataset(p.field(nm).ds) for nm in p.field_names}
        return _Checked(rel, p.n, counts, dict(p.attrs), compression)
    except Exception as e:
        raise_if_environment(e, rel)
        return f"{type(e).__name__}: {e}"
    finally:
        p.close()


def _merge_or_drop(run_dir: Path, good: list[_Checked], final_rel: str, hid: str, entry: dict, m: dict,
                   hr: HandleReport, suffix: str, report: VerifyReport) -> None:
    """Merge the handle's good files; if the merge fails (data the checks did not read is damaged),
    read every file whole, move the ones that do not read to the quarantine and merge the rest
    once more. A merge that still fails is a problem of the handle; its files stay as they were."""
    for attempt in (1, 2):
        try:
            _merge_handle(run_dir, good, final_rel, hid, entry, m, hr, suffix)
            return
        except Exception as e:  # noqa: BLE001 - reported; the inputs are untouched until a merge succeeds
            raise_if_environment(e, final_rel)
            (run_dir / (final_rel + ".partial")).unlink(missing_ok=True)
            failed = f"merge into {final_rel} failed: {type(e).__name__}: {e}"
        bad = {c.rel: why for c in good if (why := unreadable_data(run_dir / c.rel)) is not None}
        if attempt == 2 or not bad:
            hr.problems.append(f"{failed}; the files are unchanged")
            return
        for rel, why in bad.items():
            hr.repaired.append(f"moved unreadable {rel} to {_quarantine(run_dir, rel, report)} ({why})")
            hr.lost.append(f"the records of {rel} (its data does not read: {why})")
        good[:] = [c for c in good if c.rel not in bad]
        hr.records = sum(c.n for c in good)
        hr.fields = {}
        for c in good:
            for nm, count in c.counts.items():
                hr.fields[nm] = hr.fields.get(nm, 0) + count


def _merge_handle(run_dir: Path, good: list[_Checked], final_rel: str, hid: str, entry: dict, m: dict,
                  hr: HandleReport, suffix: str) -> None:
    final = run_dir / final_rel
    tmp = final.with_name(final.name + ".partial")
    final.parent.mkdir(parents=True, exist_ok=True)
    if good:
        attrs = {k: v for k, v in good[0].attrs.items()
                 if k not in ("records", "record_start", "fields", "hookline_format", "format_version")}
    else:
        attrs = {"handle_id": hid, "key": entry["key"], "module_name": entry.get("module_name", ""),
                 "module_type": entry.get("module_type", ""), "category": entry.get("category", ""),
                 "hook_fn_name": entry.get("hook_fn_name", ""), "meta": json.dumps(entry.get("meta", {})),
                 "rank": np.int64(-1 if m.get("rank") is None else m["rank"]),
                 "world_size": np.int64(-1 if m.get("world_size") is None else m["world_size"]),
                 **({"run_uuid": m["run_uuid"]} if m.get("run_uuid") else {})}
    comp: dict[str, str | None] = {}
    for c in good:
        for nm, method in c.compression.items():
            comp.setdefault(nm, method)
    merged = [run_dir / c.rel for c in good]
    key = entry["key"]
    n = merge_files(merged, tmp, attrs, lambda nm: comp.get(nm),
                    mid_path=lambda a, b: run_dir / merge_output_name(key, suffix, a, b)).records
    fsync_file(tmp)
    check = open_part(tmp)
    try:
        if check.n != n or n != hr.records:
            raise StorageError(f"merged file {str(tmp)!r} has {plural(check.n, 'record')}, expected {hr.records}; nothing removed")
        check_part(check)
    finally:
        check.close()
    os.replace(tmp, final)
    fsync_dir(final.parent)
    for path in merged:
        if path != final and path.exists():
            os.unlink(path)
    hr.repaired.append(f"merged {plural(len(merged), 'file')} into {final_rel} ({plural(n, 'record')})")
    hr.files = [final_rel]


def _remove_if_contained(run_dir: Path, rel: str, hr: HandleReport, report: VerifyReport) -> None:
    """A superseded file (left by a merge interrupted before its inputs were removed) holds
    records that are also in the merged file; move it aside rather than delete it."""
    if (run_dir / rel).exists():
        dst = _quarantine(run_dir, rel, report)
        hr.repaired.append(f"moved redundant {rel} to {dst} (its records are in the merged file)")
