"""Benchmark: what a DTensor firing costs the recorder next to a plain tensor of the same local size.

Run: ``python tests/benchmarks/bench_dtensor.py [--repeats 15] [--calls 2000]``

One process, a gloo group of one rank and a 1-D CPU mesh (DTensor needs a process group; the
capture path is the same on every rank: ``to_local()``, a cached layout, the copy). A module
that returns its input is hooked with ``rec.outputs``; per call, the forward of a plain
``(64, 256)`` float32 tensor and of a DTensor whose local shard is that tensor (``Shard(1)``)
are timed with the recorder's hook and without any hook. Variants alternate within each repeat;
the printed numbers are medians over repeats of the per-call time (process CPU time), and the
ratio is DTensor hook cost / plain hook cost measured in the same repeat.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from hookline.tracker import HookManager, Recorder


class Echo(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def _per_call(mod: nn.Module, x: torch.Tensor, calls: int) -> float:
    t0 = time.process_time()
    for _ in range(calls):
        mod(x)
    return (time.process_time() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp())
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'init'}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain = torch.randn(64, 256)
    dt = DTensor.from_local(plain, mesh, [Shard(1)], run_check=False)
    bare, hooked = Echo(), Echo()
    rec = Recorder(tmp / "run", every=1, rank=0, world_size=1, max_buffer_mb=64)
    HookManager().register_forward_hook(rec.outputs, m=hooked)
    rows: dict[str, list[float]] = {k: [] for k in ("plain bare", "plain hooked", "dtensor bare", "dtensor hooked")}
    with rec.step(0):
        for _ in range(3):  # warm up: blocks, buffers, the layout cache
            _per_call(hooked, plain, 200), _per_call(hooked, dt, 200)
        for _ in range(args.repeats):
            rows["plain bare"].append(_per_call(bare, plain, args.calls))
            rows["plain hooked"].append(_per_call(hooked, plain, args.calls))
            rows["dtensor bare"].append(_per_call(bare, dt, args.calls))
            rows["dtensor hooked"].append(_per_call(hooked, dt, args.calls))
            rec.flush()
    rec.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = [(dh - db) / (ph - pb) for ph, pb, dh, db in zip(rows["plain hooked"], rows["plain bare"],
                                                               rows["dtensor hooked"], rows["dtensor bare"])]
    for k, v in med.items():
        print(f"{k:16s} {v:8.2f} us/call")
    print(f"hook cost: plain {med['plain hooked'] - med['plain bare']:.2f} us, "
          f"DTensor {med['dtensor hooked'] - med['dtensor bare']:.2f} us; "
          f"ratio DTensor/plain (median of same-repeat ratios) {statistics.median(ratios):.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
