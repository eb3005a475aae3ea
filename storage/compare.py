"""Streaming comparison of two hookline runs (numpy only; never imports torch).

For every hook handle and field present in both runs, the records are paired on their
``(step, call)`` index (a step with several calls is compared call by call) and three metrics are
computed per pair, in float64, on the flattened record tensors ``a`` (run A) and ``b`` (run B):

* ``cosine``     = ``a.b / (||a|| ||b||)``  (1.0 when both are all-zero, NaN when only one is),
* ``rel_l2``     = ``||a - b|| / ||a||``     (0.0 when both are all-zero, inf when only ``a`` is),
* ``norm_ratio`` = ``||b|| / ||a||``         (1.0 when both are all-zero, inf when only ``a`` is).

Records are read in blocks of consecutive records of at most ``block_bytes`` (float64) each, so
memory stays bounded however large the runs are: a run larger than RAM compares fine. When only
``norm_ratio`` is asked for, the per-record norms the writer stored (``Field.norms()``) are used
and no data is read.

Problems are results, not exceptions: a handle or field present in only one run, per-record
shapes that differ, or no common ``(step, call)`` pairs each yield a :class:`FieldComparison`
with a non-``"ok"`` ``status`` and a message that says what is wrong. Only a handle or field
selection that matches nothing in either run raises :class:`InvalidArgumentError`.

Example::

    from hookline.storage import compare_runs
    result = compare_runs("runs/lr0.01", "runs/lr0.1", handles="grads[*]")
    for r in result:
        print(r.handle, r.field, r.status, r.summary("cosine"))
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field as dc_field
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

from .errors import InvalidArgumentError

__all__ = [
    "METRICS",
    "STATUSES",
    "FieldComparison",
    "CompareResult",
    "compare_runs",
    "iter_compare",
    "compare_fields",
    "pair_metrics",
    "iter_records",
]

#: Metric names, in their documented order.
METRICS: tuple[str, ...] = ("cosine", "rel_l2", "norm_ratio")

#: Every value :attr:`FieldComparison.status` can take.
STATUSES: tuple[str, ...] = (
    "ok", "missing_in_a", "missing_in_b", "shape_mismatch", "no_common_steps", "unreadable",
)

#: Default read block: at most this many bytes of float64 per run per block.
BLOCK_BYTES = 16 << 20


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------
def _finite_or_none(x: float) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


@dataclass
class FieldComparison:
    """The comparison of one field of one handle across two runs.

    Attributes:
        handle: the handle id.
        field: the field name, or ``None`` when the whole handle is missing from one run.
        status: one of :data:`STATUSES`.
        message: human-readable explanation when ``status != "ok"`` (or when some pairs were
            skipped because their shapes differ), else ``None``.
        steps, calls: the compared ``(step, call)`` pairs (int64 arrays, sorted).
        ranks: the rank of each compared pair for distributed runs (records are paired on
            ``(step, call, rank)``), else ``None``.
        values: metric name -> float64 array aligned with ``steps`` (NaN for a skipped pair).
        only_a, only_b: number of records whose ``(step, call)`` exists in only one run.
        mismatched: number of common pairs skipped because their shapes differ.
        shape_a, shape_b: per-record shapes (``None`` when ragged or unknown).
        dtype_a, dtype_b: dtype names.
    """

    handle: str
    field: str | None
    status: str = "ok"
    message: str | None = None
    steps: np.ndarray = dc_field(default_factory=lambda: np.zeros(0, np.int64))
    calls: np.ndarray = dc_field(default_factory=lambda: np.zeros(0, np.int64))
    values: dict[str, np.ndarray] = dc_field(default_factory=dict)
    only_a: int = 0
    only_b: int = 0
    mismatched: int = 0
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    mismatch_positions: list[int] = dc_field(default_factory=list, repr=False)
    ranks: np.ndarray | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __len__(self) -> int:
        return int(self.steps.size)

    def summary(self, metric: str) -> dict[str, float | None]:
        """``mean``, ``min``, ``max``, ``first``, ``last`` of one metric over the compared pairs
        (NaN/inf pairs ignored; all ``None`` when there is no finite value)."""
        v = self.values.get(metric)
        keys = ("mean", "min", "max", "first", "last")
        if v is None:
            return dict.fromkeys(keys)
        fin = v[np.isfinite(v)]
        if fin.size == 0:
            return dict.fromkeys(keys)
        return {
            "mean": float(fin.mean()),
            "min": float(fin.min()),
            "max": float(fin.max()),
            "first": float(fin[0]),
            "last": float(fin[-1]),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (stable keys; non-finite numbers become ``None``)."""
        d: dict[str, Any] = {
            "handle": self.handle,
            "field": self.field,
            "status": self.status,
            "message": self.message,
            "common_steps": int(self.steps.size),
            "only_a": self.only_a,
            "only_b": self.only_b,
            "mismatched": self.mismatched,
            "shape_a": list(self.shape_a) if self.shape_a is not None else None,
            "shape_b": list(self.shape_b) if self.shape_b is not None else None,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "steps": [int(s) for s in self.steps],
            "calls": [int(c) for c in self.calls],
            "ranks": [int(r) for r in self.ranks] if self.ranks is not None else None,
        }
        for m, v in self.values.items():
            d[m] = [_finite_or_none(x) for x in v]
        d["summary"] = {m: self.summary(m) for m in self.values}
        return d


@dataclass
class CompareResult:
    """All :class:`FieldComparison` results of one :func:`compare_runs` call."""

    run_a: str
    run_b: str
    metrics: tuple[str, ...]
    results: list[FieldComparison]

    def __iter__(self) -> Iterator[FieldComparison]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def get(self, handle: str, field: str | None = None) -> FieldComparison:
        for r in self.results:
            if r.handle == handle and (field is None or r.field == field):
                return r
        raise KeyError((handle, field))

    @property
    def problems(self) -> list[FieldComparison]:
        return [r for r in self.results if r.status != "ok"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "metrics": list(self.metrics),
            "results": [r.to_dict() for r in self.results],
        }


# --------------------------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------------------------
def _as_rows(x: np.ndarray, n: int) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind == "c":
        return x.reshape(n, -1).astype(np.complex128, copy=False)
    return x.reshape(n, -1).astype(np.float64, copy=False)


def _block_metrics(a: np.ndarray, b: np.ndarray, metrics: Sequence[str]) -> dict[str, np.ndarray]:
    """Metrics for ``n`` record pairs given as ``(n, ...)`` arrays of equal shape."""
    n = a.shape[0]
    A, B = _as_rows(a, n), _as_rows(b, n)
    if A.dtype.kind == "c" or B.dtype.kind == "c":
        dot = np.real(np.sum(np.conj(A) * B, axis=1))
        na = np.sqrt(np.sum(np.abs(A) ** 2, axis=1))
        nb = np.sqrt(np.sum(np.abs(B) ** 2, axis=1))
        nd = np.sqrt(np.sum(np.abs(A - B) ** 2, axis=1))
    else:
        dot = np.einsum("ij,ij->i", A, B)
        na = np.sqrt(np.einsum("ij,ij->i", A, A))
        nb = np.sqrt(np.einsum("ij,ij->i", B, B))
        D = A - B
        nd = np.sqrt(np.einsum("ij,ij->i", D, D))
    out: dict[str, np.ndarray] = {}
    a0, b0 = na == 0, nb == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        if "cosine" in metrics:
            c = np.clip(dot / (na * nb), -1.0, 1.0)
            c = np.where(a0 & b0, 1.0, np.where(a0 | b0, np.nan, c))
            out["cosine"] = c
        if "rel_l2" in metrics:
            r = nd / na
            out["rel_l2"] = np.where(a0, np.where(nd == 0, 0.0, np.inf), r)
        if "norm_ratio" in metrics:
            q = nb / na
            out["norm_ratio"] = np.where(a0, np.where(b0, 1.0, np.inf), q)
    return out


def pair_metrics(a: np.ndarray, b: np.ndarray, metrics: Sequence[str] = METRICS) -> dict[str, float]:
    """The metrics of one record pair (two arrays of the same shape), as floats."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise InvalidArgumentError(f"cannot compare arrays of shapes {a.shape} and {b.shape}")
    out = _block_metrics(a[None], b[None], _check_metrics(metrics))
    return {m: float(v[0]) for m, v in out.items()}


def _check_metrics(metrics: Iterable[str] | str | None) -> tuple[str, ...]:
    if metrics is None:
        return METRICS
    if isinstance(metrics, str):
        metrics = [metrics]
    ms = tuple(dict.fromkeys(metrics))
    for m in ms:
        if m not in METRICS:
            raise InvalidArgumentError(f"unknown metric {m!r}; use one of {', '.join(METRICS)}")
    if not ms:
        raise InvalidArgumentError("give at least one metric: " + ", ".join(METRICS))
    return ms


# --------------------------------------------------------------------------------------------
# record access (duck-typed on the reader's Field)
# --------------------------------------------------------------------------------------------
def _field_index(handle: Any, fld: Any) -> tuple[np.ndarray, np.ndarray]:
    steps = getattr(fld, "steps", None)
    calls = getattr(fld, "calls", None)
    if steps is None:
        steps = handle.steps
    if calls is None:
        calls = handle.calls if len(handle.calls) == len(steps) else np.zeros(len(steps), np.int64)
    return np.asarray(steps, np.int64), np.asarray(calls, np.int64)


def _field_ranks(handle: Any, fld: Any, n: int) -> np.ndarray:
    """Rank of each record of a field (-1 when not distributed or unknown)."""
    ranks = getattr(handle, "ranks", None)
    recs = getattr(fld, "records", None)
    try:
        if ranks is not None and recs is not None:
            out = np.asarray(ranks, np.int64)[np.asarray(recs, np.int64)]
            if len(out) == n:
                return out
    except Exception:  # noqa: BLE001 - a reader without rank support
        pass
    return np.full(n, -1, np.int64)


def _shape(fld: Any) -> tuple[int, ...] | None:
    s = getattr(fld, "shape", None)
    return tuple(int(x) for x in s) if s is not None else None


def _dtype_name(fld: Any) -> str | None:
    name = getattr(fld, "dtype_name", None)  # logical dtype, e.g. bfloat16 (read as float32)
    if isinstance(name, str) and name:
        return name
    d = getattr(fld, "dtype", None)
    if d is None:
        return None
    return getattr(d, "name", None) or str(d)


def _elems(shape: tuple[int, ...] | None) -> int:
    return int(np.prod(shape)) if shape is not None else 0


def _contiguous_runs(ia: np.ndarray, ib: np.ndarray | None, max_n: int) -> Iterator[tuple[int, int]]:
    """Split positions ``0..len(ia)`` into ``[s, e)`` runs where ``ia`` (and ``ib``) step by one."""
    n = len(ia)
    if n == 0:
        return
    brk = np.diff(ia) != 1
    if ib is not None:
        brk |= np.diff(ib) != 1
    starts = np.concatenate([[0], np.nonzero(brk)[0] + 1, [n]])
    for s, e in zip(starts[:-1], starts[1:]):
        s, e = int(s), int(e)
        while s < e:
            yield s, min(e, s + max_n)
            s += max_n


def _read_block(fld: Any, lo: int, hi: int) -> Any:
    if hi - lo == 1:
        return np.asarray(fld[lo])[None]
    return fld[lo:hi]


def iter_records(
    fld: Any, indices: Sequence[int] | np.ndarray | None = None, *, block_bytes: int = BLOCK_BYTES
) -> Iterator[tuple[int, np.ndarray]]:
    """Yield ``(position, record)`` for the given record indices of a field (all by default),
    reading blocks of consecutive records of at most ``block_bytes`` at a time."""
    idx = np.arange(len(fld)) if indices is None else np.asarray(indices, np.int64)
    shape = _shape(fld)
    if shape is None:
        for pos, i in enumerate(idx):
            yield pos, np.asarray(fld[int(i)])
        return
    max_n = max(1, block_bytes // max(1, 8 * _elems(shape)))
    for s, e in _contiguous_runs(idx, None, max_n):
        block = _read_block(fld, int(idx[s]), int(idx[e - 1]) + 1)
        for k in range(e - s):
            yield s + k, np.asarray(block[k])


# --------------------------------------------------------------------------------------------
# comparison
# --------------------------------------------------------------------------------------------
def _pairs(sa: np.ndarray, ca: np.ndarray, sb: np.ndarray, cb: np.ndarray,
           ra: np.ndarray | None = None, rb: np.ndarray | None = None):
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


def compare_fields(
    handle_a: Any,
    handle_b: Any,
    field: str,
    *,
    handle_id: str | None = None,
    metrics: Iterable[str] | str | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
    pair_ranks: bool = True,
) -> FieldComparison:
    """Compare one field of two handles (reader ``Handle`` objects), streaming.

    ``progress(n)`` is called with the number of record pairs just processed. With
    ``pair_ranks=False`` records are paired on ``(step, call)`` only (used when one chosen rank
    of each run is compared, e.g. rank 0 of A against rank 1 of B).
    """
    ms = _check_metrics(metrics)
    fa, fb = handle_a[field], handle_b[field]
    hid = handle_id or str(getattr(handle_a, "id", None) or getattr(handle_a, "name", "?"))
    res = FieldComparison(
        hid, field, shape_a=_shape(fa), shape_b=_shape(fb), dtype_a=_dtype_name(fa), dtype_b=_dtype_name(fb)
    )
    sa, ca = _field_index(handle_a, fa)
    sb, cb = _field_index(handle_b, fb)
    ra = _field_ranks(handle_a, fa, len(sa)) if pair_ranks else None
    rb = _field_ranks(handle_b, fb, len(sb)) if pair_ranks else None
    steps, calls, ranks, ia, ib, res.only_a, res.only_b = _pairs(sa, ca, sb, cb, ra, rb)
    res.steps, res.calls = steps, calls
    res.ranks = ranks if (ranks >= 0).any() else None
    res.values = {m: np.full(len(steps), np.nan) for m in ms}
    if len(steps) == 0:
        res.status = "no_common_steps"
        ra = f"{len(sa)} records" + (f", steps {sa.min()}..{sa.max()}" if len(sa) else "")
        rb = f"{len(sb)} records" + (f", steps {sb.min()}..{sb.max()}" if len(sb) else "")
        res.message = f"no common (step, call) records: run A has {ra}, run B has {rb}"
        return res
    if res.shape_a is not None and res.shape_b is not None:
        if res.shape_a != res.shape_b:
            res.status = "shape_mismatch"
            res.mismatched = len(steps)  # every common pair skipped: its shapes differ
            res.mismatch_positions = list(range(len(steps)))
            res.message = f"record shapes differ: {list(res.shape_a)} in run A vs {list(res.shape_b)} in run B"
            if progress:
                progress(len(steps))
            return res
        if set(ms) == {"norm_ratio"} and _stored_norms(fa) is not None and _stored_norms(fb) is not None:
            # Norms only: the writer's per-record norms, without reading the data.
            na, nb = _stored_norms(fa)[ia], _stored_norms(fb)[ib]
            with np.errstate(divide="ignore", invalid="ignore"):
                res.values["norm_ratio"] = np.where(na == 0, np.where(nb == 0, 1.0, np.inf), nb / na)
            if progress:
                progress(len(steps))
            return res
        max_n = max(1, block_bytes // max(1, 8 * _elems(res.shape_a)))
        for s, e in _contiguous_runs(ia, ib, max_n):
            blk_a = _read_block(fa, int(ia[s]), int(ia[e - 1]) + 1)
            blk_b = _read_block(fb, int(ib[s]), int(ib[e - 1]) + 1)
            if isinstance(blk_a, list) or isinstance(blk_b, list):  # reader said fixed, data ragged
                _ragged_pairs(fa, fb, ia[s:e], ib[s:e], res, s, ms)
            else:
                for m, v in _block_metrics(np.asarray(blk_a), np.asarray(blk_b), ms).items():
                    res.values[m][s:e] = v
            if progress:
                progress(e - s)
    else:
        for k in range(len(steps)):
            _ragged_pairs(fa, fb, ia[k : k + 1], ib[k : k + 1], res, k, ms)
            if progress:
                progress(1)
    if res.mismatched:
        shown = ", ".join(f"step {s} call {c}" for s, c in _mismatch_examples(res)[:3])
        if res.mismatched == len(steps):
            res.status = "shape_mismatch"
            res.message = f"record shapes differ in all {len(steps)} common records (e.g. {shown})"
        else:
            res.message = (
                f"{res.mismatched} of {len(steps)} common records skipped: shapes differ (e.g. {shown})"
            )
    return res


def _stored_norms(fld: Any) -> np.ndarray | None:
    """Per-record L2 norms stored by the writer (``Field.norms()``), or None."""
    fn = getattr(fld, "norms", None)
    if fn is None:
        return None
    try:
        v = np.asarray(fn(), np.float64)
    except Exception:  # noqa: BLE001 - not available for this field (e.g. integer data)
        return None
    return v if v.shape == (len(fld),) else None


def _ragged_pairs(fa, fb, ia, ib, res: FieldComparison, offset: int, ms) -> None:
    for k, (i, j) in enumerate(zip(ia.tolist(), ib.tolist())):
        a, b = np.asarray(fa[i]), np.asarray(fb[j])
        if a.shape != b.shape:
            res.mismatched += 1
            res.mismatch_positions.append(offset + k)
            continue
        for m, v in _block_metrics(a[None], b[None], ms).items():
            res.values[m][offset + k] = v[0]


def _mismatch_examples(res: FieldComparison) -> list[tuple[int, int]]:
    pos = res.mismatch_positions
    return [(int(res.steps[p]), int(res.calls[p])) for p in pos]


def _as_list(x: str | Iterable[str] | None) -> list[str] | None:
    if x is None:
        return None
    if isinstance(x, str):
        return [x]
    out = list(x)
    return out or None


def glob_to_regex(pattern: str) -> "re.Pattern[str]":
    """Compile a handle/field glob: ``*`` matches any run of characters, ``?`` one character;
    everything else, brackets included, is literal (handle ids read ``grads[fc1]``)."""
    parts = []
    for ch in pattern:
        parts.append(".*" if ch == "*" else "." if ch == "?" else re.escape(ch))
    return re.compile("".join(parts), re.DOTALL)


def _match(names: Sequence[str], patterns: list[str] | None) -> list[str]:
    if patterns is None:
        return list(names)
    regs = [glob_to_regex(p) for p in patterns]
    return [n for n in names if any(r.fullmatch(n) for r in regs)]


def _open(run: Any, tracking_uri: str | None) -> Any:
    if hasattr(run, "handles"):
        return run
    from .reader import open_run

    return open_run(run, tracking_uri=tracking_uri) if tracking_uri else open_run(run)


def _run_name(run: Any, given: Any) -> str:
    if isinstance(given, (str,)) or hasattr(given, "__fspath__"):
        return str(given)
    for attr in ("uri", "path", "run_dir", "root"):
        v = getattr(run, attr, None)
        if v is not None:
            return str(v)
    return repr(run)


def readable_records(handle: Any) -> tuple[int, int | None]:
    """``(readable, expected)`` records of a reader handle; ``expected`` comes from the manifest
    (``None`` when unknown). ``readable < expected`` means files are damaged or missing."""
    try:
        readable = len(handle)
    except Exception:  # noqa: BLE001
        readable = len(getattr(handle, "steps", []) or [])
    man = getattr(handle, "manifest", None)
    expected = man.get("records") if isinstance(man, dict) else None
    return int(readable), (int(expected) if isinstance(expected, (int, np.integer)) else None)


def damage_note(handle: Any, which: str = "") -> str | None:
    """A one-line note when a handle has fewer readable records than its manifest lists."""
    readable, expected = readable_records(handle)
    if expected is None or readable >= expected:
        return None
    hid = getattr(handle, "id", "?")
    where = f" in run {which}" if which else ""
    return (f"only {readable} of the {expected} records of {hid!r}{where} are readable "
            f"(damaged or missing file; run `hookline verify` on the run directory)")


def plan(
    run_a: Any, run_b: Any, *, handles: str | Iterable[str] | None = None, fields: str | Iterable[str] | None = None
) -> list[tuple[str, str | None, str]]:
    """The ``(handle, field, where)`` items a comparison will produce, ``where`` being
    ``"both"``, ``"a"`` or ``"b"``. Raises :class:`InvalidArgumentError` when ``handles`` or
    ``fields`` match nothing in either run."""
    hpat, fpat = _as_list(handles), _as_list(fields)
    ha, hb = list(run_a.handles), list(run_b.handles)
    names = ha + [h for h in hb if h not in set(ha)]
    selected = _match(names, hpat)
    if not selected:
        avail = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        raise InvalidArgumentError(
            f"handle pattern {', '.join(map(repr, hpat or []))} matches no handle in either run; "
            f"available: {avail or '(none)'}"
        )
    items: list[tuple[str, str | None, str]] = []
    sa, sb = set(ha), set(hb)
    for h in selected:
        if h not in sb:
            items.append((h, None, "a"))
            continue
        if h not in sa:
            items.append((h, None, "b"))
            continue
        broken = [w for w, r in (("A", run_a), ("B", run_b)) if readable_records(r[h])[0] == 0
                  and (readable_records(r[h])[1] or 0) > 0]
        if broken:
            items.append((h, None, "unreadable:" + ",".join(broken)))
            continue
        fa, fb = list(run_a[h].fields), list(run_b[h].fields)
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


def _records(handle: Any, fld: str) -> int:
    try:
        return len(handle[fld])
    except Exception:
        return 0


def iter_compare(
    run_a: Any,
    run_b: Any,
    *,
    handles: str | Iterable[str] | None = None,
    fields: str | Iterable[str] | None = None,
    metrics: Iterable[str] | str | None = None,
    tracking_uri: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
    rank_a: int | None = None,
    rank_b: int | None = None,
) -> Iterator[FieldComparison]:
    """Like :func:`compare_runs` but yields one :class:`FieldComparison` at a time."""
    ms = _check_metrics(metrics)
    ra, rb = _open(run_a, tracking_uri), _open(run_b, tracking_uri)
    for h, f, where in plan(ra, rb, handles=handles, fields=fields):
        if where.startswith("unreadable:"):
            notes = [damage_note(r[h], w) for w, r in (("A", ra), ("B", rb))]
            yield FieldComparison(h, None, status="unreadable", values={m: np.zeros(0) for m in ms},
                                  message="; ".join(n for n in notes if n))
            continue
        if where == "empty":
            yield FieldComparison(h, None, status="no_records", values={m: np.zeros(0) for m in ms},
                                  message=f"handle {h!r} has no records in either run")
            continue
        if f is None or where != "both":  # a handle (f None) or a field present in one run only
            missing = "missing_in_b" if where == "a" else "missing_in_a"
            other = "B" if where == "a" else "A"
            what = f"handle {h!r}" if f is None else f"field {f!r} of handle {h!r}"
            yield FieldComparison(h, f, status=missing, values={m: np.zeros(0) for m in ms},
                                  message=f"{what} is not in run {other}")
            continue
        ha = ra[h] if rank_a is None else _rank_handle(ra, h, rank_a, "A", ms)
        hb = rb[h] if rank_b is None else _rank_handle(rb, h, rank_b, "B", ms)
        if isinstance(ha, FieldComparison) or isinstance(hb, FieldComparison):
            yield ha if isinstance(ha, FieldComparison) else hb  # type: ignore[misc]
            continue
        res = compare_fields(ha, hb, f, handle_id=h, metrics=ms, block_bytes=block_bytes, progress=progress,
                             pair_ranks=rank_a is None and rank_b is None)
        notes = [n for n in (damage_note(ra[h], "A"), damage_note(rb[h], "B")) if n]
        if notes:
            res.message = "; ".join(([res.message] if res.message else []) + notes)
        yield res


def _rank_handle(run: Any, h: str, rank: int, which: str, ms: tuple[str, ...]) -> Any:
    """One rank of a handle, or a ``missing_in_<which>`` result when that rank has no data."""
    from .errors import UnknownNameError

    try:
        return run.handle(h, rank=rank)
    except UnknownNameError as e:
        return FieldComparison(h, None, status=f"missing_in_{which.lower()}", values={m: np.zeros(0) for m in ms},
                               message=f"run {which}: {e}")


def count_pairs(run_a: Any, run_b: Any, *, handles=None, fields=None, tracking_uri: str | None = None) -> int:
    """Upper bound of record pairs a comparison reads (for progress bars); cheap (indexes only)."""
    ra, rb = _open(run_a, tracking_uri), _open(run_b, tracking_uri)
    total = 0
    for h, f, where in plan(ra, rb, handles=handles, fields=fields):
        if where == "both" and f is not None:
            total += min(_records(ra[h], f), _records(rb[h], f))
    return total


def compare_runs(
    run_a: Any,
    run_b: Any,
    *,
    handles: str | Iterable[str] | None = None,
    fields: str | Iterable[str] | None = None,
    metrics: Iterable[str] | str | None = None,
    tracking_uri: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    progress: Callable[[int], None] | None = None,
    rank_a: int | None = None,
    rank_b: int | None = None,
) -> CompareResult:
    """Compare two runs handle by handle, field by field, on their common ``(step, call)`` pairs.

    Args:
        run_a, run_b: run directories, ``runs:/<id>`` URIs, or opened runs (``open_run``).
        handles: glob pattern(s) on handle ids (``"grads[*]"``, ``"*fc1*"``): ``*`` matches any
            characters, ``?`` one, brackets are literal. Default: every handle of either run.
        fields: glob pattern(s) on field names (``"grad_out.*"``). Default: every field.
        metrics: subset of :data:`METRICS` (default all).
        tracking_uri: MLflow tracking URI for ``runs:/`` sources.
        block_bytes: read-block budget per run (float64 bytes); bounds memory.
        progress: called with the number of record pairs processed after every block.
        rank_a, rank_b: compare only this rank of run A / run B (records then pair on
            ``(step, call)``, so rank 0 of A can be compared with rank 1 of B). Default: all
            ranks, paired on ``(step, call, rank)``.

    Returns:
        A :class:`CompareResult`; problems are results with a non-``"ok"`` status.

    Raises:
        InvalidArgumentError: unknown metric, or ``handles``/``fields`` matching nothing.
    """
    ms = _check_metrics(metrics)
    ra, rb = _open(run_a, tracking_uri), _open(run_b, tracking_uri)
    results = list(
        iter_compare(ra, rb, handles=handles, fields=fields, metrics=ms, block_bytes=block_bytes, progress=progress,
                     rank_a=rank_a, rank_b=rank_b)
    )
    return CompareResult(_run_name(ra, run_a), _run_name(rb, run_b), ms, results)
