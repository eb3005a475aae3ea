"""Benchmark: the CLI against MLflow, as ratios to MLflow's own CLI, and Recorder.close() uploads.

Starts its own ``mlflow server`` on 127.0.0.1 (sqlite backend, proxied artifacts, ``--workers 1``
unless ``--server-workers N``: MLflow's own default is 4; see ``bench_mlflow.py``) in a scratch directory, records two tiny runs with a ``Recorder`` (an
MLP 8-16-16-1, outputs and gradients of its three Linear layers, 6 steps) into two MLflow runs,
then times, in rounds with the commands in shuffled order, each command as a fresh process with
``MLFLOW_TRACKING_URI`` pointing at the server:

* ``mlflow runs list --experiment-id ID`` (the baseline: MLflow's own CLI, one request);
* ``hookline runs``, ``hookline show runs:/ID`` (a fresh cache each time), ``hookline sync
  RUN_DIR --run-id ID`` (nothing to do): each as a ratio to the baseline of the same round
  (target <= 1.5x);
* ``hookline compare runs:/A runs:/B`` (reported, no target) and ``hookline show LOCAL_RUN``
  (seconds; target < 1 s).

Then, in-process (mlflow already imported, as in a training script that created its run):
``Recorder.close()`` of the same tiny recording with MLflow, the same without MLflow, and one
direct ``MlflowClient.log_artifacts`` of the closed run directory into a fresh run. The target
is on what MLflow adds to ``close()``: (close with MLflow - close without) / log_artifacts < 2x.

It also prints the requests each command sent (from the server's access log).

Usage::

    .venv/bin/python tests/benchmarks/bench_cli.py [--rounds 5] [--close-rounds 7] [--close-only]
                                                   [--server-workers 1]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mlflow import start_server, stop_server  # noqa: E402

BIN = Path(sys.executable).parent


def record(run_dir: Path, run_id: str | None, uri: str | None, seed: int = 0):
    """Record the tiny MLP; returns the open Recorder (the caller times close())."""
    import torch

    from hookline.tracker import HookManager, Recorder, select

    torch.manual_seed(seed)
    model = torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(8, 16), act=torch.nn.Tanh(),
                                            fc2=torch.nn.Linear(16, 16), act2=torch.nn.Tanh(),
                                            head=torch.nn.Linear(16, 1)))
    rec = Recorder(run_dir, mlflow_run_id=run_id, tracking_uri=uri)
    mgr = HookManager()
    layers = select(model, "*", types=torch.nn.Linear)
    mgr.register_forward_hook(rec.outputs, **layers)
    mgr.register_backward_hook(rec.grads, **layers)
    for step in range(6):
        with rec.step(step):
            model(torch.randn(4, 8)).sum().backward()
    return rec


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr[-2000:]}")
    return took


def requests_of(log: Path, since: int) -> list[str]:
    """The requests in the server's access log after line ``since`` (method and path)."""
    out = []
    for line in log.read_text(errors="replace").splitlines()[since:]:
        if '"GET ' in line or '"POST ' in line or '"PUT ' in line:
            req = line.split('"', 2)[1]
            out.append(req.split("?", 1)[0].replace(" HTTP/1.1", ""))
    return out


def commands(ids: list[str], exp: str, dirs: list[Path]) -> dict[str, list[str]]:
    hl, ml = str(BIN / "hookline"), str(BIN / "mlflow")
    return {
        "mlflow runs list": [ml, "runs", "list", "--experiment-id", exp],
        "hookline runs": [hl, "runs"],
        "hookline show runs:/ID": [hl, "show", f"runs:/{ids[0]}"],
        "hookline sync (nothing to do)": [hl, "sync", str(dirs[0]), "--run-id", ids[0]],
        "hookline compare runs:/A runs:/B": [hl, "compare", f"runs:/{ids[0]}", f"runs:/{ids[1]}", "-q"],
        "hookline show LOCAL_RUN": [hl, "show", str(dirs[0])],
    }


def bench_commands(uri: str, root: Path, rounds: int) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.create_experiment("bench-cli")
    ids, dirs = [], []
    for i in range(2):
        rid = client.create_run(exp, run_name=f"tiny-{i}").info.run_id
        rec = record(root / f"run{i}", rid, uri, seed=i)
        rec.close()
        ids.append(rid)
        dirs.append(root / f"run{i}")
    cmds = commands(ids, exp, dirs)
    env = dict(os.environ, MLFLOW_TRACKING_URI=uri)
    log = root / "server.log"
    print("requests per command (first call):")
    for name, cmd in cmds.items():
        n = len(log.read_text(errors="replace").splitlines())
        timed(cmd, dict(env, HOOKLINE_CACHE_DIR=str(root / "cache-warmup")))
        time.sleep(0.3)  # (the access log line is written after the answer)
        reqs = requests_of(log, n)
        print(f"  {name:34s} {len(reqs):2d}: {', '.join(reqs)}")
    secs: dict[str, list[float]] = {k: [] for k in cmds}
    ratios: dict[str, list[float]] = {k: [] for k in cmds}
    for r in range(rounds):
        order = list(cmds)
        random.shuffle(order)
        got = {}
        for name in order:
            got[name] = timed(cmds[name], dict(env, HOOKLINE_CACHE_DIR=str(root / f"cache-{r}-{len(got)}")))
        for name in cmds:
            secs[name].append(got[name])
            ratios[name].append(got[name] / got["mlflow runs list"])
    print(f"\n{rounds} rounds, commands in shuffled order; median seconds [min, max], median ratio to "
          "`mlflow runs list` of the same round:")
    targets = {"hookline runs": 1.5, "hookline show runs:/ID": 1.5, "hookline sync (nothing to do)": 1.5}
    for name in cmds:
        s = secs[name]
        line = f"  {name:34s} {statistics.median(s):6.2f} s [{min(s):.2f}, {max(s):.2f}]"
        if name != "mlflow runs list":
            ratio = statistics.median(ratios[name])
            line += f"   {ratio:5.2f}x"
            if name in targets:
                line += f"  (target <= {targets[name]}x: {'met' if ratio <= targets[name] else 'NOT met'})"
        if name == "hookline show LOCAL_RUN":
            med = statistics.median(s)
            line += f"  (target < 1 s: {'met' if med < 1.0 else 'NOT met'})"
        print(line)


def bench_close(uri: str, root: Path, rounds: int) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.create_experiment("bench-close")
    with_ml, without, direct = [], [], []
    log = root / "server.log"
    reqs: dict[str, list[str]] = {}
    for r in range(rounds):
        order = ["mlflow", "local"]
        random.shuffle(order)
        for kind in order:
            d = root / f"close-{kind}-{r}"
            if kind == "mlflow":
                rec = record(d, client.create_run(exp).info.run_id, uri)
            else:
                rec = record(d, None, None)
            n = len(log.read_text(errors="replace").splitlines())
            t0 = time.perf_counter()
            rec.close()
            (with_ml if kind == "mlflow" else without).append(time.perf_counter() - t0)
            if kind == "mlflow" and r == 0:
                time.sleep(0.3)
                reqs["Recorder.close()"] = requests_of(log, n)
        rid = client.create_run(exp).info.run_id
        n = len(log.read_text(errors="replace").splitlines())
        t0 = time.perf_counter()
        client.log_artifacts(rid, str(root / f"close-local-{r}"), "hookline")
        direct.append(time.perf_counter() - t0)
        if r == 0:
            time.sleep(0.3)
            reqs["log_artifacts"] = requests_of(log, n)
    files = sum(1 for p in (root / "close-local-0").rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in (root / "close-local-0").rglob("*") if p.is_file())
    added = [w - o for w, o in zip(with_ml, without)]
    ratio = statistics.median(a / d for a, d in zip(added, direct))
    raw = statistics.median(w / d for w, d in zip(with_ml, direct))
    med = statistics.median
    print(f"\nRecorder.close() of a tiny run ({files} files, {size / 1024:.0f} KiB), {rounds} rounds, median:")
    print(f"  close() with MLflow             {med(with_ml) * 1000:7.1f} ms")
    print(f"  close() without MLflow          {med(without) * 1000:7.1f} ms")
    print(f"  MlflowClient.log_artifacts      {med(direct) * 1000:7.1f} ms  (the same files, one call)")
    print(f"  added by MLflow / log_artifacts {ratio:7.2f}x  (target < 2x: {'met' if ratio < 2 else 'NOT met'})")
    print(f"  close() with MLflow / log_artifacts {raw:5.2f}x")
    for name, got in reqs.items():
        print(f"  requests of {name}: {len(got)}: {', '.join(x.split(' ')[0] + ' ' + x.split('/')[-1] for x in got)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds of the CLI commands")
    ap.add_argument("--close-rounds", type=int, default=7, help="rounds of the close() comparison")
    ap.add_argument("--close-only", action="store_true", help="skip the CLI commands (close() comparison only)")
    ap.add_argument("--server-workers", type=int, default=1,
                    help="worker processes of the mlflow server (default 1: one request at a time; "
                         "`mlflow server` itself defaults to 4)")
    args = ap.parse_args()
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    root = Path(tempfile.mkdtemp(prefix="hookline-bench-cli-"))
    proc, uri = start_server(root, workers=args.server_workers)
    try:
        print(f"mlflow server {uri} ({args.server_workers} worker(s)); load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores\n")
        if not args.close_only:
            bench_commands(uri, root, args.rounds)
        bench_close(uri, root, args.close_rounds)
        print(f"\nload average at the end {os.getloadavg()[0]:.2f}")
    finally:
        stop_server(proc)
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
