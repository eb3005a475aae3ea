"""What ``verify`` checks inside one complete handle file: its indexes, the first and last entry
of every field, HDF5's per-chunk checksums (``+checksum``) and hookline's own chunk hashes
(docs/format.md, "Chunk hashes"); and whether all of a file's data reads (before a repair gives
a file up)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import numpy as np

from ._h5read import Part, PartField, open_part
from ._merge import COPY_BLOCK_BYTES
from .errors import FormatError, StorageError
from .hashes import block_failures
from .words import plural

__all__ = ["check_part", "checksum_failures", "hash_failures", "record_ranges", "unreadable_data", "raise_if_environment",
           "ENVIRONMENT_ERRNOS"]


def check_part(p: Part) -> dict[str, int]:
    """Consistency checks of one complete file; returns field -> entries. Raises on problems.

    Every index entry is checked (:mod:`._h5read` checks an index when it loads it): the record
    numbers of every field, its norms, and the offset and shape of every ragged entry; the first
    and last entry of every field are read; a field with checksums (HDF5's fletcher32, or
    hookline's chunk hashes: :mod:`.hashes`) is read whole and checked.
    """
    if len(p.steps) != p.n or len(p.calls) != p.n:
        raise FormatError(f"index length mismatch (records={p.n})")
    counts = {}
    bad = [msg for nm in p.field_names if (msg := checksum_failures(p.field(nm), p.handle_id))]
    if bad:
        raise FormatError("; ".join(bad))
    bad = [msg for nm in p.field_names if (msg := hash_failures(p.field(nm), p.handle_id))]
    if bad:
        raise FormatError("; ".join(bad))
    for nm in p.field_names:
        pf = p.field(nm)
        if len(pf.records) != pf.count:
            raise FormatError(f"field {nm!r}: {plural(len(pf.records), 'record number')} for {plural(pf.count, 'entry')}")
        if pf.count:
            if pf.info.has_norm and pf.stored_norms is None:
                raise FormatError(f"field {nm!r}: norm index missing")
            if pf.shape is None:
                pf.offsets  # noqa: B018 (loads and checks every entry's offset and shape)
            pf.read_stored(0)  # the data is readable
            pf.read_stored(pf.count - 1)
        counts[nm] = pf.count
    return counts


def checksum_failures(pf: PartField, hid: str) -> str | None:
    """Read every chunk of a checksummed field (HDF5 checks each chunk's fletcher32 on read);
    the records whose chunks fail, as ranges of global record numbers, or None."""
    ds = pf.ds
    if not ds.fletcher32 or not pf.count:
        return None
    extent = int(ds.shape[0])
    c0 = int(ds.chunks[0])
    row = max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:])))
    step = max(c0, COPY_BLOCK_BYTES // row // c0 * c0)
    bad: list[tuple[int, int]] = []  # failing item ranges along axis 0
    for a in range(0, extent, step):
        b = min(extent, a + step)
        if _reads(ds, a, b):
            continue
        bad.extend((x, min(b, x + c0)) for x in range(a, b, c0) if not _reads(ds, x, min(b, x + c0)))
    if not bad:
        return None
    return _damaged_records(pf, hid, bad, "fail their checksum")


def hash_failures(pf: PartField, hid: str) -> str | None:
    """Read a field whose file stores chunk hashes (:mod:`.hashes`) block by block and compare;
    the records of the blocks that differ, as ranges of global record numbers, or None (also
    for a file without hashes)."""
    try:
        bad = block_failures(pf, read_bytes=COPY_BLOCK_BYTES)
    except OSError as e:
        if e.errno is not None:
            raise
        return f"handle {hid!r}: field {pf.name!r}: its data does not read: {e}"
    if not bad:
        return None
    return _damaged_records(pf, hid, bad, "fail their xxh3 chunk hash")


def _damaged_records(pf: PartField, hid: str, bad: list[tuple[int, int]], what: str) -> str:
    """The problem of a field whose items ``bad`` (ranges along axis 0) failed a check."""
    if pf.shape is not None:
        entries = [j for x, y in bad for j in range(x, min(y, pf.count))]
    else:  # (ragged: the entries whose elements overlap a failing chunk)
        offs, sizes = pf.offsets, np.prod(pf.shapes, axis=1) if pf.ndim else np.ones(pf.count, np.int64)
        entries = [j for x, y in bad for j in np.nonzero((offs < y) & (offs + sizes > x))[0].tolist()]
    recs = sorted({int(r) for r in pf.records[sorted(set(entries))]}) if entries else []
    where = record_ranges(recs) or f"items {bad[0][0]}-{bad[-1][1] - 1} past the last record"
    return f"handle {hid!r}: field {pf.name!r}: {where} {what} (data damaged on disk; the other records read)"


def _reads(ds: Any, a: int, b: int) -> bool:
    """Whether items ``[a, b)`` of a dataset read (HDF5's own read errors are damage; the
    machine's, with an errno, are raised)."""
    try:
        ds[a:b]
        return True
    except OSError as e:
        if e.errno is not None:
            raise
        return False


def record_ranges(recs: list[int]) -> str:
    """``"records 4-7, 12-15"`` for sorted record numbers."""
    out: list[list[int]] = []
    for r in recs:
        if out and out[-1][1] == r - 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return ", ".join(f"records {a}-{b}" for a, b in out)


def unreadable_data(path: Path) -> str | None:
    """Why the data of a complete file does not read (every chunk of every field is read, a
    block at a time), or None when it all reads."""
    try:
        p = open_part(path)
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    try:
        for nm in p.field_names:
            ds = p.field(nm).ds
            step = max(1, COPY_BLOCK_BYTES // max(1, ds.dtype.itemsize * int(np.prod(ds.shape[1:]))))
            for a in range(0, ds.shape[0], step):
                ds[a : a + step]
        return None
    except Exception as e:  # noqa: BLE001
        raise_if_environment(e, str(path))
        return f"{type(e).__name__}: {e}"
    finally:
        p.close()


#: errnos that say something about the machine, not the file: never a reason to quarantine.
ENVIRONMENT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM}


def raise_if_environment(e: BaseException, rel: str) -> None:
    """Raise StorageError when ``e`` says the machine, not the file, failed (out of file handles
    or memory): such a failure is never a reason to move a file aside."""
    code = getattr(e, "errno", None)
    if code in ENVIRONMENT_ERRNOS or any(f"errno = {c}," in str(e) for c in ENVIRONMENT_ERRNOS):
        raise StorageError(
            f"cannot check {rel!r}: {e} (the machine ran out of resources, the file may be fine; "
            f"raise ulimit -n or free memory and run verify again; nothing was moved)") from e
