"""A recorder's handle bindings: each handle its hooks are registered under, and its firings.

:class:`HandleBindings` is the :class:`~hookline.tracker.capture.hook.CaptureSink` of a
recorder's capture hooks: a bound handle becomes a writer handle (with its module's name and
type), and each firing of it becomes one record ``(step, call, fields)`` in the block packer.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from torch import nn

from hookline.storage import RunWriter, WriterStats
from hookline.storage.errors import DuplicateNameError, InvalidArgumentError, WriterClosedError

from .dtensor import ShardLayout
from .fields import field_tensors
from .hook import Binding, CaptureOptions, Groups
from .packer import BlockPacker
from .sampling import StepState
from .stats import SCALAR_STATS, StatsSpec
from .summary import HandleSummary, RecorderSummary

__all__ = ["HandleBindings"]

#: Steps per handle whose call counters are kept (see :meth:`HandleBindings.record`).
_CALL_STEPS = 64


def _handle_meta(opts: CaptureOptions, stats_spec: StatsSpec) -> dict[str, Any]:
    """The capture options a handle's file records (its ``meta``)."""
    meta: dict[str, Any] = {"kind": opts.kind, "mode": opts.mode,
                            "batch_slice": opts.batch_slice,
                            "cast_dtype": str(opts.dtype).removeprefix("torch.") if opts.dtype else None}
    if opts.mode == "stats":
        meta["stats"] = list(SCALAR_STATS) + ["hist"]
        meta["hist_edges"] = stats_spec.edges.tolist()
    return meta


class HandleBindings:
    """The handles one recorder's hooks are bound to, and the records their firings make.

    Args:
        state: the recorder's step state (its :attr:`~StepState.lock` guards these tables too).
        writer: the run's writer (one writer handle per bound handle id).
        packer: where records go (a block per handle).
        stats_spec: histogram bins of ``mode="stats"`` hooks (recorded in their handles' meta).
    """

    def __init__(self, state: StepState, writer: RunWriter, packer: BlockPacker, stats_spec: StatsSpec) -> None:
        self._state = state
        self._writer = writer
        self._packer = packer
        self._stats_spec = stats_spec
        self._bound: list[Binding] = []
        self._owners: dict[str, weakref.ref[nn.Module]] = {}  # handle id -> its module
        self._calls: dict[str, dict[int, int]] = {}  # handle id -> step -> next call index
        self._hook_seconds: dict[str, float] = {}
        self._skipped: dict[str, list[str]] = {}
        self._layouts: dict[str, dict[str, tuple[tuple, dict[str, Any]]]] = {}  # DTensor fields

    # --- CaptureSink ------------------------------------------------------------------------
    def bind(self, binding: Binding) -> None:
        """Open the writer handle of a newly registered handle (suspended if the recorder is).

        Raises:
            WriterClosedError: the recorder is closed.
            DuplicateNameError: the handle id already records another module of this run.
        """
        state = self._state
        state.check_open()
        handle = binding.handle
        module = handle.module
        fn_name = handle.hook_fn.name
        module_name = binding.handle_id[len(fn_name) + 1 : -1] if binding.handle_id.startswith(fn_name + "[") else ""
        opts = binding.options
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
            meta=_handle_meta(opts, self._stats_spec),
        )
        with state.lock:
            self._owners[binding.handle_id] = weakref.ref(module)
            self._bound.append(binding)
            self._packer.handles = len(self._bound)  # sizes blocks: see BlockPacker.handles
            self._hook_seconds.setdefault(binding.handle_id, 0.0)
            self._skipped.setdefault(binding.handle_id, [])
            handle.set_suspended(state.holds_off)

    def unbind(self, binding: Binding) -> None:
        """Forget a removed handle (its writer handle keeps what it recorded)."""
        with self._state.lock:
            self._bound = [b for b in self._bound if b is not binding]
            self._packer.handles = len(self._bound)

    def record(self, binding: Binding, groups: Groups, t0: int) -> None:
        """Hand one firing to the packer as a record of the current step (the hot path).

        Raises:
            InvalidArgumentError: fired outside any step.
            WriterClosedError: fired after the recorder was closed.
        """
        state = self._state
        if state.paused:
            return  # a handle (re)activated inside paused(): records nothing
        step = state.step
        if step is None:
            raise InvalidArgumentError(
                f"{binding.handle_id} fired outside any recorder step: wrap the forward/backward in "
                f"`with rec.step(n):` (or call rec.set_step(n)), or use `with rec.paused():` for "
                f"passes that should not be recorded"
            )
        if state.closed:
            raise WriterClosedError(
                f"{binding.handle_id} fired after the recorder for {state.run_dir!r} was closed; "
                f"remove its hooks (mgr.remove_hook_function(rec.{binding.options.kind})) or record "
                f"with a new Recorder"
            )
        if not state.sampled:
            return  # a handle the user activated on a step that is not sampled
        state.fired = True
        hid = binding.handle_id
        with state.lock:  # CUDA backward hooks run on autograd's device threads
            # Per handle id (not per binding: a hook removed and registered again continues the
            # count) and per step, for the last _CALL_STEPS steps (a step entered again, e.g. an
            # evaluation pass reusing the step number, continues its numbering).
            calls = self._calls.setdefault(hid, {})
            call = calls.get(step, 0)
            calls[step] = call + 1
            if len(calls) > _CALL_STEPS:
                del calls[next(iter(calls))]
        opts = binding.options
        layouts: dict[str, ShardLayout] = {}
        names, tensors, skipped = field_tensors(groups, opts, layouts)
        if skipped:
            self._note_skipped(hid, skipped)
        if layouts:
            self._note_layouts(hid, layouts)
        stats = opts.mode == "stats"
        # Stats are float64 whatever the dtype option (field_tensors cast before summarising).
        self._packer.add(hid, step, call, names, tensors, None if stats else opts.dtype, stats)
        self._hook_seconds[hid] += (time.perf_counter_ns() - t0) * 1e-9

    def _note_skipped(self, hid: str, skipped: list[str]) -> None:
        """Record in the manifest the paths of a handle that were not recorded, once each."""
        known = self._skipped[hid]
        unseen = [p for p in skipped if p not in known]
        if unseen:  # rare: the first firings of a handle
            known.extend(unseen)
            self._writer.update_handle_meta(hid, {"skipped_fields": list(known)})

    def _note_layouts(self, hid: str, layouts: dict[str, ShardLayout]) -> None:
        """Record in the handle's metadata where its DTensor fields' local shards sit (when a
        field's layout is new or changed: the first firings of a handle)."""
        known = self._layouts.setdefault(hid, {})
        changed = False
        for name, layout in layouts.items():
            key = layout.key()
            seen = known.get(name)
            if seen is None:
                known[name] = (key, layout.to_json())
                changed = True
            elif seen[0] != key and not seen[1].get("varies"):
                # One layout per field is what the reader reassembles; a field whose placements or
                # mesh change between records reads per rank only.
                known[name] = (seen[0], {**seen[1], "varies": True})
                changed = True
        if changed:
            self._writer.update_handle_meta(hid, {"dtensor": {n: js for n, (_, js) in known.items()}})

    # --- the recorder's side ----------------------------------------------------------------
    def suspend_all(self, suspended: bool) -> None:
        """Suspend (or release) every bound handle (hold the state's lock)."""
        for b in self._bound:
            b.handle.set_suspended(suspended)

    def remove_all(self) -> None:
        """Remove every bound handle from its manager (the recorder closed)."""
        for b in list(self._bound):
            b.handle.remove()

    def handle_ids(self) -> list[str]:
        """Every handle id bound so far (removed ones included), in binding order."""
        return list(self._hook_seconds)

    def summary(self, run_dir: str, storage: WriterStats, mlflow_run_id: str | None) -> RecorderSummary:
        """The recorder's summary: the writer's counts per handle id, with the time in hooks."""
        handles = {}
        for hid, seconds in self._hook_seconds.items():
            st = storage.handles.get(hid)
            handles[hid] = HandleSummary(
                hid, st.records if st else 0, st.bytes if st else 0, st.dropped if st else 0,
                seconds, list(self._skipped[hid]), st.flushed - st.start if st else 0,
            )
        return RecorderSummary(run_dir, handles, storage, mlflow_run_id)
