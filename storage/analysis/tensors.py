"""Whole fields as torch tensors: :meth:`hookline.storage.Field.to_torch` without an index or
with a slice (torch only: no extra needed)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import dtypes
from ..errors import InvalidArgumentError
from .lazy import stored_range

__all__ = ["field_tensors"]


def field_tensors(field: Any, index: slice | None) -> Any:
    """Entries ``index`` of ``field`` (None: all) as tensors of the exact recorded dtype: one
    tensor stacked along a new axis 0, or a list of tensors when the field is ragged.

    Raises:
        InvalidArgumentError: ``index`` is neither None, an int nor a slice.
    """
    if index is None:
        index = slice(None)
    if not isinstance(index, slice):
        raise InvalidArgumentError(f"to_torch() takes a record index, a slice or nothing, got {index!r}; "
                                   f"e.g. field.to_torch(slice(0, 10))")
    rows = range(*index.indices(len(field)))
    if field.shape is None:
        return [field.to_torch(i) for i in rows]
    if not rows:
        return dtypes.to_torch(np.zeros((0, *field.shape), dtypes.info(field.dtype_name).storage), field.dtype_name)
    lo, hi = min(rows[0], rows[-1]), max(rows[0], rows[-1]) + 1
    pieces = field.pieces
    bounds = [0, *np.cumsum([pf.count for pf in pieces]).tolist()]
    blocks = stored_range(pieces.__getitem__, bounds, lo, hi)
    stored = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
    if rows.step != 1:
        stored = stored[np.asarray(rows) - lo]
    # (a fresh array read for this call: the tensor takes it over, no second copy)
    return dtypes.to_torch(stored, field.dtype_name, copy=False)
