"""The Recorder: hook functions that stream activations and gradients into a hookline run."""

from __future__ import annotations

import atexit
import logging
import numbers
import os
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping

import numpy as np
import torch

from hookline.storage.errors import (
    DuplicateNameError,
    HookTypeError,
    InvalidArgumentError,
    RunExistsError,
    StorageError,
    WriterClosedError,
)
from hookline.storage.format import MANIFEST_RE, MAX_STEP, manifest_name, read_manifest
from hookline.storage.writer import RunWriter, WriterStats, weak_closer

from .capture import CaptureHook, CaptureOptions, _Binding, field_tensors
from .convert import BufferPool
from .distributed import broadcast_run_id, check_same_handles, detect, gather
from .packer import BlockPacker
from .stats import SCALAR_STATS, StatsSpec

__all__ = ["Recorder", "RecorderSummary", "HandleSummary"]

log = logging.getLogger("hookline")


@dataclass
class HandleSummary:
    """What one hook handle recorded (counts from the storage writer) and what it cost."""

    handle_id: str
    records: int = 0
    bytes: int = 0
    dropped: int = 0
    hook_seconds: float = 0.0
    skipped_fields: list[str] = field(default_factory=list)
    #: Records of this recorder durably on disk (flushed); equals ``records`` after a successful
    #: close (a resumed run's earlier records are not counted, as in ``records``).
    on_disk: int = 0


@dataclass
class RecorderSummary:
    """Returned by :meth:`Recorder.close`: per-handle records, bytes, drops and hook time.

    ``storage`` holds the writer's own counters (totals, peak buffer, time blocked on the disk).
    """

    run_dir: str
    handles: dict[str, HandleSummary]
    storage: WriterStats
    mlflow_run_id: str | None = None
    mlflow_error: str | None = None

    @property
    def records(self) -> int:
        return self.storage.records

    @property
    def bytes(self) -> int:
        return self.storage.bytes

    @property
    def dropped(self) -> int:
        return self.storage.dropped

    @property
    def failed(self) -> bool:
        """Whether writing failed: then only :attr:`HandleSummary.on_disk` records per handle
        (those flushed before the failure) reached the disk, not :attr:`records`."""
        return self.storage.error is not None

    def __str__(self) -> str:
        lines = []
        if self.failed:
            lines.append(f"hookline run {self.run_dir}: WRITING FAILED: {self.storage.error}; of {self.records} "
                         f"records captured, {sum(h.on_disk for h in self.handles.values())} reached the disk "
                         f"(those flushed before the failure)")
        else:
            lines.append(f"hookline run {self.run_dir}: {self.records} records, {self.bytes / 1e6:.1f} MB"
                         + (f", {self.dropped} DROPPED (policy 'drop')" if self.dropped else "")
                         + f", {self.storage.blocked_seconds:.2f} s blocked on the disk")
        for h in self.handles.values():
            lines.append(
                f"  {h.handle_id:<40} {h.records:>7} rec {h.bytes / 1e6:>9.2f} MB"
                f" {h.dropped:>5} dropped {h.hook_seconds * 1e3:>8.1f} ms in hooks"
                + (f" {h.on_disk:>7} on disk" if self.failed else "")
            )
        if self.mlflow_run_id:
            lines.append(f"  mlflow run {self.mlflow_run_id}" + (f": ERROR {self.mlflow_error}" if self.mlflow_error else ""))
        return "\n".join(lines)


#: Steps per handle whose call counters are kept (see Recorder._capture).
_CALL_STEPS = 64


def _check_step(n: Any) -> int:
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
        raise HookTypeError(
            f"step must be an int, got {type(n).__name__} {n!r:.60} (e.g. rec.set_step(int(step)))")
    if not 0 <= n <= MAX_STEP:
        raise InvalidArgumentError(f"step must be a non-negative int up to 2**63 - 1 (stored as int64), got {n!r}")
    return int(n)


#: ``steps=`` longer than this are summarised in the run metadata (which every handle file and
#: the manifest carry) instead of listed.
_STEPS_LISTED = 256


def _steps_meta(steps: frozenset[int] | None) -> list[int] | dict[str, Any] | None:
    """The ``steps`` run metadata: the sorted list, or for long ones ``{"count", "first", "last",
    "stride"}`` (``stride`` when they are evenly spaced, else None)."""
    if steps is None:
        return None
    ordered = sorted(steps)
    if len(ordered) <= _STEPS_LISTED:
        return ordered
    stride = ordered[1] - ordered[0]
    even = all(b - a == stride for a, b in zip(ordered, ordered[1:]))
    return {"count": len(ordered), "first": ordered[0], "last": ordered[-1], "stride": stride if even else None}


#: Run metadata keys the recorder writes itself (a user's ``meta=`` may not override them).
_OWN_META = ("torch_version", "every", "steps", "mlflow_run_id")


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
    by the storage layer's background thread.

    Args:
        run_dir: directory of the run (created; must not already hold a run unless ``resume``).
        every: record every N-th step (``step % every == 0``). Default 1.
        steps: explicit steps to record instead of ``every``.
        max_buffer_mb: memory budget for data captured but not yet on disk: the blocks being
            filled (at most a quarter of it, and at most 64 MB) plus what the writer holds.
        policy: ``"block"`` (wait for the disk) or ``"drop"`` (drop records, counted) when the
            budget is exhausted.
        compression: storage compression (``None``, ``"gzip"``, ``"lzf"``, ``"zstd"``, ``"lz4"``).
        mlflow_run_id: register the run's data with this MLflow run at close. Under
            ``torch.distributed`` pass it on rank 0 (the others receive it by broadcast).
        tracking_uri: MLflow tracking URI (default: MLflow's own resolution).
        rank, world_size: distributed rank information (stored in file names and attributes);
            default: taken from an initialised ``torch.distributed`` process group. Under
            ``torch.distributed`` the constructor and :meth:`close` are collectives: every rank
            must create and close its recorder.
        meta: extra JSON-serialisable run metadata.
        stats: histogram bins for ``mode="stats"`` hooks.
        resume: continue a run this directory already holds (e.g. after a crash: each handle
            appends after its last durable record). Without it, a directory that holds a run
            is refused, so two runs are never mixed by a reused name.
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
        rank: int | None = None,
        world_size: int | None = None,
        meta: dict[str, Any] | None = None,
        stats: StatsSpec | None = None,
        resume: bool = False,
    ) -> None:
        if not isinstance(run_dir, (str, os.PathLike)):
            raise HookTypeError(
                f"Recorder needs a run directory path (str or os.PathLike), got "
                f"{type(run_dir).__name__} {run_dir!r:.80}; e.g. Recorder('runs/baseline')"
            )
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)):
            raise HookTypeError(f"every must be an int (record every N-th step), got {type(every).__name__} {every!r:.60}")
        if every < 1:
            raise InvalidArgumentError(f"every must be a positive int (record every N-th step), got {every!r}")
        every = int(every)
        if steps is not None:
            if every != 1:
                raise InvalidArgumentError(
                    f"give either every={every!r} or steps=..., not both"
                )
            if isinstance(steps, (str, bytes)) or not isinstance(steps, Iterable):
                raise HookTypeError(
                    f"steps must be an iterable of step numbers (e.g. range(0, 1000, 50)), got "
                    f"{type(steps).__name__} {steps!r:.60}")
            steps = frozenset(_check_step(s) for s in steps)
        if meta is not None and not isinstance(meta, Mapping):
            raise HookTypeError(f"meta must be a dict of run metadata, got {type(meta).__name__} {meta!r:.60}")
        if meta is not None:
            own = [k for k in meta if k in _OWN_META]
            if own:
                raise InvalidArgumentError(
                    f"meta key {own[0]!r} is written by the recorder itself ({', '.join(_OWN_META)}); "
                    f"rename yours (e.g. 'user_{own[0]}')")
        if isinstance(max_buffer_mb, bool) or not isinstance(max_buffer_mb, numbers.Real):
            raise HookTypeError(f"max_buffer_mb must be a number of MB, got {type(max_buffer_mb).__name__} "
                                f"{max_buffer_mb!r:.60}")
        if not 0 < max_buffer_mb < float("inf"):
            raise InvalidArgumentError(f"max_buffer_mb must be a positive number, got {max_buffer_mb!r}")
        max_buffer_mb = float(max_buffer_mb)
        for arg, v in (("mlflow_run_id", mlflow_run_id), ("tracking_uri", tracking_uri)):
            if v is not None and not isinstance(v, str):
                raise HookTypeError(f"{arg} must be a str or None, got {type(v).__name__} {v!r:.60}")
        self.every = every
        self.steps = steps
        self.run_dir = Path(run_dir)
        if stats is not None and not isinstance(stats, StatsSpec):
            raise HookTypeError(f"stats must be a StatsSpec (e.g. StatsSpec(bins=64, range=(-8, 8))), got {stats!r}")
        self.stats_spec = stats or StatsSpec()
        self._dist = detect(rank, world_size)
        rank, world_size = self._dist.rank, self._dist.world_size
        # Rank 0 owns the MLflow run; the others learn its id (a collective, outside any hook).
        mlflow_run_id = broadcast_run_id(self._dist, mlflow_run_id)
        self.mlflow_run_id = mlflow_run_id
        self.tracking_uri = tracking_uri
        run_meta = {"torch_version": torch.__version__, "every": every, "steps": _steps_meta(steps),
                    **(meta or {})}
        if mlflow_run_id is not None:
            run_meta["mlflow_run_id"] = mlflow_run_id
        self._mlflow = None
        if mlflow_run_id is not None:
            from hookline.storage import MlflowAdapter

            # Validates the id before anything is created; mlflow itself is imported on the
            # adapter's own thread.
            self._mlflow = MlflowAdapter(mlflow_run_id, tracking_uri=tracking_uri, rank=rank)
        if not resume:
            # Agreed between ranks (a collective before any rank creates a file), so every rank
            # raises, or none does.
            held = [h for h in gather(self._dist, _held_run(self.run_dir, rank, world_size)) if h]
            if held:
                raise RunExistsError(
                    f"{str(self.run_dir)!r} already holds a run ({held[0]}); record into a new "
                    f"directory, or pass resume=True to continue that run (e.g. after a crash)")
        # The budget covers the blocks being filled (tracker/packer.py) and the writer's queue.
        budget = int(max_buffer_mb * 2**20)
        open_bytes = min(budget // 4, 64 << 20)
        self._writer = RunWriter(
            self.run_dir,
            max_buffer_mb=(budget - open_bytes) / 2**20,
            policy=policy,
            compression=compression,
            rank=rank,
            world_size=world_size,
            meta=run_meta,
        )
        self.rank, self.world_size = rank, world_size
        self._lock = threading.Lock()
        self._step: int | None = None
        self._sampled = True
        self._paused = 0  # depth of paused() contexts
        self._calls: dict[str, dict[int, int]] = {}  # handle id -> step -> next call index
        self._closed = False
        self._bindings: list[tuple[CaptureHook, _Binding]] = []
        self._owners: dict[str, weakref.ref[torch.nn.Module]] = {}  # handle id -> its module
        self._hook_seconds: dict[str, float] = {}
        self._skipped: dict[str, list[str]] = {}
        # Records are packed into chunk-sized host blocks (reused buffers: warm pages) and
        # handed to the writer a block at a time. Free buffers kept for reuse are bounded like
        # the open blocks, so memory stays within the budget + 64 MB (SPEC §8) even when
        # ragged shapes leave pooled buffers that no later block can use.
        self._pool = BufferPool(max_bytes=open_bytes)
        self._packer = BlockPacker(self._writer.write_block, self._pool, max_open_bytes=open_bytes,
                                   check_fields=self._writer.reserve_fields)
        self.inputs = CaptureHook(self, CaptureOptions("inputs"))
        self.outputs = CaptureHook(self, CaptureOptions("outputs"))
        self.grads = CaptureHook(self, CaptureOptions("grads"))
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
        return CaptureHook(self, opts, name)

    # --- steps and sampling ---------------------------------------------------------------
    def is_sampled(self, step: int) -> bool:
        """Whether ``step`` is recorded under this recorder's ``every``/``steps`` setting."""
        return step in self.steps if self.steps is not None else step % self.every == 0

    @property
    def current_step(self) -> int | None:
        """The step being recorded, or None outside any step."""
        return self._step

    def set_step(self, step: int) -> None:
        """Make ``step`` the current step (for loops that prefer a setter to ``with rec.step``).

        On steps that are not sampled the recorder suspends its handles through the manager
        (no torch hook is left on the modules, so they cost nothing) and releases them on the
        next sampled step. Suspension is separate from the handles' ``active`` switch: handles
        the user deactivated (before or during a skipped step) stay deactivated.
        """
        self._check_open()
        step = _check_step(step)
        self._raise_writer_error()
        self._packer.hand_over_stale()
        self._set_current(step)

    def _set_current(self, step: int) -> None:
        sampled = self.is_sampled(step)
        with self._lock:
            self._step = step
            if sampled != self._sampled:
                self._sampled = sampled
                self._apply_suspension()

    def _apply_suspension(self) -> None:
        """Suspend the handles on skipped steps and inside paused(); release them otherwise."""
        off = self._paused > 0 or not self._sampled
        for _, b in self._bindings:
            b.handle._suspend(off)

    @contextmanager
    def step(self, step: int) -> Iterator[int]:
        """Context for one training step: records made inside carry ``step``.

        Example:
            >>> with rec.step(7):
            ...     loss_fn(model(batch)).backward()
        """
        outer = self._step
        self.set_step(step)
        try:
            yield self._step  # type: ignore[misc]
        finally:
            if outer is None or self._closed:
                self._step = None
            else:  # nested: the outer step goes on (its sampling and call counts included)
                self._set_current(outer)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Suspend this recorder's handles (e.g. around an evaluation loop), release them on exit.

        Handles registered meanwhile are suspended too; the handles' ``active`` switches are left
        alone (what the user deactivates inside stays deactivated).
        """
        self._check_open()
        with self._lock:
            self._paused += 1
            self._apply_suspension()
        try:
            yield
        finally:
            with self._lock:
                self._paused -= 1
                self._apply_suspension()

    # --- binding (called by CaptureHook) ----------------------------------------------------
    def _bind(self, hook: CaptureHook, binding: _Binding) -> None:
        self._check_open()
        handle = binding.handle
        module = handle.module
        fn_name = handle.hook_fn.name
        module_name = binding.handle_id[len(fn_name) + 1 : -1] if binding.handle_id.startswith(fn_name + "[") else ""
        opts = hook.options
        meta: dict[str, Any] = {"kind": opts.kind, "mode": opts.mode,
                                "batch_slice": opts.batch_slice,
                                "cast_dtype": str(opts.dtype).removeprefix("torch.") if opts.dtype else None}
        if opts.mode == "stats":
            meta["stats"] = list(SCALAR_STATS) + ["hist"]
            meta["hist_edges"] = self.stats_spec.edges.tolist()
        owner_ref = self._owners.get(binding.handle_id)
        owner = owner_ref() if owner_ref is not None else None
        if owner is not None and owner is not module:
            # Two managers naming modules alike (a teacher and a student, a model and its EMA
            # copy): one handle would silently mix two modules' records.
            raise DuplicateNameError(
                f"handle id {binding.handle_id!r} already records another module of this run "
                f"({type(owner).__name__} at 0x{id(owner):x}; this one is {type(module).__name__} at "
                f"0x{id(module):x}); give each model's registration its own hook name, e.g. "
                f"rec.hook({opts.kind!r}, name='student_{opts.kind}')"
            )
        self._writer.add_handle(
            binding.handle_id,
            module_name=module_name,
            module_type=f"{type(module).__module__}.{type(module).__qualname__}",
            category=binding.category,
            hook_fn_name=fn_name,
            meta=meta,
        )
        with self._lock:
            self._owners[binding.handle_id] = weakref.ref(module)
            self._bindings.append((hook, binding))
            self._packer.handles = len(self._bindings)  # sizes blocks: see BlockPacker.handles
            self._hook_seconds.setdefault(binding.handle_id, 0.0)
            self._skipped.setdefault(binding.handle_id, [])
            handle._suspend(self._paused > 0 or not self._sampled)

    def _unbind(self, hook: CaptureHook, binding: _Binding) -> None:
        with self._lock:
            self._bindings = [(h, b) for h, b in self._bindings if b is not binding]
            self._packer.handles = len(self._bindings)

    # --- hot path ---------------------------------------------------------------------------
    def _capture(self, hook: CaptureHook, binding: _Binding, groups: Any, t0: int) -> None:
        if self._paused:
            return  # a handle (re)activated inside paused(): records nothing
        step = self._step
        if step is None:
            raise InvalidArgumentError(
                f"{binding.handle_id} fired outside any recorder step: wrap the forward/backward in "
                f"`with rec.step(n):` (or call rec.set_step(n)), or use `with rec.paused():` for "
                f"passes that should not be recorded"
            )
        if self._closed:
            raise WriterClosedError(
                f"{binding.handle_id} fired after the recorder for {str(self.run_dir)!r} was closed; "
                f"remove its hooks (mgr.remove_hook_function(rec.{hook.options.kind})) or record "
                f"with a new Recorder"
            )
        if not self._sampled:
            return  # a handle the user activated on a step that is not sampled
        hid = binding.handle_id
        with self._lock:  # CUDA backward hooks run on autograd's device threads
            # Per handle id (not per binding: a hook removed and registered again continues the
            # count) and per step, for the last _CALL_STEPS steps (a step entered again, e.g. an
            # evaluation pass reusing the step number, continues its numbering).
            calls = self._calls.setdefault(hid, {})
            call = calls.get(step, 0)
            calls[step] = call + 1
            if len(calls) > _CALL_STEPS:
                del calls[next(iter(calls))]
        opts = hook.options
        names, tensors, skipped = field_tensors(groups, opts)
        if skipped:
            known = self._skipped[hid]
            unseen = [p for p in skipped if p not in known]
            if unseen:  # rare: the first firings of a handle; recorded in the manifest
                known.extend(unseen)
                self._writer.update_handle_meta(hid, {"skipped_fields": list(known)})
        stats = opts.mode == "stats"
        # Stats are float64 whatever the dtype option (field_tensors cast before summarising).
        self._packer.add(hid, step, call, names, tensors, None if stats else opts.dtype, stats)
        self._hook_seconds[hid] += (time.perf_counter_ns() - t0) * 1e-9

    # --- lifecycle --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(
                f"the recorder for {str(self.run_dir)!r} is closed; create a new Recorder to record more"
            )

    def _raise_writer_error(self) -> None:
        check = getattr(self._writer, "raise_if_failed", None)
        if check is not None:
            check()

    def flush(self) -> None:
        """Block until everything captured so far is on disk (and readable after a crash).

        With MLflow, also schedules a background update of the run's metrics and tags.
        """
        self._check_open()
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
        storage = self._writer.stats()
        handles = {}
        for hid, seconds in self._hook_seconds.items():
            st = storage.handles.get(hid)
            handles[hid] = HandleSummary(
                hid, st.records if st else 0, st.bytes if st else 0, st.dropped if st else 0,
                seconds, list(self._skipped[hid]), st.flushed - st.start if st else 0,
            )
        return RecorderSummary(str(self.run_dir), handles, storage, self.mlflow_run_id)

    def close(self) -> RecorderSummary:
        """Flush, close the files, upload to MLflow if configured; idempotent.

        Returns:
            The :class:`RecorderSummary` (also logged at INFO level on the ``hookline`` logger).

        Raises:
            StorageError: if writing failed (what was flushed before stays readable).
            TrackingError: if the MLflow upload failed (local files are complete; use
                ``hookline sync`` to upload later).
        """
        if self._closed:
            return self.summary()
        atexit.unregister(self._atexit)
        self._collected.detach()
        failure: BaseException | None = None
        try:
            self._packer.drain(final=True)  # a record racing in from another thread now fails
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the collective
            failure = e
        self._closed = True
        # The recorder's hooks are useless once it is closed: remove them from their managers
        # so later forwards of the model neither pay for them nor fail.
        for _, b in list(self._bindings):
            b.handle.remove()
        try:
            self._writer.close()
        except BaseException as e:  # noqa: BLE001
            failure = failure or e
        # Every rank must have recorded the same handles (checked after the files are complete).
        # The check is a collective: it runs even when this rank failed, so no rank hangs.
        check_same_handles(self._dist, list(self._hook_seconds))
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

    def __enter__(self) -> Recorder:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Recorder({str(self.run_dir)!r}, every={self.every}, closed={self._closed})"


def _held_run(run_dir: Path, rank: int | None, world_size: int | None) -> str | None:
    """What shows that ``run_dir`` already holds a run this recorder would mix into, or None.

    Any manifest does (whatever its rank layout), except another rank's manifest of a run with
    this world size (this run's own ranks, when they start at different times); so do handle
    files without a manifest (which a writer would continue).
    """
    try:
        names = sorted(p.name for p in run_dir.iterdir())
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageError(f"cannot list run directory {str(run_dir)!r}: {e}") from e
    mine = manifest_name(rank, world_size)
    for name in names:
        m = MANIFEST_RE.fullmatch(name)
        if m is None:
            continue
        if name == mine or world_size is None or m.group(1) is None:
            return name
        try:
            other_ws = read_manifest(run_dir / name).get("world_size")
        except Exception:  # noqa: BLE001 - unreadable: still a run's manifest
            return name
        if other_ws != world_size:
            return f"{name}, recorded with world_size={other_ws}"
    if any(MANIFEST_RE.fullmatch(n) for n in names):
        return None  # another rank's of this run: its files are its own
    for pattern in ("*.h5", "*.h5seg", "*.h5seg.partial"):  # handle files live in subdirectories
        found = next(run_dir.rglob(pattern), None)
        if found is not None:
            return f"{found.relative_to(run_dir)}, without a manifest"
    return None


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
