"""Representation metrics of feature matrices: linear CKA and the angular Procrustes distance,
per record pair and pooled over a field (streaming co-moments).

A record of shape ``(d0, ..., dk)`` is read as a matrix of ``n = d0 * ... * d(s-1)`` samples
(rows) by ``d = ds * ... * dk`` features, ``s = sample_dims`` (default ``k``: every axis but the
last holds samples, so the tokens of a ``(batch, seq, d)`` output are samples). Columns are
centred; everything is float64; complex features count as their real and imaginary parts.

* ``cka`` (linear CKA, Kornblith et al. 2019): ``||X^T Y||_F^2 / (||X^T X||_F ||Y^T Y||_F)``,
  in ``[0, 1]``; 1 when ``Y`` is an orthogonal transform of ``X`` times a scale.
* ``procrustes`` (angular Procrustes distance, Williams et al. 2021, netrep's ``"angular"``):
  ``arccos(||X^T Y||_* / (||X||_F ||Y||_F))`` in radians, in ``[0, pi/2]``; 0 when ``Y`` is an
  orthogonal transform of ``X`` times a scale. (The Euclidean form on unit-norm matrices,
  ``min_Q ||X/||X|| - Y Q/||Y|| ||_F``, is ``2 sin(theta/2)``.) Near 0 the arccos amplifies
  rounding: values below ~1e-7 are zero.

One pair is computed in feature space (``p x p``, ``q x q``, ``p x q`` co-moments: memory
O(d^2)) when it has more samples than features, in sample space (``n x n`` Gram matrices)
otherwise: never an ``n x n`` matrix when ``n > d``. The value over all records of a field
(:class:`PairStream`) merges each pair's centred co-moments (Chan et al.'s pairwise update),
so it equals the metric of all records stacked without holding them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["REPRESENTATION_METRICS", "POOL_BYTES", "sample_split", "as_samples", "centre", "Moments",
           "PairStream", "representation_metrics", "check_sample_dims"]

#: The metrics of this module (per record pair, and pooled over a field).
REPRESENTATION_METRICS: tuple[str, ...] = ("cka", "procrustes")
#: Largest pooled co-moment matrices (bytes of float64, all three together) kept per field.
POOL_BYTES = 256 << 20


def check_sample_dims(sample_dims: int | None) -> int | None:
    """``sample_dims`` as given, checked.

    Raises:
        InvalidArgumentError: not None and not an int >= 0.
    """
    if sample_dims is None:
        return None
    if isinstance(sample_dims, bool) or not isinstance(sample_dims, (int, np.integer)) or sample_dims < 0:
        raise InvalidArgumentError(f"sample_dims must be an int >= 0 (leading axes that hold samples), "
                                   f"got {sample_dims!r}")
    return int(sample_dims)


def sample_split(shape: Sequence[int], sample_dims: int | None) -> tuple[tuple[int, ...], int]:
    """``(sample shape, feature count)`` of a record shape (complex counted as stored).

    Raises:
        InvalidArgumentError: ``sample_dims`` exceeds the record's number of axes.
    """
    shape = tuple(int(s) for s in shape)
    k = max(len(shape) - 1, 0) if sample_dims is None else sample_dims
    if k > len(shape):
        raise InvalidArgumentError(f"sample_dims={sample_dims} exceeds the {len(shape)} axes of records shaped "
                                   f"{list(shape)}; use 0..{len(shape)}")
    return shape[:k], int(np.prod(shape[k:], dtype=np.int64))


def as_samples(x: np.ndarray, sample_dims: int | None, out: np.ndarray | None = None) -> np.ndarray:
    """One record as a float64 ``(samples, features)`` matrix of its own (complex: real and
    imaginary parts), written into the float64 buffer ``out`` when it is given and large enough."""
    x = np.asarray(x)
    rows, _ = sample_split(x.shape, sample_dims)
    n = int(np.prod(rows, dtype=np.int64))
    if x.dtype.kind == "c":
        x = np.ascontiguousarray(x, np.complex128).view(np.float64)  # last axis doubled: (re, im)
    src = x.reshape(n, -1)
    if out is None or out.size < src.size:
        return src.astype(np.float64, copy=True)
    dst = out[: src.size].reshape(src.shape)
    np.copyto(dst, src, casting="unsafe")
    return dst


def centre(x: np.ndarray) -> np.ndarray:
    """Subtract the column means of ``x`` in place; returns the means."""
    mean = x.mean(axis=0)
    x -= mean
    return mean


def _cka(hsic: float, norm_x: float, norm_y: float) -> float:
    """``hsic / (norm_x norm_y)``; NaN when a side has no variance."""
    denom = norm_x * norm_y
    return float(hsic / denom) if denom > 0 else float("nan")


def _angle(nuc: float, sq_x: float, sq_y: float) -> float:
    """``arccos(nuc / sqrt(sq_x sq_y))`` (clipped to 1: rounding); NaN when a side has no variance."""
    scale = np.sqrt(sq_x * sq_y)
    return float(np.arccos(min(1.0, nuc / scale))) if scale > 0 else float("nan")


def _from_moments(cxx: np.ndarray, cyy: np.ndarray, cxy: np.ndarray, metrics: Sequence[str]) -> dict[str, float]:
    """The metrics from centred co-moment sums ``X^T X``, ``Y^T Y``, ``X^T Y``."""
    out: dict[str, float] = {}
    if "cka" in metrics:
        out["cka"] = _cka(np.sum(cxy * cxy), np.linalg.norm(cxx), np.linalg.norm(cyy))
    if "procrustes" in metrics:
        nuc = np.linalg.svd(cxy, compute_uv=False).sum() if cxy.size else 0.0
        out["procrustes"] = _angle(nuc, np.trace(cxx), np.trace(cyy))
    return out


def _sample_space(xc: np.ndarray, yc: np.ndarray, metrics: Sequence[str]) -> dict[str, float]:
    """The metrics of centred ``(n, p)``, ``(n, q)`` with few samples: ``n x n`` Gram matrices."""
    out: dict[str, float] = {}
    if "cka" in metrics:
        k, l = xc @ xc.T, yc @ yc.T
        out["cka"] = _cka(np.sum(k * l), np.linalg.norm(k), np.linalg.norm(l))  # tr(KL) = ||X^T Y||_F^2
    if "procrustes" in metrics:
        # X^T = Q R (Q orthonormal columns): the singular values of X^T Y are those of R Y
        r = np.linalg.qr(xc.T, mode="r")
        nuc = np.linalg.svd(r @ yc, compute_uv=False).sum()
        out["procrustes"] = _angle(nuc, np.sum(xc * xc), np.sum(yc * yc))
    return out


@dataclass
class Moments:
    """Centred co-moment sums of paired samples: ``n``, column means, ``X^T X``, ``Y^T Y``, ``X^T Y``."""

    n: int
    mx: np.ndarray
    my: np.ndarray
    cxx: np.ndarray
    cyy: np.ndarray
    cxy: np.ndarray

    @classmethod
    def of(cls, xc: np.ndarray, yc: np.ndarray, mx: np.ndarray, my: np.ndarray) -> Moments:
        """The moments of centred float64 ``(n, p)``, ``(n, q)`` sample matrices and their means."""
        return cls(len(xc), mx, my, xc.T @ xc, yc.T @ yc, xc.T @ yc)

    def merge(self, o: Moments) -> None:
        """Add ``o``'s samples (Chan et al.'s update: stable however far the means lie apart)."""
        n = self.n + o.n
        dx, dy = o.mx - self.mx, o.my - self.my
        f = self.n * o.n / n
        self.cxx += o.cxx + f * np.outer(dx, dx)
        self.cyy += o.cyy + f * np.outer(dy, dy)
        self.cxy += o.cxy + f * np.outer(dx, dy)
        self.mx = self.mx + dx * (o.n / n)
        self.my = self.my + dy * (o.n / n)
        self.n = n

    def metrics(self, metrics: Sequence[str]) -> dict[str, float]:
        """The metrics of every sample added (NaN with fewer than 2 samples or constant features)."""
        if self.n < 2:
            return {m: float("nan") for m in metrics}
        return _from_moments(self.cxx, self.cyy, self.cxy, metrics)


def representation_metrics(x: np.ndarray, y: np.ndarray, metrics: Sequence[str], *,
                           moments: bool = False) -> tuple[dict[str, float], Moments | None]:
    """The metrics of one pair of float64 sample matrices (same number of rows; centred here, in
    place), and its :class:`Moments` when ``moments`` (or when feature space computed them anyway)."""
    n, p, q = x.shape[0], x.shape[1], y.shape[1]
    mx, my = centre(x), centre(y)
    if n > max(p, q):
        mom = Moments.of(x, y, mx, my)
        return mom.metrics(metrics), mom
    values = {m: float("nan") for m in metrics} if n < 2 else _sample_space(x, y, metrics)
    return values, (Moments.of(x, y, mx, my) if moments else None)


class PairStream:
    """Per-record metrics of a field's record pairs, and the metrics over all of them stacked
    (their moments merged as they stream by; nothing but the pooled matrices is kept).

    Args:
        metrics: the representation metrics wanted.
        sample_dims: leading axes that hold samples (None: all but the last).
        max_bytes: the pooled matrices' budget; wider features leave the pooled value NaN and
            :attr:`note` says why.
    """

    def __init__(self, metrics: Sequence[str], sample_dims: int | None = None, max_bytes: int = POOL_BYTES) -> None:
        self.metrics = tuple(metrics)
        self.sample_dims = sample_dims
        self.max_bytes = max_bytes
        self.total: Moments | None = None
        self.widths: tuple[int, int] | None = None
        self.buffers = [np.empty(0), np.empty(0)]  # reused record matrices: no fresh pages per record
        #: Why the value over all records is NaN, when it is for a reason other than no records.
        self.note: str | None = None

    def _poolable(self, p: int, q: int) -> bool:
        if self.note is not None:
            return False
        if self.widths is None:
            self.widths = (p, q)
            need = 8 * (p * p + q * q + p * q)
            if need > self.max_bytes:
                self.note = (f"the value over all records is not computed: {p} x {q} features need "
                             f"{need / 2**20:.0f} MiB of co-moments (limit {self.max_bytes / 2**20:.0f} MiB)")
        elif self.widths != (p, q):
            self.note = (f"the value over all records is not computed: feature widths change across "
                         f"records ({self.widths[0]} x {self.widths[1]}, then {p} x {q})")
        return self.note is None

    def _matrix(self, k: int, record: np.ndarray) -> np.ndarray:
        """Side ``k``'s record as a float64 samples x features matrix, in its reused buffer."""
        record = np.asarray(record)
        need = int(np.prod(record.shape, dtype=np.int64)) * (2 if record.dtype.kind == "c" else 1)
        if self.buffers[k].size < need:
            self.buffers[k] = np.empty(need)
        return as_samples(record, self.sample_dims, self.buffers[k])

    def pair(self, a: np.ndarray, b: np.ndarray) -> dict[str, float]:
        """The metrics of one record pair (records of equal sample shape); pools its moments."""
        x, y = (self._matrix(k, r) for k, r in enumerate((a, b)))
        pool = self._poolable(x.shape[1], y.shape[1])
        values, mom = representation_metrics(x, y, self.metrics, moments=pool)
        if pool and mom is not None:
            if self.total is None:
                self.total = mom
            else:
                self.total.merge(mom)
        return values

    def overall(self) -> dict[str, float]:
        """Metric -> value over every record pair seen, stacked (NaN when none, or not pooled)."""
        if self.total is None or self.note is not None:
            return {m: float("nan") for m in self.metrics}
        return self.total.metrics(self.metrics)
