"""What both framework callbacks share: their keywords, checked when a callback is made, and one
recording session per training run (the Recorder, its hooks, steps, pauses, closing).

A callback only translates its framework's events into a :class:`RecordingSession`:

* training begins: :meth:`RecordingSession.open` selects the modules of the unwrapped model,
  creates the :class:`~hookline.tracker.Recorder` (in the framework's MLflow run, if any) and
  registers its hooks through a private :class:`~hookline.tracker.HookManager`; the session
  starts paused;
* an optimizer step begins: :meth:`~RecordingSession.begin_step` sets the step and releases the
  hooks; every forward and backward until the step ends is a call of that step (micro-batches
  of gradient accumulation are calls 0..k-1);
* the step ends: :meth:`~RecordingSession.end_step` pauses the hooks again, so evaluation and
  logging passes between steps are not recorded;
* training ends: :meth:`~RecordingSession.close` closes the recorder (files complete, hooks
  removed, MLflow upload); training that raises: :meth:`~RecordingSession.abort` does the same
  for this rank alone and never raises over the training's own exception.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from torch import nn

from hookline.storage.errors import HookTypeError, InvalidArgumentError, MissingDependencyError, RunExistsError
from hookline.tracker.capture.distributed import detect, gather
from hookline.tracker.capture.hook import CaptureOptions
from hookline.tracker.capture.recorder import Recorder
from hookline.tracker.capture.run import held_run
from hookline.tracker.capture.sampling import check_sampling
from hookline.tracker.capture.summary import RecorderSummary
from hookline.tracker.hooks.manager import HookManager
from hookline.tracker.hooks.select import select

__all__ = ["CallbackOptions", "RecordingSession", "SessionCallback", "RECORDER_KEYWORDS", "missing_extra", "numbered_run_dir"]

log = logging.getLogger("hookline")

#: capture kind -> the HookManager method that registers its hook function
_REGISTER = {
    "inputs": "register_forward_pre_hook",
    "outputs": "register_forward_hook",
    "grads": "register_backward_hook",
}

#: The Recorder keywords a callback passes through (``run_dir``, ``every`` and ``steps`` are
#: keywords of the callback itself).
RECORDER_KEYWORDS = tuple(p for p in inspect.signature(Recorder).parameters if p not in ("run_dir", "every", "steps"))


def missing_extra(extra: str, framework: str, error: ImportError) -> MissingDependencyError:
    """The error an integration module raises when its framework cannot be imported: it names
    the extra that installs it (``pip install 'hookline[<extra>]'``)."""
    return MissingDependencyError(
        f"hookline.tracker.integrations.{extra} needs {framework}: pip install 'hookline[{extra}]' "
        f"(in a clone of hookline's repository: pip install -e '.[{extra}]'; import failed: {error})")


def numbered_run_dir(base: Path, *, resume: bool = False, rank: int | None = None,
                     world_size: int | None = None) -> Path:
    """The run directory of a training run whose callback was given no ``run_dir=``: ``base``
    (``<output_dir>/hookline``) unless it holds a run, else the first of ``base-2``, ``base-3``,
    ... that holds none; so training again into the same output directory records a new run
    beside the earlier ones, which stay untouched. With ``resume``: the last of them that holds
    a run (the one to continue), or ``base``.

    Every rank of a distributed run sees the same directories before any of them writes (the
    session's first collective comes first), so all ranks choose the same one.
    """
    found = base
    n = 1
    while True:
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        held = held_run(candidate, rank, world_size) is not None
        if resume and not held:
            return found
        if not resume and not held:
            return candidate
        found, n = candidate, n + 1


def _ranks(kwargs: dict[str, Any]) -> tuple[int | None, int | None]:
    """The ``rank``/``world_size`` Recorder keywords a callback was given (None: detected)."""
    return kwargs.get("rank"), kwargs.get("world_size")


def _check_patterns(kind: str, value: Any) -> tuple[str, ...] | None:
    """``outputs=``/``inputs=``/``grads=`` as a tuple of select patterns (None: not recorded)."""
    if value is None:
        return None
    patterns = (value,) if isinstance(value, str) else value
    if not isinstance(patterns, (list, tuple)) or not all(isinstance(p, str) for p in patterns):
        raise HookTypeError(
            f"{kind}= takes a select pattern or a list of them, e.g. {kind}='transformer.h.*.mlp', got "
            f"{type(value).__name__} {value!r:.60}")
    if not patterns or not all(patterns):
        raise InvalidArgumentError(
            f"{kind}= needs non-empty select patterns (e.g. '*' for every module), got {value!r}; pass "
            f"{kind}=None not to record {kind}")
    return tuple(patterns)


def _check_types(types: Any) -> None:
    if types is None or isinstance(types, type):
        return
    if isinstance(types, tuple) and types and all(isinstance(t, type) for t in types):
        return
    raise HookTypeError(f"types= takes a module class or a tuple of them (e.g. torch.nn.Linear), got {types!r:.80}")


@dataclass(frozen=True)
class CallbackOptions:
    """A framework callback's keywords, checked when the callback is made (so a typo fails before
    any training starts).

    Attributes:
        patterns: capture kind (``"inputs"``, ``"outputs"``, ``"grads"``) -> select patterns,
            for the kinds that are recorded.
        types: the module classes every pattern is narrowed to (None: any module).
        capture: the per-hook options (``mode``, ``batch_slice``, ``dtype``) for
            :meth:`Recorder.hook`.
        run_dir: the run directory; None: the framework's default.
        recorder: the other :class:`Recorder` keywords (``every``/``steps`` included).
    """

    patterns: dict[str, tuple[str, ...]]
    types: type | tuple[type, ...] | None
    capture: dict[str, Any]
    run_dir: Path | None
    recorder: dict[str, Any]

    @classmethod
    def parse(cls, *, outputs: Any, inputs: Any, grads: Any, types: Any, every: Any, steps: Iterable[int] | None,
              mode: Any, batch_slice: Any, dtype: Any, run_dir: Any, recorder_kwargs: dict[str, Any],
              owner: str) -> CallbackOptions:
        """Check a callback's keywords.

        Args:
            owner: the callback's name, for messages (``"HooklineCallback"``).

        Raises:
            HookTypeError: a keyword of the wrong type, or one neither the callback nor the
                Recorder knows.
            InvalidArgumentError: a bad value, or nothing to record.
        """
        unknown = sorted(set(recorder_kwargs) - set(RECORDER_KEYWORDS))
        if unknown:
            known = ["outputs", "inputs", "grads", "types", "every", "steps", "mode", "batch_slice", "dtype",
                     "run_dir", *RECORDER_KEYWORDS]
            close = difflib.get_close_matches(unknown[0], known, n=1)
            raise HookTypeError(
                f"{owner} got unknown keyword {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else "")
                + f"; it takes {', '.join(known)}")
        patterns = {kind: p for kind, p in (("inputs", _check_patterns("inputs", inputs)),
                                            ("outputs", _check_patterns("outputs", outputs)),
                                            ("grads", _check_patterns("grads", grads))) if p is not None}
        if not patterns:
            raise InvalidArgumentError(
                f"{owner} records nothing: give at least one of outputs=, inputs=, grads= (select patterns "
                "such as 'transformer.h.*' or '*')")
        _check_types(types)
        for kind in patterns:  # the Recorder's own checks, now rather than when training begins
            CaptureOptions(kind, mode=mode, batch_slice=batch_slice, dtype=dtype)
        every, steps = check_sampling(every, steps)
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise HookTypeError(f"run_dir= takes a path (str or os.PathLike), got {type(run_dir).__name__} {run_dir!r:.60}")
        capture = {"mode": mode, "batch_slice": batch_slice, "dtype": dtype}
        recorder = {"every": every, "steps": steps, **recorder_kwargs}
        return cls(patterns, types, capture, Path(run_dir) if run_dir is not None else None, recorder)

    def select_modules(self, model: nn.Module) -> dict[str, dict[str, nn.Module]]:
        """capture kind -> ``{qualified name: module}`` of ``model`` (DDP wrappers looked through).

        Raises:
            InvalidArgumentError: a pattern selects no module (a typo would otherwise record
                nothing, silently).
        """
        chosen: dict[str, dict[str, nn.Module]] = {}
        for kind, patterns in self.patterns.items():
            modules: dict[str, nn.Module] = {}
            for pattern in patterns:
                found = select(model, pattern, self.types)
                if not found:
                    names = [n for n, _ in model.named_modules() if n][:6]
                    narrowed = f" of types {self.types!r}" if self.types is not None else ""
                    raise InvalidArgumentError(
                        f"{kind}={pattern!r} selects no module{narrowed} of the {type(model).__name__} being "
                        f"trained; its modules are named like {', '.join(map(repr, names))}, ... (see "
                        "model.named_modules(); '*' matches dots too)")
                modules.update(found)
            chosen[kind] = modules
        return chosen


class RecordingSession:
    """One training run's recording: a :class:`Recorder` whose hooks run only inside the
    framework's training steps. Made by :meth:`open`; see the module docstring for the events.

    Attributes:
        recorder: the Recorder (``recorder.run_dir``, ``recorder.mlflow_run_id``).
        model: the module the hooks are on.
    """

    def __init__(self, recorder: Recorder, manager: HookManager, model: nn.Module) -> None:
        self.recorder = recorder
        self.model = model
        self._manager = manager  # keeps the registry of the recorder's handles alive
        self._pause = ExitStack()
        self._open = True
        self._pause.enter_context(recorder.paused())

    @classmethod
    def open(cls, options: CallbackOptions, model: nn.Module, default_run_dir: str | Path,
             mlflow_run_id: str | None, tracking_uri: str | None) -> RecordingSession:
        """Create the recorder and put its hooks on ``model``, paused until the first step.

        Under ``torch.distributed`` this is a collective (every rank opens its session): rank
        0's MLflow run id and tracking URI reach every rank. An ``mlflow_run_id=`` or
        ``tracking_uri=`` given to the callback wins over the framework's.

        Args:
            options: the callback's keywords.
            model: the unwrapped model being trained.
            default_run_dir: the run directory unless the callback was given ``run_dir=``.
            mlflow_run_id, tracking_uri: the MLflow run the framework logs to, and its store
                (None: the framework does not log to MLflow; other ranks may pass None).
        """
        modules = options.select_modules(model)  # before anything is created
        kwargs = dict(options.recorder)
        # Rank 0 knows the framework's store; the run id itself is broadcast by the Recorder.
        uris = gather(detect(kwargs.get("rank"), kwargs.get("world_size")), tracking_uri)
        kwargs.setdefault("tracking_uri", uris[0])
        kwargs.setdefault("mlflow_run_id", mlflow_run_id)
        recorder = Recorder(options.run_dir or default_run_dir, **kwargs)
        manager = HookManager()
        try:
            for kind, named in modules.items():
                getattr(manager, _REGISTER[kind])(recorder.hook(kind, **options.capture), **named)
            return cls(recorder, manager, model)
        except BaseException:
            recorder.close()
            raise

    @property
    def is_open(self) -> bool:
        """Whether the session still records (not closed or aborted)."""
        return self._open

    def begin_step(self, step: int) -> None:
        """The framework's optimizer step ``step`` begins: record its calls (if sampled)."""
        self.recorder.set_step(int(step))
        self._pause.close()

    def end_step(self) -> None:
        """The step ended: pause the hooks until the next one begins."""
        if not self._open:
            return
        self._pause.close()  # (nothing to leave when the step was already paused)
        self._pause.enter_context(self.recorder.paused())

    def close(self) -> RecorderSummary:
        """Close the recorder: files complete, hooks removed, MLflow upload (raises its errors)."""
        self._open = False
        self._pause.close()
        return self.recorder.close()

    def abort(self, error: BaseException) -> None:
        """Training raised ``error``: close the recorder for this rank alone (no collective: the
        other ranks may not have failed), log what happened, and never raise (the training's
        own exception is the one the caller sees)."""
        if not self._open:
            return
        self._open = False
        try:
            self._pause.close()
        except Exception:  # noqa: BLE001 - closing below matters more
            pass
        try:
            self.recorder.close(check_ranks=False)
        except BaseException as e:  # noqa: BLE001 - logged; the training's error propagates
            log.error("hookline: closing the recorder for %r after %s failed: %s",
                      str(self.recorder.run_dir), type(error).__name__, e)
            return
        log.warning("hookline: training stopped (%s: %s); the recorder for %r was closed: its records are on "
                    "disk and readable, its hooks removed", type(error).__name__, error, str(self.recorder.run_dir))


class SessionCallback:
    """The framework-independent half of both ``HooklineCallback`` classes (a mixin before the
    framework's callback class): the keywords, the session of the current training run, closing.

    Attributes:
        options: the checked keywords.
        recorder: the Recorder of the current (or last) training run; None before training.
        summary: the :class:`~hookline.tracker.RecorderSummary` of the last run that ended
            normally (None before).
    """

    def __init__(self, *, outputs: str | Iterable[str] | None = None, inputs: str | Iterable[str] | None = None,
                 grads: str | Iterable[str] | None = None, types: type | tuple[type, ...] | None = None,
                 every: int = 1, steps: Iterable[int] | None = None, mode: str = "tensor",
                 batch_slice: int | None = None, dtype: Any = None, run_dir: str | os.PathLike | None = None,
                 **recorder_kwargs: Any) -> None:
        self.options = CallbackOptions.parse(
            outputs=outputs, inputs=inputs, grads=grads, types=types, every=every, steps=steps, mode=mode,
            batch_slice=batch_slice, dtype=dtype, run_dir=run_dir, recorder_kwargs=recorder_kwargs,
            owner=type(self).__name__)
        self.recorder: Recorder | None = None
        self.summary: RecorderSummary | None = None
        self.session: RecordingSession | None = None
        self._planned: Path | None = None
        if self.options.run_dir is not None and not recorder_kwargs.get("resume"):
            self._refuse_held(self.options.run_dir, *_ranks(recorder_kwargs))  # before any trainer exists

    def plan_run_dir(self, default_base: str | Path) -> Path:
        """Choose the run directory of the next training run, and refuse now what the Recorder
        would refuse later (called before the framework starts its MLflow run where the
        framework lets a callback act that early).

        Args:
            default_base: the framework's default (``<output_dir>/hookline``); without
                ``run_dir=`` the run records there, or into the first free ``<base>-N``
                (:func:`numbered_run_dir`).

        Raises:
            RunExistsError: ``run_dir=`` holds a run and ``resume=True`` was not given.
        """
        kw = self.options.recorder
        info = detect(*_ranks(kw))
        resume = bool(kw.get("resume"))
        run_dir = self.options.run_dir
        if run_dir is None:
            run_dir = numbered_run_dir(Path(default_base), resume=resume, rank=info.rank, world_size=info.world_size)
        elif not resume:
            self._refuse_held(run_dir, info.rank, info.world_size)
        self._planned = run_dir
        return run_dir

    def _refuse_held(self, run_dir: Path, rank: int | None, world_size: int | None) -> None:
        held = held_run(run_dir, rank, world_size)
        if held:
            raise RunExistsError(
                f"{type(self).__name__}(run_dir={str(run_dir)!r}): it already holds a run ({held}); nothing was "
                "started. Leave run_dir unset (each training then records into its own <output_dir>/hookline, "
                "hookline-2, ...), pass a new directory, or resume=True to continue that run")

    def open_session(self, model: nn.Module, default_run_dir: str | Path, mlflow_run_id: str | None,
                     tracking_uri: str | None) -> None:
        """Start recording a training run of ``model`` (see :meth:`RecordingSession.open`) into
        the directory :meth:`plan_run_dir` chose (planned now if it was not called before)."""
        self.abort(RuntimeError("an earlier training run did not end"))  # it raised past the callback
        run_dir, self._planned = self._planned or self.plan_run_dir(default_run_dir), None
        self.session = RecordingSession.open(self.options, model, run_dir, mlflow_run_id, tracking_uri)
        self.recorder = self.session.recorder

    def begin_step(self, step: int) -> None:
        """The framework's optimizer step ``step`` begins (no-op outside a training run)."""
        if self.session is not None:
            self.session.begin_step(step)

    def end_step(self) -> None:
        """The step ended (no-op outside a training run)."""
        if self.session is not None:
            self.session.end_step()

    def close(self) -> RecorderSummary | None:
        """Close the current recording (idempotent): files complete, hooks removed, MLflow upload.

        Returns:
            Its summary, or None when nothing was open.
        """
        session, self.session = self.session, None
        if session is None or not session.is_open:
            return None
        self.summary = session.close()
        return self.summary

    def abort(self, error: BaseException) -> None:
        """Training raised ``error``: close the current recording for this rank alone, never
        raising (see :meth:`RecordingSession.abort`)."""
        session, self.session = self.session, None
        if session is not None:
            session.abort(error)
