"""What a comparison returns: one :class:`FieldComparison` per handle and field, in a :class:`CompareResult`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field as dc_field
from typing import Any, Iterator

import numpy as np

__all__ = ["STATUSES", "FieldComparison", "CompareResult"]

#: Every value :attr:`FieldComparison.status` can take.
STATUSES: tuple[str, ...] = (
    "ok", "missing_in_a", "missing_in_b", "shape_mismatch", "no_common_steps", "unreadable",
)


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
        mismatch_positions: positions (in ``steps``) of the pairs skipped for their shapes.
        overall: representation metric (``cka``, ``procrustes``) -> its value over all compared
            records of the field at once (their samples stacked; NaN when it could not be had,
            :attr:`message` says why).
        handle_a, handle_b: the handle ids in run A and run B (they differ from ``handle`` when
            names were aligned: :attr:`CompareResult.alignment`); ``None`` where absent.
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
    overall: dict[str, float] = dc_field(default_factory=dict)
    handle_a: str | None = None
    handle_b: str | None = None

    @property
    def ok(self) -> bool:
        """True when the field was compared (``status == "ok"``)."""
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
            "handle_a": self.handle_a,
            "handle_b": self.handle_b,
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
        if self.overall:
            d["overall"] = {m: _finite_or_none(v) for m, v in self.overall.items()}
        return d


@dataclass
class CompareResult:
    """All :class:`FieldComparison` results of one :func:`compare_runs` call.

    Attributes:
        alignment: how handle names were aligned across the runs (a wrapper prefix dropped,
            ``rename=`` applied), or ``None`` when they paired as recorded.
    """

    run_a: str
    run_b: str
    metrics: tuple[str, ...]
    results: list[FieldComparison]
    alignment: str | None = None

    def __iter__(self) -> Iterator[FieldComparison]:
        return iter(self.results)

    def __len__(self) -> int:
        return len(self.results)

    def get(self, handle: str, field: str | None = None) -> FieldComparison:
        """The first result of ``handle`` (and ``field``, when given).

        Raises:
            KeyError: no such result.
        """
        for r in self.results:
            if r.handle == handle and (field is None or r.field == field):
                return r
        raise KeyError((handle, field))

    def overall(self, metric: str) -> dict[tuple[str, str | None], float]:
        """``(handle, field)`` -> the value of a representation metric over all common records
        of that field (samples of every matched step stacked), for the compared fields."""
        return {(r.handle, r.field): r.overall[metric] for r in self.results if metric in r.overall}

    @property
    def problems(self) -> list[FieldComparison]:
        """The results whose status is not ``"ok"``."""
        return [r for r in self.results if r.status != "ok"]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: the runs, the metrics and every result's :meth:`FieldComparison.to_dict`."""
        return {
            "run_a": self.run_a,
            "run_b": self.run_b,
            "metrics": list(self.metrics),
            "alignment": self.alignment,
            "results": [r.to_dict() for r in self.results],
        }
