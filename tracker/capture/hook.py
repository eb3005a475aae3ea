"""Capture hooks: the hook-function objects a :class:`~hookline.tracker.Recorder` hands out.

A :class:`CaptureHook` is an ordinary callable registered through a
:class:`~hookline.tracker.HookManager`. The manager tells it about every handle it is registered
under (``_hookline_bind``), which is how the recorder learns handle ids, module names and types,
and how it can deactivate its handles on steps that are not sampled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from hookline.storage.errors import HookTypeError, InvalidArgumentError

from hookline.tracker.hooks.handles import passive
from hookline.tracker.hooks.pytree import index_paths
from .stats import StatsSpec, compute_stats

if TYPE_CHECKING:  # pragma: no cover
    from .recorder import Recorder

__all__ = ["CaptureHook", "CaptureOptions", "KIND_CATEGORIES"]

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
class _Binding:
    """What the recorder knows about one handle its hook is registered under."""

    handle: Any
    handle_id: str
    category: str


class CaptureHook:
    """A hook function that records what it sees into its recorder's run.

    Its ``repr`` is its short name, so handle ids read ``outputs[blocks.0]``.
    """

    def __init__(self, recorder: Recorder, options: CaptureOptions, name: str | None = None) -> None:
        self._recorder = recorder
        self.options = options
        self.name = name or options.default_name()
        # (id(module), category) -> binding: rec.inputs may be a pre hook and a forward hook
        # of the same module at once.
        self._bindings: dict[tuple[int, str], _Binding] = {}
        # It only copies what it sees (detached) and returns None: passive, which keeps backward
        # hooks' single-op calls possible.
        passive(self)

    def __repr__(self) -> str:
        return self.name

    # --- manager protocol ---------------------------------------------------------------
    def _hookline_bind(self, handle: Any) -> None:
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
        binding = _Binding(handle=handle, handle_id=handle.name, category=category)
        self._bindings[key] = binding
        self._recorder._bind(self, binding)

    def _hookline_unbind(self, handle: Any) -> None:
        """Called by HookManager when a handle of this hook is removed."""
        key = (id(handle.module), handle.hook_fn.category)
        binding = self._bindings.get(key)
        if binding is not None and binding.handle is handle:
            del self._bindings[key]
            self._recorder._unbind(self, binding)

    # --- hook entry points --------------------------------------------------------------
    def __call__(self, module: torch.nn.Module, *args: Any) -> None:
        t0 = time.perf_counter_ns()
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
            groups = (("grad_in", args[0]), ("grad_out", args[1]))
        elif kind == "inputs":
            groups = (("inputs", args[0]),)
        else:
            groups = (("outputs", args[1]),)
        self._recorder._capture(self, binding, groups, t0)
        return None


def field_tensors(
    groups: tuple[tuple[str, Any], ...], options: CaptureOptions
) -> tuple[list[str], list[torch.Tensor], list[str]]:
    """Name and slice the tensors of one firing (stats mode: cast and summarise them).

    Returns:
        ``(names, tensors, skipped)``: field names (``outputs.0``, ``grad_in.1``...), the detached
        tensors to copy (stats mode: one packed stats tensor per field; tensor mode: not yet cast,
        the copy into the host block casts), and the paths of non-tensor leaves and ``None``
        gradients that were not recorded.
    """
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    skipped: list[str] = []
    stats = options.mode == "stats"
    k = options.batch_slice
    for prefix, leaves in groups:
        paths = getattr(leaves, "paths", None) or index_paths(len(leaves))
        group_names = _names(prefix, paths)
        leaf_skipped = getattr(leaves, "skipped", ())
        if leaf_skipped:
            skipped.extend(f"{prefix}.{p}" for p in leaf_skipped)
        for name, t in zip(group_names, leaves):
            if t is None:
                skipped.append(name)
                continue
            if t.layout is not _STRIDED or t.is_quantized or t.is_meta:
                _refuse_layout(name, t)
            if k is not None and t.dim() > 0:
                t = t[:k]
            t = t.detach()
            if stats:
                if options.dtype is not None and t.is_floating_point() and t.dtype != options.dtype:
                    t = t.to(options.dtype)  # stats of what a tensor capture would store
                t = compute_stats(t, options.stats or StatsSpec())
            names.append(name)
            tensors.append(t)
    return names, tensors, skipped


_STRIDED = torch.strided


def _refuse_layout(name: str, t: torch.Tensor) -> None:
    what = "quantized" if t.is_quantized else "meta" if t.is_meta else str(t.layout).removeprefix("torch.")
    raise HookTypeError(
        f"field {name!r} is a {what} tensor, which hookline cannot record (dense strided tensors "
        f"only); convert it in the module (to_dense()/dequantize()) or do not hook this module"
    )


_NAME_CACHE: dict[tuple[str, tuple[str, ...]], tuple[str, ...]] = {}


def _names(prefix: str, paths: tuple[str, ...]) -> tuple[str, ...]:
    """Field names ``<prefix>.<path>`` (cached: a module's paths rarely change between calls)."""
    key = (prefix, paths)
    names = _NAME_CACHE.get(key)
    if names is None:
        names = tuple(f"{prefix}.{p}" for p in paths)
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidArgumentError(
                f"two tensors of the {prefix} would both be stored as field {dup!r} (paths "
                f"{[p for p in paths if f'{prefix}.{p}' == dup]}: a dict key containing '.' or a str "
                f"key equal to an int key); rename one of the keys in the module's output"
            )
        if len(_NAME_CACHE) < 4096:  # bounded: paths of dict outputs could vary without end
            _NAME_CACHE[key] = names
    return names
