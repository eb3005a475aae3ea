"""``HooklineCallback`` for Lightning: records the LightningModule being fitted into a hookline run,
in the ``MLFlowLogger``'s run when the Trainer has one (``pip install 'hookline[lightning]'``).

Events (the shared logic is :mod:`.session`): ``on_train_start`` opens the session on the
LightningModule, ``on_train_batch_start``/``on_train_batch_end`` bracket each batch (step =
``trainer.global_step``, the optimizer steps taken so far, so accumulated batches are calls
0..k-1 of one step), ``on_train_end`` closes it, ``on_exception`` closes it when fitting raises,
and ``teardown`` closes whatever is still open.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .session import SessionCallback, missing_extra

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import MLFlowLogger
except ImportError as e:  # the core install does not include lightning
    raise missing_extra("lightning", "Lightning", e) from e

__all__ = ["HooklineCallback"]


class HooklineCallback(SessionCallback, Callback):
    """Records activations and gradients of the LightningModule a Lightning ``Trainer`` fits.

    Pass it to the Trainer::

        trainer = L.Trainer(max_steps=100, logger=MLFlowLogger(...),
                            callbacks=[HooklineCallback(grads="net.*", types=torch.nn.Linear)])
        trainer.fit(module, loader)

    Hooks go on the LightningModule when training starts and come off when it ends. The step of
    a record is ``trainer.global_step`` (0-based optimizer steps); with
    ``accumulate_grad_batches=k`` the k batches of a step are its calls 0..k-1. Validation and
    other passes between training batches are not recorded. With an ``MLFlowLogger`` (the first
    one, if several) hookline's files, tags and metrics go into ``logger.run_id``, beside what
    the module logs; without one the run is only recorded locally.

    Args:
        outputs, inputs, grads: select pattern(s) of the modules whose outputs, inputs or
            gradients are recorded (names relative to the LightningModule); None: not recorded.
        types: keep only modules of these classes.
        every: record every N-th optimizer step (default 1: every step, full tensors of every
            selected module; size: docs/integrations.md, Keywords). steps: exactly these steps instead.
        mode: ``"tensor"`` (default) or ``"stats"``.
        batch_slice: keep only the first K items of dimension 0. dtype: cast floating tensors.
        run_dir: the run directory; default ``<trainer.default_root_dir>/hookline``, or when that
            holds a run (fitting again with the same ``default_root_dir``) the first free
            ``hookline-2``, ``-3``, ... beside it (``resume=True``: the last one). A ``run_dir=``
            that holds a run is refused (``RunExistsError``) when the callback is made.
        **recorder_kwargs: any other :class:`~hookline.tracker.Recorder` keyword.

    Attributes:
        recorder: the Recorder of the current (or last) fit; None before training starts.
        summary: the :class:`~hookline.tracker.RecorderSummary` of the last fit that ended
            normally.
    """

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Open the session: the Recorder (in the MLFlowLogger's run) and its hooks."""
        run_id, tracking_uri = _mlflow_run(trainer)
        self.open_session(pl_module, Path(trainer.default_root_dir) / "hookline", run_id, tracking_uri)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A batch begins: its forward and backward belong to step ``trainer.global_step``."""
        self.begin_step(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """The batch ended: pause until the next one (validation is not recorded)."""
        self.end_step()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Close the recorder: files complete, hooks removed, upload into the logger's run."""
        self.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """Fitting raised: close the recorder (this rank alone); the exception goes on."""
        self.abort(exception)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Close whatever is still open when the Trainer tears down."""
        self.close()


def _mlflow_run(trainer: Any) -> tuple[str | None, str | None]:
    """The first ``MLFlowLogger``'s run id and tracking URI on global rank 0; ``(None, None)``
    elsewhere (the other ranks receive rank 0's) and without such a logger."""
    loggers = [lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)]
    if not loggers or not trainer.is_global_zero:
        return None, None
    logger = loggers[0]
    run_id = logger.run_id  # (creates the run if the logger has not yet)
    return run_id, getattr(logger.experiment, "tracking_uri", None)
