"""When backward hooks fire, what they receive, and what they leave behind."""

from __future__ import annotations

import copy
import dataclasses
import gc
from collections import namedtuple

import pytest
import torch
from _grad_reference import assert_same_calls, recorder, reference_grads
from torch import nn

from hookline.tracker import HookFunctionError, HookManager, select
from hookline.tracker.hooks.backward import BackwardCall


def counter():
    calls = []
    return calls, lambda module, gi, go: calls.append((module.name, gi, go))


def test_fires_under_autograd_grad_and_never_waits_for_parameters(mgr):
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    calls, hook = counter()
    mgr.register_backward_hook(hook, **select(m, "?"))
    x = torch.randn(3, 4, requires_grad=True)
    (gx,) = torch.autograd.grad(m(x).sum(), x)
    assert [c[0] for c in calls] == ["1", "0"]
    torch.testing.assert_close(calls[1][1][0], gx)
    assert m[0].weight.grad is None


@pytest.mark.parametrize("leaf_input", [True, False], ids=["identity-node", "single-op"])
def test_autograd_grad_stopping_before_inputs_fires_at_end_of_pass(mgr, leaf_input):
    lin = nn.Linear(4, 4)
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    x = torch.randn(3, 4, requires_grad=True)
    y = lin(x if leaf_input else x * 1)  # a non-leaf input takes the single-op path
    (gy,) = torch.autograd.grad((y * 2).sum(), y)
    assert len(calls) == 1
    _, grad_in, grad_out = calls[0]
    assert grad_in[0] is None  # neither the input node nor the op ran
    torch.testing.assert_close(grad_out[0], gy)


def test_retain_graph_fires_on_every_pass(mgr):
    lin = nn.Linear(4, 4)
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    x = torch.randn(3, 4, requires_grad=True)
    loss = lin(x).sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(calls) == 3
    for _, gi, go in calls:
        torch.testing.assert_close(gi[0], calls[0][1][0])


def test_no_grad_forward_does_not_fire(mgr):
    lin = nn.Linear(4, 4)
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    with torch.no_grad():
        y = lin(torch.randn(2, 4))
    assert not y.requires_grad and calls == []
    with torch.inference_mode():
        lin(torch.randn(2, 4))
    lin(torch.randn(2, 4)).sum().backward()
    assert len(calls) == 1


def test_deactivated_between_forward_and_backward_does_not_fire(mgr):
    lin = nn.Linear(4, 4)
    calls, hook = counter()
    other_calls, other = counter()
    hf = mgr.register_backward_hook(hook, lin=lin)
    mgr.register_backward_hook(other, lin=lin)
    y = lin(torch.randn(2, 4, requires_grad=True))
    hf.module_to_handle[lin].deactivate()
    y.sum().backward()
    assert calls == [] and len(other_calls) == 1


def test_no_input_needs_grad_fires_after_output_grads(mgr):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    calls, hook = counter()
    mgr.register_backward_hook(hook, **select(m, "?"))
    m(torch.randn(3, 4)).sum().backward()
    assert [c[0] for c in calls] == ["2", "1", "0"]
    assert calls[2][1] == (None,)


def _live_calls() -> int:
    gc.collect()
    return sum(type(o) is BackwardCall for o in gc.get_objects())


def test_forward_without_backward_leaks_nothing(mgr):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    calls, hook = counter()
    mgr.register_backward_hook(hook, **select(m, "*"))
    before = _live_calls()
    x = torch.randn(3, 4, requires_grad=True)
    for _ in range(5):
        y = m(x)
    assert _live_calls() > before
    del y
    assert _live_calls() == before
    assert all(not mh._pending for mh in mgr._slots.values())
    assert x._backward_hooks is None or not x._backward_hooks
    assert calls == []


def test_backward_state_released_after_backward(mgr):
    lin = nn.Linear(4, 4)
    mgr.register_backward_hook(lambda *a: None, lin=lin)
    before = _live_calls()
    lin(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert _live_calls() == before


def test_backward_hooks_of_one_module_share_one_identity_node(mgr):
    lin = nn.Linear(4, 4)
    a_calls, a = counter()
    b_calls, b = counter()
    mgr.register_backward_hook(a, lin=lin)
    mgr.register_backward_hook(b, lin=lin)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    nodes = []
    stack = [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            nodes.append(type(node).__name__)
            stack.extend(n for n, _ in node.next_functions)
    assert nodes.count("_CallInputsBackward") == 1
    y.sum().backward()
    assert len(a_calls) == len(b_calls) == 1


def test_forward_only_registration_sets_up_no_backward_machinery(mgr):
    lin = nn.Linear(4, 4)
    mgr.register_forward_hook(lambda m, i, o: None, lin=lin)
    mgr.register_forward_pre_hook(lambda m, i: None, lin=lin)
    x = torch.randn(2, 4, requires_grad=True)
    y = lin(x)
    assert type(y.grad_fn).__name__ == "AddmmBackward0"
    assert all("_CallInputs" not in type(n).__name__ for n, _ in y.grad_fn.next_functions if n is not None)
    assert not mgr._slots[lin]._pending


Point = namedtuple("Point", "a b")


@dataclasses.dataclass
class Out:
    hidden: torch.Tensor
    extra: object = None


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.kind = kind

    def forward(self, x, *, scale):
        h = self.lin(x)
        a, b = h * scale, h.sum(-1)
        if self.kind == "dict":
            return {"a": a, "none": None, "b": b}
        if self.kind == "list":
            return [a, [b, 3]]
        if self.kind == "namedtuple":
            return Point(a, b)
        return Out(a, extra="meta")


@pytest.mark.parametrize(("kind", "paths"), [
    ("dict", ("a", "b")), ("list", ("0", "1.0")), ("namedtuple", ("a", "b")), ("dataclass", ("hidden",)),
])
def test_structured_outputs_and_kwargs_inputs(mgr, kind, paths):
    m = Structured(kind)
    x = torch.randn(3, 4, requires_grad=True)
    scale = torch.randn(4, requires_grad=True)

    def leaves_of(out):
        if isinstance(out, dict):
            return [out["a"], out["b"]]
        if isinstance(out, list):
            return [out[0], out[1][0]]
        if isinstance(out, Out):
            return [out.hidden]
        return list(out)

    def loss(mod):
        return sum(t.pow(2).sum() for t in leaves_of(mod(x, scale=scale)))

    reference = copy.deepcopy(m)  # before registering: deepcopy would copy the torch hooks too
    seen = []
    mgr.register_backward_hook(lambda mod, gi, go: seen.append((gi.paths, go.paths)), m=m)
    got, hook = recorder()
    mgr.register_backward_hook(hook, m=m)
    loss(m).backward()
    assert_same_calls(got, reference_grads(reference, {"m": reference}, loss))
    assert seen == [(("0", "scale"), paths)]


def test_hook_error_in_backward_names_the_handle(mgr):
    lin = nn.Linear(4, 4)

    def bad(module, gi, go):
        raise ValueError("boom")

    mgr.register_backward_hook(bad, hook_fn_name="bad", lin=lin)
    y = lin(torch.randn(2, 4, requires_grad=True))
    with pytest.raises(HookFunctionError, match=r"bad\[lin\].*ValueError: boom") as info:
        y.sum().backward()
    assert isinstance(info.value.__cause__, ValueError)


def test_torch_full_backward_hook_fails_where_hookline_works():
    """The reason this module exists: torch raises on `out += identity` after a hooked module."""
    block = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    handle = block[0].register_full_backward_hook(lambda *a: None)
    try:
        with pytest.raises(RuntimeError, match="view and is being modified inplace"):
            out = block(x)
            out += x
    finally:
        handle.remove()
    mgr = HookManager()
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=block[0])
    out = block(x)
    out += x
    out.sum().backward()
    mgr.remove_all_hooks()
    torch.testing.assert_close(calls[0][2][0], torch.ones(2, 4))


def test_no_input_needs_grad_and_unused_output_fires_at_end_of_pass(mgr):
    lstm = nn.LSTM(2, 3)
    calls, hook = counter()
    mgr.register_backward_hook(hook, lstm=lstm)
    out, (h, c) = lstm(torch.randn(4, 1, 2))
    (out.sum() + h.sum()).backward()
    assert len(calls) == 1
    _, grad_in, grad_out = calls[0]
    assert grad_in == (None,) and [g is None for g in grad_out] == [False, False, True]


def test_hook_error_from_end_of_pass_callback_propagates(mgr):
    lin = nn.Linear(3, 3)

    def bad(module, gi, go):
        raise ValueError("late")

    mgr.register_backward_hook(bad, hook_fn_name="bad", lin=lin)
    y = lin(torch.randn(2, 3, requires_grad=True))
    with pytest.raises(HookFunctionError, match=r"bad\[lin\].*ValueError: late"):
        torch.autograd.grad(y.sum(), y)


def test_end_of_pass_fires_every_waiting_call_even_if_one_hook_raises(mgr):
    """All calls still waiting at the end of a pass share one engine callback: a hook that
    raises there must not keep the other calls' hooks from firing (nothing captured is lost)."""
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    fired = []

    def hook(module, gi, go):
        fired.append(module)
        if len(fired) == 1:  # the first call to fire raises
            raise ValueError("late")

    mgr.register_backward_hook(hook, hook_fn_name="h", first=first, second=second)
    x = torch.randn(2, 3, requires_grad=True)
    y1, y2 = first(x), second(x)
    # autograd.grad stops at the outputs: neither call's input node runs, both fire at the end
    with pytest.raises(HookFunctionError, match=r"h\[(first|second)\].*ValueError: late"):
        torch.autograd.grad(y1.sum() + y2.sum(), (y1, y2))
    assert len(fired) == 2 and set(fired) == {first, second}
    # the next pass starts clean
    fired.clear()
    fired.append("placeholder: no raise this time")
    (second(x).sum()).backward()
    assert fired[1:] == [second]


def test_a_raising_backward_hook_does_not_stop_the_modules_other_hooks(mgr):
    """A user's hook that raises must not cost the recorder (registered after it) its record."""
    lin = nn.Linear(3, 3)
    seen = []

    def bad(module, gi, go):
        raise ValueError("user bug")

    mgr.register_backward_hook(bad, hook_fn_name="bad", lin=lin)
    mgr.register_backward_hook(lambda m, gi, go: seen.append(go[0].clone()), hook_fn_name="rec", lin=lin)
    x = torch.randn(2, 3, requires_grad=True)
    with pytest.raises(HookFunctionError, match=r"bad\[lin\].*ValueError: user bug"):
        lin(x).sum().backward()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], torch.ones(2, 3), rtol=0, atol=0)


class _Boom(torch.autograd.Function):
    """Stands in for an out-of-memory error raised inside a layer's backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("out of memory (simulated)")


def test_a_failed_pass_releases_its_waiting_calls_and_gradients(mgr):
    """The engine drops the end-of-pass callback of a pass that fails: the calls waiting in it
    (holding output gradients and the module) must go with it, not stay reachable."""
    lin = nn.Linear(16, 16)
    mgr.register_backward_hook(lambda m, gi, go: None, hook_fn_name="h", lin=lin)
    x = torch.randn(4, 16, requires_grad=True)
    with pytest.raises(RuntimeError, match="simulated"):
        lin(_Boom.apply(x)).sum().backward()  # lin got its output gradient, then the pass failed
    assert _live_calls() == 0


def test_nested_pass_does_not_split_the_outer_pass_end_callback(mgr):
    """A reentrant checkpoint runs a nested backward pass in the middle of the outer one; every
    call of the outer pass that waits for its end must still fire when a hook raises there."""

    class Cut(nn.Module):  # its input needs a gradient, but no path leads back to it
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, t):
            return self.lin(t.detach())

    first, inner, last = Cut(), nn.Linear(3, 3), Cut()
    fired = []

    def hook(module, gi, go):
        fired.append(module)
        if module is last:
            raise ValueError("late")

    mgr.register_backward_hook(hook, hook_fn_name="h", first=first, inner=inner, last=last)
    y = first(torch.randn(2, 3, requires_grad=True))  # waits for the end of the outer pass
    c = torch.utils.checkpoint.checkpoint(inner, torch.randn(2, 3, requires_grad=True), use_reentrant=True)
    z = last(torch.randn(2, 3, requires_grad=True))  # waits too, and its hook raises
    with pytest.raises(HookFunctionError, match=r"h\[last\].*late"):
        (y + c + z).sum().backward()
    assert set(fired) == {first, inner, last} and len(fired) == 3


def test_tensor_escaped_from_a_functorch_transform_keeps_its_gradient(mgr):
    """A tensor created inside torch.func.grad and used afterwards is a dead functorch wrapper;
    the identity node must unwrap it like Function.apply does, or the gradient of what it came
    from (here ``w``) is silently lost."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    w = torch.randn(2, 3, requires_grad=True)
    x = torch.randn(2, 3)
    escaped = {}

    def f(v):
        escaped["t"] = v * w
        return (v * w).sum()

    def w_grad() -> torch.Tensor:
        w.grad = None
        torch.func.grad(f)(x)
        lin(escaped["t"]).sum().backward()
        return w.grad

    expected = w_grad()
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    got = w_grad()
    assert got is not None and len(calls) == 1
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_torch_func_transforms_work_with_backward_hooks_registered(mgr, monkeypatch):
    """torch.func.grad / jacrev / vmap over hooked modules compute what they compute without
    hooks (they raised before, as they do with torch's full backward hooks); the backward hooks
    do not fire inside them (said once, by a warning) and fire again in ordinary passes."""
    from hookline.tracker.hooks import dispatch

    monkeypatch.setattr(dispatch, "_warned_transform", False)
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    plain = {
        "grad": torch.func.grad(lambda v: lin(v).pow(2).sum())(x),
        "jacrev": torch.func.jacrev(lin)(x[0]),
        "per-sample": torch.func.vmap(torch.func.grad(lambda v: lin(v).pow(2).sum()))(x),
    }
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    with pytest.warns(UserWarning, match=r"does not fire for module calls inside torch.func"):
        hooked = {
            "grad": torch.func.grad(lambda v: lin(v).pow(2).sum())(x),
            "jacrev": torch.func.jacrev(lin)(x[0]),
            "per-sample": torch.func.vmap(torch.func.grad(lambda v: lin(v).pow(2).sum()))(x),
        }
    for k in plain:
        torch.testing.assert_close(hooked[k], plain[k], rtol=0, atol=0, msg=k)
    assert calls == []
    lin(x.requires_grad_()).sum().backward()
    assert len(calls) == 1


def test_torch_compile_of_hooked_modules_gives_the_same_gradients(mgr):
    """Under torch.compile the manager registers its hooks the way torch can trace (no write of
    the tensor's hook dict, Function.apply), and hooks see what they see in eager mode."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    calls, hook = counter()
    mgr.register_backward_hook(hook, **select(m, "?"))
    x = torch.randn(2, 4, requires_grad=True)
    m(x).pow(2).sum().backward()
    eager = [(name, [g.clone() for g in gi if g is not None], [g.clone() for g in go]) for name, gi, go in calls]
    calls.clear()
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="eager")
    compiled(x).pow(2).sum().backward()
    assert [c[0] for c in calls] == [e[0] for e in eager]
    for (_, gi, go), (_, egi, ego) in zip(calls, eager):
        for a, b in zip([g for g in gi if g is not None] + list(go), egi + ego):
            torch.testing.assert_close(a, b)
    reasons = " ".join(str(k) for k in torch._dynamo.utils.counters["graph_break"])
    assert "_backward_hooks" not in reasons


def test_double_backward_works(mgr):
    lin = nn.Linear(3, 3)
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    x = torch.randn(2, 3, requires_grad=True)
    (g,) = torch.autograd.grad(lin(x).pow(2).sum(), x, create_graph=True)
    assert len(calls) == 1
    g.pow(2).sum().backward()  # the output gets a gradient again: one more firing
    assert len(calls) == 2 and x.grad is not None


def test_deactivated_during_its_own_forward_leaves_no_state(mgr):
    outer = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    calls, hook = counter()
    hf = mgr.register_backward_hook(hook, outer=outer)
    mgr.register_forward_hook(lambda m, i, o: hf.module_to_handle[outer].deactivate(), inner=outer[0])
    outer(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert mgr._slots[outer]._pending == [] and calls == []
    hf.module_to_handle[outer].activate()
    mgr.deactivate_all_hooks(category="forward_hook")
    outer(torch.randn(1, 2, requires_grad=True)).sum().backward()
    assert len(calls) == 1


def test_a_pre_hook_that_deactivates_its_modules_backward_hook(mgr):
    """A one-shot pattern: the module's own pre hook turns its backward hook off. (Raised a bare
    IndexError from inside hookline before.)"""
    lin = nn.Linear(3, 3)
    calls, hook = counter()
    mgr.register_backward_hook(hook, hook_fn_name="bw", lin=lin)
    mgr.register_forward_pre_hook(lambda m, i: mgr.deactivate_hook_by_name("bw[lin]"), hook_fn_name="once", lin=lin)
    lin(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert calls == []
    assert mgr._slots[lin]._pending == [] and not lin._forward_hooks  # nothing left behind
    mgr.activate_hook_by_name("bw[lin]")
    mgr.remove_hook_function_by_name("once")
    lin(torch.randn(2, 3, requires_grad=True)).sum().backward()
    assert len(calls) == 1


def test_toggled_off_and_on_during_its_own_forward_keeps_its_outputs(mgr):
    """A child's hook deactivates and reactivates the parent's hooks while the parent runs: the
    parent's backward hook still gets its grad_out (it got an empty one before)."""
    outer = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    calls, hook = counter()
    mgr.register_backward_hook(hook, outer=outer)

    def toggle(m, i, o):
        mgr.deactivate_module_hooks_by_name("outer")
        mgr.activate_module_hooks_by_name("outer")

    mgr.register_forward_hook(toggle, inner=outer[0])
    x = torch.randn(2, 3, requires_grad=True)
    y = outer(x)
    y.pow(2).sum().backward()
    (_, gi, go), = calls
    assert go.paths == ("0",) and len(gi) == 1
    torch.testing.assert_close(go[0], 2 * y.detach())


def test_a_raising_forward_keeps_its_error_when_its_hook_was_turned_off_in_the_call(mgr):
    """The deferred removal of the torch hook must not run inside torch's exception handler,
    which iterates the module's hook dict (the caller got 'OrderedDict mutated during
    iteration' instead of the forward's own error)."""

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("the forward's own error")

    m = Fails()
    mgr.register_backward_hook(lambda *a: None, hook_fn_name="bw", m=m)
    mgr.register_forward_pre_hook(lambda mod, i: mgr.deactivate_hook_by_name("bw[m]"), hook_fn_name="once", m=m)
    other = HookManager()
    other.register_forward_hook(lambda mod, i, o: None, m2=m)  # a torch hook after ours
    with pytest.raises(ValueError, match="the forward's own error"):
        m(torch.randn(2, requires_grad=True))
    other.remove_all_hooks()


def test_remove_all_hooks_after_an_interrupted_forward_leaves_no_torch_hook(mgr):
    """KeyboardInterrupt skips torch's always-call hooks, so the call's state is never popped;
    removing the hooks must still take the torch hooks (and the state holding the input) off."""

    class Interrupted(nn.Module):
        def forward(self, x):
            raise KeyboardInterrupt

    m = Interrupted()
    mgr.register_backward_hook(lambda *a: None, m=m)
    with pytest.raises(KeyboardInterrupt):
        m(torch.randn(2, 4, requires_grad=True))
    mgr.remove_all_hooks()
    assert not m._forward_hooks and not m._forward_pre_hooks


def test_a_failed_pass_does_not_break_the_next_one(mgr):
    lin = nn.Linear(3, 3)
    calls = []

    def flaky(module, gi, go):
        calls.append(gi[0])
        if len(calls) == 1:
            raise ValueError("first pass fails")

    mgr.register_backward_hook(flaky, lin=lin)
    y = lin(torch.randn(2, 3, requires_grad=True)).sum()
    with pytest.raises(HookFunctionError):
        y.backward(retain_graph=True)
    y.backward()
    assert len(calls) == 2
    torch.testing.assert_close(calls[0], calls[1])


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(mgr, reentrant):
    from torch.utils.checkpoint import checkpoint

    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    (want,) = torch.autograd.grad(m(x).pow(2).sum(), x)
    calls, hook = counter()
    mgr.register_backward_hook(hook, **select(m, "?"))
    checkpoint(m, x, use_reentrant=reentrant).pow(2).sum().backward()
    assert [c[0] for c in calls] == ["2", "1", "0"]  # once per call, not again for the recompute
    torch.testing.assert_close(calls[-1][1][0], want)


def test_torch_full_backward_hook_fails_on_an_in_place_module():
    relu = nn.ReLU(inplace=True)
    handle = relu.register_full_backward_hook(lambda *a: None)
    try:
        with pytest.raises(RuntimeError, match="view and is being modified inplace"):
            relu(torch.randn(3, requires_grad=True) * 1)
    finally:
        handle.remove()
    mgr = HookManager()
    calls, hook = counter()
    mgr.register_backward_hook(hook, relu=relu)
    x = torch.randn(3, requires_grad=True)
    h = x * 1
    relu(h).sum().backward()
    mgr.remove_all_hooks()
    torch.testing.assert_close(calls[0][1][0], (x > 0).float())


def test_user_tensor_hooks_on_a_hooked_output_run_alongside(mgr):
    """The manager puts its output hook into the tensor's hook dict itself (no RemovableHandle):
    hooks the user registers on the same tensor later must run too, and removing theirs must
    leave the manager's in place."""
    lin = nn.Linear(4, 3)
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    x = torch.randn(2, 4, requires_grad=True)
    out = lin(x)
    seen, gone = [], []
    out.register_hook(lambda g: seen.append(g.clone()))
    out.register_hook(lambda g: gone.append(g)).remove()
    weight = torch.randn(2, 3)
    (out * weight).sum().backward()
    assert len(calls) == 1 and gone == []
    torch.testing.assert_close(seen[0], weight, rtol=0, atol=0)
    torch.testing.assert_close(calls[0][2][0], weight, rtol=0, atol=0)


class _Tagged(torch.Tensor):
    """A tensor subclass, as libraries return them (their __torch_function__ must be honoured)."""


def test_tensor_subclass_outputs_get_their_hooks_through_register_hook(mgr):
    class Wrap(nn.Module):
        def forward(self, x):
            return (x * 2).as_subclass(_Tagged)

    m = Wrap()
    calls, hook = counter()
    mgr.register_backward_hook(hook, wrap=m)
    x = torch.randn(3, requires_grad=True)
    out = m(x)
    assert type(out) is _Tagged
    out.sum().backward()
    assert len(calls) == 1
    torch.testing.assert_close(calls[0][2][0], torch.ones(3), rtol=0, atol=0)
    torch.testing.assert_close(calls[0][1][0], torch.full((3,), 2.0), rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # torch's jvp rules
@pytest.mark.parametrize("shape", [(2, 2, 3), (4, 3)], ids=["identity-node", "single-op"])
def test_forward_mode_ad_passes_through_hooked_modules(mgr, shape):
    """Dual tensors (torch.autograd.forward_ad) through a call with backward hooks: the tangent
    is the module's jvp (the identity node once raised NotImplementedError: no jvp), and the
    backward hook still gets the exact grad_in."""
    import torch.autograd.forward_ad as fwAD

    lin = nn.Linear(3, 3)
    calls, hook = counter()
    mgr.register_backward_hook(hook, lin=lin)
    x = torch.randn(*shape, requires_grad=True)
    tangent = torch.randn(*shape)
    with fwAD.dual_level():
        out = lin(fwAD.make_dual(x, tangent) * 1)
        got = fwAD.unpack_dual(out).tangent
    torch.testing.assert_close(got, tangent @ lin.weight.detach().T)  # the jvp of a Linear
    out.sum().backward()
    torch.testing.assert_close(calls[0][1][0], x.grad, rtol=0, atol=0)
