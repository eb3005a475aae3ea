"""Worker for the 2-process gloo FSDP2 test: one spawn records several FSDP2 variants, each
against an unsharded copy of the model run with plain torch hooks on the same rank's data."""

from __future__ import annotations

import copy
import faulthandler
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from hookline.tracker import HookManager, Recorder, select

#: variant -> (fully_shard keywords, activation checkpointing, torch.compile)
VARIANTS = {
    "plain": ({}, False, False),
    "bf16": ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16), "reshard_after_forward": False},
             False, False),
    "checkpoint": ({}, True, False),
    "compile": ({}, False, True),
}
STEPS = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 2)
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return self.head(x)


def _reference_hooks(model: nn.Module, names: list[str]) -> dict[str, dict[str, list]]:
    """Plain torch hooks on the unsharded model: outputs, grad_out, grad_in per module."""
    seen: dict[str, dict[str, list]] = {k: {n: [] for n in names} for k in ("outputs", "grad_out", "grad_in")}
    mods = dict(model.named_modules())

    def backward(n: str, gi: tuple, go: tuple) -> None:
        seen["grad_out"][n].append(go[0].detach().clone())
        seen["grad_in"][n].append(None if gi[0] is None else gi[0].detach().clone())

    for n in names:
        mods[n].register_forward_hook(lambda m, i, o, n=n: seen["outputs"][n].append(o.detach().clone()))
        mods[n].register_full_backward_hook(lambda m, gi, go, n=n: backward(n, gi, go))
    return seen


def _variant(name: str, rank: int, run_dir: str) -> dict:
    kwargs, ckpt, compiled = VARIANTS[name]
    torch.manual_seed(0)
    model = Net(ckpt)
    ref = copy.deepcopy(model)  # the unsharded model, eager (its hooks fire once per call)
    ref.ckpt = False
    bf16 = "mp_policy" in kwargs
    if bf16:
        ref = ref.to(torch.bfloat16)
    names = sorted(select(model, "*", types=nn.Linear))
    seen = _reference_hooks(ref, names)
    for b in model.blocks:
        fully_shard(b, **kwargs)
    fully_shard(model, **kwargs)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    mgr = HookManager()
    rec = Recorder(run_dir, every=1)
    layers = select(model, "*", types=nn.Linear)
    mgr.register_forward_hook(rec.outputs, **layers)
    mgr.register_backward_hook(rec.grads, **layers)
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for step in range(STEPS):
        x = torch.randn(3, 8, generator=g, requires_grad=True)
        with rec.step(step):
            run(x).square().sum().backward()
        xr = x.detach().to(torch.bfloat16 if bf16 else torch.float32).requires_grad_()
        ref(xr).square().sum().backward()
    rec.close()
    return {"names": names, "seen": seen, "sharded": all(
        type(p).__name__ == "DTensor" for p in model.parameters())}


def train(rank: int, world: int, init_file: str, root: str, out_dir: str) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result: dict = {"rank": rank}
    try:
        for name in VARIANTS:
            t0 = time.perf_counter()
            result[name] = _variant(name, rank, str(Path(root) / name))
            result[name]["seconds"] = time.perf_counter() - t0
    except Exception as e:  # reported to the parent test through the result file
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
