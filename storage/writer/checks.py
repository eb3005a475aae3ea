"""Checking what callers hand a RunWriter, on their own thread: names, steps, record fields, metadata.

A refused record raises here, in the caller's ``write()``, and leaves no trace in the writer.
"""

from __future__ import annotations

import json
import math
from typing import Any, Mapping, Union

import numpy as np

from .. import dtypes
from ..errors import HookTypeError, InvalidArgumentError
from ..format import MAX_STEP
from ..keys import check_name
from .handle import NewField, WriterHandle

__all__ = ["FieldValue", "check_handle_names", "check_seconds", "check_steps", "checked_fields", "json_meta",
           "meta_conflicts"]

#: How to fix a bad ``autoflush_s`` (RunWriter, Recorder).
AUTOFLUSH_FIX = "pass e.g. 60, or None to seal only at flush() and close()"

#: What ``write()`` takes per field: an array, or ``(raw_bits, dtype_name)``.
FieldValue = Union[np.ndarray, "tuple[np.ndarray, str]"]


def check_seconds(value: Any, name: str, fix: str) -> float | None:
    """``value`` as seconds: None, or a positive finite number (not a bool).

    Raises:
        InvalidArgumentError: anything else, quoting it, with ``fix`` as the way out.
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name} must be a positive number of seconds or None, got {value!r}; {fix}")
    return float(value)


#: A handle's ``category`` (docs/format.md section 2); ``""``: data not recorded by a hook.
HANDLE_CATEGORIES = ("forward_hook", "forward_pre_hook", "backward_hook", "")


def check_handle_names(handle_id: str, info: Mapping[str, str]) -> None:
    """A handle's id and names (``module_name``, ``module_type``, ``category``, ``hook_fn_name``
    in ``info``) follow :func:`~hookline.storage.keys.check_name`: checked before the handle is
    declared, so a name the files cannot hold never reaches the writer thread.

    Raises:
        HookTypeError, InvalidArgumentError: naming the handle and quoting the bad name.
    """
    check_name(handle_id, "handle id", fix="use another handle id (with a HookManager: register the module and the hook "
               "function under other names)")
    for what, value in info.items():
        check_name(value, f"{what} of handle {handle_id!r}")
    if info.get("category", "") not in HANDLE_CATEGORIES:
        raise InvalidArgumentError(
            f"category of handle {handle_id!r} is {info['category']!r:.80}; use one of "
            f"{', '.join(map(repr, HANDLE_CATEGORIES))} ('' for data not recorded by a hook)")


def check_steps(handle_id: str, steps: list[int], calls: list[int]) -> None:
    """Steps and calls are stored as int64: each must be in ``[0, MAX_STEP]`` (non-empty lists).

    Raises:
        InvalidArgumentError: naming the handle and the first values.
    """
    if min(steps) < 0 or min(calls) < 0 or max(steps) > MAX_STEP or max(calls) > MAX_STEP:
        got = (f"step={steps[0]!r}, call={calls[0]!r}" if len(steps) == 1
               else f"steps {steps[:8]} calls {calls[:8]}")
        raise InvalidArgumentError(
            f"step and call numbers of {handle_id!r} must be non-negative ints up to 2**63 - 1 (stored as "
            f"int64), got {got}")


def checked_fields(h: WriterHandle, fields: Mapping[str, FieldValue], k: int | None,
                   ) -> tuple[dict[str, tuple[np.ndarray, str]], list[NewField], int]:
    """Check the fields of one record (``k`` None) or of a block of ``k`` records.

    Returns:
        ``(fields, new, nbytes)``: field name -> ``(array of shape (k, *record_shape), dtype
        name)`` (one record gets a leading axis of 1), the fields ``h`` has not seen yet (to
        register once the whole record passed), and the arrays' bytes.

    Raises:
        HookTypeError, InvalidArgumentError: a value that is not an array or raw bits, a bad
            field name, a dtype or ndim that differs from the field's first record, or a block
            array whose first dimension is not ``k``.
    """
    if type(fields) is not dict and not isinstance(fields, Mapping):
        raise HookTypeError(f"fields must be a mapping of field name -> array, got {type(fields).__name__}")
    lead = 0 if k is None else 1
    out: dict[str, tuple[np.ndarray, str]] = {}
    new: list[NewField] = []
    nbytes = 0
    for name, v in fields.items():
        arr, dn = _array_and_dtype(name, v)
        if k is not None and (arr.ndim == 0 or arr.shape[0] != k):
            raise InvalidArgumentError(
                f"field {name!r} of {h.id!r}: a block of {k} records needs arrays of shape "
                f"({k}, ...), got shape {arr.shape}")
        if h.check_field(name, dn, arr.shape[lead:]):
            new.append(NewField(name, dn, arr.ndim - lead))
        out[name] = (arr if lead else arr[None], dn)
        nbytes += arr.nbytes
    return out, new, nbytes


def _array_and_dtype(name: str, v: Any) -> tuple[np.ndarray, str]:
    """A field value as ``(array, logical dtype name)``."""
    if type(v) is tuple:
        if len(v) != 2:
            raise HookTypeError(f"field {name!r}: expected (raw_bits, dtype_name), got a {len(v)}-tuple")
        arr, dn = v
        try:
            inf = dtypes.info(dn) if isinstance(dn, str) else None
        except InvalidArgumentError:
            inf = None
        if inf is None or not inf.is_bits:
            raise InvalidArgumentError(
                f"field {name!r}: dtype name {dn!r} is not a raw-bits dtype; use one of {dtypes.BITS_NAMES}")
        if not isinstance(arr, np.ndarray) or arr.dtype.itemsize != inf.storage.itemsize or arr.dtype.kind not in "iu":
            raise HookTypeError(
                f"field {name!r}: {dn} bits must be a numpy {inf.storage} array, got "
                f"{getattr(arr, 'dtype', type(arr).__name__)}")
        return arr, dn
    if isinstance(v, (np.ndarray, np.generic)):
        arr = v if type(v) is np.ndarray else np.asarray(v)
        return arr, dtypes.native_name(arr.dtype)
    raise HookTypeError(
        f"field {name!r}: value must be a numpy array or (raw_bits, dtype_name), got {type(v).__name__}")


def meta_conflicts(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Keys of ``new`` whose value differs from the one in ``old``: ``{key: (old, new)}`` (NaN
    equals NaN here: values are also compared as JSON text)."""
    return {k: (old[k], v) for k, v in new.items()
            if k in old and old[k] != v and json.dumps(old[k], sort_keys=True) != json.dumps(v, sort_keys=True)}


def json_meta(meta: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """``meta`` as plain JSON data, checked: numpy values (and anything else with ``tolist()``,
    e.g. a 0-dim tensor) become lists and scalars; anything JSON cannot store is refused, naming
    its key, instead of being stored as its ``str()``.

    Args:
        meta: the metadata (None: empty).
        what: what it is, for messages (e.g. ``"run meta"``).

    Raises:
        HookTypeError: ``meta`` is not a mapping with str keys, or a value cannot be stored.
    """
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise HookTypeError(f"{what} must be a dict, got {type(meta).__name__} {meta!r:.80}")

    def plain(o: Any) -> Any:
        tolist = getattr(o, "tolist", None)
        if callable(tolist):
            return tolist()
        raise TypeError(type(o).__name__)

    out: dict[str, Any] = {}
    for k, v in meta.items():
        if not isinstance(k, str):
            raise HookTypeError(f"{what}: keys must be str, got {type(k).__name__} {k!r:.80}")
        try:
            out[k] = json.loads(json.dumps(v, default=plain, allow_nan=True))
        except (TypeError, ValueError) as e:
            raise HookTypeError(
                f"{what}: the value of {k!r} ({type(v).__name__} {v!r:.60}) cannot be stored as JSON ({e}); "
                f"pass numbers, strings, lists or dicts (e.g. str(value) for its text)") from None
    return out
