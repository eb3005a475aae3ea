"""Benchmark: MLflow upload cost of a run with many handles, batched (hookline) vs naive.

Starts its own ``mlflow server`` on 127.0.0.1 (sqlite backend, proxied artifacts, ``--workers 1``)
in a scratch directory, writes a run directory with ``--handles`` handles of ``--records``
records each, then registers it with two fresh MLflow runs:

* batched: ``hookline.storage.sync`` (``log_batch`` for tags and metrics, parallel uploads);
* naive: one request per tag (``set_tag``) and per metric point (``log_metric``), sequential
  ``log_artifact`` per file - what a straightforward integration does.

Both runs end up with the same tags, metrics and artifacts (checked). Also reports the cost of
``MlflowAdapter.submit`` on the calling (training) thread, and the same comparison against the
embedded sqlite store.

Usage::

    .venv/bin/python tests/benchmarks/bench_mlflow.py [--handles 100] [--records 5] [--no-sqlite]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(root: Path, workers: int = 1) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    env.pop("MLFLOW_TRACKING_URI", None)
    log = open(root / "server.log", "wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).with_name("mlflow")), "server", "--backend-store-uri", f"sqlite:///{root / 'srv.db'}",
         "--artifacts-destination", str(root / "srv-artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(uri + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, uri
        except OSError:
            time.sleep(0.25)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError(f"server did not start; see {root / 'server.log'}")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def build_run(path: Path, handles: int, records: int) -> None:
    """A run directory written with the real RunWriter: ``handles`` Linear output handles."""
    from hookline.storage import RunWriter

    rng = np.random.default_rng(0)
    w = RunWriter(path, fsync=False)
    ids = [f"outputs[layers.{i}]" for i in range(handles)]
    for hid in ids:
        w.add_handle(hid, module_name=hid[8:-1], module_type="torch.nn.modules.linear.Linear",
                     category="forward_hook", hook_fn_name="outputs")
    for step in range(records):
        for hid in ids:
            w.write(hid, step * 10, 0, {"outputs.0": rng.standard_normal((64, 64)).astype(np.float32)})
    w.close()


def naive_upload(client, run_id: str, run_dir: Path, like_run: str) -> int:
    """Log the same tags/metrics/artifacts as ``like_run`` one request at a time; returns requests."""
    ref = client.get_run(like_run).data
    n = 0
    for k, v in ref.tags.items():
        if k.startswith("hookline"):
            client.set_tag(run_id, k, v)
            n += 1
    for k in ref.metrics:
        for m in client.get_metric_history(like_run, k):
            client.log_metric(run_id, k, m.value, timestamp=m.timestamp, step=m.step)
            n += 1
    for p in sorted(run_dir.rglob("*")):
        if p.is_file() and p.suffix in (".h5", ".json"):
            rel = p.relative_to(run_dir).parent.as_posix()
            client.log_artifact(run_id, str(p), "hookline" if rel == "." else f"hookline/{rel}")
            n += 1
    return n


def measure(uri: str, run_dir: Path, label: str) -> dict:
    from mlflow import MlflowClient

    from hookline.storage import MlflowAdapter, sync

    client = MlflowClient(uri)
    exp = client.create_experiment(f"bench-{label}-{time.time_ns()}")
    r_batched = client.create_run(exp).info.run_id
    t0 = time.perf_counter()
    rep = sync(run_dir, r_batched, tracking_uri=uri)
    t_batched = time.perf_counter() - t0
    assert rep.ok, rep.errors
    t0 = time.perf_counter()
    rep2 = sync(run_dir, r_batched, tracking_uri=uri)
    t_repeat = time.perf_counter() - t0
    assert rep2.ok and not rep2.uploaded and rep2.metrics == 0

    r_naive = client.create_run(exp).info.run_id
    t0 = time.perf_counter()
    requests = naive_upload(client, r_naive, run_dir, r_batched)
    t_naive = time.perf_counter() - t0
    a, b = client.get_run(r_batched).data, client.get_run(r_naive).data
    assert {k: v for k, v in a.tags.items() if k.startswith("hookline")} == \
        {k: v for k, v in b.tags.items() if k.startswith("hookline")}
    assert a.metrics == b.metrics

    # training-thread cost of a background pass
    r_async = client.create_run(exp).info.run_id
    ad = MlflowAdapter(r_async, tracking_uri=uri)
    t0 = time.perf_counter()
    ad.submit(run_dir)
    t_submit = time.perf_counter() - t0
    t0 = time.perf_counter()
    ad.close()
    t_close = time.perf_counter() - t0
    return {"store": label, "batched_s": round(t_batched, 2), "repeat_sync_s": round(t_repeat, 2),
            "naive_s": round(t_naive, 2), "naive_requests": requests,
            "naive_over_batched": round(t_naive / t_batched, 1), "metric_points": rep.metrics,
            "tags": rep.tags, "files": len(rep.uploaded), "submit_ms": round(t_submit * 1000, 3),
            "close_after_submit_s": round(t_close, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handles", type=int, default=100)
    ap.add_argument("--records", type=int, default=5)
    ap.add_argument("--no-sqlite", action="store_true", help="skip the embedded sqlite store")
    args = ap.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="hookline-bench-mlflow-"))
    proc = None
    try:
        run_dir = scratch / "run"
        build_run(run_dir, args.handles, args.records)
        size = sum(p.stat().st_size for p in run_dir.rglob("*") if p.is_file())
        print(f"run: {args.handles} handles x {args.records} records, {size / 1e6:.1f} MB", flush=True)
        results = []
        proc, uri = start_server(scratch)
        results.append(measure(uri, run_dir, "server"))
        print(json.dumps(results[-1]), flush=True)
        if not args.no_sqlite:
            from mlflow import MlflowClient

            db = f"sqlite:///{scratch / 'embedded.db'}"
            cwd = os.getcwd()
            os.chdir(scratch)  # the embedded store's ./mlruns artifacts go into the scratch dir
            try:
                MlflowClient(db).search_experiments()
                results.append(measure(db, run_dir, "sqlite"))
            finally:
                os.chdir(cwd)
            print(json.dumps(results[-1]), flush=True)
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
