"""Worked example: record a model trained with FSDP2, tensor parallelism, or both on a 2-D mesh.

Run (CPU, gloo; the same code runs on GPUs with ``nccl`` and ``init_device_mesh("cuda", ...)``):

    torchrun --nproc_per_node 2 docs/examples/parallel.py fsdp RUN_DIR
    torchrun --nproc_per_node 2 docs/examples/parallel.py tp   RUN_DIR
    torchrun --nproc_per_node 4 docs/examples/parallel.py 2d   RUN_DIR   # dp=2 x tp=2

Rank 0 then opens the run and prints each handle's field: what the reader gives (logical
tensors for DTensor fields, per-rank records otherwise) and its per-record shape.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from hookline.storage import open_run
from hookline.tracker import HookManager, Recorder, select


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.act, self.down = nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([MLP(), MLP()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def build(mode: str) -> tuple[nn.Module, int]:
    """The parallel model, and the data-parallel index of this rank (ranks of one TP group share data)."""
    torch.manual_seed(0)
    model = Net()
    world = dist.get_world_size()
    if mode == "fsdp":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for b in model.blocks:
            fully_shard(b, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model, dist.get_rank()
    mesh = init_device_mesh("cpu", (world // 2, 2) if mode == "2d" else (world,),
                            mesh_dim_names=("dp", "tp") if mode == "2d" else ("tp",))
    for b in model.blocks:  # DTensor outputs: recorded as local shards, read back as logical tensors
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(use_local_output=False),
                                           "down": RowwiseParallel()})
    if mode == "2d":
        for b in model.blocks:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model, mesh["dp"].get_local_rank()
    return model, 0


def main(mode: str, run_dir: str) -> None:
    dist.init_process_group("gloo")
    model, dp = build(mode)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mgr = HookManager()
    rec = Recorder(run_dir, every=2)                   # a collective: every rank creates it
    layers = select(model, "blocks.*.up") | select(model, "blocks.*.down")
    mgr.register_forward_hook(rec.outputs, **layers)
    mgr.register_backward_hook(rec.grads, **layers)
    g = torch.Generator().manual_seed(dp)
    for step in range(6):
        with rec.step(step):
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    rec.close()                                        # a collective too: before destroying the group
    if dist.get_rank() == 0:
        run = open_run(run_dir)
        for hid in run.handles:
            for name in run[hid].fields:
                f = run[hid][name]
                print(f"{hid:22s} {name:11s} {type(f).__name__:12s} records={len(f)} shape={f.shape} "
                      f"dtype={f.dtype_name}")
    dist.destroy_process_group()


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("fsdp", "tp", "2d"):
        sys.exit("usage: torchrun --nproc_per_node N parallel.py {fsdp|tp|2d} RUN_DIR")
    main(sys.argv[1], sys.argv[2])
