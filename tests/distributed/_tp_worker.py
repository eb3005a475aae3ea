"""Worker for the gloo tensor-parallel tests: an MLP under ``parallelize_module`` (Rowwise into a
sequence-sharded output, SequenceParallel LayerNorm, Colwise, Rowwise; DTensor outputs), checked
against plain torch hooks on the unsharded model; ``mesh_shape=(2, 2)`` adds FSDP2 on the outer
(data-parallel) mesh dimension (a 2-D mesh as torchtitan composes them)."""

from __future__ import annotations

import copy
import faulthandler
import logging
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from hookline.storage import InvalidArgumentError
from hookline.tracker import HookManager, Recorder
from hookline.tracker.capture.dtensor import local_shard

STEPS = 2
NAMES = ["inp", "norm", "up", "act", "down"]
BATCH, SEQ, D_IN, D, HIDDEN = 2, 4, 6, 8, 12


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.norm = nn.Linear(D_IN, D), nn.LayerNorm(D)
        self.up, self.act, self.down = nn.Linear(D, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(self.norm(self.inp(x)))))


def _plan() -> dict:
    return {
        "inp": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False),
        "norm": SequenceParallel(use_local_output=False),
        "up": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        "down": RowwiseParallel(use_local_output=False),
    }


def _reference_hooks(model: nn.Module) -> dict[str, dict[str, list]]:
    """Plain torch hooks on the unsharded model: outputs, grad_out, grad_in per module."""
    seen: dict[str, dict[str, list]] = {k: {n: [] for n in NAMES} for k in ("outputs", "grad_out", "grad_in")}

    def backward(n: str, gi: tuple, go: tuple) -> None:
        seen["grad_out"][n].append(go[0].detach().clone())
        if gi[0] is not None:
            seen["grad_in"][n].append(gi[0].detach().clone())

    for n in NAMES:
        m = getattr(model, n)
        m.register_forward_hook(lambda m, i, o, n=n: seen["outputs"][n].append(o.detach().clone()))
        m.register_full_backward_hook(lambda m, gi, go, n=n: backward(n, gi, go))
    return seen


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _record(rank: int, mesh_shape: tuple[int, ...], root: Path, result: dict) -> Recorder:
    """Record the parallel model (run ``tp``) and the unsharded one (``ref``, rank 0 only, as a
    single-process run); returns a second, still open recorder (run ``late``)."""
    names = ("dp", "tp") if len(mesh_shape) == 2 else ("tp",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    seen = _reference_hooks(ref)
    parallelize_module(model, mesh["tp"], _plan())
    if "dp" in names:
        fully_shard(model, mesh=mesh["dp"])
    mgr = HookManager()
    rec = Recorder(root / "tp", every=1)
    late = Recorder(root / "late", every=1)  # closed after the process group is gone
    modules = {n: getattr(model, n) for n in NAMES}
    mgr.register_forward_hook(rec.outputs, **modules)
    mgr.register_backward_hook(rec.grads, **modules)
    mgr.register_forward_hook(rec.inputs, up=model.up)
    mgr.register_forward_hook(rec.hook("outputs", mode="stats"), up=model.up)  # the local shard's stats
    mgr.register_forward_hook(rec.hook("outputs", batch_slice=1, name="first"), up=model.up)
    HookManager().register_forward_hook(late.outputs, up=model.up, down=model.down)
    single = None
    if rank == 0:  # the unsharded model recorded by hookline too, as a single-process run
        single = Recorder(root / "ref", every=1, rank=0, world_size=1)
        HookManager().register_forward_hook(single.outputs, **{n: getattr(ref, n) for n in NAMES})
    dp = mesh["dp"].get_local_rank() if "dp" in names else 0
    g = torch.Generator().manual_seed(100 + dp)  # data differs across dp, not across tp
    comm: list[int] = []  # collectives of each recorded step (torch's CommDebugMode counts them)
    for step in range(STEPS):
        x = torch.randn(BATCH, SEQ, D_IN, generator=g)
        with rec.step(step), late.step(step), CommDebugMode() as counted:
            model(x).full_tensor().square().sum().backward()
        comm.append(counted.get_total_counts())
        if single is not None:
            with single.step(step):
                ref(x).square().sum().backward()
        else:
            ref(x).square().sum().backward()
    with rec.paused(), late.paused(), CommDebugMode() as counted:  # the same step, hooks suspended
        model(x).full_tensor().square().sum().backward()
    result["comm"] = {"recorded": comm, "paused": counted.get_total_counts()}
    try:  # batch_slice cannot keep the first items of a tensor sharded along dimension 0
        local_shard("outputs.0", DTensor.from_local(torch.ones(2, 3), mesh["tp"], [Shard(0)], run_check=False), 1)
    except InvalidArgumentError as e:
        result["refused"] = str(e)
    rec.close()
    if single is not None:
        single.close()
    result.update(seen=seen, dp=dp, sharded=[type(p).__name__ for p in model.parameters()])
    return late


def train(rank: int, world: int, init_file: str, root: str, out_dir: str, mesh_shape: tuple[int, ...]) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result: dict = {"rank": rank}
    said = _Said()
    logging.getLogger("hookline").addHandler(said)
    gone = False
    try:
        late = _record(rank, mesh_shape, Path(root), result)
        dist.barrier()
        dist.destroy_process_group()
        gone = True
        late.close()  # the group is gone: this rank's files close completely all the same
        late.close()
        result["said"] = said.messages
    except Exception as e:  # reported to the parent test through the result file
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        if not gone:
            dist.barrier()
            dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
