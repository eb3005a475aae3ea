"""Merging complete parts of a handle into one new part, with bounded memory and open files.

The writer's compaction and ``close()`` and ``verify(repair=True)`` merge through here.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

from ._fs import WRITEBACK_BYTES, Writeback
from ._h5check import Structure, forget, remember
from ._h5read import Part, PartField, open_part
from ._h5write import FieldOut, FieldSpec, HandleFileWriter
from .errors import FormatError

__all__ = ["COPY_BLOCK_BYTES", "MERGE_MAX_FILES", "Merged", "merge_files", "merge_parts", "open_parts"]

#: Bytes per read block when copying (merge): bounds merge memory.
COPY_BLOCK_BYTES = 64 << 20
#: Most files one merge opens at once; merging more goes through intermediate files of this many
#: each (a handle can have hundreds of segments: see RunWriter's max_open_files).
MERGE_MAX_FILES = 32


class Merged(NamedTuple):
    """What a merge wrote: its records, and the new file's structure (to
    :func:`~._h5check.remember` once the file has its final name)."""

    records: int
    structure: Structure | None


def open_parts(paths: Iterable[Path]) -> list[Part]:
    """Open complete files; if one fails, close the ones already open and re-raise."""
    parts: list[Part] = []
    try:
        for path in paths:
            parts.append(open_part(path))
    except BaseException:
        for p in parts:
            p.close()
        raise
    return parts


def merge_files(paths: list[Path], out_path: Path, attrs: dict[str, Any],
                compression_for: Callable[[str], str | None] | None = None, record_start: int = 0,
                writeback: Writeback | int | None = WRITEBACK_BYTES,
                mid_path: Callable[[int, int], Path] | None = None) -> Merged:
    """:func:`merge_parts` of the complete files ``paths``, with at most :data:`MERGE_MAX_FILES` of
    them open at once. Beyond that, groups are merged first into intermediate files at
    ``mid_path(start, end)`` (name them like merge outputs, :func:`~.format.merge_output_name`,
    so that one left by a crash is recognised as a leftover), which are removed at the end.

    Returns:
        The records written and the output's structure.
    """
    limit = MERGE_MAX_FILES
    if len(paths) <= limit:
        parts = open_parts(paths)
        try:
            return merge_parts(parts, out_path, attrs, compression_for, record_start=record_start,
                               writeback=writeback)
        finally:
            for p in parts:
                p.close()
    if mid_path is None:
        raise ValueError(f"merging {len(paths)} files (> {limit}) needs mid_path for intermediate files")
    mids: list[Path] = []  # intermediate files, removed at the end
    level: list[Path] = []  # the next level's inputs
    try:
        start = record_start
        for i in range(0, len(paths), limit):
            group = paths[i : i + limit]
            parts = open_parts(group)
            try:
                n = sum(p.n for p in parts)
                if len(group) == 1 or n == 0:  # nothing to merge (a single file keeps its name)
                    level.extend(group if n else [])
                else:
                    mid = mid_path(start, start + n)
                    mids.append(mid)  # before writing: a failed merge's output is removed too
                    remember(mid, merge_parts(parts, mid, attrs, compression_for, record_start=start,
                                              writeback=writeback).structure)
                    level.append(mid)
            finally:
                for p in parts:
                    p.close()
            start += n
        return merge_files(level, out_path, attrs, compression_for, record_start, writeback, mid_path)
    finally:
        for m in mids:
            forget(m)
            m.unlink(missing_ok=True)


def merge_parts(parts: list[Part], out_path: Path, attrs: dict[str, Any],
                compression_for: Callable[[str], str | None] | None = None,
                record_start: int = 0, writeback: Writeback | int | None = WRITEBACK_BYTES) -> Merged:
    """Copy the records of ``parts`` (in order) into one new complete file at ``out_path``.

    Records are renumbered contiguously from ``record_start``. A field is stored ragged in the
    output if it is ragged in any input or its per-record shape differs between inputs. Memory is
    bounded by :data:`COPY_BLOCK_BYTES`.

    Returns:
        The records written and the output's structure.
    """
    w = HandleFileWriter(out_path, attrs, record_start, writeback)
    try:
        shifts = []
        base = record_start
        for p in parts:
            shifts.append(base - p.record_start)  # add to a part's record number -> output number
            w.add_index(p.steps, p.calls)
            base += p.n
        names: list[str] = []
        for p in parts:
            for nm in p.field_names:
                if nm not in names:
                    names.append(nm)
        for nm in names:
            pfs = [(p.field(nm), shift) for p, shift in zip(parts, shifts) if nm in p.field_names]
            spec, total = _merged_spec(nm, pfs, compression_for)
            _copy_field(w.field(spec, total), spec, pfs)
        w.finish()
    except BaseException:
        w.abort()
        raise
    return Merged(w.n_records, w.structure)


def _merged_spec(nm: str, pfs: list[tuple[PartField, int]],
                 compression_for: Callable[[str], str | None] | None) -> tuple[FieldSpec, int]:
    """The output spec of field ``nm`` of the inputs ``pfs``, and the entries it will hold.

    Raises:
        FormatError: the inputs store the field with different dtypes.
    """
    dnames = {pf.dtype_name for pf, _ in pfs}
    if len(dnames) != 1:
        raise FormatError(f"field {nm!r} has different dtypes across segments: {sorted(dnames)}")
    first = pfs[0][0]
    shapes = {pf.shape for pf, _ in pfs}
    ragged = None in shapes or len(shapes) > 1
    total = sum(pf.count for pf, _ in pfs)
    if ragged:
        total = sum(int(np.prod(pf.shapes, axis=1).sum()) if pf.shape is None and pf.ndim
                    else pf.count * math.prod(pf.shape or ()) for pf, _ in pfs)
    shape0 = first.shape if first.shape is not None else (
        first.record_shape(0) if first.count else (0,) * first.ndim)
    spec = FieldSpec(nm, first.dtype_name, ragged, tuple(shape0),
                     compression_for(nm) if compression_for else None)
    return spec, total


def _copy_field(out: FieldOut, spec: FieldSpec, pfs: list[tuple[PartField, int]]) -> None:
    """Copy one field of every input (``(field, record number shift)``) into the output."""
    elem_off = 0  # elements written so far (ragged output)
    for pf, shift in pfs:
        if pf.count == 0:
            continue
        out.records.append(pf.records + shift)
        if spec.info.has_norm:
            sn = pf.stored_norms
            out.norms.append(sn if sn is not None else np.full(pf.count, np.nan))
        if pf.shape is not None:
            elem_off = _copy_fixed(out, pf, spec, elem_off)
        else:
            elem_off = _copy_ragged(out, pf, spec, elem_off)


def _copy_fixed(out: FieldOut, pf: PartField, spec: FieldSpec, elem_off: int) -> int:
    """Copy a fixed-shape input field in blocks (flattened when the output is ragged); returns the
    output's element offset after it."""
    per = max(1, math.prod(pf.shape) * spec.info.storage.itemsize)
    step = max(1, COPY_BLOCK_BYTES // per)
    for a in range(0, pf.count, step):
        blk = pf.read_block(a, min(pf.count, a + step))
        out.append(blk.reshape(-1) if spec.ragged else blk)
    if spec.ragged:
        size = math.prod(pf.shape)
        out.offsets.append(elem_off + np.arange(pf.count, dtype=np.int64) * size)
        out.shapes.append(np.tile(np.asarray(pf.shape, np.int64), (pf.count, 1)).reshape(pf.count, pf.ndim))
        elem_off += size * pf.count
    return elem_off


def _copy_ragged(out: FieldOut, pf: PartField, spec: FieldSpec, elem_off: int) -> int:
    """Copy a ragged input field's flat data in blocks with its offsets (rebased) and shapes;
    returns the output's element offset after it."""
    offs, shps = pf.offsets, pf.shapes
    sizes = np.prod(shps, axis=1, dtype=np.int64) if pf.ndim else np.ones(pf.count, np.int64)
    lo = int(offs[0]) if pf.count else 0
    hi = int(offs[-1] + sizes[-1]) if pf.count else 0
    step_el = max(1, COPY_BLOCK_BYTES // spec.info.storage.itemsize)
    for a in range(lo, hi, step_el):
        out.append(pf.ds[a : min(hi, a + step_el)])
    out.offsets.append(offs - lo + elem_off)
    out.shapes.append(shps)
    return elem_off + hi - lo
