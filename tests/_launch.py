"""Launching a worker function in N gloo processes (``torch.multiprocessing.spawn``) and
collecting each rank's result file (``<out>/rank<r>.pt``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def spawn(fn: Callable[..., None], nprocs: int, out: Path, *args: Any, timeout: float = 300) -> list[dict]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; every rank must save ``out/rank<r>.pt``."""
    out.mkdir(exist_ok=True)
    ctx = mp.spawn(fn, args=args, nprocs=nprocs, join=False)
    exits = []
    while True:
        try:
            if ctx.join(timeout=timeout):
                break
        except mp.ProcessExitedException as e:
            # gloo occasionally aborts a process while tearing the group down, after the worker
            # saved its result; every result is still checked by the caller.
            exits.append(str(e))
            if all(not p.is_alive() for p in ctx.processes):
                break
    missing = [r for r in range(nprocs) if not (out / f"rank{r}.pt").exists()]
    assert not missing, f"ranks {missing} died before reporting: {exits}"
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(nprocs)]
    for r in results:
        assert "error" not in r, r.get("traceback")
    return results
