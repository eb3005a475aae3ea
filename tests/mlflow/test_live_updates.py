"""A Recorder with an MLflow run brings the run's norm series up to date while training runs
(``mlflow_update_s``, after each seal of the writer: ``autoflush_s``), not only at close."""

from __future__ import annotations

import time

import pytest
import torch

from hookline.storage.errors import InvalidArgumentError
from hookline.storage.mlflow.keys import metric_key
from hookline.tracker import HookManager, Recorder, select


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def test_metrics_reach_the_run_during_training(store, new_run, tmp_path):
    client, rid = new_run.client, new_run()
    model = _model()
    rec = Recorder(tmp_path / "run", mlflow_run_id=rid, tracking_uri=store, mlflow_update_s=0.05, autoflush_s=0.2)
    HookManager().register_forward_hook(rec.outputs, **select(model, "*", types=torch.nn.Linear))
    key = metric_key("outputs[0]", "outputs.0")
    seen, step, deadline = [], 0, time.monotonic() + 60
    while not seen and time.monotonic() < deadline:  # training goes on; no flush() is called
        with rec.step(step):
            model(torch.randn(3, 4))
        step += 1
        time.sleep(0.01)
        if step % 10 == 0:
            seen = client.get_metric_history(rid, key)
    assert seen, "no metric point reached the run while training ran"
    assert not client.list_artifacts(rid, "hookline")  # files (and the manifest) wait for close()
    assert {p.step for p in seen} <= set(range(step))
    rec.close()
    final = client.get_metric_history(rid, key)
    assert sorted(p.step for p in final) == list(range(step))  # every record once, none twice
    assert client.list_artifacts(rid, "hookline")


def test_no_update_before_close_when_switched_off(store, new_run, tmp_path):
    client, rid = new_run.client, new_run()
    model = _model()
    rec = Recorder(tmp_path / "run", mlflow_run_id=rid, tracking_uri=store, mlflow_update_s=None, autoflush_s=0.1)
    HookManager().register_forward_hook(rec.outputs, **select(model, "*", types=torch.nn.Linear))
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < 1.0:
        with rec.step(step):
            model(torch.randn(3, 4))
        step += 1
        time.sleep(0.01)
    assert client.get_run(rid).data.metrics == {}
    rec.close()
    assert len(client.get_metric_history(rid, metric_key("outputs[0]", "outputs.0"))) == step


@pytest.mark.parametrize("kw", ["mlflow_update_s", "autoflush_s"])
@pytest.mark.parametrize("bad", [0, -1, float("nan"), "60", True])
def test_bad_intervals_are_refused_before_anything_is_created(kw, bad, tmp_path):
    with pytest.raises(InvalidArgumentError, match=f"{kw} must be a positive number of seconds or None, got"):
        Recorder(tmp_path / "run", **{kw: bad})
    assert not (tmp_path / "run").exists()
