"""L2 norms of records, as the writer stores them in every part's index (``_index/<field>/norm``)."""

from __future__ import annotations

import math

import numpy as np

from .. import dtypes

__all__ = ["l2", "row_norms"]


def row_norms(block: np.ndarray, dn: str) -> list[float]:
    """L2 norm of every record of a ``(k, ...)`` block (batched BLAS; float64 retry on
    overflow/underflow)."""
    k = block.shape[0]
    if block.size == 0:
        return [0.0] * k
    x = _real_floats(block, dn, (k, -1))
    s = (x[:, None, :] @ x[:, :, None]).reshape(k).astype(np.float64)
    bad = ~np.isfinite(s) | (s < 1e-30)
    if bad.any():
        x64 = x[bad].astype(np.float64)
        s[bad] = (x64[:, None, :] @ x64[:, :, None]).reshape(-1)
    return np.sqrt(s).tolist()


def l2(arr: np.ndarray, dn: str) -> float:
    """L2 norm of one record, accumulated in float32 (BLAS) with a float64 retry on overflow/underflow."""
    if arr.size == 0:
        return 0.0
    x = _real_floats(arr, dn, (-1,))
    s = float(np.dot(x, x))
    if not math.isfinite(s) or s < 1e-30:
        x64 = x.astype(np.float64)
        s = float(np.dot(x64, x64))
    return math.sqrt(s) if s == s else float("nan")


def _real_floats(a: np.ndarray, dn: str, shape: tuple[int, ...]) -> np.ndarray:
    """Stored data ``a`` of logical dtype ``dn``, reshaped, as real floats whose sum of squares
    is the norm (a complex value is its two parts); no copy for float and complex storage."""
    if dn in ("float32", "float64"):
        return a.reshape(shape)
    if dn in ("complex64", "complex128"):
        return a.reshape(shape).view(np.float32 if dn == "complex64" else np.float64)
    x = dtypes.to_float(a, dn).reshape(shape)
    return x.view(np.float32) if x.dtype.kind == "c" else x
