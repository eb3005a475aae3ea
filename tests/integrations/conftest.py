"""Fixtures for the framework integration tests: no network, a clean MLflow fluent state, an
MLflow experiment of the test's own on the session's real server."""

from __future__ import annotations

import uuid
from typing import Iterator

import pytest

#: Environment that keeps Hugging Face (and the integrations Trainer would otherwise pick up) off
#: the network: the tests build random-init models and feed token ids, nothing is downloaded.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DISABLE_MLFLOW_INTEGRATION": "FALSE",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch, tmp_path) -> Iterator[None]:
    """No network for Hugging Face; MLflow's fluent state (the tracking URI a framework set, a run
    a failed training left active) does not leak from one test into the next."""
    for k, v in OFFLINE_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    yield
    import mlflow

    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(None)


@pytest.fixture
def mlflow_experiment(mlflow_server: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """``(tracking_uri, experiment_name)``: the session's MLflow server, and a fresh experiment
    name that the Hugging Face Trainer (``MLFLOW_EXPERIMENT_NAME``) and MLflow's fluent API use."""
    import mlflow

    name = f"hookline-integ-{uuid.uuid4().hex[:12]}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", name)
    mlflow.set_tracking_uri(mlflow_server)
    return mlflow_server, name

