"""Fixtures for the MLflow adapter tests: a tracking store (both kinds) and fresh runs in it."""

from __future__ import annotations

import uuid
from typing import Callable

import pytest


@pytest.fixture(params=["sqlite", "server"])
def store(request: pytest.FixtureRequest) -> str:
    """A tracking URI: the embedded sqlite store (per-test copy) or the session's real server."""
    if request.param == "sqlite":
        return request.getfixturevalue("sqlite_tracking_uri")
    return request.getfixturevalue("mlflow_server")


@pytest.fixture
def new_run(store: str) -> Callable[..., str]:
    """``new_run(name=None) -> run_id`` in an experiment private to this test."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exp = client.create_experiment(f"hookline-test-{uuid.uuid4().hex[:12]}")

    def make(name: str | None = None) -> str:
        return client.create_run(exp, run_name=name).info.run_id

    make.experiment_id = exp  # type: ignore[attr-defined]
    make.client = client  # type: ignore[attr-defined]
    make.uri = store  # type: ignore[attr-defined]
    return make
