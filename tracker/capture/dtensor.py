"""DTensor leaves of a firing: the rank's local shard, and its layout for the handle's metadata.

A ``torch.distributed.tensor.DTensor`` (tensor parallelism, ``use_local_output=False``) is
recorded as the rank's local shard (``to_local()``: no collective, no copy). Its layout goes into
the handle's metadata under ``"dtensor"`` (one entry per field), so the reader can reassemble the
logical tensor from the ranks' files (``hookline.storage.shards``). Along a mesh dimension where
the tensor is replicated, only mesh coordinate 0 stores it: the other ranks record the record
without the field (a replicated tensor is stored once, not once per rank).

Placements are written as ``"shard:<dim>"``, ``"replicate"`` and ``"partial:<op>"`` (``sum``,
``avg``, ``max``, ``min``); any other placement (``_StridedShard``...) as its ``repr``, which the
reader refuses to reassemble (the local shards stay readable).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from hookline.storage.errors import InvalidArgumentError

__all__ = ["ShardLayout", "local_shard", "is_dtensor"]

_TENSOR = torch.Tensor


def _dtensor_class() -> type | None:
    # Without torch.distributed.tensor imported no DTensor exists: nothing to import here.
    mod = sys.modules.get("torch.distributed.tensor")
    return getattr(mod, "DTensor", None) if mod is not None else None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (cheap for plain tensors: one type comparison)."""
    if type(t) is _TENSOR:
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def _placement(p: Any) -> str:
    name = type(p).__name__
    if name == "Shard":
        return f"shard:{p.dim}"
    if name == "Replicate":
        return "replicate"
    if name == "Partial":
        return f"partial:{p.reduce_op}"
    return repr(p)  # e.g. _StridedShard: recorded, not reassembled


class ShardLayout:
    """Where a DTensor's local shard sits: placements, mesh, this rank's coordinate.

    Attributes:
        placements: one placement string per mesh dimension (module docstring).
        mesh_shape, mesh_dim_names: the device mesh.
        mesh_ranks: the mesh's global ranks, flattened in row-major order.
        coordinate: this rank's coordinate in the mesh.
        stores: whether this rank stores the tensor (coordinate 0 on every replicated dim).
    """

    __slots__ = ("placements", "mesh_shape", "mesh_dim_names", "mesh_ranks", "coordinate", "stores")

    def __init__(self, t: Any) -> None:
        mesh = t.device_mesh
        self.placements = tuple(_placement(p) for p in t.placements)
        self.mesh_shape = tuple(int(s) for s in mesh.shape)
        self.mesh_dim_names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        self.mesh_ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        coord = mesh.get_coordinate()  # (from the mesh's own rank table: no collective)
        self.coordinate = tuple(int(c) for c in coord) if coord is not None else None
        self.stores = self.coordinate is not None and all(
            c == 0 for c, p in zip(self.coordinate, self.placements) if p == "replicate")

    def key(self) -> tuple:
        """What identifies the layout (a field whose layout changes between records is marked)."""
        return (self.placements, self.mesh_shape, self.mesh_ranks, self.coordinate)

    def to_json(self) -> dict[str, Any]:
        """The handle-metadata entry of a field with this layout."""
        return {"placements": list(self.placements), "mesh_shape": list(self.mesh_shape),
                "mesh_dim_names": list(self.mesh_dim_names) if self.mesh_dim_names else None,
                "mesh_ranks": list(self.mesh_ranks), "coordinate": list(self.coordinate or ()),
                "stored": self.stores}


#: (id(mesh), placements) -> (mesh, layout): a layout is made once per mesh and placements, not
#: per firing (reading the mesh's rank table costs a few microseconds).
_LAYOUTS: dict[tuple[int, Any], tuple[Any, ShardLayout]] = {}


def _layout_of(t: Any) -> ShardLayout:
    mesh, placements = t.device_mesh, t.placements
    key = (id(mesh), placements)
    hit = _LAYOUTS.get(key)
    if hit is not None and hit[0] is mesh:
        return hit[1]
    layout = ShardLayout(t)
    if len(_LAYOUTS) >= 256:  # bounded: meshes made and dropped in a loop
        _LAYOUTS.clear()
    _LAYOUTS[key] = (mesh, layout)
    return layout


def local_shard(name: str, t: Any, batch_slice: int | None) -> tuple[torch.Tensor, ShardLayout]:
    """The local shard of DTensor ``t`` (detached, sliced) and its layout.

    Raises:
        InvalidArgumentError: ``batch_slice`` on a tensor sharded along dimension 0 (the first K
            items of the logical tensor are not the first K of each shard).
    """
    layout = _layout_of(t)
    with torch.no_grad():  # to_local() then hands back the local tensor itself, not an autograd op
        local = t.to_local().detach()
    if batch_slice is not None and local.dim() > 0:
        if "shard:0" in layout.placements or f"shard:{-t.dim()}" in layout.placements:
            raise InvalidArgumentError(
                f"field {name!r} is a DTensor sharded along dimension 0 {list(layout.placements)}, so "
                f"batch_slice={batch_slice} cannot keep its first items on each rank; drop batch_slice "
                f"for this hook (rec.hook(..., batch_slice=None))")
        local = local[:batch_slice]
    return local, layout
