"""Fixtures for the CLI tests: small runs recorded with the real Recorder."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Iterable

import pytest


def _tracker():
    from hookline.tracker import HookManager, Recorder, select

    return HookManager, Recorder, select


def record_mlp(run_dir: Path, *, lr: float = 0.05, steps: int = 12, every: int = 3,
               record_steps: Iterable[int] | None = None, seed: int = 0, width: int = 16,
               mlflow_run_id: str | None = None, tracking_uri: str | None = None) -> Path:
    """Train a tiny MLP (fc1 -> tanh -> head) with SGD, recording Linear outputs and grads."""
    import torch

    HookManager, Recorder, select = _tracker()

    torch.manual_seed(seed)
    model = torch.nn.Sequential(OrderedDict(
        fc1=torch.nn.Linear(8, width), act=torch.nn.Tanh(), head=torch.nn.Linear(width, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(123)
    mgr = HookManager()
    kw = {"steps": list(record_steps)} if record_steps is not None else {"every": every}
    with Recorder(run_dir, mlflow_run_id=mlflow_run_id, tracking_uri=tracking_uri, **kw) as rec:
        layers = select(model, "*", types=torch.nn.Linear)
        mgr.register_forward_hook(rec.outputs, **layers)
        mgr.register_backward_hook(rec.grads, **layers)
        for step in range(steps):
            x = torch.randn(6, 8, generator=gen)
            y = x[:, :1].sin()
            with rec.step(step):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
            opt.step()
    return Path(run_dir)


def record_twice_called(run_dir: Path, *, scale: float = 1.0, steps: int = 4) -> Path:
    """A Linear called twice per forward: two calls (0 and 1) per step."""
    import torch

    HookManager, Recorder, select = _tracker()

    torch.manual_seed(0)

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(5, 5)

        def forward(self, x):
            return self.lin(torch.tanh(self.lin(x)))

    model = Twice()
    gen = torch.Generator().manual_seed(7)
    mgr = HookManager()
    with Recorder(run_dir) as rec:
        mgr.register_forward_hook(rec.outputs, **select(model, "lin"))
        for step in range(steps):
            x = torch.randn(3, 5, generator=gen) * (scale if step % 2 else 1.0)
            with rec.step(step):
                model(x)
    return Path(run_dir)


def record_ragged(run_dir: Path, *, lengths=(3, 5, 4, 5), offset: float = 0.0) -> Path:
    """Outputs whose sequence length varies per step (a ragged field)."""
    import torch

    HookManager, Recorder, select = _tracker()

    torch.manual_seed(0)
    model = torch.nn.Sequential(OrderedDict(proj=torch.nn.Linear(4, 4)))
    gen = torch.Generator().manual_seed(3)
    mgr = HookManager()
    with Recorder(run_dir) as rec:
        mgr.register_forward_hook(rec.outputs, **select(model, "proj"))
        for step, n in enumerate(lengths):
            x = torch.randn(n, 4, generator=gen) + offset
            with rec.step(step):
                model(x)
    return Path(run_dir)


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A set of small recorded runs shared by the CLI tests (read-only: do not modify)."""
    root = tmp_path_factory.mktemp("cli-runs")
    return {
        "a": record_mlp(root / "a", lr=0.05),
        "a_same": record_mlp(root / "a_same", lr=0.05),
        "b": record_mlp(root / "b", lr=0.5),
        "wide": record_mlp(root / "wide", lr=0.05, width=24),
        "offset": record_mlp(root / "offset", lr=0.05, record_steps=[1, 4, 7, 10]),
        "twice_a": record_twice_called(root / "twice_a"),
        "twice_b": record_twice_called(root / "twice_b", scale=2.0),
        "ragged_a": record_ragged(root / "ragged_a"),
        "ragged_b": record_ragged(root / "ragged_b", lengths=(3, 6, 4, 5), offset=0.5),
    }


@pytest.fixture
def recorder_run():
    """The :func:`record_mlp` helper, for tests that record their own runs."""
    return record_mlp


@pytest.fixture
def cli_runner():
    from click.testing import CliRunner

    try:
        return CliRunner(mix_stderr=False)  # click < 8.2
    except TypeError:
        return CliRunner()  # click >= 8.2 keeps stderr apart by default
