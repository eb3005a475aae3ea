"""Comparing one field of two handles, streaming: records paired on ``(step, call[, rank])``, read
in bounded blocks; element-wise metrics per block, representation metrics per record pair and
pooled over the field."""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from ..blocks import BLOCK_BYTES, contiguous_runs, read_block, records_per_block
from ..reader import Field, Handle
from ..words import plural
from .metrics import block_metrics, check_metrics
from .represent import POOL_BYTES, REPRESENTATION_METRICS, PairStream, check_sample_dims, sample_split
from .results import FieldComparison

__all__ = ["compare_fields"]


def _pairs(sa: np.ndarray, ca: np.ndarray, sb: np.ndarray, cb: np.ndarray, ra: np.ndarray | None = None,
           rb: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int, int]:
    """Common (step, call[, rank]) keys -> (steps, calls, ranks, idx_a, idx_b), sorted by step,
    call, rank; and the only-in-A / only-in-B counts."""
    ra = np.full(len(sa), -1, np.int64) if ra is None else ra
    rb = np.full(len(sb), -1, np.int64) if rb is None else rb
    pos_a: dict[tuple[int, int, int], int] = {}
    for i, key in enumerate(zip(sa.tolist(), ca.tolist(), ra.tolist())):
        pos_a.setdefault(key, i)
    pos_b: dict[tuple[int, int, int], int] = {}
    for j, key in enumerate(zip(sb.tolist(), cb.tolist(), rb.tolist())):
        pos_b.setdefault(key, j)
    common = sorted(pos_a.keys() & pos_b.keys())
    steps = np.array([k[0] for k in common], np.int64)
    calls = np.array([k[1] for k in common], np.int64)
    ranks = np.array([k[2] for k in common], np.int64)
    ia = np.array([pos_a[k] for k in common], np.int64)
    ib = np.array([pos_b[k] for k in common], np.int64)
    return steps, calls, ranks, ia, ib, len(pos_a) - len(common), len(pos_b) - len(common)


def _field_ranks(handle: Handle, fld: Field) -> np.ndarray:
    """Rank of each entry of a field (-1 when not distributed; a DTensor field's logical records
    carry their own: -1 when one mesh spans the run, see ``storage/shards.py``)."""
    own = getattr(fld, "ranks", None)
    if own is not None:
        return np.asarray(own, np.int64)
    return np.asarray(handle.ranks, np.int64)[np.asarray(fld.records, np.int64)]


def _pair_fields(res: FieldComparison, handle_a: Handle, fa: Field, handle_b: Handle, fb: Field,
                 pair_ranks: bool) -> tuple[np.ndarray, np.ndarray]:
    """Fill ``res``'s pairs (steps, calls, ranks, only_a, only_b); the paired entry indices of
    each field."""
    sa, sb = np.asarray(fa.steps, np.int64), np.asarray(fb.steps, np.int64)
    ca, cb = np.asarray(fa.calls, np.int64), np.asarray(fb.calls, np.int64)
    ra = _field_ranks(handle_a, fa) if pair_ranks else None
    rb = _field_ranks(handle_b, fb) if pair_ranks else None
    res.steps, res.calls, ranks, ia, ib, res.only_a, res.only_b = _pairs(sa, ca, sb, cb, ra, rb)
    res.ranks = ranks if (ranks >= 0).any() else None
    return ia, ib


def compare_fields(
    handle_a: Handle,
    handle_b: Handle,
    field: str,
    *,
    handle_id: str | None = None,
    metrics: Iterable[str] | str | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
    pair_ranks: bool = True,
    sample_dims: int | None = None,
    pool_bytes: int = POOL_BYTES,
) -> FieldComparison:
    """Compare one field of two handles, streaming.

    Args:
        handle_a, handle_b: the handles (of run A and run B); both have ``field``.
        field: the field name.
        handle_id: the id the result carries (default ``handle_a.id``).
        metrics: subset of :data:`ALL_METRICS` (default: :data:`METRICS`).
        block_bytes: read-block budget per field (float64 bytes); bounds memory.
        progress: called with the number of record pairs just processed.
        pair_ranks: pair records on ``(step, call, rank)``; False pairs on ``(step, call)`` only
            (one chosen rank of each run is compared, e.g. rank 0 of A against rank 1 of B).
        sample_dims: for ``cka``/``procrustes``: how many leading axes of a record hold samples
            (default: all but the last).
        pool_bytes: budget of the pooled co-moments behind :attr:`FieldComparison.overall`.

    Returns:
        The :class:`FieldComparison` (its ``status`` says what was wrong, if anything).
    """
    ms = check_metrics(metrics)
    sample_dims = check_sample_dims(sample_dims)
    fa, fb = handle_a[field], handle_b[field]
    res = FieldComparison(handle_id or handle_a.id, field, shape_a=fa.shape, shape_b=fb.shape,
                          dtype_a=fa.dtype_name, dtype_b=fb.dtype_name)
    ia, ib = _pair_fields(res, handle_a, fa, handle_b, fb, pair_ranks)
    res.values = {m: np.full(len(ia), np.nan) for m in ms}
    tick = progress or (lambda n: None)
    rep = [m for m in ms if m in REPRESENTATION_METRICS]
    stream = PairStream(rep, sample_dims, pool_bytes) if rep else None
    if len(ia) == 0:
        _no_common_steps(res, fa, fb)
    elif res.shape_a is None or res.shape_b is None:
        for k in range(len(ia)):
            _ragged_pairs(fa, fb, ia[k : k + 1], ib[k : k + 1], res, k, ms, stream)
            tick(1)
    elif not _comparable(res.shape_a, res.shape_b, ms, sample_dims):
        _shapes_differ(res)
        tick(len(ia))
    elif set(ms) == {"norm_ratio"} and (na := _stored_norms(fa)) is not None and (nb := _stored_norms(fb)) is not None:
        _norm_ratio(res, na[ia], nb[ib])  # the writer's per-record norms: no data read
        tick(len(ia))
    else:
        _block_pairs(fa, fb, ia, ib, res, ms, block_bytes, tick, stream)
    if res.status == "ok" and res.mismatched:
        _note_mismatches(res)
    if stream is not None:
        _pooled(res, stream)
    return res


def _comparable(shape_a: tuple[int, ...], shape_b: tuple[int, ...], ms: tuple[str, ...],
                sample_dims: int | None) -> bool:
    """Whether records of these shapes compare: equal shapes, or (representation metrics only)
    equal sample axes with any number of features."""
    if shape_a == shape_b:
        return True
    if any(m not in REPRESENTATION_METRICS for m in ms):
        return False
    return sample_split(shape_a, sample_dims)[0] == sample_split(shape_b, sample_dims)[0]


def _pooled(res: FieldComparison, stream: PairStream) -> None:
    """The representation metrics over all compared records (NaN unless some were compared)."""
    res.overall = stream.overall()
    if stream.note and res.status == "ok":
        res.message = "; ".join(([res.message] if res.message else []) + [stream.note])


def _no_common_steps(res: FieldComparison, fa: Field, fb: Field) -> None:
    res.status = "no_common_steps"
    sa, sb = np.asarray(fa.steps, np.int64), np.asarray(fb.steps, np.int64)
    ra = plural(len(sa), "record") + (f", steps {sa.min()}..{sa.max()}" if len(sa) else "")
    rb = plural(len(sb), "record") + (f", steps {sb.min()}..{sb.max()}" if len(sb) else "")
    res.message = f"no common (step, call) records: run A has {ra}, run B has {rb}"


def _shapes_differ(res: FieldComparison) -> None:
    """Fixed per-record shapes that differ: every common pair is skipped."""
    assert res.shape_a is not None and res.shape_b is not None
    res.status = "shape_mismatch"
    res.mismatched = len(res.steps)
    res.mismatch_positions = list(range(len(res.steps)))
    res.message = f"record shapes differ: {list(res.shape_a)} in run A vs {list(res.shape_b)} in run B"


def _stored_norms(fld: Field) -> np.ndarray | None:
    """Per-record L2 norms (``Field.norms()``), or None when they cannot be had."""
    try:
        v = np.asarray(fld.norms(), np.float64)
    except Exception:  # noqa: BLE001 - unreadable: the data path reads (and reports) instead
        return None
    return v if v.shape == (len(fld),) else None


def _norm_ratio(res: FieldComparison, na: np.ndarray, nb: np.ndarray) -> None:
    with np.errstate(divide="ignore", invalid="ignore"):
        res.values["norm_ratio"] = np.where(na == 0, np.where(nb == 0, 1.0, np.inf), nb / na)


def _block_pairs(fa: Field, fb: Field, ia: np.ndarray, ib: np.ndarray, res: FieldComparison,
                 ms: tuple[str, ...], block_bytes: int, tick: Callable[[int], None],
                 stream: PairStream | None) -> None:
    """Fixed shapes: the metrics of runs of consecutive pairs, one block of each field at a time."""
    assert res.shape_a is not None and res.shape_b is not None
    wider = max(res.shape_a, res.shape_b, key=lambda s: int(np.prod(s)))
    elementwise = [m for m in ms if m not in REPRESENTATION_METRICS]
    for s, e in contiguous_runs(ia, ib, records_per_block(wider, block_bytes)):
        blk_a = read_block(fa, int(ia[s]), int(ia[e - 1]) + 1)
        blk_b = read_block(fb, int(ib[s]), int(ib[e - 1]) + 1)
        if elementwise:
            for m, v in block_metrics(blk_a, blk_b, elementwise).items():
                res.values[m][s:e] = v
        if stream is not None:
            for k in range(e - s):
                for m, v in stream.pair(blk_a[k], blk_b[k]).items():
                    res.values[m][s + k] = v
        tick(e - s)


def _ragged_pairs(fa: Field, fb: Field, ia: np.ndarray, ib: np.ndarray, res: FieldComparison, offset: int,
                  ms: tuple[str, ...], stream: PairStream | None) -> None:
    """Pairs read one record at a time; a pair whose shapes do not compare is skipped and counted."""
    elementwise = [m for m in ms if m not in REPRESENTATION_METRICS]
    for k, (i, j) in enumerate(zip(ia.tolist(), ib.tolist())):
        a, b = np.asarray(fa[i]), np.asarray(fb[j])
        if not _comparable(a.shape, b.shape, ms, stream.sample_dims if stream else None):
            res.mismatched += 1
            res.mismatch_positions.append(offset + k)
            continue
        if elementwise:
            for m, v in block_metrics(a[None], b[None], elementwise).items():
                res.values[m][offset + k] = v[0]
        if stream is not None:
            for m, v in stream.pair(a, b).items():
                res.values[m][offset + k] = v


def _note_mismatches(res: FieldComparison) -> None:
    """Say which pairs were skipped for their shapes (all of them: a ``shape_mismatch``)."""
    n = len(res.steps)
    shown = ", ".join(f"step {int(res.steps[p])} call {int(res.calls[p])}" for p in res.mismatch_positions[:3])
    if res.mismatched == n:
        res.status = "shape_mismatch"
        res.message = f"record shapes differ in all {n} common records (e.g. {shown})"
    else:
        res.message = f"{res.mismatched} of {n} common records skipped: shapes differ (e.g. {shown})"
