"""Recorder(..., mlflow_run_id=...) registers every handle's data with the MLflow run."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from mlflow import MlflowClient
from torch import nn

from hookline.storage import TrackingError, open_run
from hookline.tracker import HookManager, Recorder, select


def _record(run_dir, run_id, uri, steps=4):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    mgr = HookManager()
    rec = Recorder(run_dir, every=2, mlflow_run_id=run_id, tracking_uri=uri)
    mgr.register_forward_hook(rec.outputs, **select(model, "*", types=nn.Linear))
    mgr.register_backward_hook(rec.grads, **select(model, "*", types=nn.Linear))
    for step in range(steps):
        with rec.step(step):
            model(torch.randn(3, 4)).sum().backward()
        if step == 1:
            rec.flush()  # mid-run: metrics go to MLflow in the background
    return rec, rec.close()


@pytest.mark.parametrize("store", ["sqlite", "server"])
def test_recorder_logs_artifacts_tags_and_metrics(tmp_path, store, request):
    uri = request.getfixturevalue("sqlite_tracking_uri" if store == "sqlite" else "mlflow_server")
    client = MlflowClient(uri)
    exp = client.create_experiment(f"rec-{store}-{tmp_path.name}", artifact_location=(tmp_path / "art").as_uri())
    run_id = client.create_run(exp).info.run_id
    rec, summary = _record(tmp_path / "run", run_id, uri)
    assert summary.mlflow_error is None and summary.records == 8
    # artifacts: byte-identical handle files + manifest
    arts = {a.path for a in client.list_artifacts(run_id, "hookline")}
    assert "hookline/manifest.json" in arts
    local = open_run(tmp_path / "run")
    for hid in local.handles:
        key = local[hid].key
        got = client.download_artifacts(run_id, f"hookline/{key}.h5", str(tmp_path / "dl"))
        want = tmp_path / "run" / f"{key}.h5"
        assert hashlib.sha256(open(got, "rb").read()).digest() == hashlib.sha256(want.read_bytes()).digest()
    # queryable: the run is found by a handle tag and a module-type tag
    found = client.search_runs([exp], filter_string="tags.`hookline.has.Linear` = 'true'")
    assert [r.info.run_id for r in found] == [run_id]
    # per-step norm series equal the norms of the recorded data
    run = client.get_run(run_id)
    series = [k for k in run.data.metrics if k.endswith(".norm") and "grad_out" in k]
    assert series, sorted(run.data.metrics)
    hist = client.get_metric_history(run_id, series[0])
    assert sorted(m.step for m in hist) == [0, 2]
    # reading back through MLflow gives the same data
    remote = open_run(f"runs:/{run_id}", tracking_uri=uri, cache_dir=tmp_path / "cache")
    for hid in local.handles:
        for f in local[hid].fields:
            np.testing.assert_array_equal(remote[hid][f].read(), local[hid][f].read())


def test_dead_server_keeps_local_files_and_reports(tmp_path):
    """A tracking server that is down: nothing listens on its port (as after it was killed; a
    server started and killed for this cost seconds and showed nothing more)."""
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{sock.getsockname()[1]}"
    run_id = "0123456789abcdef0123456789abcdef"
    with pytest.raises(TrackingError) as e:
        _record(tmp_path / "run", run_id, uri)
    assert run_id in str(e.value) or "sync" in str(e.value)
    run = open_run(tmp_path / "run")  # local data complete
    assert len(run.handles) == 4 and all(len(run[h].steps) == 2 for h in run.handles)


def _script_without_close(tmp_path, uri: str, body: str) -> tuple[MlflowClient, str]:
    """Run ``body`` in a fresh interpreter after creating ``rec`` (a Recorder with MLflow, its
    outputs hook on ``m = Linear(4, 2)``), which the script never closes; return the MLflow
    client and run id."""
    import subprocess
    import sys

    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment(f"exit-{tmp_path.name}")).info.run_id
    code = (
        "import threading, time, torch\n"
        "from hookline.tracker import HookManager, Recorder\n"
        "m = torch.nn.Linear(4, 2)\n"
        f"rec = Recorder({str(tmp_path / 'run')!r}, mlflow_run_id={run_id!r}, tracking_uri={uri!r})\n"
        "HookManager().register_forward_hook(rec.outputs, lin=m)\n" + body
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and "ERROR" not in out.stderr and "Error" not in out.stderr, out.stderr
    return client, run_id


def test_a_recorder_left_open_at_exit_uploads_its_files(tmp_path, sqlite_tracking_uri):
    """The recorder closes before the MLflow adapters' exit hook (which found the writer still
    open and uploaded no file: the run had metrics and no artifacts)."""
    client, run_id = _script_without_close(tmp_path, sqlite_tracking_uri, (
        "for step in range(5):\n"
        "    with rec.step(step):\n"
        "        m(torch.randn(3, 4))\n"
        "rec.flush()\n"  # (a mid-run pass too) -- and no close(): the exit hooks must finish
    ))
    arts = {a.path for a in client.list_artifacts(run_id, "hookline")}
    assert {"hookline/manifest.json", "hookline/outputs"} <= arts, arts
    assert [a.path for a in client.list_artifacts(run_id, "hookline/outputs")] == ["hookline/outputs/lin.h5"]
    assert len(open_run(tmp_path / "run")["outputs[lin]"]) == 5


def test_training_in_a_thread_after_main_returned_is_not_cut_off(tmp_path, sqlite_tracking_uri):
    """The exit hook runs before Python joins the threads still running: it must not close the
    recorder under a training thread (it raised WriterClosedError there and lost the records)."""
    _script_without_close(tmp_path, sqlite_tracking_uri, (
        "def train():\n"
        "    for step in range(30):\n"
        "        with rec.step(step):\n"
        "            m(torch.randn(3, 4))\n"
        "        time.sleep(0.02)\n"
        "threading.Thread(target=train).start()\n"  # non-daemon; main returns at once
    ))
    assert len(open_run(tmp_path / "run")["outputs[lin]"]) == 30
