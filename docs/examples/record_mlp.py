"""Worked example: record a small MLP's activations and gradients, then analyse them offline.

Run:  python docs/examples/record_mlp.py [OUT_DIR]   (default: a new runs/example-<time> directory)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import torch

from hookline.storage import open_run
from hookline.tracker import HookManager, Recorder, select


def train(run_dir: Path, lr: float, steps: int = 60, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = torch.randn(512, 32)
    target = data[:, :1].sin()
    mgr = HookManager()
    with Recorder(run_dir, every=5) as rec:
        linears = select(model, "*", types=torch.nn.Linear)
        mgr.register_forward_hook(rec.outputs, **linears)
        mgr.register_backward_hook(rec.grads, **linears)
        # A cheap summary of every ReLU output, on every recorded step.
        mgr.register_forward_hook(rec.hook("outputs", mode="stats"), **select(model, "*", types=torch.nn.ReLU))
        for step in range(steps):
            idx = torch.randint(0, len(data), (32,))
            with rec.step(step):
                loss = torch.nn.functional.mse_loss(model(data[idx]), target[idx])
                opt.zero_grad()
                loss.backward()
            opt.step()
    print(rec.summary())


def main(out: Path) -> None:
    train(out / "lr0.05", lr=0.05)
    train(out / "lr0.5", lr=0.5)
    a, b = open_run(out / "lr0.05"), open_run(out / "lr0.5")
    print("handles:", a.handles)
    for handle in ("grads[0]", "grads[2]", "grads[4]"):
        na, nb = a[handle]["grad_out.0"].norms(), b[handle]["grad_out.0"].norms()
        print(f"{handle:10} mean |grad_out| lr=0.05: {np.mean(na):.4f}  lr=0.5: {np.mean(nb):.4f}")
    relu = a["outputs.stats[1]"]
    print("ReLU(1) output mean per recorded step:", np.round(relu["outputs.0.mean"].read(), 3))


if __name__ == "__main__":
    # A new directory per run by default: a Recorder refuses a directory that holds a run.
    main(Path(sys.argv[1] if len(sys.argv) > 1 else f"runs/example-{time.strftime('%Y%m%d-%H%M%S')}"))
