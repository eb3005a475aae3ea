"""Capture hooks: the hook-function objects a :class:`~hookline.tracker.Recorder` hands out.

A :class:`CaptureHook` is an ordinary callable registered through a
:class:`~hookline.tracker.HookManager`. The manager tells it about every handle it is registered
under (``_hookline_bind``, the manager's documented protocol), which is how its
:class:`CaptureSink` (the recorder's bindings) learns handle ids, module names and types, and how
it can suspend its handles on steps that are not sampled. Each firing goes to the sink with the
:class:`Binding` of the handle that fired.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from hookline.storage.errors import HookTypeError, InvalidArgumentError
from hookline.storage.keys import check_name

from hookline.tracker.hooks.handles import HookHandle, passive
from hookline.tracker.hooks.pytree import Leaves

from .compiled import TARGETS, record_in_graph
from .recompute import is_recomputing
from .stats import StatsSpec

__all__ = ["Binding", "CaptureHook", "CaptureOptions", "CaptureSink", "Groups", "KIND_CATEGORIES"]

#: Which manager categories each capture kind may be registered under.
KIND_CATEGORIES = {
    "inputs": ("forward_pre_hook", "forward_hook"),
    "outputs": ("forward_hook",),
    "grads": ("backward_hook",),
}
_MODES = ("tensor", "stats")
_CATEGORY = {"outputs": "forward_hook", "grads": "backward_hook"}  # "inputs": pre or forward


@dataclass(frozen=True)
class CaptureOptions:
    """Per-registration capture options (see :meth:`Recorder.hook`)."""

    kind: str
    mode: str = "tensor"
    batch_slice: int | None = None
    dtype: torch.dtype | None = None
    stats: StatsSpec | None = None

    def __post_init__(self) -> None:
        for arg, v in (("kind", self.kind), ("mode", self.mode)):
            if not isinstance(v, str):
                raise HookTypeError(f"capture {arg} must be a str, got {type(v).__name__} {v!r:.60}")
        if self.kind not in KIND_CATEGORIES:
            raise InvalidArgumentError(
                f"unknown capture kind {self.kind!r}; use one of {sorted(KIND_CATEGORIES)}"
            )
        if self.mode not in _MODES:
            raise InvalidArgumentError(f"unknown capture mode {self.mode!r}; use 'tensor' or 'stats'")
        if self.batch_slice is not None and (
            isinstance(self.batch_slice, bool) or not isinstance(self.batch_slice, (int, np.integer))
        ):
            raise HookTypeError(
                f"batch_slice must be an int (keep the first K items), got {type(self.batch_slice).__name__} "
                f"{self.batch_slice!r:.60}"
            )
        if self.batch_slice is not None:
            object.__setattr__(self, "batch_slice", int(self.batch_slice))  # numpy ints too
        if self.batch_slice is not None and self.batch_slice < 1:
            raise InvalidArgumentError(
                f"batch_slice must be a positive int (keep the first K items), got {self.batch_slice!r}"
            )
        if self.dtype is not None and not isinstance(self.dtype, torch.dtype):
            raise HookTypeError(
                f"dtype must be a torch dtype such as torch.bfloat16 or torch.float16, got "
                f"{type(self.dtype).__name__} {self.dtype!r:.60}"
            )
        if self.dtype is not None and not self.dtype.is_floating_point:
            raise InvalidArgumentError(
                f"dtype must be a floating torch dtype such as torch.bfloat16 or torch.float16, "
                f"got {self.dtype!r}"
            )

    def default_name(self) -> str:
        """Short, readable hook name: ``outputs``, ``outputs.stats``, ``grads.b4.bfloat16``..."""
        parts = [self.kind]
        if self.mode == "stats":
            parts.append("stats")
        if self.batch_slice is not None:
            parts.append(f"b{self.batch_slice}")
        if self.dtype is not None:
            parts.append(str(self.dtype).removeprefix("torch."))
        return ".".join(parts)


@dataclass
class Binding:
    """One handle a capture hook is registered under, as its sink knows it.

    Attributes:
        handle: the manager's handle.
        handle_id: its id, ``"<hook name>[<module name>]"`` (the writer handle's name).
        category: the manager category it was registered as (``"forward_hook"``...).
        options: the capture options of the hook.
        token: names the binding to compiled graphs (``hookline::record`` ops, see
            :mod:`.compiled`).
    """

    handle: HookHandle
    handle_id: str
    category: str
    options: CaptureOptions
    token: int = 0


#: What one firing hands its sink: ``(group, leaves)`` pairs, the group being ``"inputs"``,
#: ``"outputs"``, ``"grad_in"`` or ``"grad_out"``.
Groups = tuple[tuple[str, Any], ...]


class CaptureSink(Protocol):
    """Where a :class:`CaptureHook` reports its handles and firings (the recorder's
    :class:`~hookline.tracker.capture.bindings.HandleBindings`)."""

    def bind(self, binding: Binding) -> None:
        """A handle was registered; raising rolls the registration back."""

    def unbind(self, binding: Binding) -> None:
        """The handle was removed."""

    def record(self, binding: Binding, groups: Groups, t0: int) -> None:
        """The handle fired (``t0``: ``time.perf_counter_ns()`` when the hook was entered)."""


class CaptureHook:
    """A hook function that records what it sees into its recorder's run.

    Its ``repr`` is its short name, so handle ids read ``outputs[blocks.0]``.
    """

    def __init__(self, sink: CaptureSink, options: CaptureOptions, name: str | None = None,
                 unscale: Callable[[Leaves], Leaves] | None = None) -> None:
        self._sink = sink
        # grads under a GradScaler: the gradients divided by the scale (see .scaler)
        self._unscale = unscale if options.kind == "grads" else None
        self.options = options
        self.name = name or options.default_name()
        # Its name becomes part of every handle id it records under: checked now, not at registration.
        check_name(self.name, "recorder hook name", fix="pass another name= to rec.hook()")
        # (id(module), category) -> binding: rec.inputs may be a pre hook and a forward hook
        # of the same module at once.
        self._bindings: dict[tuple[int, str], Binding] = {}
        # It only copies what it sees (detached) and returns None: passive, which keeps backward
        # hooks' single-op calls possible.
        passive(self)

    def __repr__(self) -> str:
        return self.name

    # --- manager protocol ---------------------------------------------------------------
    def _hookline_bind(self, handle: HookHandle) -> None:
        """Called by HookManager for every handle this hook is registered under."""
        category = handle.hook_fn.category
        if category not in KIND_CATEGORIES[self.options.kind]:
            raise InvalidArgumentError(
                f"recorder hook {self.name!r} captures {self.options.kind} and cannot be registered "
                f"as a {category}; register it with "
                f"{' or '.join('register_' + c for c in KIND_CATEGORIES[self.options.kind])}"
            )
        key = (id(handle.module), category)
        other = self._bindings.get(key)
        if other is not None and not other.handle.removed:
            # Its firings could not be told apart (a hook function is called with the module
            # only): one registration per module and category.
            raise InvalidArgumentError(
                f"recorder hook {self.name!r} is already registered on this module as {other.handle_id!r}; "
                f"to record the module twice, register a second hook function: "
                f"rec.hook({self.options.kind!r}, name='{self.name}2')"
            )
        binding = Binding(handle=handle, handle_id=handle.name, category=category, options=self.options)
        self._bindings[key] = binding
        self._sink.bind(binding)
        binding.token = TARGETS.add(self._record_compiled, binding)

    def _hookline_unbind(self, handle: HookHandle) -> None:
        """Called by HookManager when a handle of this hook is removed."""
        key = (id(handle.module), handle.hook_fn.category)
        binding = self._bindings.get(key)
        if binding is not None and binding.handle is handle:
            del self._bindings[key]
            TARGETS.discard(binding.token)
            self._sink.unbind(binding)

    # --- hook entry points --------------------------------------------------------------
    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        compiling = _is_compiling()
        t0 = 0 if compiling else time.perf_counter_ns()  # (Dynamo cannot trace the clock)
        kind = self.options.kind
        # The manager calls pre hooks with (inputs,), forward hooks with (inputs, outputs) and
        # backward hooks with (grad_in, grad_out).
        category = _CATEGORY.get(kind) or ("forward_pre_hook" if len(args) == 1 else "forward_hook")
        binding = self._bindings.get((id(module), category))
        if binding is None:
            raise InvalidArgumentError(
                f"recorder hook {self.name!r} fired for a module it was not registered on through a "
                f"HookManager ({type(module).__name__}); register it with "
                f"HookManager.register_*_hook(rec.{self.options.kind}, ...)"
            )
        if kind == "grads":
            grad_in, grad_out = args
            if self._unscale is not None:
                grad_in, grad_out = self._unscale(grad_in), self._unscale(grad_out)
            self._sink.record(binding, (("grad_in", grad_in), ("grad_out", grad_out)), t0)
            return None
        leaves = args[0] if kind == "inputs" else args[1]
        if compiling:
            # Dynamo is tracing the module: record when the compiled graph runs (.compiled).
            record_in_graph(binding.token, leaves)
        elif not is_recomputing():  # checkpointing's recomputed forward is not a new call
            self._sink.record(binding, ((kind, leaves),), t0)
        return None

    def _record_compiled(self, binding: Binding, leaves: Leaves, t0: int) -> None:
        """A forward firing recorded from inside a compiled graph (the ``hookline::record`` op)."""
        if not is_recomputing():
            self._sink.record(binding, ((self.options.kind, leaves),), t0)


_is_compiling = torch.compiler.is_compiling
