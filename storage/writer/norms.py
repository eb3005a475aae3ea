"""L2 norms of records, as the writer stores them in every part's index (``_index/<field>/norm``).

The pass works through a record in slices of at most :data:`SLICE` elements, so its scratch
memory (a converted slice, and a float64 copy of it when float32 squares overflow or
underflow) stays a few MiB whatever the size and contents of the records.
"""

from __future__ import annotations

import numpy as np

from .. import dtypes

__all__ = ["SLICE", "l2", "row_norms"]

#: Most elements converted or squared at once (a float64 copy of them is 2 MiB).
SLICE = 1 << 18
#: Below this, a float32 sum of squares may have lost its digits to underflow: recomputed in float64.
_TINY = 1e-30


def row_norms(block: np.ndarray, dn: str) -> list[float]:
    """L2 norm of every record of a ``(k, ...)`` block: float32 BLAS per slice of up to
    :data:`SLICE` elements (many small records per call), a slice whose float32 sum overflows or
    underflows recomputed in float64; slices add up in float64."""
    k = block.shape[0]
    if block.size == 0:
        return [0.0] * k
    flat = block.reshape(k, -1)
    n = flat.shape[1]
    out = np.zeros(k, np.float64)
    if n <= SLICE:
        rows = max(1, SLICE // n)
        for r0 in range(0, k, rows):
            out[r0 : r0 + rows] = _sum_squares(flat[r0 : r0 + rows], dn)
    else:
        for r in range(k):
            for c0 in range(0, n, SLICE):
                out[r] += _sum_squares(flat[r : r + 1, c0 : c0 + SLICE], dn)[0]
    return np.sqrt(out).tolist()


def l2(arr: np.ndarray, dn: str) -> float:
    """L2 norm of one record (see :func:`row_norms`)."""
    if arr.size == 0:
        return 0.0
    return row_norms(arr.reshape(1, -1), dn)[0]


def _sum_squares(rows: np.ndarray, dn: str) -> np.ndarray:
    """float64 sum of squares of each row of a 2-D slice of stored data of logical dtype ``dn``."""
    x = _real_floats(rows, dn)
    with np.errstate(over="ignore", invalid="ignore"):  # handled below: no warning in a user's log
        s = (x[:, None, :] @ x[:, :, None]).reshape(len(x)).astype(np.float64)
    bad = ~np.isfinite(s) | (s < _TINY)
    for i in np.flatnonzero(bad):  # zeros, denormals, huge values, inf/NaN: one row at a time
        x64 = x[i].astype(np.float64)
        s[i] = x64 @ x64
    return s


def _real_floats(a: np.ndarray, dn: str) -> np.ndarray:
    """2-D stored data ``a`` of logical dtype ``dn`` as real floats whose sum of squares per row
    is the norm (a complex value is its two parts); no copy for float and complex storage."""
    if dn in ("float32", "float64"):
        return a
    if dn in ("complex64", "complex128"):
        return a.view(np.float32 if dn == "complex64" else np.float64)
    x = dtypes.to_float(a, dn)
    return x.view(np.float32 if x.dtype == np.complex64 else np.float64) if x.dtype.kind == "c" else x
