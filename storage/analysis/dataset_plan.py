"""The read plan of a :class:`~hookline.storage.analysis.dataset.RecordDataset`: which records of
which fields line up, how many rows each gives, and the blocks ("units") they are read in.

A plan holds numpy arrays only (no open file), so a dataset pickles to ``DataLoader`` workers
and ``torch.distributed`` ranks cheaply and each of them reopens the run itself. Built once, in
the process that creates the dataset, from the reader's record index (no tensor data is read).
Needs only numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..errors import HookTypeError, InvalidArgumentError, UnknownNameError
from ..format import chunk_records
from ..local import names_hint
from ..reader import Field, Run

__all__ = ["ROWS", "INDEX_KEYS", "Plan", "parse_refs", "make_plan", "unit_order"]

#: What one item of a dataset is: a sample row of a record, or the whole record.
ROWS = ("sample", "record")
#: Keys an item carries with ``index=True`` (field references always contain a ``/``).
INDEX_KEYS = ("step", "call", "rank", "sample")
#: Default bytes of the widest field read per unit (FACTS: 256 KiB - 4 MiB chunks all read well).
UNIT_BYTES = 4 << 20

_KEY = np.dtype([("rank", "i8"), ("step", "i8"), ("call", "i8")])


@dataclass
class Plan:
    """Aligned records of several fields and how they are read.

    Attributes:
        refs: ``(handle_id, field_name)`` per field, in the order given.
        keys: the field references (``"handle/field"``), the item keys.
        dtype_names: logical dtype of each field (``"bfloat16"``...).
        row_shapes: shape of one row of each field (None: ragged records, ``rows="record"``).
        rows: ``"sample"`` or ``"record"``.
        entries: ``(records, fields)`` entry index of every aligned record in each field.
        steps, calls, ranks: step, call and rank (-1: not distributed) of each aligned record.
        counts: rows each aligned record gives (1 with ``rows="record"``).
        units: boundaries of the read units in aligned-record positions (``units[u]:units[u+1]``).
    """

    refs: list[tuple[str, str]]
    keys: list[str]
    dtype_names: list[str]
    row_shapes: list[tuple[int, ...] | None]
    rows: str
    entries: np.ndarray
    steps: np.ndarray
    calls: np.ndarray
    ranks: np.ndarray
    counts: np.ndarray
    units: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))

    @property
    def num_records(self) -> int:
        """Aligned records."""
        return int(len(self.steps))

    @property
    def num_rows(self) -> int:
        """Rows over all records (items of a dataset that yields rows)."""
        return int(self.counts.sum())

    @property
    def num_units(self) -> int:
        """Read units (the blocks shuffled, and shared out among workers and ranks)."""
        return int(len(self.units) - 1)

    @property
    def rows_per_record(self) -> int:
        """The most rows one record gives."""
        return int(self.counts.max()) if len(self.counts) else 0


def parse_refs(fields: str | Sequence[str], run: Run) -> list[tuple[str, str]]:
    """``"handle/field"`` references -> ``(handle_id, field_name)`` pairs of ``run``.

    The field name is what follows the last ``/`` (field names never hold one).

    Raises:
        HookTypeError: ``fields`` is not a string or a sequence of strings.
        InvalidArgumentError: no reference, a reference without ``/``, or one given twice.
        UnknownNameError: an unknown handle or field (the message lists the available ones).
    """
    refs = [fields] if isinstance(fields, str) else fields
    if not isinstance(refs, (list, tuple)) or not all(isinstance(r, str) for r in refs):
        raise HookTypeError(f"fields must be 'handle/field' strings (e.g. 'outputs[blocks.0]/outputs.0'), "
                            f"got {fields!r:.200}")
    if not refs:
        raise InvalidArgumentError("fields is empty; give at least one 'handle/field' reference")
    out: list[tuple[str, str]] = []
    for ref in refs:
        handle, sep, name = ref.rpartition("/")
        if not sep or not handle or not name:
            raise InvalidArgumentError(
                f"field reference {ref!r} is not 'handle/field'; e.g. '{(run.handles or ['outputs[fc1]'])[0]}/"
                f"outputs.0' (handles of this run: {names_hint(run.handles)})")
        if handle not in run:
            raise UnknownNameError(f"unknown handle {handle!r} in field reference {ref!r}; available: "
                                   f"{names_hint(run.handles)}")
        if name not in run[handle].fields:
            raise UnknownNameError(f"unknown field {name!r} in field reference {ref!r}; fields of {handle!r}: "
                                   f"{names_hint(run[handle].fields)}")
        if (handle, name) in out:
            raise InvalidArgumentError(f"field reference {ref!r} is given twice; give each field once")
        out.append((handle, name))
    return out


def _record_keys(fld: Field) -> np.ndarray:
    """(rank, step, call) of every entry of ``fld``, as one structured array."""
    keys = np.empty(len(fld), _KEY)
    keys["rank"] = fld.handle.ranks[fld.records]
    keys["step"] = fld.steps
    keys["call"] = fld.calls
    return keys


def _align(fields: list[Field], keys: list[str]) -> np.ndarray:
    """``(records, fields)`` entry indices of the records (rank, step, call) every field has, in
    the first field's record order.

    Raises:
        InvalidArgumentError: a field repeats a (rank, step, call), or the fields share no record.
    """
    per = [_record_keys(f) for f in fields]
    for k, ref in zip(per, keys):
        if len(np.unique(k)) != len(k):
            raise InvalidArgumentError(f"field {ref!r} has several records with the same (rank, step, call); "
                                       f"rows cannot be aligned (record such runs into separate run directories)")
    idx = [np.arange(len(per[0]), dtype=np.int64)]
    for k in per[1:]:
        _, ia, ib = np.intersect1d(per[0][idx[0]], k, assume_unique=True, return_indices=True)
        order = np.argsort(ia, kind="stable")
        idx = [a[ia[order]] for a in idx] + [ib[order].astype(np.int64)]
    if len(idx[0]) == 0:
        raise InvalidArgumentError(f"fields {keys!r} have no record (rank, step, call) in common; give fields "
                                   f"recorded at the same steps")
    return np.stack(idx, axis=1)


def _step_mask(steps: Iterable[int] | None, have: np.ndarray) -> np.ndarray | None:
    """Which aligned records ``steps`` keeps (None: all).

    Raises:
        HookTypeError: ``steps`` is not a collection of ints.
        InvalidArgumentError: it selects no aligned record.
    """
    if steps is None:
        return None
    try:
        wanted = list(steps)
    except TypeError:
        raise HookTypeError(f"steps must be a collection of ints (e.g. range(0, 100)), got {steps!r:.100}") from None
    if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in wanted):
        raise HookTypeError(f"steps must be ints, got {wanted[:10]!r:.200}")
    mask = np.isin(have, np.asarray(wanted, np.int64))
    if not mask.any():
        span = f"{int(have.min())}..{int(have.max())}" if have.size else "none"
        raise InvalidArgumentError(f"steps {wanted[:10]!r:.200} select no aligned record; the fields' common "
                                   f"steps are {span}")
    return mask


def _sample_dims(sample_dims: int | Mapping[str, int] | None, ref: str, ndim: int) -> int:
    """Leading dimensions of ``ref``'s records that index rows (default: all but the last)."""
    k: Any = sample_dims.get(ref) if isinstance(sample_dims, Mapping) else sample_dims
    if k is None:
        return max(ndim - 1, 0)
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 0 <= k <= ndim:
        raise InvalidArgumentError(f"sample_dims {k!r} for {ref!r} must be an int in 0..{ndim} (its records have "
                                   f"{ndim} dimensions; rows are the records' first sample_dims dimensions)")
    return int(k)


def _rows_of(fld: Field, ref: str, entries: np.ndarray, rows: str, k: int | None
             ) -> tuple[np.ndarray, tuple[int, ...] | None]:
    """Rows per aligned record of one field, and the shape of one row."""
    if rows == "record":
        return np.ones(len(entries), np.int64), fld.shape
    assert k is not None
    if fld.shape is not None:
        return np.full(len(entries), math.prod(fld.shape[:k]), np.int64), tuple(fld.shape[k:])
    shapes = [fld.record_shape(int(e)) for e in entries]
    tails = {s[k:] for s in shapes}
    if len(tails) != 1:
        raise InvalidArgumentError(
            f"rows of {ref!r} vary in shape ({sorted(tails)[:3]}); choose sample_dims so that only the leading "
            f"dimensions vary (its records have {len(shapes[0])} dimensions)")
    return np.array([math.prod(s[:k]) for s in shapes], np.int64), tails.pop()


def _units(entries: np.ndarray, per_unit: int) -> np.ndarray:
    """Unit boundaries: a new unit where any field's entries stop being consecutive, and where
    the first field's entry index crosses a multiple of ``per_unit`` (chunk-aligned blocks)."""
    n = len(entries)
    cut = np.zeros(n, bool)
    cut[0] = True
    if n > 1:
        cut[1:] = (np.diff(entries, axis=0) != 1).any(axis=1) | (np.diff(entries[:, 0] // per_unit) != 0)
    return np.append(np.nonzero(cut)[0], n).astype(np.int64)


def _per_unit(fields: list[Field], entries: np.ndarray, unit_bytes: int) -> int:
    """Records per unit: ``unit_bytes`` of the widest field, a multiple of its writer's chunk
    records when more than one chunk fits."""
    widest = 1
    for j, fld in enumerate(fields):
        if fld.shape is not None:
            nbytes = math.prod(fld.shape) * fld.dtype.itemsize
        else:  # (ragged: the mean record; its size per row is fixed, its row count varies)
            sample = entries[:: max(1, len(entries) // 64), j]
            nbytes = int(np.mean([math.prod(fld.record_shape(int(e))) for e in sample])) * fld.dtype.itemsize
        widest = max(widest, nbytes)
    per = max(1, unit_bytes // widest)
    chunk = chunk_records(widest)
    return per - per % chunk if per >= chunk else per


def make_plan(run: Run, refs: list[tuple[str, str]], *, rows: str = "sample", steps: Iterable[int] | None = None,
              sample_dims: int | Mapping[str, int] | None = None, unit_bytes: int = UNIT_BYTES) -> Plan:
    """The plan of reading ``refs`` of ``run`` as aligned rows (reads the record index only).

    Raises:
        InvalidArgumentError: unknown ``rows``; fields without common records; steps selecting
            nothing; records whose row counts differ between fields (the message names the step).
    """
    if rows not in ROWS:
        raise InvalidArgumentError(f"rows must be one of {ROWS}, got {rows!r}")
    keys = [f"{h}/{f}" for h, f in refs]
    fields = [run[h][f] for h, f in refs]
    entries = _align(fields, keys)
    base = fields[0]
    mask = _step_mask(steps, base.steps[entries[:, 0]])
    if mask is not None:
        entries = entries[mask]
    counts, shapes = None, []
    for j, (fld, ref) in enumerate(zip(fields, keys)):
        k = _sample_dims(sample_dims, ref, len(fld.shape) if fld.shape is not None
                         else len(fld.record_shape(int(entries[0, j])))) if rows == "sample" else None
        c, shape = _rows_of(fld, ref, entries[:, j], rows, k)
        if counts is not None and not np.array_equal(c, counts):
            bad = int(np.nonzero(c != counts)[0][0])
            raise InvalidArgumentError(
                f"rows of {ref!r} ({int(c[bad])} per record) do not line up with {keys[0]!r} ({int(counts[bad])}) "
                f"at step {int(base.steps[entries[bad, 0]])}; choose sample_dims per field (a dict) so both give "
                f"the same rows per record")
        counts = c
        shapes.append(shape)
    first = entries[:, 0]
    plan = Plan(refs=list(refs), keys=keys, dtype_names=[f.dtype_name for f in fields], row_shapes=shapes,
                rows=rows, entries=entries, steps=base.steps[first], calls=base.calls[first],
                ranks=base.handle.ranks[base.records[first]], counts=counts)  # type: ignore[arg-type]
    plan.units = _units(entries, _per_unit(fields, entries, unit_bytes))
    return plan


def unit_order(num_units: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order units are read in this epoch: a seeded permutation (the same for every worker
    and rank, which then take every n-th unit), or storage order."""
    if not shuffle:
        return np.arange(num_units, dtype=np.int64)
    return np.random.default_rng([seed, epoch]).permutation(num_units).astype(np.int64)
