"""Per-module dispatch: the torch hooks one manager installs on one module.

A :class:`ModuleHooks` keeps the *active* handles of one module by category, in registration
order, and installs at most one torch forward pre-hook and one torch forward hook on the module,
only while some handle needs them (pre-hooks and backward hooks need the pre-hook; forward hooks
and backward hooks need the forward hook). With no active handle, the module carries no torch
hook at all, so deactivated hooks cost nothing.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hookline.storage.errors import HookOutputError
from hookline.tracker.hooks.backward import BackwardCall, PendingInputs
from hookline.tracker.hooks.handles import HookHandle, is_passive
from hookline.tracker.hooks.pytree import Leaves, flatten, flatten_call, unflatten, unflatten_call
from hookline.tracker.hooks.single_op import single_op_input

__all__ = ["ModuleHooks"]

_Tensor = torch.Tensor


def replace_leaves(handle: HookHandle, leaves: Leaves, new: Any, what: str) -> Leaves:
    """Validate a hook's return value and return the leaves it replaces ``leaves`` with."""
    if new is leaves:
        return leaves
    if isinstance(new, _Tensor):
        new = (new,)
    elif not isinstance(new, (tuple, list)):
        raise HookOutputError(
            f"hook {handle.name!r} returned a {type(new).__name__}; it must return None (keep the "
            f"{what}), a tuple of {len(leaves)} tensors to replace them, or a bare tensor when "
            "there is exactly one"
        )
    if len(new) != len(leaves):
        raise HookOutputError(
            f"hook {handle.name!r} returned {len(new)} {what} but the module has {len(leaves)} "
            f"(paths {list(leaves.paths)}); return a tuple of the same length, or None"
        )
    for path, t in zip(leaves.paths, new):
        if not isinstance(t, _Tensor):
            raise HookOutputError(
                f"hook {handle.name!r} returned a {type(t).__name__} for {what[:-1]} {path!r}; "
                "every element of a replacement must be a tensor"
            )
    return Leaves(new, leaves.paths, leaves.skipped)


class ModuleHooks:
    """The active handles of one module (for one manager) and the torch hooks serving them."""

    __slots__ = (
        "module", "registered", "pre", "fwd", "bwd", "_torch_pre", "_torch_fwd", "_pending", "_single_op",
        "_passive_fwd",
    )

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.registered = 0  # handles registered on the module (active or not), kept by the manager
        self.pre: tuple[HookHandle, ...] = ()
        self.fwd: tuple[HookHandle, ...] = ()
        self.bwd: tuple[HookHandle, ...] = ()
        self._torch_pre = _TorchHook(module, "pre", self._pre_hook)
        self._torch_fwd = _TorchHook(module, "fwd", self._forward_hook)
        # One entry per call between pre-hook and forward hook (a stack: calls can nest).
        self._pending: list[PendingInputs | BackwardCall | None] = []
        self._single_op = True  # False once a single-op call's check failed (see backward.py)
        # Whether every forward hook function is known not to compute with what it sees (the
        # recorder's): single-op calls hand forward hooks the caller's input, not an alias
        # whose gradient the call's grad_in would include.
        self._passive_fwd = True

    # --- activation ------------------------------------------------------------------------
    def add(self, handle: HookHandle) -> None:
        """Start calling ``handle`` (keeps registration order)."""
        attr = _ATTR[handle.hook_fn.category]
        handles = (*getattr(self, attr), handle)
        setattr(self, attr, tuple(sorted(handles, key=lambda h: h.order)))
        self._sync()

    def discard(self, handle: HookHandle) -> None:
        """Stop calling ``handle``."""
        attr = _ATTR[handle.hook_fn.category]
        setattr(self, attr, tuple(h for h in getattr(self, attr) if h is not handle))
        self._sync()

    def _sync(self) -> None:
        self._passive_fwd = all(is_passive(h.hook_fn.fn) for h in self.fwd)
        need_pre = bool(self.pre or self.bwd)
        need_fwd = bool(self.fwd or self.bwd)
        if need_pre != self._torch_pre.attached:
            self._torch_pre.attach(need_pre)
        if need_fwd != self._torch_fwd.attached and (need_fwd or not self._pending):
            # (While calls are in flight, e.g. a hook of this module or of a child deactivated
            # it, the forward hook stays until they returned: it pops their state, then goes.)
            self._torch_fwd.attach(need_fwd)

    def close(self) -> None:
        """Remove the torch hooks now, calls in flight or not (the manager let go of the module;
        a forward interrupted by KeyboardInterrupt never returns to pop its state)."""
        self.pre = self.fwd = self.bwd = ()
        self._pending.clear()
        self._torch_pre.remove()
        self._torch_fwd.remove()

    # --- torch hooks -----------------------------------------------------------------------
    def _pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.bwd and _is_compiling():
            # Backward hooks build autograd state Dynamo cannot trace: the call's hooks run
            # eagerly (a graph break before and after the module; docs/capture.md, Training stacks).
            return _eager_pre_hook(self, module, args, kwargs)
        return self._run_pre_hooks(module, args, kwargs, compiled=False)

    def _run_pre_hooks(
        self, module: nn.Module, args: tuple, kwargs: dict, compiled: bool
    ) -> tuple[tuple, dict] | None:
        bwd = self.bwd
        if bwd:
            self._pending.append(None)  # popped by the forward hook even if this hook raises
        if not self.pre and not (bwd and torch.is_grad_enabled()):
            return None
        leaves, spec = flatten_call(args, kwargs)
        original = leaves
        for handle in self.pre:
            new = handle.call(module, leaves)
            if new is not None:
                leaves = replace_leaves(handle, leaves, new, "inputs")
        if bwd:
            bwd = self.bwd  # the pre hooks may have (de)activated backward hooks
            if bwd and _functorch_active():
                _skip_in_transform(bwd)
                bwd = ()
        if bwd and torch.is_grad_enabled():
            call = BackwardCall(module, bwd, leaves)
            single = (
                single_op_input(module, leaves)
                if call.in_index and self._single_op and self._passive_fwd and not compiled
                else None
            )  # (in a compiled region the op runs inside a graph: its node is the graph's)
            if single is not None and self._outermost():
                call.note_input(*single, self)  # its gradient comes from the op's node (no identity node)
                self._pending[-1] = call
            else:
                leaves, pending = call.wrap_inputs(leaves)
                self._pending[-1] = pending or call
        if leaves is original:
            return None
        return unflatten_call(spec, leaves)

    def _outermost(self) -> bool:
        """Whether the manager's torch pre-hook runs last and its forward hook is the module's
        only one (no other hook can change the input the op sees, or compute with the caller's
        input: forward hooks are handed it instead of an alias)."""
        m = self.module
        return (
            self._torch_pre.attached
            and self._torch_fwd.attached
            and next(reversed(m._forward_pre_hooks)) == self._torch_pre.id
            and len(m._forward_hooks) == 1
        )

    def single_op_failed(self, call: BackwardCall, why: str | None = None) -> None:
        """A single-op call cannot report its ``grad_in``: warn, and send the module's later
        calls through the identity node."""
        self._single_op = False
        why = why or (
            "the module did not compute its output with one op on its input (something replaced "
            "the op or ran between the input and the op)"
        )
        warnings.warn(
            f"hookline: backward hook {call.handles[0].name!r} on a call of "
            f"{type(self.module).__name__}: {why}, so its grad_in is None for this call; later "
            "calls of the module take the identity node (docs/hooks.md, single-op calls). If no "
            "patch, hook or subclass of yours is involved, please report it with your torch "
            f"version ({torch.__version__}).",
            RuntimeWarning,
            stacklevel=_caller_level(),
        )

    def _forward_hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if output is None and _forward_raised():
            # torch calls always_call hooks only to let them clean up. (No deferred removal
            # here: torch's handler iterates the module's hook dict itself; the next call or
            # close() removes the hook.)
            if self._pending:
                self._pending.pop()
            return None
        if self.bwd and _is_compiling():
            return _eager_forward_hook(self, module, args, kwargs, output)
        return self._run_forward_hooks(module, args, kwargs, output)

    def _run_forward_hooks(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        entry = self._pending.pop() if self._pending else None
        if not self._pending and not (self.fwd or self.bwd) and self._torch_fwd.attached:
            self._sync()  # deactivated while this call ran: the deferred removal
        # A single-op call's node is found before the forward hooks run: one of them may modify
        # or replace the output.
        if type(entry) is BackwardCall and entry.edge is not None and not entry.attach_node(output):
            self.single_op_failed(entry)
        leaves: Leaves | None = None
        replaced = False
        if self.fwd:
            inputs = flatten_call(args, kwargs)[0]
            leaves, spec = flatten(output)
            for handle in self.fwd:
                new = handle.call(module, inputs, leaves)
                if new is not None:
                    if is_passive(handle.hook_fn.fn):
                        raise HookOutputError(
                            f"hook {handle.name!r} is marked passive but returned a "
                            f"{type(new).__name__}; a passive hook must return None (remove "
                            "passive() from a hook that replaces outputs)"
                        )
                    new_leaves = replace_leaves(handle, leaves, new, "outputs")
                    replaced = replaced or new_leaves is not leaves
                    leaves = new_leaves
        if entry is not None:
            if leaves is None:
                leaves, spec = flatten(output)
            rebased = leaves
            if isinstance(entry, PendingInputs):
                rebased = entry.rebase_modified(leaves)
                entry = entry.call
            # hooks go on the aliases: all gradient for the module's result flows into them
            entry.watch_outputs(leaves)
            if rebased is not leaves:
                leaves, replaced = rebased, True
        if replaced:
            return unflatten(spec, leaves)
        return None


def guard_module_hooks() -> None:
    """Make torch.compile guard on module hooks (``torch._dynamo.config.skip_nnmodule_hook_guards
    = False``); done when this module is imported.

    torch's default skips those guards: a graph compiled while a module carried no hook (a step
    the recorder does not sample, a ``paused()`` evaluation before training, a first call before
    the hooks were registered) would keep running after the hooks came, and record nothing.
    With the guards, a module's hook set selects its graph; :class:`_TorchHook` keeps hook ids
    and functions stable, so each hook set compiles once (docs/capture.md, Training stacks).
    Graphs compiled before this ran keep torch's unguarded entries (``torch._dynamo.reset()``
    drops them).
    """
    torch._dynamo.config.skip_nnmodule_hook_guards = False


guard_module_hooks()


class _TorchHook:
    """One torch module hook of a :class:`ModuleHooks` (its forward pre-hook or forward hook),
    attached while some handle needs it.

    It keeps its torch hook id and its function object while detached, and attaching it again
    puts the same entries back into the module's hook dicts (at their end, as a new
    registration would). torch.compile guards on a module's hooks by their ids and functions
    (see :func:`guard_module_hooks`): a hook that comes back unchanged finds the graph compiled
    for it in Dynamo's cache instead of causing a recompilation per sampled step.
    """

    __slots__ = ("module", "kind", "fn", "handle", "attached")

    def __init__(self, module: nn.Module, kind: str, fn: Any) -> None:
        self.module = module
        self.kind = kind
        self.fn = fn  # one bound method for the hook's life: torch.compile guards on its identity
        self.handle: RemovableHandle | None = None
        self.attached = False

    @property
    def id(self) -> int | None:
        return None if self.handle is None else self.handle.id

    def _dicts(self) -> tuple[dict, ...]:
        m = self.module
        if self.kind == "pre":
            return m._forward_pre_hooks, m._forward_pre_hooks_with_kwargs
        return m._forward_hooks, m._forward_hooks_with_kwargs, m._forward_hooks_always_called

    def attach(self, on: bool) -> None:
        """Put the torch hook on the module (``on``) or take it off."""
        if on == self.attached:
            return
        self.attached = on
        if self.handle is None:  # (a first registration: torch's own API)
            if self.kind == "pre":
                self.handle = self.module.register_forward_pre_hook(self.fn, with_kwargs=True)
            else:
                self.handle = self.module.register_forward_hook(self.fn, with_kwargs=True, always_call=True)
            return
        hid = self.handle.id
        hooks, *flags = self._dicts()
        if on:
            hooks[hid] = self.fn
            for d in flags:
                d[hid] = True
        else:
            hooks.pop(hid, None)
            for d in flags:
                d.pop(hid, None)

    def remove(self) -> None:
        """Take the torch hook off for good."""
        self.attached = False
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


@torch._dynamo.disable
def _eager_pre_hook(hooks: ModuleHooks, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The pre-hook of a call with backward hooks in a compiled region, run outside Dynamo."""
    return hooks._run_pre_hooks(module, args, kwargs, compiled=True)


@torch._dynamo.disable
def _eager_forward_hook(hooks: ModuleHooks, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """The forward hook of a call with backward hooks in a compiled region, run outside Dynamo."""
    return hooks._run_forward_hooks(module, args, kwargs, output)


_is_compiling = torch.compiler.is_compiling
_functorch_active = torch._C._are_functorch_transforms_active
_warned_transform = False


def _skip_in_transform(handles: tuple[HookHandle, ...]) -> None:
    """Backward hooks do not fire for calls inside ``torch.func`` transforms (grad, vjp, jacrev,
    vmap): the gradients there are the transform's, not a backward pass's (torch's own full
    backward hooks raise there). Said once per process, naming a handle."""
    global _warned_transform
    if not _warned_transform:
        _warned_transform = True
        warnings.warn(
            f"hookline: backward hook {handles[0].name!r} (and any other) does not fire for module "
            "calls inside torch.func transforms (grad, vjp, jacrev, vmap); forward hooks do",
            stacklevel=4,
        )


_SKIP_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))  # torch, hookline.tracker


def _caller_level() -> int:
    """``stacklevel`` of the first frame outside torch and hookline (the user's model call),
    counted from the function that calls ``warnings.warn``."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_DIRS):
        frame, level = frame.f_back, level + 1
    return level


def _forward_raised() -> bool:
    """Whether torch runs the forward hook from its handler of an exception of this call's
    forward (not merely while the caller handles an exception of its own: a module returning
    None in an ``except`` block still gets its hooks)."""
    exc = sys.exc_info()[1]
    # The call's ``_call_impl`` frame both caught the exception (the head of its traceback) and
    # called this hook (two frames up: _forward_hook's caller).
    return exc is not None and exc.__traceback__ is not None and exc.__traceback__.tb_frame is sys._getframe(2)


_ATTR = {"forward_pre_hook": "pre", "forward_hook": "fwd", "backward_hook": "bwd"}
