"""hookline's own MLflow calls have a time budget: failing or hanging servers fail fast.

The failing servers are real HTTP servers on 127.0.0.1 (``http.server`` in a thread): one that
answers every request with HTTP 500, one that answers ``/health`` and then never answers, and one
that answers the reachability probe but hangs on every real MLflow call. The budget is set short
(``HOOKLINE_MLFLOW_TIMEOUT`` / ``mlflow_timeout=``) so the tests are quick; one test checks the
default. Afterwards the same run directory syncs completely to a real ``mlflow server``.
"""

from __future__ import annotations

import http.server
import os
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from _mlflow_support import LINEAR, HandleSpec, build_run, sha256
from click.testing import CliRunner
from torch import nn

from hookline.cli.main import cli
from hookline.storage import InvalidArgumentError, TrackingError, TrackingUnreachableError, mlflow_source, sync
from hookline.storage.mlflow.client import BUDGET_S, CallBudget, budget_seconds
from hookline.storage.mlflow.upload import Uploader
from hookline.tracker import HookManager, Recorder, select

RUN_ID = "0123456789abcdef0123456789abcdef"
BUDGET = 1.0  # seconds, for the tests (each failing call waits it out)
PROBE = "/api/2.0/mlflow/experiments/get"  # (commands probe with it; a pass's probe is its get_run)
RUN_PROBE = "/api/2.0/mlflow/runs/get"
SPECS = [HandleSpec("outputs[blocks.0]", LINEAR, "outputs.0")]
#: (server mode, what the error says it answered)
ANSWERS = [("500", "answered HTTP 500"), ("hang", "no answer to GET /api/2.0/mlflow/"),
           ("hang_after_probe", f"did not finish get_run within {BUDGET:g} s")]


class _Fake(http.server.BaseHTTPRequestHandler):
    """``mode``: ``"500"`` (every request), ``"hang"`` (``/health`` answers, nothing else does),
    ``"hang_after_probe"`` (``/health`` and the reachability probes answer, with no run: MLflow's
    own calls hang)."""

    mode = "500"
    release: threading.Event

    def _serve(self) -> None:
        path = self.path.split("?", 1)[0]
        probe = path == PROBE or (path == RUN_PROBE and "User-Agent: Python-urllib" in str(self.headers))
        answers = path == "/health" or (self.mode == "hang_after_probe" and probe)
        if self.mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"boom")
        elif answers:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b"{}")
        else:
            self.release.wait(600)  # hangs until the test ends

    do_GET = do_POST = do_PUT = _serve

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator:
    """``start(mode) -> uri`` of a failing server; stopped at teardown."""
    servers = []

    def start(mode: str) -> str:
        release = threading.Event()
        handler = type("Handler", (_Fake,), {"mode": mode, "release": release})
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append((srv, release))
        return f"http://127.0.0.1:{srv.server_port}"

    yield start
    for srv, release in servers:
        release.set()
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def short_budget(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setenv("HOOKLINE_MLFLOW_TIMEOUT", str(BUDGET))
    return BUDGET


def _train(run_dir: Path, run_id: str, uri: str, steps: int = 6) -> tuple[Recorder, list[float]]:
    """Record a tiny model; returns the open recorder and the seconds each step (and flush) took."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    rec = Recorder(run_dir, mlflow_run_id=run_id, tracking_uri=uri)
    mgr = HookManager()
    mgr.register_forward_hook(rec.outputs, **select(model, "*", types=nn.Linear))
    mgr.register_backward_hook(rec.grads, **select(model, "*", types=nn.Linear))
    times = []
    for step in range(steps):
        t0 = time.perf_counter()
        with rec.step(step):
            model(torch.randn(3, 4)).sum().backward()
        rec.flush()  # each flush submits a background pass to the failing server
        times.append(time.perf_counter() - t0)
    return rec, times


def _files(run_dir: Path) -> dict[str, str]:
    return {p.relative_to(run_dir).as_posix(): sha256(p) for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mode,answer", ANSWERS)
def test_close_fails_within_the_budget_and_sync_later_uploads_everything(
        mode, answer, fake_server, short_budget, mlflow_server, tmp_path):
    """Recorder.close() against a failing server raises a TrackingError naming the URI and what
    it answered, within the budget; training never waits; the files are complete and a later
    sync to a real server uploads every one of them."""
    from mlflow import MlflowClient

    bad = fake_server(mode)
    rec, step_times = _train(tmp_path / "run", RUN_ID, bad)
    assert max(step_times) < 1.0, step_times  # the failing server never blocks a training step
    t0 = time.perf_counter()
    with pytest.raises(TrackingError) as ei:
        rec.close()
    took = time.perf_counter() - t0
    assert took < short_budget + 2.0, f"close() took {took:.1f} s with a {short_budget} s budget"
    msg = str(ei.value)
    assert repr(bad) in msg and answer in msg and "hookline sync" in msg, msg
    assert isinstance(ei.value, TrackingUnreachableError)

    files = _files(tmp_path / "run")
    assert {"manifest.json", "outputs/0.h5", "outputs/2.h5", "grads/0.h5", "grads/2.h5"} <= set(files)
    client = MlflowClient(mlflow_server)
    rid = client.create_run(client.create_experiment(f"budget-{mode}-{tmp_path.name}")).info.run_id
    report = sync(tmp_path / "run", rid, tracking_uri=mlflow_server, mlflow_timeout=60)  # (a working server)
    assert report.ok and sorted(report.uploaded) == sorted(f"hookline/{f}" for f in files)
    for rel, digest in files.items():
        got = client.download_artifacts(rid, f"hookline/{rel}", str(tmp_path / "dl"))
        assert sha256(Path(got)) == digest
    assert _files(tmp_path / "run") == files  # nothing local was touched


@pytest.mark.parametrize("mode,answer", ANSWERS)
def test_sync_runs_and_show_fail_within_the_budget(mode, answer, fake_server, short_budget, tmp_path):
    bad = fake_server(mode)
    built = build_run(tmp_path / "run", SPECS, records=2)
    before = _files(built.path)
    t0 = time.perf_counter()
    with pytest.raises(TrackingUnreachableError) as ei:
        sync(built.path, RUN_ID, tracking_uri=bad)
    assert time.perf_counter() - t0 < short_budget + 2.0
    assert repr(bad) in str(ei.value) and answer in str(ei.value), str(ei.value)
    with pytest.raises(TrackingUnreachableError):
        mlflow_source(f"runs:/{RUN_ID}", tracking_uri=bad)
    assert _files(built.path) == before

    runner = CliRunner()
    for args in (["runs"], ["show", f"runs:/{RUN_ID}"], ["sync", str(built.path), "--run-id", RUN_ID]):
        t0 = time.perf_counter()
        res = runner.invoke(cli, [*args, "--tracking-uri", bad])
        took = time.perf_counter() - t0
        assert res.exit_code == 1 and bad in res.output and "Traceback" not in res.output, (args, res.output)
        assert took < short_budget + 2.0, (args, took)


def test_a_call_after_the_probe_is_bounded_by_the_keyword(fake_server, tmp_path):
    """The keyword wins over the environment; the error names the call that ran out."""
    bad = fake_server("hang_after_probe")
    built = build_run(tmp_path / "run", SPECS, records=2)
    os.environ["HOOKLINE_MLFLOW_TIMEOUT"] = "300"
    try:
        t0 = time.perf_counter()
        with pytest.raises(TrackingUnreachableError, match=r"did not finish get_run within 1\.5 s"):
            sync(built.path, RUN_ID, tracking_uri=bad, mlflow_timeout=1.5)
        assert time.perf_counter() - t0 < 4.0
    finally:
        del os.environ["HOOKLINE_MLFLOW_TIMEOUT"]


def test_the_default_budget_is_60_s_and_bounds_a_hanging_server(fake_server, tmp_path, monkeypatch):
    """Default: 60 s per call (the probe waits at most ``REACH_TIMEOUT_S``, 10 s, of it); a server
    that answers /health and hangs fails a sync at the probe's limit, not the budget's. (The test
    sets the probe's limit to 1 s: what it checks is that the limit, not the 60 s, applies.)"""
    from hookline.storage.mlflow import client

    monkeypatch.delenv("HOOKLINE_MLFLOW_TIMEOUT", raising=False)
    assert BUDGET_S == 60.0 and budget_seconds() == 60.0 and client.REACH_TIMEOUT_S == 10.0
    assert Uploader(RUN_ID).budget_s == 60.0 and CallBudget("http://x").seconds == 60.0
    monkeypatch.setattr(client, "REACH_TIMEOUT_S", 1.0)
    built = build_run(tmp_path / "run", SPECS, records=2)
    t0 = time.perf_counter()
    with pytest.raises(TrackingUnreachableError, match="waited up to 1 s"):
        sync(built.path, RUN_ID, tracking_uri=fake_server("hang"))
    assert time.perf_counter() - t0 < 1.0 + 2.0


def test_the_budget_leaves_the_users_mlflow_settings_alone(fake_server, short_budget, tmp_path):
    """hookline changes no MLflow environment variable or tracking URI of the process."""
    import mlflow
    built = build_run(tmp_path / "run", SPECS, records=2)
    env = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    uri = mlflow.get_tracking_uri()
    for mode in ("500", "hang_after_probe"):
        with pytest.raises(TrackingUnreachableError):
            sync(built.path, RUN_ID, tracking_uri=fake_server(mode))
    assert {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")} == env
    assert mlflow.get_tracking_uri() == uri


def test_bad_budgets_are_named(monkeypatch):
    for bad in (0, -1, float("inf"), "ten", True):
        with pytest.raises(InvalidArgumentError, match="mlflow_timeout must be a positive number"):
            Uploader(RUN_ID, mlflow_timeout=bad)
    monkeypatch.setenv("HOOKLINE_MLFLOW_TIMEOUT", "soon")
    with pytest.raises(InvalidArgumentError, match="HOOKLINE_MLFLOW_TIMEOUT .* got 'soon'"):
        Uploader(RUN_ID)


def test_the_adapter_and_the_recorder_take_the_budget_as_a_keyword(fake_server, tmp_path, monkeypatch):
    """``MlflowAdapter(mlflow_timeout=...)`` and ``Recorder(mlflow_timeout=...)`` bound each call by
    the keyword, over the environment; a bad value is refused before anything is created."""
    from hookline.storage import MlflowAdapter

    monkeypatch.setenv("HOOKLINE_MLFLOW_TIMEOUT", "300")
    bad = fake_server("hang_after_probe")
    built = build_run(tmp_path / "run", SPECS, records=2)
    adapter = MlflowAdapter(RUN_ID, tracking_uri=bad, mlflow_timeout=1.5)
    t0 = time.perf_counter()
    with pytest.raises(TrackingUnreachableError, match=r"did not finish get_run within 1\.5 s"):
        adapter.log_run_dir(built.path)
    assert time.perf_counter() - t0 < 4.0
    adapter.close(raise_on_error=False)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 2))
    rec = Recorder(tmp_path / "rec", mlflow_run_id=RUN_ID, tracking_uri=bad, mlflow_timeout=1.5)
    HookManager().register_forward_hook(rec.outputs, **select(model, "*", types=nn.Linear))
    with rec.step(0):
        model(torch.randn(3, 4))
    t0 = time.perf_counter()
    with pytest.raises(TrackingUnreachableError, match=r"did not finish get_run within 1\.5 s"):
        rec.close()
    assert time.perf_counter() - t0 < 4.0

    for value in (0, "soon"):
        with pytest.raises(InvalidArgumentError, match=f"mlflow_timeout must be a positive number.*{value!r}"):
            MlflowAdapter(RUN_ID, mlflow_timeout=value)
        with pytest.raises(InvalidArgumentError, match="mlflow_timeout must be a positive number"):
            Recorder(tmp_path / f"never-{value}", mlflow_run_id=RUN_ID, mlflow_timeout=value)
        assert not (tmp_path / f"never-{value}").exists()
