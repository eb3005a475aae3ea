"""Metrics of record pairs: cosine, rel_l2 and norm_ratio, in float64 (see :mod:`hookline.storage.compare`),
and the names of every metric a comparison accepts (the representation metrics live in :mod:`.represent`)."""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from ..errors import InvalidArgumentError
from .represent import REPRESENTATION_METRICS

__all__ = ["METRICS", "ALL_METRICS", "block_metrics", "pair_metrics", "check_metrics"]

#: Element-wise metric names, in their documented order: the default of a comparison.
METRICS: tuple[str, ...] = ("cosine", "rel_l2", "norm_ratio")
#: Every metric a comparison accepts: :data:`METRICS`, then ``cka`` and ``procrustes``.
ALL_METRICS: tuple[str, ...] = METRICS + REPRESENTATION_METRICS


def _as_rows(x: np.ndarray, n: int) -> np.ndarray:
    x = np.asarray(x)
    if x.dtype.kind == "c":
        return x.reshape(n, -1).astype(np.complex128, copy=False)
    return x.reshape(n, -1).astype(np.float64, copy=False)


def block_metrics(a: np.ndarray, b: np.ndarray, metrics: Sequence[str]) -> dict[str, np.ndarray]:
    """Metrics for ``n`` record pairs given as ``(n, ...)`` arrays of equal shape: metric name ->
    float64 array of ``n`` (complex records compare as complex vectors)."""
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
    """The element-wise metrics of one record pair (two arrays of the same shape), as floats."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        raise InvalidArgumentError(f"cannot compare arrays of shapes {a.shape} and {b.shape}")
    ms = check_metrics(metrics)
    rep = [m for m in ms if m in REPRESENTATION_METRICS]
    if rep:
        raise InvalidArgumentError(f"pair_metrics computes {', '.join(METRICS)}; for {', '.join(map(repr, rep))} "
                                   f"use compare_runs(..., metrics=[...])")
    out = block_metrics(a[None], b[None], ms)
    return {m: float(v[0]) for m, v in out.items()}


def check_metrics(metrics: Iterable[str] | str | None) -> tuple[str, ...]:
    """The metrics asked for, deduplicated, in the order given (None: all of :data:`METRICS`;
    :data:`ALL_METRICS` are accepted).

    Raises:
        InvalidArgumentError: an unknown metric, or none.
    """
    if metrics is None:
        return METRICS
    if isinstance(metrics, str):
        metrics = [metrics]
    ms = tuple(dict.fromkeys(metrics))
    for m in ms:
        if m not in ALL_METRICS:
            raise InvalidArgumentError(f"unknown metric {m!r}; use one of {', '.join(ALL_METRICS)}")
    if not ms:
        raise InvalidArgumentError("give at least one metric: " + ", ".join(ALL_METRICS))
    return ms
