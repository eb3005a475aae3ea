"""Module backward hooks built from autograd machinery attached during the forward pass.

For every call of a module with active backward hooks (and grad mode on):

* the forward pre-hook passes all grad-requiring input leaves through ONE identity autograd
  Function (:class:`_CallInputs`). Its backward receives exactly the gradients that flow into
  the inputs *through this call* (the call's own contribution, also when an input feeds a
  residual branch too or is passed twice) and delivers all of them at once. Its outputs are
  detached aliases of the inputs (same storage and version counter, not views), so a module that
  modifies its input in place (``nn.ReLU(inplace=True)``) works; the caller's tensor is then
  re-based onto the module's in-place result (:class:`_Rebase`) and returned in place of the
  alias, which keeps torch's in-place semantics for the caller (one tensor object whose history
  includes the modification and any later in-place op).
* the forward hook registers plain tensor hooks on the output leaves (no custom Function on the
  outputs, so in-place ops after the module, like ``out += identity``, keep working; a tensor hook
  registered before an in-place op receives the gradient of the value before the modification).

Single-op calls skip the identity node (which calls qualify: :mod:`.single_op`). For such calls
the pre-hook only notes the input's gradient edge (:meth:`BackwardCall.note_input`), and the
forward hook checks that the output's node has that edge exactly once and registers a post-hook
on the node (:meth:`BackwardCall.attach_node`): the same ``grad_in`` as through the identity
node. The forward hook checks the op's node kind and edge before any forward hook function runs;
should that fail, the call's ``grad_in`` is reported as None with a warning (never a wrong value)
and the module goes back to the identity node (:class:`SingleOpFallback`). Such a call fires right
after its op, before the module's parameter gradients are accumulated (docs/hooks.md).

The state of one call (:class:`BackwardCall`) is owned by the autograd graph (the Function's
context and the tensor hooks), never by the module: a forward without backward leaks nothing
once its graph is freed, and several forwards before one backward each fire separately.

A call fires its hooks once per backward pass: when its inputs' gradients arrive, or, when no
input needs a gradient, when all of its grad-requiring outputs got theirs; anything that has not
fired by the end of the pass (outputs unused by the loss, ``autograd.grad`` stopping before the
inputs) fires from the pass's end-of-pass engine callback (one per pass). A hook function that
raises does not keep the other hook functions of its call, or the other waiting calls, from
firing: the first error is raised once they all ran.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from hookline.tracker.hooks.handles import HookHandle
from hookline.tracker.hooks.pytree import Leaves

__all__ = ["BackwardCall", "PendingInputs", "SingleOpFallback"]

_Tensor = torch.Tensor
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback
_graph_task_id = torch._C._current_graph_task_id
_set_versions = torch._C._autograd._unsafe_set_version_counter
_functorch_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
_is_compiling = torch.compiler.is_compiling


class SingleOpFallback(Protocol):
    """Who is told when a single-op call cannot report its ``grad_in`` (the module's dispatcher,
    which then sends the module's later calls through the identity node)."""

    def single_op_failed(self, call: BackwardCall, why: str | None = None) -> None:
        """Warn about ``call`` (``why``: the reason, or a default one) and stop single-op calls."""


class _CallInputs(torch.autograd.Function):
    """Identity over the grad-requiring inputs of one call; its backward reports grad_in."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, call: BackwardCall, *inputs: _Tensor
    ) -> tuple[_Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)  # keep None for inputs this call sent no gradient to
        return tuple(t.detach() for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: _Tensor | None) -> tuple[_Tensor | None, ...]:  # type: ignore[override]
        ctx.call.on_grad_in(grads)
        return (None, *grads)

    @staticmethod
    def jvp(ctx: Any, call_tangent: None, *tangents: _Tensor | None) -> tuple[_Tensor | None, ...]:  # type: ignore[override]
        # forward-mode AD (dual tensors) through a hooked call: an identity passes tangents on
        return tangents


# torch's C ``apply``, bound to _CallInputs: ``Function.apply`` adds a Python layer that is
# paid inside every training step, where the matmuls have evicted it from the caches. Used only
# while no functorch transform is active and torch.compile is not tracing, and with what that
# layer does outside transforms:
# tensors that escaped a finished transform (dead wrappers) are unwrapped first (else the
# gradient of whatever they came from is silently lost).
_call_inputs_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, _CallInputs)


def _watch(t: _Tensor, hook: Any) -> None:
    """``t.register_hook(hook)`` without the handle (never removed: the hook lives and dies with
    ``t``'s graph node). Tensor.register_hook builds a RemovableHandle and an OrderedDict in
    Python on every call; the first hook of a tensor goes straight into a dict here (the same
    C++ hook registration torch uses), under a key no RemovableHandle can take."""
    # Subclasses keep their own register_hook; torch.compile cannot trace the attribute write.
    if not _is_compiling() and type(t) is _Tensor and t._backward_hooks is None:
        t._backward_hooks = OrderedDict(((_HOOK_KEY, hook),))  # RemovableHandle needs weakrefs
        t.grad_fn._register_hook_dict(t)
    else:
        t.register_hook(hook)


_HOOK_KEY = "hookline"  # RemovableHandle ids are ints
_ONE = (0,)


class _Rebase(torch.autograd.Function):
    """Give a caller's tensor the history of the module's in-place result on its alias."""

    @staticmethod
    def forward(ctx: Any, tensor: _Tensor, result: _Tensor) -> _Tensor:  # type: ignore[override]
        ctx.mark_dirty(tensor)
        # For a view, autograd wraps this node in CopySlices, which drops the gradient of the
        # whole base when the view's own gradient is None: send an (expanded) zero instead.
        ctx.is_view = tensor._is_view()
        return tensor

    @staticmethod
    def backward(ctx: Any, grad: _Tensor) -> tuple[_Tensor | None, _Tensor]:  # type: ignore[override]
        # The old value's contribution already flows through ``result``'s history.
        return (grad.new_zeros(()).expand_as(grad) if ctx.is_view else None), grad


class PendingInputs:
    """What the forward hook needs from the pre-hook of the same call (holds tensors briefly)."""

    __slots__ = ("call", "inputs", "versions", "aliases")

    def __init__(self, call: BackwardCall, inputs: list[_Tensor], aliases: Sequence[_Tensor]) -> None:
        self.call = call
        self.inputs = inputs
        self.versions = [t._version for t in inputs]
        self.aliases = aliases

    def rebase_modified(self, outputs: Leaves) -> Leaves:
        """Re-base caller tensors that the module modified in place (through their alias).

        Returns ``outputs`` with each such alias replaced by the caller's own tensor, so that the
        caller keeps one tensor object, as without hooks: later in-place ops on the returned
        value then also update the history of every reference the caller holds.
        """
        if len(self.inputs) == 1 and self.inputs[0]._version == self.versions[0]:
            return outputs  # the common case: nothing modified
        modified: dict[int, tuple[_Tensor, list[_Tensor]]] = {}  # id(t) -> (t, its aliases)
        for t, v, alias in zip(self.inputs, self.versions, self.aliases):
            if t._version != v:
                modified.setdefault(id(t), (t, []))[1].append(alias)
        swap: dict[int, _Tensor] = {}
        for t, aliases in modified.values():
            # a tensor passed twice has two aliases: the one changed last has the full history
            newest = max(aliases, key=lambda a: a.grad_fn._sequence_nr())
            version = t._version
            _Rebase.apply(t, newest)
            _set_versions((t,), (version,))  # the re-base is not a new modification
            swap.update((id(a), t) for a in aliases)
        if not swap or not any(id(o) in swap for o in outputs):
            return outputs
        return Leaves([swap.get(id(o), o) for o in outputs], outputs.paths, outputs.skipped)


class BackwardCall:
    """Gradients of one module call in one backward pass, and the firing of its hooks."""

    __slots__ = (
        "module", "handles", "in_index", "in_paths", "in_skipped", "out_paths", "out_skipped",
        "expected", "grad_in", "grad_out", "seen", "task", "fired", "edge", "node_hook", "fallback",
    )

    def __init__(self, module: nn.Module, handles: tuple[HookHandle, ...], inputs: Leaves) -> None:
        self.module = module
        self.handles = handles
        if len(inputs) == 1:  # the common case, without a generator
            self.in_index = _ONE if inputs[0].requires_grad else ()
        else:
            self.in_index = tuple(i for i, t in enumerate(inputs) if t.requires_grad)
        self.in_paths = inputs.paths
        self.in_skipped = inputs.skipped
        self.out_paths: tuple[str, ...] = ()
        self.out_skipped: tuple[str, ...] = ()
        self.expected = 0
        self.grad_in: list | None = None
        self.grad_out: list | None = None
        self.seen = 0
        self.task = -1  # id of the backward pass (autograd graph task) the state belongs to
        self.fired = False
        # single-op calls: the input's gradient edge (node, output_nr) and the op node names
        # allowed, until the forward hook found it on the op's node
        self.edge: tuple[Any, int, tuple[str, ...]] | None = None
        self.node_hook: Any = None  # single-op calls: the handle of the post-hook on the op node
        self.fallback: SingleOpFallback | None = None  # single-op calls: told when they fail

    # --- forward ---------------------------------------------------------------------------
    def wrap_inputs(self, inputs: Leaves) -> tuple[Leaves, PendingInputs | None]:
        """Pass the grad-requiring inputs through one :class:`_CallInputs` node."""
        if not self.in_index:
            return inputs, None
        originals = [inputs[i] for i in self.in_index]
        if _functorch_active() or _is_compiling():  # torch.compile traces Function.apply
            aliases = _CallInputs.apply(self, *originals)
        else:
            aliases = _call_inputs_apply(self, *[_unwrap_if_dead(t) for t in originals])
        new = list(inputs)
        for i, a in zip(self.in_index, aliases):
            new[i] = a
        return Leaves(new, inputs.paths, inputs.skipped), PendingInputs(self, originals, aliases)

    def note_input(self, x: _Tensor, op_names: tuple[str, ...], fallback: SingleOpFallback) -> None:
        """Single-op call: remember the input's gradient edge instead of wrapping the input;
        ``fallback`` is told should the op's node change during the backward pass."""
        self.edge = (x.grad_fn, x.output_nr, op_names)
        self.fallback = fallback

    def attach_node(self, output: Any) -> bool:
        """Single-op call: take ``grad_in`` from a post-hook on the module's own output node.

        ``output`` is what the module returned, before any forward hook saw it. False (and the
        call then fires with ``grad_in`` None) when that node is not the expected op or does not
        hold the input's edge exactly once.
        """
        node, nr, op_names = self.edge  # type: ignore[misc]
        self.edge = None
        op = output.grad_fn if type(output) is _Tensor else None
        # (an input modified in place before the op would have a new node: no edge found; a
        # patched torch.nn.functional makes another node)
        if op is None or op is node or op.name() not in op_names:
            return self._unattached()
        found = -1
        for j, (fn, fn_nr) in enumerate(op.next_functions):
            if fn is node and fn_nr == nr:
                if found >= 0:
                    return self._unattached()  # the input twice: two contributions
                found = j
        if found < 0:
            return self._unattached()
        # (the handle holds the node's hook dict weakly: no reference cycle through the graph)
        self.node_hook = op.register_hook(partial(self._on_node, found))
        return True

    def _unattached(self) -> bool:
        self.in_index = ()  # fire on the output gradients alone
        return False

    def _on_node(self, j: int, grad_inputs: tuple, grad_outputs: tuple) -> None:
        grad = grad_inputs[j]
        hooks = self.node_hook.hooks_dict_ref()
        # torch runs the node's Python post-hooks in the dict's insertion order (dict.keys, not
        # the OrderedDict's own order): one added during this pass after _on_grad_out put ours
        # last may still change what reaches the input. Never report a stale value.
        if hooks is not None and next(reversed(dict.keys(hooks))) != self.node_hook.id:
            grad = None
            self.fallback.single_op_failed(  # type: ignore[union-attr]
                self, "a post-hook was added to its op's node during the backward pass, after "
                "hookline's, and may change what reaches the input"
            )
        self.on_grad_in((grad,))

    def watch_outputs(self, outputs: Leaves) -> None:
        """Register one tensor hook per distinct grad-requiring, non-leaf output tensor."""
        self.out_paths = outputs.paths
        self.out_skipped = outputs.skipped
        if len(outputs) == 1:  # the common case, without the bookkeeping of repeated tensors
            if outputs[0].grad_fn is not None:
                _watch(outputs[0], partial(self._on_grad_out, _ONE))
                self.expected = 1
            return
        positions: dict[int, list[int]] = {}
        tensors: list[_Tensor] = []
        for i, t in enumerate(outputs):
            if t.grad_fn is not None:  # leaves (e.g. a returned Parameter) would keep the hook forever
                if id(t) in positions:
                    positions[id(t)].append(i)
                else:
                    positions[id(t)] = [i]
                    tensors.append(t)
        for t in tensors:
            _watch(t, partial(self._on_grad_out, positions[id(t)]))
        self.expected = len(tensors)

    # --- backward --------------------------------------------------------------------------
    def _in_pass(self) -> bool:
        """Reset the state when a new backward pass starts; False once fired in this pass."""
        task = _graph_task_id()
        if task != self.task:
            self.task = task
            self.fired = False
            self.seen = 0
            self.grad_in = [None] * len(self.in_paths)
            self.grad_out = [None] * len(self.out_paths)
            _end_of_pass(task).append(self)
        return not self.fired

    def _on_grad_out(self, positions: list[int], grad: _Tensor) -> None:
        hook = self.node_hook
        if hook is not None:
            # Single-op call, its op about to run: post-hooks put on the op's node since the
            # forward (a parent module's legacy backward hook, the user's grad_fn.register_hook)
            # may change the gradients it passes on; ours runs after them, so grad_in is what
            # reaches the input, as through the identity node.
            hooks = hook.hooks_dict_ref()
            if hooks is not None and len(hooks) > 1:
                # (pop and insert again: torch walks the dict in insertion order, which
                # OrderedDict.move_to_end does not change)
                hooks[hook.id] = hooks.pop(hook.id)
        if self._in_pass():
            for i in positions:
                self.grad_out[i] = grad  # type: ignore[index]
            self.seen += 1
            if not self.in_index and self.seen == self.expected:  # else: wait for on_grad_in
                self._fire()

    def on_grad_in(self, grads: tuple[_Tensor | None, ...]) -> None:
        """Called by :class:`_CallInputs` backward with this call's input gradients."""
        if self._in_pass():
            for i, g in zip(self.in_index, grads):
                self.grad_in[i] = g  # type: ignore[index]
            self._fire()

    def _fire(self) -> None:
        self.fired = True
        grad_in = Leaves(self.grad_in, self.in_paths, self.in_skipped)  # type: ignore[arg-type]
        grad_out = Leaves(self.grad_out, self.out_paths, self.out_skipped)  # type: ignore[arg-type]
        self.grad_in = self.grad_out = None
        failure: Exception | None = None
        for handle in self.handles:
            if handle.runs:  # deactivated or suspended since the forward: skip
                try:
                    handle.call(self.module, grad_in, grad_out)
                except Exception as e:  # noqa: BLE001 - the module's other hooks still run
                    failure = failure or e
        if failure is not None:
            raise failure


_pass_calls: dict[int, list[BackwardCall]] = {}


class _EndOfPass:
    """The engine callback of one backward pass: fires the pass's calls that have not fired.

    One callback per pass, not one per call (each is a Python call from the engine, paid inside
    the step). The engine owns the callback, which owns the list of waiting calls; the table
    :data:`_pass_calls` maps graph tasks to those lists for the hooks of the running pass and
    loses its entry when the engine drops the callback, after running it or when the pass failed.
    Keyed by graph task, so a pass that nested passes (reentrant checkpointing) interrupt keeps
    its one callback.
    """

    __slots__ = ("task", "calls")

    def __init__(self, task: int) -> None:
        self.task = task
        self.calls: list[BackwardCall] = []

    def __call__(self) -> None:
        """Fire every waiting call, even if a hook function of one raises (the first error is
        raised afterwards)."""
        failure: Exception | None = None
        for call in self.calls:
            if not call.fired:
                try:
                    call._fire()
                except Exception as e:  # noqa: BLE001 - re-raised below, after the others fired
                    failure = failure or e
        self.calls.clear()
        if failure is not None:
            raise failure

    def __del__(self, table: dict[int, list[BackwardCall]] = _pass_calls) -> None:
        # (the table bound as a default: still there while the interpreter shuts down)
        if table.get(self.task) is self.calls:
            del table[self.task]


def _end_of_pass(task: int) -> list[BackwardCall]:
    """The list of calls that fire at the end of graph task ``task`` (registered on first use)."""
    calls = _pass_calls.get(task)
    if calls is None:
        callback = _EndOfPass(task)
        calls = _pass_calls[task] = callback.calls
        _queue_callback(callback)
    return calls
