"""The Recorder: hook functions that stream activations and gradients into a hookline run."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from hookline.storage.budget import Budget
from hookline.storage.errors import HookTypeError, InvalidArgumentError
from hookline.storage.format import manifest_name
from hookline.storage.lifecycle import weak_closer
from hookline.storage.live import AUTOFLUSH_S
from hookline.storage.mlflow.client import budget_seconds
from hookline.storage.priority import WRITER_PRIORITY, check_priority
from hookline.storage.writer import RunWriter, WriterStats

from .bindings import HandleBindings
from .convert import BufferPool
from .distributed import broadcast_run_id, check_same_handles, detect
from .empty import EmptyStepCheck
from .hook import CaptureHook, CaptureOptions
from .live import LiveUpdates, check_intervals
from .packer import BlockPacker
from .run import check_meta, check_run_dir, refuse_held_run, run_metadata
from .sampling import StepState, check_sampling, check_step
from .scaler import GradUnscaler, InfSteps, check_scaler
from .stats import StatsSpec
from .summary import RecorderSummary

__all__ = ["Recorder"]

log = logging.getLogger("hookline")

#: Run metadata key: the steps whose GradScaler found inf/NaN (``grad_scaler=``).
_INF_KEY = "found_inf_steps"


class Recorder:
    """Records activations and gradients of hooked modules into a run directory.

    Register its hook functions through a :class:`~hookline.tracker.HookManager`::

        mgr = HookManager()
        with Recorder("runs/baseline", every=10) as rec:
            mgr.register_forward_hook(rec.outputs, **select(model, "blocks.*"))
            mgr.register_backward_hook(rec.grads, **select(model, "blocks.*"))
            for step, batch in enumerate(loader):
                with rec.step(step):
                    loss_fn(model(batch)).backward()

    Each firing of a hook is one record ``(step, call, tensors)`` in that handle's HDF5 file;
    ``call`` counts the firings of the handle within the step (a module called twice gives calls
    0 and 1). Tensors are detached and copied on the training thread (CPU: one ``clone``; CUDA:
    a ``non_blocking`` copy into pinned memory, delivered when its event completes) and written
    by the storage layer's background thread. A ``DTensor`` (tensor parallelism) is recorded as
    the rank's local shard with its placements and mesh coordinate in the handle's metadata,
    without a collective; a replicated one only by mesh coordinate 0 (docs/distributed.md).

    Args:
        run_dir: directory of the run (created; must not already hold a run unless ``resume``).
        every: record every N-th step (``step % every == 0``). Default 1: every step, each record
            a full copy of its tensors (the bytes per step: docs/capture.md, Steps and sampling).
        steps: explicit steps to record instead of ``every``.
        max_buffer_mb: memory budget for data captured but not yet on disk: the blocks being
            filled (at most a quarter of it, and at most 64 MB) plus what the writer holds.
        policy: ``"block"`` (wait for the disk) or ``"drop"`` (drop records, counted) when the
            budget is exhausted.
        compression: storage compression (``None``, ``"gzip"``, ``"lzf"``, ``"zstd"``, ``"lz4"``).
        mlflow_run_id: register the run's data with this MLflow run: its norm series and tags
            while training runs (see ``mlflow_update_s``), its files at close. Under
            ``torch.distributed`` pass it on rank 0 (the others receive it by broadcast).
        tracking_uri: MLflow tracking URI (default: MLflow's own resolution).
        mlflow_timeout: seconds each MLflow call of the upload may take (default
            ``$HOOKLINE_MLFLOW_TIMEOUT``, else 60; see docs/mlflow.md, "Time budget").
        mlflow_update_s: with an MLflow run, at most this often (checked at step boundaries) a
            background pass logs the norm points of the records sealed since the last one
            (None: only at :meth:`flush` and :meth:`close`). Default 60.
        autoflush_s: the writer seals what it holds (durable, readable, and visible to the
            MLflow updates) every this many seconds without waiting for :meth:`flush`
            (None: only at :meth:`flush` and :meth:`close`). Default 60 (cost: docs/performance.md,
            "Sealing while training runs").
        rank, world_size: distributed rank information (stored in file names and attributes);
            default: taken from an initialised ``torch.distributed`` process group. Under
            ``torch.distributed`` the constructor and :meth:`close` are collectives: every rank
            must create and close its recorder.
        meta: extra JSON-serialisable run metadata.
        stats: histogram bins for ``mode="stats"`` hooks.
        resume: continue a run this directory already holds (e.g. after a crash: each handle
            appends after its last durable record). Without it, a directory that holds a run
            is refused, so two runs are never mixed by a reused name.
        grad_scaler: the ``torch.amp.GradScaler`` the loss is scaled with: gradients (and their
            stats) are recorded divided by the scale in effect for their backward pass, in
            float32 (float64 stays float64), without a device synchronisation in hooks; the
            steps whose scaler found inf/NaN are listed in the run metadata
            (``found_inf_steps``). Expects one ``scaler.update()`` per recorder step.
        writer_priority: the scheduling priority of the writer's background threads on Linux:
            ``"nice"`` (default: nice 19, so that they run in the gaps of torch's parallel
            regions instead of stalling them) or ``"normal"`` (the caller's priority;
            docs/internals/capture.md, "The writer's priority").
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        every: int = 1,
        steps: Iterable[int] | None = None,
        max_buffer_mb: float = 512,
        policy: str = "block",
        compression: str | None = None,
        mlflow_run_id: str | None = None,
        tracking_uri: str | None = None,
        mlflow_timeout: float | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        meta: dict[str, Any] | None = None,
        stats: StatsSpec | None = None,
        resume: bool = False,
        grad_scaler: torch.amp.GradScaler | None = None,
        mlflow_update_s: float | None = 60.0,
        autoflush_s: float | None = AUTOFLUSH_S,
        writer_priority: str = WRITER_PRIORITY,
    ) -> None:
        self.run_dir = check_run_dir(run_dir)
        self.every, self.steps = every, steps = check_sampling(every, steps)
        check_meta(meta, resume)
        update_s, autoflush_s = check_intervals(mlflow_update_s, autoflush_s)
        writer_priority = check_priority(writer_priority)
        self.grad_scaler = check_scaler(grad_scaler, meta, _INF_KEY)
        budget = Budget(max_buffer_mb)
        for arg, v in (("mlflow_run_id", mlflow_run_id), ("tracking_uri", tracking_uri)):
            if v is not None and not isinstance(v, str):
                raise HookTypeError(f"{arg} must be a str or None, got {type(v).__name__} {v!r:.60}")
        if stats is not None and not isinstance(stats, StatsSpec):
            raise HookTypeError(f"stats must be a StatsSpec (e.g. StatsSpec(bins=64, range=(-8, 8))), got {stats!r}")
        self.stats_spec = stats or StatsSpec()
        self._dist = detect(rank, world_size)
        rank, world_size = self._dist.rank, self._dist.world_size
        # Rank 0 owns the MLflow run; the others learn its id (a collective, outside any hook).
        mlflow_run_id = broadcast_run_id(self._dist, mlflow_run_id)
        self.mlflow_run_id = mlflow_run_id
        self.tracking_uri = tracking_uri
        run_meta = run_metadata(every, steps, meta, mlflow_run_id)
        if grad_scaler is not None:
            run_meta[_INF_KEY] = []  # (the key exists from the start: later updates replace its value)
        if mlflow_timeout is not None:
            budget_seconds(mlflow_timeout)  # a bad value fails now, with MLflow or without
        self._mlflow = None
        if mlflow_run_id is not None:
            from hookline.storage import MlflowAdapter

            # Validates the id before anything is created; mlflow itself is imported on the
            # adapter's own thread.
            self._mlflow = MlflowAdapter(mlflow_run_id, tracking_uri=tracking_uri, rank=rank,
                                         mlflow_timeout=mlflow_timeout)
        if not resume:
            refuse_held_run(self._dist, self.run_dir)
        # The budget covers the blocks being filled (capture/packer.py) and the writer's queue.
        open_bytes = budget.open_blocks_bytes
        self._writer = RunWriter(
            self.run_dir,
            max_buffer_mb=budget.writer_share_mb,
            policy=policy,
            compression=compression,
            rank=rank,
            world_size=world_size,
            meta=run_meta,
            autoflush_s=autoflush_s,
            writer_priority=writer_priority,
        )
        self.rank, self.world_size = rank, world_size
        self._live = LiveUpdates(self._mlflow, self.run_dir / manifest_name(rank, world_size), update_s)
        self._state, self._empty = StepState(every, steps, str(self.run_dir)), EmptyStepCheck(str(self.run_dir))
        # Records are packed into chunk-sized host blocks (reused buffers: warm pages) and
        # handed to the writer a block at a time. Free buffers kept for reuse share the open
        # blocks' part of the budget (SPEC §8), also when ragged shapes leave pooled buffers
        # that no later block can use (the packer shrinks the pool as blocks grow).
        self._pool = BufferPool(max_bytes=open_bytes)
        self._packer = BlockPacker(self._writer.write_block, self._pool, max_open_bytes=open_bytes,
                                   check_fields=self._writer.reserve_fields, write_rows=self._writer.write_rows,
                                   make_room=self._writer.make_room)
        self._bindings = HandleBindings(self._state, self._writer, self._packer, self.stats_spec)
        self._unscale = GradUnscaler(grad_scaler) if grad_scaler is not None else None
        self._inf_steps = InfSteps(grad_scaler, self._note_inf_steps) if grad_scaler is not None else None
        self.inputs = CaptureHook(self._bindings, CaptureOptions("inputs"))
        self.outputs = CaptureHook(self._bindings, CaptureOptions("outputs"))
        self.grads = CaptureHook(self._bindings, CaptureOptions("grads"), unscale=self._unscale)
        # A recorder dropped without close() (hooks removed, last reference gone) still gets its
        # open blocks to disk and its files closed.
        self._collected = weakref.finalize(self, _close_collected, self._packer, self._writer, str(self.run_dir))
        self._collected.atexit = False  # at exit the closer below closes it properly
        # Close at interpreter exit so buffered data reaches the disk (weakly: no leak).
        self._atexit = weak_closer(self, _log_exit_error)
        self._exit_timeout: float | None = None  # the MLflow upload's limit when closed at exit
        if self._mlflow is not None:
            from hookline.storage.mlflow.shutdown import at_main_exit

            # Before the adapters' own exit hook (which would find the writer still open and
            # upload no files) and while threads can still be started.
            at_main_exit(_exit_closer(self))
        else:
            atexit.register(self._atexit)

    # --- configuration ------------------------------------------------------------------
    def hook(
        self,
        kind: str,
        *,
        mode: str = "tensor",
        batch_slice: int | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> CaptureHook:
        """Return a configured hook function for one registration.

        Args:
            kind: ``"inputs"`` (forward pre hook), ``"outputs"`` (forward hook) or ``"grads"``
                (backward hook: ``grad_in`` and ``grad_out``).
            mode: ``"tensor"`` stores tensors; ``"stats"`` stores per-record ``norm``, ``mean``,
                ``std``, ``min``, ``max``, ``absmax`` scalars and a fixed-bin ``hist`` per field.
            batch_slice: keep only the first K items along dimension 0.
            dtype: cast floating tensors (e.g. ``torch.bfloat16``) before storing.
            name: the hook function's name (its ``repr``, used in handle ids). Default derived
                from the options, e.g. ``outputs.stats.b4``.

        Example:
            >>> mgr.register_forward_hook(rec.hook("outputs", mode="stats"), **select(model, "*"))
        """
        if name is not None and not isinstance(name, str):
            raise HookTypeError(f"hook name must be a str, got {type(name).__name__} {name!r:.60}")
        if name is not None and not name:
            raise InvalidArgumentError("hook name must be a non-empty str, got ''")
        opts = CaptureOptions(kind, mode=mode, batch_slice=batch_slice, dtype=dtype,
                              stats=self.stats_spec if mode == "stats" else None)
        return CaptureHook(self._bindings, opts, name, unscale=self._unscale)

    # --- steps and sampling ---------------------------------------------------------------
    def is_sampled(self, step: int) -> bool:
        """Whether ``step`` is recorded under this recorder's ``every``/``steps`` setting."""
        return self._state.is_sampled(step)

    @property
    def current_step(self) -> int | None:
        """The step being recorded, or None outside any step."""
        return self._state.step

    def set_step(self, step: int) -> None:
        """Make ``step`` the current step (for loops that prefer a setter to ``with rec.step``).

        On steps that are not sampled the recorder suspends its handles through the manager
        (no torch hook is left on the modules, so they cost nothing) and releases them on the
        next sampled step. Suspension is separate from the handles' ``active`` switch: handles
        the user deactivated (before or during a skipped step) stay deactivated.
        """
        self._state.check_open()
        step = check_step(step)
        self._writer.raise_if_failed()
        self._packer.hand_over_stale()
        self._live.tick()  # (a clock read; now and then a background MLflow pass)
        if self._inf_steps is not None:
            self._inf_steps.boundary(step)
        if step != self._state.step:
            self._step_ended()
        self._set_current(step)

    def _step_ended(self) -> None:
        """The current step ends: warn (once) when it was sampled and recorded nothing."""
        if self._state.recorded_nothing:
            self._empty.step_ended(self._state.step, self._bindings.handle_ids())  # type: ignore[arg-type]

    def _set_current(self, step: int) -> None:
        state = self._state
        with state.lock:
            if state.enter(step):
                self._bindings.suspend_all(state.holds_off)

    @contextmanager
    def step(self, step: int) -> Iterator[int]:
        """Context for one training step: records made inside carry ``step``.

        Example:
            >>> with rec.step(7):
            ...     loss_fn(model(batch)).backward()
        """
        state = self._state
        outer = state.step
        self.set_step(step)
        ended = False  # (a step cut short by an exception is not checked for records)
        try:
            yield state.step  # type: ignore[misc]
            ended = True
        finally:
            if outer is None or state.closed:
                if ended and not state.closed:
                    self._step_ended()
                state.step = None
            else:  # nested: the outer step goes on (its sampling and call counts included)
                self._set_current(outer)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Suspend this recorder's handles (e.g. around an evaluation loop), release them on exit.

        Handles registered meanwhile are suspended too; the handles' ``active`` switches are left
        alone (what the user deactivates inside stays deactivated).
        """
        state = self._state
        state.check_open()
        with state.lock:
            state.paused += 1
            self._bindings.suspend_all(state.holds_off)
        try:
            yield
        finally:
            with state.lock:
                state.paused -= 1
                self._bindings.suspend_all(state.holds_off)
                state.released = state.released or (state.step is not None and not state.holds_off)

    def _note_inf_steps(self, steps: list[int]) -> None:
        # The writer's run metadata goes into the manifest at the next flush/close; the value
        # is replaced, never mutated (the writer thread may be serialising it).
        self._writer.meta[_INF_KEY] = steps

    # --- lifecycle --------------------------------------------------------------------------
    def flush(self) -> None:
        """Block until everything captured so far is on disk (and readable after a crash).

        With MLflow, also schedules a background update of the run's metrics and tags.
        """
        self._state.check_open()
        if self._inf_steps is not None:
            self._inf_steps.read(wait=True)
        failure: BaseException | None = None
        try:
            self._packer.drain()
        except BaseException as e:  # noqa: BLE001 - one refused block must not keep the others off disk
            failure = e
        self._writer.flush()
        if failure is not None:
            raise failure
        if self._mlflow is not None:
            self._mlflow.submit(self.run_dir)  # per-step metrics so far, in the background

    def summary(self) -> RecorderSummary:
        """Per-handle records, bytes, drops and time spent in hooks so far.

        Counts come from the writer: records still in a block being filled (at most one block
        per handle, handed over within ~1 s at a step boundary) are not counted yet; call
        :meth:`flush` first for exact numbers mid-run. After :meth:`close` they are exact.
        """
        storage: WriterStats = self._writer.stats()
        return self._bindings.summary(str(self.run_dir), storage, self.mlflow_run_id)

    def close(self, *, check_ranks: bool = True) -> RecorderSummary:
        """Flush, close the files, upload to MLflow if configured; idempotent.

        Args:
            check_ranks: under ``torch.distributed``, compare the ranks' handle sets (a
                collective: every rank must close). ``False`` closes this rank alone, e.g.
                after an exception that the other ranks may not have seen.

        Returns:
            The :class:`RecorderSummary` (also logged at INFO level on the ``hookline`` logger).

        Raises:
            StorageError: if writing failed (what was flushed before stays readable).
            TrackingError: if the MLflow upload failed (local files are complete; use
                ``hookline sync`` to upload later).
        """
        if self._state.closed:
            return self.summary()
        atexit.unregister(self._atexit)
        self._collected.detach()
        if sys.exc_info()[0] is None:  # (closed while handling training's exception: the step was cut short)
            self._step_ended()  # (a loop of set_step() calls: its last step ends here)
        failure: BaseException | None = None
        try:
            self._packer.drain(final=True)  # a record racing in from another thread now fails
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the collective
            failure = e
        self._state.closed = True
        if self._inf_steps is not None:
            try:
                self._inf_steps.close()
            except BaseException as e:  # noqa: BLE001 - the files are closed first
                failure = failure or e
        # The recorder's hooks are useless once it is closed: remove them from their managers
        # so later forwards of the model neither pay for them nor fail.
        self._bindings.remove_all()
        if self._mlflow is not None and failure is None:
            self._mlflow.prefetch()  # (the server answers the final pass's get_run while the files close)
        try:
            self._writer.close()
        except BaseException as e:  # noqa: BLE001
            failure = failure or e
        # Every rank must have recorded the same handles (checked after the files are complete).
        # The check is a collective: it runs even when this rank failed, so no rank hangs.
        if check_ranks:
            check_same_handles(self._dist, self._bindings.handle_ids())
        if failure is not None:
            raise failure
        summary = self.summary()
        if self._mlflow is not None:
            self._mlflow.submit(self.run_dir)
            try:
                self._mlflow.close(self._exit_timeout)  # final sync incl. files; waits for uploads
            except Exception as e:  # reported in the summary, then raised for the caller
                summary.mlflow_error = str(e)
                log.error("%s", summary)
                raise
        log.info("%s", summary)
        return summary

    @property
    def _closed(self) -> bool:
        # The flag storage's weak_closer (the exit closer) reads, as on a RunWriter.
        return self._state.closed

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder({str(self.run_dir)!r}, every={self.every}, closed={self._closed})"


def _exit_closer(rec: Recorder) -> Any:
    """The exit hook of a recorder with MLflow (``at_main_exit``: it runs once the main thread
    has finished, while Python still waits for the other threads). While another non-daemon
    thread runs (training in a thread while the main one returned), closing now would cut it
    off: the recorder is closed after that thread, by ``atexit`` (its files complete; MLflow
    may be gone by then: ``hookline sync`` uploads later). The MLflow upload waits at most
    ``$HOOKLINE_MLFLOW_EXIT_TIMEOUT`` seconds (default 120), as the adapters' own exit hook."""
    ref = weakref.ref(rec)
    closer = rec._atexit

    def close() -> None:
        r = ref()
        if r is None or r._closed:
            return
        me = threading.current_thread()
        if any(t.is_alive() and not t.daemon and t is not me for t in threading.enumerate()):
            atexit.register(closer)
            return
        from hookline.storage.mlflow.shutdown import exit_timeout

        r._exit_timeout = exit_timeout()
        closer()

    return close


def _close_collected(packer: BlockPacker, writer: RunWriter, run_dir: str) -> None:
    """Finalizer of a recorder garbage-collected without :meth:`Recorder.close`: its open blocks
    go to the writer, which closes (on a thread of its own: the collection may run on any
    thread, the writer's included, which must not wait for itself)."""

    def close() -> None:
        try:
            try:
                packer.drain(final=True)
            finally:
                writer.close()
            log.warning("hookline: the Recorder for %r was garbage-collected without close(); its records "
                        "were written and its files closed (MLflow, if used, was not updated: run "
                        "`hookline sync`)", run_dir)
        except Exception as e:  # noqa: BLE001 - no caller left to raise to
            log.error("hookline: closing the garbage-collected Recorder for %r failed: %s", run_dir, e)

    if not threading.main_thread().is_alive() and not writer.on_own_thread():
        # Collected while the interpreter exits (threading already shut down: a thread started
        # now would not be joined and would race the writer's own exit closer): close here.
        close()
    else:
        threading.Thread(target=close, name="hookline-recorder-finalizer").start()


def _log_exit_error(rec: Recorder, e: Exception) -> None:
    log.error("hookline: closing %r at exit failed: %s", rec, e)
