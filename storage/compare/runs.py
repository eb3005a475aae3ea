"""Comparing two runs: which handles and fields to compare (:func:`plan`, on handles paired by
:func:`~.align.align_handles`), then one :class:`FieldComparison` each (:func:`iter_compare`,
:func:`compare_runs`)."""

from __future__ import annotations

import os
import re
from typing import Callable, Iterable, Iterator, Mapping, Sequence, Union

import numpy as np

from ..blocks import BLOCK_BYTES, damage_note, readable_records
from ..errors import InvalidArgumentError, UnknownNameError
from ..reader import Handle, Run, open_run
from .align import Alignment, align_handles
from .fields import compare_fields
from .metrics import check_metrics
from .represent import REPRESENTATION_METRICS, check_sample_dims
from .results import CompareResult, FieldComparison

__all__ = ["RunLike", "compare_runs", "iter_compare", "count_pairs", "plan", "glob_to_regex"]

#: What the comparison functions accept as a run: an opened run, a run directory or an MLflow URI.
RunLike = Union[Run, str, os.PathLike]


def _as_list(x: str | Iterable[str] | None) -> list[str] | None:
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    out = list(x)
    if not out or not all(isinstance(p, str) for p in out):  # ([] would select nothing, silently)
        raise InvalidArgumentError(f"a handle/field selection must be None (all) or glob patterns, got {x!r:.80}; "
                                   "e.g. fields='grad_out.*' or fields=None")
    return out


def glob_to_regex(pattern: str) -> re.Pattern[str]:
    """Compile a handle/field glob: ``*`` matches any run of characters, ``?`` one character;
    everything else, brackets included, is literal (handle ids read ``grads[fc1]``)."""
    parts = []
    for ch in pattern:
        parts.append(".*" if ch == "*" else "." if ch == "?" else re.escape(ch))
    return re.compile("".join(parts), re.DOTALL)


def _match(names: Sequence[str], patterns: list[str] | None, al: Alignment | None = None) -> list[str]:
    """The names a pattern matches (a handle also by its ids in either run, when aligned)."""
    if patterns is None:
        return list(names)
    regs = [glob_to_regex(p) for p in patterns]

    def ids(n: str) -> set[str]:
        return {n} if al is None else {n, al.a.get(n, n), al.b.get(n, n)}

    return [n for n in names if any(r.fullmatch(x) for r in regs for x in ids(n))]


def _open(run: RunLike, tracking_uri: str | None) -> Run:
    if isinstance(run, Run):
        return run
    return open_run(run, tracking_uri=tracking_uri or None)


def _run_name(run: Run, given: RunLike) -> str:
    return str(given) if isinstance(given, (str, os.PathLike)) else run.path


def _unreadable(handle: Handle) -> bool:
    """No record is readable although the manifest lists some (every file damaged or missing)."""
    readable, expected = readable_records(handle)
    return readable == 0 and (expected or 0) > 0


def plan(
    run_a: Run, run_b: Run, *, handles: str | Iterable[str] | None = None, fields: str | Iterable[str] | None = None,
    rename: Mapping[str, str] | None = None, alignment: Alignment | None = None,
) -> list[tuple[str, str | None, str]]:
    """The ``(handle, field, where)`` items a comparison will produce; ``handle`` is the aligned
    name (``alignment``, else :func:`~.align.align_handles` with ``rename``).

    ``where`` is ``"both"``, ``"a"`` or ``"b"`` (where the handle or field is), ``"empty"`` (a
    handle without fields in either run) or ``"unreadable:A"``/``"unreadable:B"``/
    ``"unreadable:A,B"`` (a handle none of whose records can be read there).

    Raises:
        InvalidArgumentError: ``handles`` or ``fields`` match nothing in either run, or a bad
            ``rename`` rule.
    """
    hpat, fpat = _as_list(handles), _as_list(fields)
    al = alignment or align_handles(run_a, run_b, rename)
    names = al.names
    selected = _match(names, hpat, al)
    if not selected:
        avail = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        raise InvalidArgumentError(
            f"handle pattern {', '.join(map(repr, hpat or []))} matches no handle in either run; "
            f"available: {avail or '(none)'}"
        )
    items: list[tuple[str, str | None, str]] = []
    for h in selected:
        if h not in al.b or h not in al.a:
            items.append((h, None, "a" if h in al.a else "b"))
            continue
        broken = [w for w, r, i in (("A", run_a, al.a), ("B", run_b, al.b)) if _unreadable(r[i[h]])]
        if broken:
            items.append((h, None, "unreadable:" + ",".join(broken)))
            continue
        fa, fb = list(run_a[al.a[h]].fields), list(run_b[al.b[h]].fields)
        fnames = fa + [f for f in fb if f not in set(fa)]
        if not fnames and fpat is None:
            items.append((h, None, "empty"))  # its hooks never fired in either run: say so
            continue
        for f in _match(fnames, fpat):
            items.append((h, f, "both" if (f in fa and f in fb) else ("a" if f in fa else "b")))
    if fpat is not None and not any(f is not None for _, f, _ in items):
        raise InvalidArgumentError(
            f"field pattern {', '.join(map(repr, fpat))} matches no field of the selected handles "
            f"({', '.join(selected[:5])}{' ...' if len(selected) > 5 else ''})"
        )
    return items


def _not_compared(h: str, f: str | None, where: str, ra: Run, rb: Run, ms: tuple[str, ...],
                  al: Alignment) -> FieldComparison:
    """The result of a :func:`plan` item that has nothing to compare (``where`` is not ``"both"``)."""
    empty = {m: np.zeros(0) for m in ms}
    if where.startswith("unreadable:"):
        notes = [damage_note(r[i[h]], w) for w, r, i in (("A", ra, al.a), ("B", rb, al.b))]
        return FieldComparison(h, None, status="unreadable", values=empty, message="; ".join(n for n in notes if n))
    if where == "empty":
        return FieldComparison(h, None, status="no_records", values=empty,
                               message=f"handle {h!r} has no records in either run")
    missing = "missing_in_b" if where == "a" else "missing_in_a"
    other = "B" if where == "a" else "A"
    what = f"handle {h!r}" if f is None else f"field {f!r} of handle {h!r}"
    return FieldComparison(h, f, status=missing, values=empty, message=f"{what} is not in run {other}")


def _rank_handle(run: Run, h: str, rank: int, which: str, ms: tuple[str, ...]) -> Handle | FieldComparison:
    """One rank of a handle, or a ``missing_in_<which>`` result when that rank has no data."""
    try:
        return run.handle(h, rank=rank)
    except UnknownNameError as e:
        return FieldComparison(h, None, status=f"missing_in_{which.lower()}", values={m: np.zeros(0) for m in ms},
                               message=f"run {which}: {e}")


def iter_compare(
    run_a: RunLike,
    run_b: RunLike,
    *,
    handles: str | Iterable[str] | None = None,
    fields: str | Iterable[str] | None = None,
    metrics: Iterable[str] | str | None = None,
    tracking_uri: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
    rank_a: int | None = None,
    rank_b: int | None = None,
    rename: Mapping[str, str] | None = None,
    sample_dims: int | None = None,
) -> Iterator[FieldComparison]:
    """Like :func:`compare_runs` but yields one :class:`FieldComparison` at a time."""
    ms = check_metrics(metrics)
    sample_dims = check_sample_dims(sample_dims)
    ra, rb = _open(run_a, tracking_uri), _open(run_b, tracking_uri)
    al = align_handles(ra, rb, rename)
    for h, f, where in plan(ra, rb, handles=handles, fields=fields, alignment=al):
        res = _compare_item(ra, rb, al, (h, f, where), ms, rank_a, rank_b,
                            dict(block_bytes=block_bytes, progress=progress, sample_dims=sample_dims))
        res.handle_a, res.handle_b = al.a.get(h), al.b.get(h)
        if not res.overall:  # (nothing compared: every result carries the pooled metrics asked for)
            res.overall = {m: float("nan") for m in ms if m in REPRESENTATION_METRICS}
        yield res


def _compare_item(ra: Run, rb: Run, al: Alignment, item: tuple[str, str | None, str], ms: tuple[str, ...],
                  rank_a: int | None, rank_b: int | None, options: dict) -> FieldComparison:
    """One :func:`plan` item's result (``options``: :func:`compare_fields`'s keywords)."""
    h, f, where = item
    if f is None or where != "both":
        return _not_compared(h, f, where, ra, rb, ms, al)
    ha = ra[al.a[h]] if rank_a is None else _rank_handle(ra, al.a[h], rank_a, "A", ms)
    hb = rb[al.b[h]] if rank_b is None else _rank_handle(rb, al.b[h], rank_b, "B", ms)
    for side in (ha, hb):
        if isinstance(side, FieldComparison):
            side.handle = h
            return side
    res = compare_fields(ha, hb, f, handle_id=h, metrics=ms, pair_ranks=rank_a is None and rank_b is None, **options)
    notes = [n for n in (damage_note(ra[al.a[h]], "A"), damage_note(rb[al.b[h]], "B")) if n]
    if notes:
        res.message = "; ".join(([res.message] if res.message else []) + notes)
    return res


def _records(handle: Handle, fld: str) -> int:
    try:
        return len(handle[fld])
    except Exception:  # noqa: BLE001 - a field that cannot be opened: compare_fields reports it
        return 0


def count_pairs(run_a: RunLike, run_b: RunLike, *, handles: str | Iterable[str] | None = None,
                fields: str | Iterable[str] | None = None, tracking_uri: str | None = None,
                rename: Mapping[str, str] | None = None, alignment: Alignment | None = None) -> int:
    """Upper bound of record pairs a comparison reads (for progress bars); cheap (indexes only)."""
    ra, rb = _open(run_a, tracking_uri), _open(run_b, tracking_uri)
    al = alignment or align_handles(ra, rb, rename)
    total = 0
    for h, f, where in plan(ra, rb, handles=handles, fields=fields, alignment=al):
        if where == "both" and f is not None:
            total += min(_records(ra[al.a[h]], f), _records(rb[al.b[h]], f))
    return total


def compare_runs(
    run_a: RunLike,
    run_b: RunLike,
    *,
    handles: str | Iterable[str] | None = None,
    fields: str | Iterable[str] | None = None,
    metrics: Iterable[str] | str | None = None,
    tracking_uri: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
    rank_a: int | None = None,
    rank_b: int | None = None,
    rename: Mapping[str, str] | None = None,
    sample_dims: int | None = None,
) -> CompareResult:
    """Compare two runs handle by handle, field by field, on their common ``(step, call)`` pairs.

    Args:
        run_a, run_b: run directories, ``runs:/<id>`` URIs, or opened runs (``open_run``).
        handles: glob pattern(s) on handle ids (``"grads[*]"``, ``"*fc1*"``): ``*`` matches any
            characters, ``?`` one, brackets are literal. Default: every handle of either run.
        fields: glob pattern(s) on field names (``"grad_out.*"``). Default: every field.
        metrics: subset of :data:`ALL_METRICS` (default: :data:`METRICS`, the element-wise
            three). ``"cka"`` and ``"procrustes"`` compare each record pair as a samples x
            features matrix (:mod:`.represent`) and also give the value over all common records
            of a field (:attr:`FieldComparison.overall`).
        tracking_uri: MLflow tracking URI for ``runs:/`` sources.
        block_bytes: read-block budget per run (float64 bytes); bounds memory.
        progress: called with the number of record pairs processed after every block.
        rank_a, rank_b: compare only this rank of run A / run B (records then pair on
            ``(step, call)``, so rank 0 of A can be compared with rank 1 of B). Default: all
            ranks, paired on ``(step, call, rank)``.
        rename: ``{"OLD": "NEW"}`` name rules applied to both runs before pairing handles (a
            handle id, or a dotted module-name prefix; ``"NEW"`` empty drops it). Without it, when
            no handle pairs as recorded, a wrapper prefix (``model.``, ``module.``,
            ``_orig_mod.``) is dropped where every module name has it (:mod:`.align`);
            :attr:`CompareResult.alignment` says what was done.
        sample_dims: for ``cka``/``procrustes``: the number of leading record axes that hold
            samples (default: all but the last, so ``(batch, seq, d)`` has ``batch*seq`` samples).

    Returns:
        A :class:`CompareResult`; problems are results with a non-``"ok"`` status.

    Raises:
        InvalidArgumentError: unknown metric, ``handles``/``fields`` matching nothing, a bad
            ``rename`` rule or ``sample_dims``.
    """
    ms = check_metrics(metrics)
    ra, rb = _open(run_a, tracking_uri), _open(run_b, tracking_uri)
    al = align_handles(ra, rb, rename)
    results = list(
        iter_compare(ra, rb, handles=handles, fields=fields, metrics=ms, block_bytes=block_bytes, progress=progress,
                     rank_a=rank_a, rank_b=rank_b, rename=rename, sample_dims=sample_dims)
    )
    return CompareResult(_run_name(ra, run_a), _run_name(rb, run_b), ms, results, al.note)
