"""Worker for the 2-process gloo DDP tests (imported by torch.multiprocessing.spawn children): one
process group runs every scenario of the tests in turn."""

from __future__ import annotations

import faulthandler
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hookline.tracker import HookManager, Recorder, select


def train(rank: int, world: int, init_file: str, scenarios: list[dict], uri: str | None, out_dir: str) -> None:
    """Run each scenario (``run_dir``, ``name``, and the keywords of :func:`_scenario`) in turn in
    one process group: starting two processes costs far more than a scenario does. Every
    scenario's failure is agreed on by both ranks, so they stay in step for the next one."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for sc in scenarios:
            # A worker stuck for 150 s prints every thread's stack to stderr and exits, so the parent
            # test fails with where it hung instead of running into pytest's timeout with no trace.
            faulthandler.dump_traceback_later(150, exit=True)
            result = _scenario(rank, sc["run_dir"], uri if sc.get("mlflow") else None,
                               sc.get("extra_handle_on_rank", -1), sc.get("run_ids"))
            torch.save(result, Path(out_dir) / f"{sc['name']}.rank{rank}.pt")
            # Go on together: a rank tearing gloo down (or starting the next scenario) while its
            # peer is still in a collective can abort the peer.
            dist.barrier()
            faulthandler.cancel_dump_traceback_later()
    finally:
        dist.destroy_process_group()


def _scenario(rank: int, run_dir: str, uri: str | None, extra_handle_on_rank: int, run_ids: tuple | None) -> dict:
    """Train 3 steps of a DDP model recording into ``run_dir``; what each rank saw, or its error."""
    result: dict = {"rank": rank}
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        ddp = DDP(model)
        run_id = None
        if rank == 0 and uri is not None:
            from mlflow import MlflowClient

            client = MlflowClient(uri)
            run_id = client.create_run(client.create_experiment(f"ddp-{Path(run_dir).parent.name}")).info.run_id
        if run_ids is not None:  # each rank passes its own (possibly conflicting) id
            run_id = run_ids[rank]
        mgr = HookManager()
        rec = Recorder(run_dir, every=1, mlflow_run_id=run_id, tracking_uri=uri)
        linears = select(ddp, "*", types=nn.Linear)  # names without DDP's "module." prefix
        result["names"] = sorted(linears)
        mgr.register_forward_hook(rec.outputs, **linears)
        mgr.register_backward_hook(rec.grads, **linears)
        if rank == extra_handle_on_rank:
            mgr.register_forward_hook(rec.inputs, relu=model[1])
        seen: dict[str, list] = {n: [] for n in linears}
        seen_grad: dict[str, list] = {n: [] for n in linears}
        for n, m in linears.items():
            m.register_forward_hook(lambda m, i, o, n=n: seen[n].append(o.detach().clone()))
            # torch's own full backward hook as the reference for grad_out (no in-place ops here)
            m.register_full_backward_hook(lambda m, gi, go, n=n: seen_grad[n].append(go[0].detach().clone()))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        for step in range(3):
            with rec.step(step):
                loss = ddp(torch.randn(5, 4, generator=g)).square().sum()
                opt.zero_grad()
                loss.backward()
            opt.step()
        result["run_id"] = rec.mlflow_run_id
        result["seen"] = seen
        result["seen_grad"] = seen_grad
        rec.close()
    except Exception as e:  # reported to the parent test through the result file
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    return result
