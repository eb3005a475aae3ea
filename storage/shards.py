"""Logical tensors of DTensor fields, reassembled lazily from the ranks' local shards.

A recorder stores a DTensor (tensor parallelism) as each rank's local shard and writes its layout
into the handle's metadata (``meta["dtensor"][field]``: placements, mesh shape and ranks, the
rank's mesh coordinate, whether it stored the tensor). Reading such a field of a handle that
spans ranks (``run[handle_id][field]``) gives a :class:`LogicalField`: one record per step, call
and *mesh* (not per rank), each the logical tensor equal to what the non-parallel model computes.
Record ``i`` reads only the shards of record ``i``, one per rank that stored one. Placements are
undone mesh dimension by mesh dimension, innermost first: ``shard:<d>`` concatenates the shards
along tensor dimension ``d`` in coordinate order (torch's uneven chunks included), ``replicate``
takes coordinate 0 (the only one stored), ``partial:<op>`` reduces (``sum``, ``avg``, ``max``,
``min``; computed in the read dtype, so bfloat16 partials sum in float32).

The local shards stay readable per rank (``run.handle(handle_id, rank=r)[field]``, or
:meth:`LogicalField.local`). Needs only numpy (torch only for :meth:`LogicalField.to_torch`).
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Callable, Iterator

import numpy as np

from .errors import FormatError, InvalidArgumentError, RecordIndexError, UnknownNameError

__all__ = ["LogicalField", "logical_field", "parse_placement"]

_REDUCE: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min,
                                                 "product": np.prod}


def parse_placement(text: str) -> tuple[str, Any]:
    """``"shard:1"`` -> ``("shard", 1)``, ``"replicate"`` -> ``("replicate", None)``,
    ``"partial:sum"`` -> ``("partial", "sum")``.

    Raises:
        FormatError: a placement the reader cannot undo (e.g. torch's ``_StridedShard``).
    """
    kind, _, arg = str(text).partition(":")
    if kind == "shard" and arg.lstrip("-").isdigit():
        return "shard", int(arg)
    if kind == "replicate" and not arg:
        return "replicate", None
    if kind == "partial" and arg in _REDUCE:
        return "partial", arg
    raise FormatError(f"placement {text!r} cannot be reassembled (known: 'shard:<dim>', 'replicate', "
                      f"'partial:<{'|'.join(_REDUCE)}>'); read the local shards per rank with "
                      f"run.handle(handle_id, rank=r)")


def _fold(pieces: dict[tuple[int, ...], Any], placements: list[tuple[str, Any]],
          concat: Callable[[list[Any], int], Any], reduce: Callable[[list[Any], str], Any]) -> Any:
    """Undo ``placements`` over ``pieces`` (mesh coordinate -> shard), innermost mesh dim first."""
    for d in reversed(range(len(placements))):
        kind, arg = placements[d]
        groups: dict[tuple[int, ...], list[tuple[int, Any]]] = {}
        for coord, piece in pieces.items():
            groups.setdefault(coord[:d] + coord[d + 1:], []).append((coord[d], piece))
        folded = {}
        for rest, members in groups.items():
            members.sort(key=lambda cm: cm[0])
            values = [p for _, p in members]
            if kind == "shard":
                folded[rest] = concat(values, arg)
            elif kind == "partial":
                folded[rest] = reduce(values, arg)
            else:  # replicate: only coordinate 0 stored it
                folded[rest] = values[0]
        pieces = folded
    (value,) = pieces.values()
    return value


def _concat_arrays(values: list[np.ndarray], dim: int) -> np.ndarray:
    return values[0] if len(values) == 1 else np.concatenate(values, axis=dim)


def _reduce_arrays(values: list[np.ndarray], op: str) -> np.ndarray:
    stacked = np.stack(values)
    return np.asarray(_REDUCE[op](stacked, axis=0), dtype=stacked.dtype)


def _concat_shapes(values: list[tuple[int, ...]], dim: int) -> tuple[int, ...]:
    out = list(values[0])
    out[dim] = sum(v[dim] for v in values)
    return tuple(out)


def _fixed_shape(f: Any) -> tuple[int, ...] | None:
    """A rank's per-record shard shape; the storage counts a field with empty records (an empty
    trailing shard of an uneven split) as ragged, so those are checked record by record (their
    shapes only, no data)."""
    if f.shape is not None or not len(f):
        return f.shape
    shapes = {f.record_shape(j) for j in range(len(f))}
    return shapes.pop() if len(shapes) == 1 else None


class _Mesh:
    """The ranks of one device mesh that recorded a field: who stored which coordinate."""

    def __init__(self, what: str, layouts: dict[int, dict[str, Any]]) -> None:
        first = next(iter(layouts.values()))
        self.placements = [parse_placement(p) for p in first["placements"]]
        self.mesh_ranks = [int(r) for r in first["mesh_ranks"]]
        for r, lay in layouts.items():
            if lay["placements"] != first["placements"] or lay["mesh_shape"] != first["mesh_shape"]:
                raise FormatError(f"{what}: rank {r} recorded placements {lay['placements']} on mesh "
                                  f"{lay['mesh_shape']}, rank {next(iter(layouts))} {first['placements']} on "
                                  f"{first['mesh_shape']}; read the local shards per rank")
        #: mesh coordinate -> rank, of the ranks that stored the tensor
        self.stored = {tuple(lay["coordinate"]): r for r, lay in layouts.items() if lay.get("stored", True)}
        ndim = len(self.placements)
        self.lead = self.stored.get((0,) * ndim)
        missing = [r for r in self.mesh_ranks if r not in layouts]
        if missing or self.lead is None:
            raise FormatError(f"{what} is a DTensor over ranks {self.mesh_ranks}, but rank(s) "
                              f"{missing or [self.mesh_ranks[0]]} have no data of it in this run; read "
                              f"the local shards per rank with run.handle(handle_id, rank=r)")


class LogicalField:
    """The logical tensors of a DTensor field: one record per (mesh, step, call).

    Reads like a :class:`~hookline.storage.reader.Field` (``len``, ``[i]``, ``[a:b]``, ``read()``,
    ``at_step()``, ``steps``, ``calls``, ``shape``, ``dtype``, ``to_torch()``, ``norms()``).

    Attributes:
        handle: the handle (all ranks) it belongs to.
        name: the field name.
        dtype_name: the logical dtype (``"float32"``, ``"bfloat16"``...).
        placements: the DTensor's placements (``["shard:1"]``...).
        meshes: the rank lists of the meshes it was recorded on (one per data-parallel group
            under a 2-D mesh), in record order.
    """

    def __init__(self, handle: Any, name: str, layouts: dict[int, dict[str, Any]]) -> None:
        self.handle = handle
        self.name = name
        by_mesh: dict[tuple[int, ...], dict[int, dict[str, Any]]] = {}
        for r, lay in sorted(layouts.items()):
            by_mesh.setdefault(tuple(lay["mesh_ranks"]), {})[r] = lay
        self._meshes = sorted((_Mesh(f"field {name!r} of handle {handle.id!r}", lays) for lays in by_mesh.values()),
                              key=lambda m: m.lead)
        self.meshes = [list(m.mesh_ranks) for m in self._meshes]
        self.placements = list(next(iter(layouts.values()))["placements"])
        leads = [self.local(m.lead) for m in self._meshes]
        self.dtype_name: str = leads[0].dtype_name if leads else "float32"
        self.dtype = leads[0].dtype if leads else np.dtype(np.float32)
        self._leads = leads
        self._bounds = np.cumsum([0, *(len(f) for f in leads)])
        self._index: dict[int, dict[tuple[int, int], int]] = {}  # rank -> (step, call) -> entry

    # --- the ranks' own fields ---------------------------------------------------------------
    def local(self, rank: int) -> Any:
        """The local shards of ``rank`` (its own :class:`~hookline.storage.reader.Field`)."""
        try:
            return self.handle.run.handle(self.handle.id, rank=rank)[self.name]
        except UnknownNameError:
            return _NoRecords(self.name)

    def _entry(self, rank: int, step: int, call: int) -> int:
        idx = self._index.get(rank)
        if idx is None:
            f = self.local(rank)
            idx = self._index[rank] = {k: i for i, k in enumerate(zip(np.asarray(f.steps).tolist(),
                                                                       np.asarray(f.calls).tolist()))}
        i = idx.get((step, call))
        if i is None:
            raise FormatError(f"rank {rank} has no shard of {self.handle.id!r}/{self.name!r} at step {step} "
                              f"call {call}, so the logical tensor cannot be reassembled; read the local "
                              f"shards per rank")
        return i

    # --- record index --------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._bounds[-1])

    @cached_property
    def steps(self) -> np.ndarray:
        """Step of each logical record."""
        return self._cat(lambda f: np.asarray(f.steps, np.int64))

    @cached_property
    def calls(self) -> np.ndarray:
        """Call index of each logical record."""
        return self._cat(lambda f: np.asarray(f.calls, np.int64))

    @cached_property
    def ranks(self) -> np.ndarray:
        """Rank of each logical record: the mesh's coordinate-0 rank, or -1 when one mesh spans
        every rank of the run (the logical tensor is then the run's own, as in a single process:
        a comparison with a single-process run pairs on ``(step, call)``)."""
        whole = len(self._meshes) == 1 and set(self._meshes[0].mesh_ranks) >= set(self.handle.run.ranks)
        return np.concatenate([np.full(len(f), -1 if whole else m.lead, np.int64)
                               for m, f in zip(self._meshes, self._leads)] or [np.zeros(0, np.int64)])

    @cached_property
    def records(self) -> np.ndarray:
        """Record index in the handle (all ranks) of the coordinate-0 shard of each logical record."""
        hr = np.asarray(self.handle.ranks, np.int64)
        parts = [np.flatnonzero(hr == m.lead)[np.asarray(f.records, np.int64)] for m, f in zip(self._meshes, self._leads)]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def _cat(self, fn: Callable[[Any], np.ndarray]) -> np.ndarray:
        parts = [fn(f) for f in self._leads]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def step_indices(self, step: int) -> np.ndarray:
        """Logical record indices recorded at ``step``, in record order."""
        return np.flatnonzero(self.steps == step)

    # --- shapes ----------------------------------------------------------------------------------
    @cached_property
    def shape(self) -> tuple[int, ...] | None:
        """Logical per-record shape, or None when it varies (or a shard's shape varies)."""
        shapes = set()
        for m in self._meshes:
            local = {c: _fixed_shape(self.local(r)) for c, r in m.stored.items()}
            if any(s is None for s in local.values()):
                return None
            shapes.add(_fold(local, m.placements, _concat_shapes, lambda v, op: v[0]))
        return shapes.pop() if len(shapes) == 1 else None

    @property
    def ragged(self) -> bool:
        """True when the logical per-record shape varies."""
        return self.shape is None

    @property
    def torch_dtype_name(self) -> str:
        """The exact torch dtype name of the recorded tensors."""
        return self.dtype_name

    def record_shape(self, i: int) -> tuple[int, ...]:
        """Logical shape of record ``i`` (no data read)."""
        m, step, call = self._locate(i)
        local = {c: self.local(r).record_shape(self._entry(r, step, call)) for c, r in m.stored.items()}
        return _fold(local, m.placements, _concat_shapes, lambda v, op: v[0])

    # --- reading ----------------------------------------------------------------------------------
    def _locate(self, i: int) -> tuple[_Mesh, int, int]:
        n = len(self)
        ii = int(i) + (n if int(i) < 0 else 0)
        if not 0 <= ii < n:
            raise RecordIndexError(f"record {i!r} out of range for field {self.name!r} of {self.handle.id!r}, "
                                   f"which has {n} logical records (valid: 0..{n - 1}, or negative from the end)")
        g = int(np.searchsorted(self._bounds, ii, "right")) - 1
        return self._meshes[g], int(self.steps[ii]), int(self.calls[ii])

    def shards(self, i: int) -> dict[int, np.ndarray]:
        """The stored local shards of logical record ``i``: rank -> array (only the ranks that
        stored one: mesh coordinate 0 along replicated dimensions)."""
        m, step, call = self._locate(i)
        return {r: self.local(r)[self._entry(r, step, call)] for r in m.stored.values()}

    def _read(self, i: int) -> np.ndarray:
        m, step, call = self._locate(i)
        pieces = {c: np.asarray(self.local(r)[self._entry(r, step, call)]) for c, r in m.stored.items()}
        return _fold(pieces, m.placements, _concat_arrays, _reduce_arrays)

    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        """``f[i]`` one logical record; ``f[a:b]`` stacked on a new axis 0 (a list if ragged)."""
        if isinstance(index, (int, np.integer)):
            return self._read(int(index))
        if isinstance(index, slice):
            return self._gather(range(*index.indices(len(self))))
        raise InvalidArgumentError(f"field index must be an int or a slice, got {index!r}")

    def _gather(self, idx: Any) -> np.ndarray | list[np.ndarray]:
        recs = [self._read(int(i)) for i in idx]
        if self.shape is None:
            return recs
        return np.stack(recs) if recs else np.zeros((0, *self.shape), self.dtype)

    def __iter__(self) -> Iterator[np.ndarray]:
        for i in range(len(self)):
            yield self._read(i)

    def read(self) -> np.ndarray | list[np.ndarray]:
        """All logical records: stacked along a new axis 0, or a list when ragged."""
        return self[:]

    def at_step(self, step: int) -> np.ndarray | list[np.ndarray]:
        """The logical records of ``step`` (all calls, all meshes), stacked (a list if ragged).

        Raises:
            UnknownNameError: no logical record at ``step``.
        """
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
            raise InvalidArgumentError(f"step must be an int, got {step!r}")
        idx = self.step_indices(int(step))
        if idx.size == 0:
            raise UnknownNameError(f"field {self.name!r} of {self.handle.id!r} has no record at step {step!r}; "
                                   f"recorded steps: {sorted(set(self.steps.tolist()))[:20]}")
        return self._gather(idx)

    def norms(self) -> np.ndarray:
        """float64 L2 norm of every logical record (computed by reading them)."""
        return np.array([float(np.linalg.norm(np.asarray(x, np.float64).ravel())) for x in self], np.float64)

    def to_torch(self, i: int) -> Any:
        """Logical record ``i`` as a torch tensor of the recorded dtype (imports torch; exact: the
        read dtype holds every value of the recorded one)."""
        import torch

        x = np.ascontiguousarray(self._read(i))
        return torch.from_numpy(x.copy()).to(getattr(torch, self.dtype_name))

    def __repr__(self) -> str:
        return (f"LogicalField({self.handle.id!r}/{self.name!r}, records={len(self)}, dtype={self.dtype_name}, "
                f"shape={self.shape}, placements={self.placements})")


class _NoRecords:
    """A rank's field that recorded nothing (as a :class:`Field` with no entries)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.dtype_name = "float32"
        self.dtype = np.dtype(np.float32)
        self.shape = None
        self.steps = self.calls = self.records = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return 0


def _check_layout(handle: Any, name: str, rank: int, lay: dict[str, Any]) -> None:
    """A layout from a file's metadata (untrusted) has the documented keys and types."""
    ints = [lay.get(k) for k in ("mesh_shape", "mesh_ranks", "coordinate")]
    ok = (isinstance(lay.get("placements"), list) and all(isinstance(p, str) for p in lay["placements"])
          and all(isinstance(v, list) and all(type(x) is int for x in v) for v in ints)
          and len(lay["placements"]) == len(lay["mesh_shape"]) == len(lay["coordinate"]))
    if not ok:
        raise FormatError(f"rank {rank}'s DTensor layout of field {name!r} of handle {handle.id!r} is malformed "
                          f"({str(lay)[:200]}); read the local shards per rank with run.handle(handle_id, rank=r)")


def logical_field(handle: Any, name: str, rank_metas: list[tuple[int | None, dict[str, Any]]]) -> LogicalField | None:
    """The :class:`LogicalField` of ``name`` when every rank of ``handle`` recorded it as a DTensor
    with one layout; None otherwise (the plain field, rank-major, is then the right view).

    Args:
        handle: a handle spanning several ranks.
        name: the field name.
        rank_metas: ``(rank, handle meta)`` of each rank of the handle.

    Raises:
        FormatError: the ranks' layouts do not fit together, or a rank of a mesh is missing.
    """
    layouts: dict[int, dict[str, Any]] = {}
    for rank, meta in rank_metas:
        table = meta.get("dtensor") if isinstance(meta, dict) else None
        lay = table.get(name) if isinstance(table, dict) else None
        if rank is None or not isinstance(lay, dict) or lay.get("varies"):
            return None
        _check_layout(handle, name, rank, lay)
        try:
            [parse_placement(p) for p in lay["placements"]]
        except FormatError:  # e.g. _StridedShard: the local shards, rank-major
            return None
        layouts[int(rank)] = lay
    if len(layouts) < 2:
        return None
    return LogicalField(handle, name, layouts)
