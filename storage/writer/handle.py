"""One handle of a RunWriter: its identity, its fields' registry and the writer thread's state of its parts."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Mapping, NamedTuple

import numpy as np

from .._parts import PartEntry
from ..errors import InvalidArgumentError
from ..format import check_field_name
from ..keys import check_name
from .staging import OpenPart
from .stats import HandleStats

__all__ = ["NewField", "WriterHandle"]


class NewField(NamedTuple):
    """A field seen for the first time in an accepted record."""

    name: str
    dtype_name: str
    ndim: int


class WriterHandle:
    """A declared handle of a RunWriter.

    Caller threads use the field registry (:attr:`field_dtype`, :attr:`field_ndim`, checked by
    :meth:`check_field`); the writer thread owns everything from :attr:`started` on.

    Args:
        handle_id: the hook handle id.
        key: its file key (:func:`~hookline.storage.handle_key`).
        suffix: the rank suffix of its file names.
        info: ``module_name``, ``module_type``, ``category``, ``hook_fn_name`` and ``meta``.
    """

    def __init__(self, handle_id: str, key: str, suffix: str, info: dict[str, Any]) -> None:
        self.id = handle_id
        self.key = key
        self.suffix = suffix
        self.info = info
        # caller-thread validation caches
        self.known: set[str] = set()
        self.field_dtype: dict[str, str] = {}
        self.field_ndim: dict[str, int] = {}
        self.stats = HandleStats()
        # writer-thread state
        self.started = False
        self.next_record = 0
        self.base: list[Path] = []  # final parts found at start (a continued run)
        self.sealed: list[PartEntry] = []  # sealed segments, in record order
        self.part: OpenPart | None = None
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.ragged: set[str] = set()
        self.steps_min: int | None = None
        self.steps_max: int | None = None
        self.written_bytes = 0
        self.final_done = False

    # --- caller threads -------------------------------------------------------------------------
    def adopt_fields(self, previous: Mapping[str, Any]) -> None:
        """A continued run: fields keep the dtype and ndim they were recorded with (``previous``
        is the handle's ``fields`` in the old manifest), so a mismatch is a clear error at
        ``write()``, not a failed merge at close."""
        for name, f in previous.items():
            if isinstance(f, dict) and isinstance(f.get("dtype"), str):
                self.field_dtype[name] = f["dtype"]
                ndim = f.get("ndim", len(f["shape"]) if isinstance(f.get("shape"), list) else None)
                if isinstance(ndim, int):
                    self.field_ndim[name] = ndim

    def check_field(self, name: str, dn: str, shape: tuple[int, ...]) -> bool:
        """Refuse a field whose name is invalid, or whose dtype or ndim differs from its first
        record's. Returns whether the field is new (to register once the whole record passed:
        a refused record must leave no trace).

        Raises:
            InvalidArgumentError: naming the handle, the field and what changed.
        """
        ndim = len(shape)
        if name not in self.known:
            try:
                check_field_name(name)
                check_name(name, "field name")
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"handle {self.id!r}: {e}") from None
            if name not in self.field_dtype:  # a continued run knows its fields' dtypes already
                return True
        if self.field_dtype[name] != dn:
            raise InvalidArgumentError(
                f"field {name!r} of {self.id!r} changed dtype from {self.field_dtype[name]} to {dn}; "
                f"a field keeps one dtype (use another field name)")
        if self.field_ndim.get(name, ndim) != ndim:
            raise InvalidArgumentError(
                f"field {name!r} of {self.id!r} changed ndim from {self.field_ndim[name]} to {ndim} "
                f"(record shape {shape}); a field keeps its number of dimensions")
        return name not in self.known

    def register_fields(self, new: list[NewField], lock: threading.Condition) -> None:
        """Register the new fields of an accepted record (under ``lock``: the writer thread reads
        the registry to build the manifest)."""
        if new:
            with lock:
                for name, dn, ndim in new:
                    self.field_dtype.setdefault(name, dn)
                    self.field_ndim.setdefault(name, ndim)
                    self.known.add(name)

    # --- the writer thread ----------------------------------------------------------------------
    def note_shapes(self, fields: Mapping[str, tuple[np.ndarray, str]]) -> bool:
        """Note the record shapes of a block: a field whose shape changes becomes ragged for good.
        Returns whether the open part holds such a field as fixed-shape (it must be sealed first:
        merges rewrite the field ragged)."""
        part = self.part
        need_seal = False
        for name, (arr, _) in fields.items():
            if name in self.ragged:
                continue
            shape = arr.shape[1:]
            known = self.shapes.get(name)
            if known is None:
                self.shapes[name] = shape
                if 0 in shape:
                    self.ragged.add(name)
            elif known != shape:
                self.ragged.add(name)
                if part is not None and name in part.fields and not part.fields[name].spec.ragged:
                    need_seal = True
        return need_seal

    def note_steps(self, steps: list[int]) -> None:
        """Widen the handle's step range (written to the manifest) by ``steps``."""
        lo, hi = min(steps), max(steps)
        self.steps_min = lo if self.steps_min is None else min(self.steps_min, lo)
        self.steps_max = hi if self.steps_max is None else max(self.steps_max, hi)
