"""The Lightning callback with the real Lightning Trainer, MLFlowLogger and MLflow server (SPEC §11)."""

from __future__ import annotations

import uuid
from collections import OrderedDict

import numpy as np
import pytest
import torch

pytest.importorskip("lightning", reason="the lightning extra is part of hookline[test]")

import lightning.pytorch as L  # noqa: E402
from _integ_support import Reference, artifact_files, experiment_runs, hook_count, named_modules_with_names  # noqa: E402
from lightning.pytorch.loggers import MLFlowLogger  # noqa: E402

from hookline.storage import open_run  # noqa: E402
from hookline.storage.errors import WriterClosedError  # noqa: E402
from hookline.tracker import select  # noqa: E402
from hookline.tracker.integrations.lightning import HooklineCallback  # noqa: E402

pytestmark = [  # Lightning's own deprecation (torch's pytree), and the reference hook on an input without grad
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing when gradients are computed"),
]


class Regressor(L.LightningModule):
    """A tiny MLP that logs its own metric; ``fail_at`` makes that batch raise."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(OrderedDict(
            fc1=torch.nn.Linear(4, 8), act=torch.nn.Tanh(), head=torch.nn.Linear(8, 1)))
        self.fail_at = fail_at
        self.batches = 0

    def training_step(self, batch, batch_idx):
        self.batches += 1
        if self.batches == self.fail_at:
            raise RuntimeError(f"boom in batch {batch_idx}")
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :1].sin()), batch_size=8)


def _trainer(root, cb, logger=False, **kw) -> L.Trainer:
    return L.Trainer(default_root_dir=str(root), logger=logger, callbacks=[cb], accelerator="cpu", devices=1,
                     enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                     log_every_n_steps=1, **kw)


def test_grads_recorded_per_optimizer_step_into_the_loggers_run(tmp_path, mlflow_server):
    experiment = f"hookline-lightning-{uuid.uuid4().hex[:12]}"
    logger = MLFlowLogger(experiment_name=experiment, tracking_uri=mlflow_server)
    module = Regressor()
    baseline = hook_count(module)
    ref = Reference(select(module, "net.*", types=torch.nn.Linear), grads=True)
    cb = HooklineCallback(grads="net.*", types=torch.nn.Linear)
    _trainer(tmp_path, cb, logger, max_steps=3, accumulate_grad_batches=2).fit(module, _loader())
    ref.remove()

    assert hook_count(module) == baseline and named_modules_with_names(module) == []
    with pytest.raises(WriterClosedError):
        cb.recorder.flush()
    run = open_run(tmp_path / "hookline")  # the default run_dir: <default_root_dir>/hookline
    assert sorted(run.handles) == ["grads[net.fc1]", "grads[net.head]"]
    for name in ("fc1", "head"):
        g = run[f"grads[net.{name}]"]["grad_out.0"]
        # max_steps=3 optimizer steps of 2 accumulated batches each
        assert g.steps.tolist() == [0, 0, 1, 1, 2, 2] and g.calls.tolist() == [0, 1, 0, 1, 0, 1]
        assert len(ref.grad_out[f"net.{name}"]) == 6
        for i, t in enumerate(ref.grad_out[f"net.{name}"]):
            np.testing.assert_array_equal(g[i], t.numpy())

    (mlrun,) = experiment_runs(mlflow_server, experiment)  # no second run
    assert mlrun.info.run_id == logger.run_id == cb.recorder.mlflow_run_id
    assert "train_loss" in mlrun.data.metrics  # the module's own metric, beside hookline's
    assert any(k.startswith("hookline.grads/net.fc1/") for k in mlrun.data.metrics)
    assert {"hookline/grads/net.fc1.h5", "hookline/grads/net.head.h5"} <= set(artifact_files(mlflow_server, logger.run_id))


def test_a_step_that_raises_closes_the_recorder_uploads_and_removes_the_hooks(tmp_path, mlflow_server):
    logger = MLFlowLogger(experiment_name=f"hookline-lightning-{uuid.uuid4().hex[:12]}", tracking_uri=mlflow_server)
    module = Regressor(fail_at=3)
    baseline = hook_count(module)
    cb = HooklineCallback(outputs="net.*", grads="net.*", types=torch.nn.Linear, mode="stats",
                          run_dir=tmp_path / "rec")
    with pytest.raises(RuntimeError, match="boom in batch 2"):
        _trainer(tmp_path, cb, logger, max_steps=5).fit(module, _loader())

    assert hook_count(module) == baseline and named_modules_with_names(module) == []
    with pytest.raises(WriterClosedError):
        cb.recorder.flush()
    run = open_run(tmp_path / "rec")
    assert run.status == "closed"
    h = run["outputs.stats[net.head]"]
    assert h.steps.tolist() == [0, 1] and h["outputs.0.norm"].read().shape == (2,)
    # what was recorded before the failure is in the logger's run (which Lightning marks FAILED)
    assert cb.recorder.mlflow_run_id == logger.run_id
    assert "hookline/outputs.stats/net.head.h5" in artifact_files(mlflow_server, logger.run_id)


def test_without_an_mlflow_logger_the_run_is_recorded_locally(tmp_path):
    cb = HooklineCallback(outputs="net.head", every=2)
    _trainer(tmp_path, cb, max_steps=3).fit(Regressor(), _loader())
    assert cb.recorder.mlflow_run_id is None and cb.summary is not None
    assert open_run(tmp_path / "hookline")["outputs[net.head]"]["outputs.0"].steps.tolist() == [0, 2]
