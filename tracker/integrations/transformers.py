"""``HooklineCallback`` for the Hugging Face ``Trainer``: records the model being trained into a
hookline run, in the Trainer's own MLflow run (``pip install 'hookline[transformers]'``).

Events (the shared logic is :mod:`.session`): ``on_train_begin`` opens the session on the
unwrapped model, ``on_step_begin``/``on_step_end`` bracket each optimizer step
(``state.global_step``, 0-based), ``on_train_end`` closes it. The Trainer calls no callback when
training raises, so the callback also wraps ``trainer.train`` on the Trainer it belongs to (found
when the Trainer calls it first): an exception (``KeyboardInterrupt`` included) closes the
recorder before it propagates.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Any, Callable

from .session import SessionCallback, missing_extra

try:
    from transformers import Trainer, TrainerCallback
except ImportError as e:  # the core install does not include transformers
    raise missing_extra("transformers", "Hugging Face transformers", e) from e

__all__ = ["HooklineCallback"]

log = logging.getLogger("hookline")

#: How many frames above a callback method to look for the Trainer that calls it.
_STACK_DEPTH = 12


class HooklineCallback(SessionCallback, TrainerCallback):
    """Records activations and gradients of the model a Hugging Face ``Trainer`` trains.

    Pass it to the Trainer::

        trainer = Trainer(model=model, args=TrainingArguments(..., report_to=["mlflow"]),
                          train_dataset=ds, callbacks=[HooklineCallback(grads="transformer.h.*")])
        trainer.train()

    Hooks go on the Trainer's unwrapped model when training begins and come off when it ends.
    The step of a record is the Trainer's global optimizer step (0-based); the micro-batches of
    gradient accumulation are calls 0..k-1 of that step. Forwards between optimizer steps
    (evaluation, logging) are not recorded. When the Trainer logs to MLflow (``report_to``
    includes ``"mlflow"``), hookline's files, tags and metrics go into the Trainer's MLflow run,
    also when the Trainer ended that run before this callback closed; otherwise the run is only
    recorded locally. Under ``torchrun`` every rank records its own files into the one run.

    Args:
        outputs: select pattern(s) of the modules whose outputs are recorded (forward hooks);
            None: not recorded. Patterns are those of :func:`~hookline.tracker.select`.
        inputs: pattern(s) of the modules whose inputs are recorded (forward pre hooks).
        grads: pattern(s) of the modules whose gradients are recorded (backward hooks).
        types: keep only modules of these classes (e.g. ``torch.nn.Linear``).
        every: record every N-th optimizer step (default 1: every step, full tensors of every
            selected module; size: docs/integrations.md, Keywords). steps: exactly these steps instead.
        mode: ``"tensor"`` (default) or ``"stats"`` (per-record summaries).
        batch_slice: keep only the first K items of dimension 0. dtype: cast floating tensors.
        run_dir: the run directory; default ``<args.output_dir>/hookline``, or when that holds
            a run (training again into the same ``output_dir``) the first free
            ``<args.output_dir>/hookline-2``, ``-3``, ... (``resume=True``: the last one). A
            ``run_dir=`` that holds a run is refused (``RunExistsError``) when the callback is
            made, or when ``trainer.train()`` is called: before the Trainer starts an MLflow run.
        **recorder_kwargs: any other :class:`~hookline.tracker.Recorder` keyword
            (``max_buffer_mb``, ``compression``, ``meta``, ``resume``; ``mlflow_run_id`` and
            ``tracking_uri`` record into another MLflow run than the Trainer's).

    Attributes:
        recorder: the Recorder of the current (or last) training run; None before training.
        summary: the :class:`~hookline.tracker.RecorderSummary` of the last run that ended
            normally.

    Raises:
        HookTypeError, InvalidArgumentError: bad keywords (here), or a pattern that selects no
            module (when training begins, before anything is recorded).
    """

    # --- Trainer events ------------------------------------------------------------------------
    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer was made with this callback: guard its ``train`` (see the module docstring)."""
        trainer = self._find_trainer()
        if trainer is not None:
            self._guard(trainer, "train", plan=True)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        """Open the session: the Recorder (in the Trainer's MLflow run) and its hooks on ``model``."""
        trainer = self._find_trainer()
        if trainer is not None and not self._guarded(trainer, "train"):
            # Added after the Trainer was made: guard later train() calls, and this call's steps
            # (unless a failed step is retried with a smaller batch: auto_find_batch_size).
            self._guard(trainer, "train", plan=True)
            if not getattr(args, "auto_find_batch_size", False):
                self._guard(trainer, "training_step")
        if (getattr(args, "auto_find_batch_size", False) and self.session is not None and self.session.is_open
                and self.session.model is model):
            return  # train() goes on with a smaller batch after an out-of-memory step: same recording
        run_id, tracking_uri = _mlflow_run(trainer, args, state, model)
        self.open_session(model, _default_base(args), run_id, tracking_uri)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An optimizer step (all its micro-batches) begins: record it as ``state.global_step``."""
        self.begin_step(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The optimizer stepped: pause until the next step (evaluation is not recorded)."""
        self.end_step()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Close the recorder: files complete, hooks removed, upload into the MLflow run."""
        self.close()

    # --- failure -------------------------------------------------------------------------------
    def _find_trainer(self) -> Trainer | None:
        """The Trainer calling this callback: the first caller frame whose ``self`` is a Trainer
        that holds this callback (the Trainer does not pass itself to its callbacks)."""
        frame = sys._getframe(1)
        for _ in range(_STACK_DEPTH):
            frame = frame.f_back
            if frame is None:
                break
            obj = frame.f_locals.get("self")
            if isinstance(obj, Trainer) and any(cb is self for cb in obj.callback_handler.callbacks):
                return obj
        log.debug("hookline: the Trainer calling HooklineCallback was not found on the stack")
        return None

    def _guarded(self, trainer: Trainer, name: str) -> bool:
        return getattr(getattr(trainer, name, None), "hookline_guard", None) is self

    def _guard(self, trainer: Trainer, name: str, plan: bool = False) -> None:
        """Wrap ``trainer.<name>`` (on the instance) so that an exception aborts the recording;
        with ``plan``, each call first chooses (or refuses) the run directory, before the
        Trainer's MLflowCallback starts a run."""
        if self._guarded(trainer, name):
            return
        inner: Callable[..., Any] = getattr(trainer, name)

        @functools.wraps(inner)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if plan:  # refusals before the Trainer's MLflowCallback starts a run
                self.plan_run_dir(_default_base(trainer.args))
                if trainer.model is not None:
                    self.options.select_modules(trainer.model)
            try:
                return inner(*args, **kwargs)
            except BaseException as e:
                self.abort(e)
                raise

        guarded.hookline_guard = self  # type: ignore[attr-defined]
        setattr(trainer, name, guarded)


def _default_base(args: Any) -> Path:
    """``<output_dir>/hookline``: the default run directory (numbered when it holds a run)."""
    return Path(args.output_dir or ".") / "hookline"


def _mlflow_run(trainer: Trainer | None, args: Any, state: Any, model: Any) -> tuple[str | None, str | None]:
    """The MLflow run the Trainer logs to, and its tracking URI, on the main process; ``(None,
    None)`` on the others (they receive rank 0's) and when the Trainer does not log to MLflow."""
    from transformers.integrations import MLflowCallback

    if trainer is not None:
        logging_cbs = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, MLflowCallback)]
        if not logging_cbs:
            return None, None
    else:  # not found on the stack: the arguments tell
        logging_cbs = []
        if "mlflow" not in (getattr(args, "report_to", None) or []):
            return None, None
    if not state.is_world_process_zero:
        return None, None
    from hookline.storage.mlflow.client import active_run

    run_id, uri = active_run()
    if run_id is None and logging_cbs:
        # The MLflowCallback comes after this one in the Trainer's list: let it start its run now
        # (its own on_train_begin then finds it set up).
        logging_cbs[0].setup(args, state, model)
        run_id, uri = active_run()
    if run_id is None:
        log.warning("hookline: the Trainer reports to MLflow but no MLflow run is active; recording locally only")
        return None, None
    return run_id, uri
