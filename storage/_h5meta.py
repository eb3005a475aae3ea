"""A handle part's metadata, checked: :func:`part_meta` -> :class:`PartMeta` -> :class:`FieldMeta`.

The root attributes (format, version, record range, handle id, registration strings, the field
list) and every field's attributes checked against the datasets' shapes and types, from the
file's :class:`~._h5check.Structure` (no read of the file). Derived once per structure and kept
with it, so a file opened again (whose structure :func:`~._h5check.checked_structure` reuses) is
not checked again; :class:`~._h5read.Part` and :class:`~._h5read.PartField` are made from them.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from . import dtypes
from ._filters import ensure_filters
from ._h5check import HINT, Structure, attr_str, damaged
from .errors import FormatError, HooklineError
from .identity import is_utf8
from .format import FILE_FORMAT, FORMAT_VERSION, INDEX_GROUP, MAX_STEP, check_field_name

__all__ = ["FieldMeta", "PartMeta", "part_meta"]

#: Most dimensions a field's entries may have (torch allows 64).
_MAX_NDIM = 64


def _int_attr(attrs: Any, key: str, where: str, lo: int = 0, hi: int = MAX_STEP) -> int:
    """Attribute ``key`` as an int in ``[lo, hi]``."""
    v = attrs[key]
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        raise damaged(where, f"attribute {key!r} is {v!r:.60}, expected an integer from {lo} to {hi}")
    return int(v)


def _str_attr(attrs: Any, key: str, where: str) -> str:
    v = attrs[key]
    if not isinstance(v, (str, bytes)):
        raise damaged(where, f"attribute {key!r} is {v!r:.60}, expected a string")
    text = attr_str(v)
    if not is_utf8(text):  # (never a name of its own: a ghost handle or module)
        raise damaged(where, f"attribute {key!r} is {v!r:.60}, which is not valid UTF-8")
    return text


#: Root attributes that are strings when present (docs/format.md section 3.1).
_STR_ATTRS = ("key", "module_name", "module_type", "category", "hook_fn_name", "hookline_version", "created",
              "run_uuid", "run_created")


def _check_root_attrs(a: dict[str, Any], where: str) -> None:
    """The registration attributes have their types; ``meta``/``run_meta`` are JSON objects."""
    for k in _STR_ATTRS:
        if k in a:
            _str_attr(a, k, where)
    for k in ("rank", "world_size"):
        if k in a:
            _int_attr(a, k, where, -1, 1 << 31)
    for k in ("meta", "run_meta"):
        if k in a:
            try:
                obj = json.loads(_str_attr(a, k, where))
            except (ValueError, RecursionError):
                obj = None
            if not isinstance(obj, dict):
                raise damaged(where, f"attribute {k!r} is {a[k]!r:.60}, expected a JSON object")


def _index_ds(st: Structure, name: str, count: int, where: str, cols: int | None = None) -> None:
    """Check index dataset ``name``: 1-D (2-D with ``cols`` columns) with at least ``count`` rows."""
    shape = st.shapes.get(name)
    want = (count,) if cols is None else (count, cols)
    if shape is None or len(shape) != len(want) or shape[0] < count or shape[1:] != want[1:]:
        got = "missing" if shape is None else f"of shape {shape}"
        raise damaged(where, f"index dataset {name!r} is {got}, expected {want}")


def _field_names(text: Any, where: str, st: Structure) -> list[str]:
    """The root attribute ``fields``: a JSON list of distinct field names, each a dataset."""
    try:
        names = json.loads(text)
    except (TypeError, ValueError):
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise damaged(where, f"attribute 'fields' is {text!r:.80}, expected a JSON list of distinct field names")
    for nm in names:
        try:
            check_field_name(nm)
        except HooklineError:
            raise damaged(where, f"attribute 'fields' lists {nm!r:.80}, which is not a field name") from None
        if nm not in st.shapes:
            raise damaged(where, f"field {nm!r} (in attribute 'fields') has no dataset")
    return names


class FieldMeta:
    """A field's checked attributes and layout (what :class:`PartField` is made from; derived
    from a file's :class:`~._h5check.Structure` once and kept with it)."""

    __slots__ = ("name", "dtype_name", "layout", "ndim", "count", "shape", "info", "stored", "has_norm")

    def __init__(self, st: Structure, name: str, n: int, w: str) -> None:
        """Check field ``name`` of a part of ``n`` records (``w``: the file, for messages).

        Raises:
            FormatError: the field's attributes or index datasets are inconsistent.
        """
        self.name = name
        at = st.attrs[name]
        try:
            self.dtype_name = _str_attr(at, "dtype", w)
            self.layout = _str_attr(at, "layout", w)
            self.ndim = _int_attr(at, "ndim", w, 0, _MAX_NDIM)
            self.count = _int_attr(at, "records", w, 0, n)
            shape_attr = at["shape"] if self.layout == "fixed" else None
        except KeyError as e:
            raise FormatError(f"{w!r}: field {name!r} lacks attribute {e} {HINT}") from None
        info = dtypes.lookup(self.dtype_name)
        if info is None:
            raise damaged(w, f"field {name!r} has unknown dtype {self.dtype_name!r:.60}")
        self.info = info
        self.stored = stored = st.dtypes[name]
        if stored.newbyteorder("=") != info.storage:
            raise damaged(w, f"field {name!r} ({self.dtype_name}) is stored as {stored}, expected {info.storage}")
        ensure_filters(st.filters[name])
        shape = st.shapes[name]
        idx = f"{INDEX_GROUP}/{name}/"
        _index_ds(st, idx + "record", self.count, w)
        if self.layout == "fixed":
            shp = np.asarray(shape_attr)
            if shp.shape != (self.ndim,) or (shp.size and shp.dtype.kind not in "iu") or (shp < 0).any():
                raise damaged(w, f"field {name!r} has attribute shape {shape_attr!r:.60} for ndim {self.ndim}")
            self.shape: tuple[int, ...] | None = tuple(int(x) for x in shp)
            if shape[1:] != self.shape or shape[0] < self.count:
                raise damaged(w, f"field {name!r}: dataset shape {shape} != attributes (shape {self.shape}, "
                                  f"{self.count} records)")
        elif self.layout == "ragged":
            self.shape = None
            if len(shape) != 1:
                raise damaged(w, f"field {name!r}: ragged data of shape {shape}, expected 1-D")
            _index_ds(st, idx + "offset", self.count, w)
            _index_ds(st, idx + "shape", self.count, w, self.ndim)
        else:
            raise damaged(w, f"field {name!r} has unknown layout {self.layout!r:.60}")
        self.has_norm = idx + "norm" in st.shapes
        if self.has_norm:
            _index_ds(st, idx + "norm", self.count, w)


class PartMeta:
    """A part's checked root attributes and fields (see :func:`part_meta`).

    Attributes:
        attrs: the root attributes (shared: read-only).
        record_start, n, handle_id: from the root attributes.
        field_names: the fields, in the file's order.
        fields: :class:`FieldMeta` by name.
    """

    __slots__ = ("attrs", "record_start", "n", "handle_id", "field_names", "fields")

    def __init__(self, st: Structure, w: str) -> None:
        a = st.attrs[""]
        if a.get("hookline_format") != FILE_FORMAT:
            raise FormatError(f"{w!r} is not a hookline handle file (root attribute hookline_format is "
                              f"{a.get('hookline_format')!r:.60}, expected {FILE_FORMAT!r})")
        try:
            version = _int_attr(a, "format_version", w, 0, 1 << 31)
            self.record_start = _int_attr(a, "record_start", w)
            self.n = _int_attr(a, "records", w, 0, MAX_STEP - self.record_start)
            self.handle_id = _str_attr(a, "handle_id", w)
        except KeyError as e:
            raise FormatError(f"{w!r} is not a hookline handle file (missing attribute {e})") from None
        if version > FORMAT_VERSION:
            raise FormatError(
                f"{w!r} has format_version {version}; this hookline reads <= {FORMAT_VERSION}: upgrade hookline"
            )
        _check_root_attrs(a, w)
        self.attrs = a
        self.field_names: list[str] = _field_names(a.get("fields", "[]"), w, st)
        _index_ds(st, "step", self.n, w)
        _index_ds(st, "call", self.n, w)
        # Every field's attributes and index shapes are checked now (a damaged field is a
        # damaged file at open, not an error at some later read).
        self.fields = {nm: FieldMeta(st, nm, self.n, w) for nm in self.field_names}


def part_meta(st: Structure, where: str) -> PartMeta:
    """The :class:`PartMeta` of a file whose structure is ``st``: checked once per structure
    (:func:`~._h5check.checked_structure` shares one per unchanged file), so a file opened
    again is not checked again.

    Raises:
        FormatError: not a hookline handle file, a newer format version, or attributes and index
            datasets that do not fit together.
    """
    meta = st.memo.get("part")
    if meta is None:
        meta = st.memo["part"] = PartMeta(st, where)  # (only a file that passed is remembered)
    return meta
