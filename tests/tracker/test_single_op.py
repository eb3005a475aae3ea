"""Single-op calls: ``grad_in`` read off the op's own node instead of an identity node.

For the module classes in ``single_op._SINGLE_OP`` the manager skips the identity node when it can
prove nothing comes between the input and the op. These tests check (1) that the path is taken
where it should be and gives the gradients of an independent reference, (2) that every condition
that could put something between input and op falls back to the identity node, with the same
values, and (3) that a failed check is loud and the module falls back for later calls.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import pytest
import torch
from _grad_reference import assert_same_calls, recorder, reference_grads
from torch import nn

from hookline.tracker import HookManager, HookOutputError, HookTypeError, passive
from hookline.tracker.hooks import single_op
from hookline.tracker.hooks.handles import is_passive


def identity_node_used(y: torch.Tensor, depth: int = 4) -> bool:
    """Whether the manager's identity node sits in ``y``'s graph within ``depth`` nodes."""
    todo, seen = [(y.grad_fn, 0)], set()
    while todo:
        node, d = todo.pop()
        if node is None or id(node) in seen or d > depth:
            continue
        seen.add(id(node))
        if "_CallInputs" in node.name():
            return True
        todo.extend((fn, d + 1) for fn, _ in node.next_functions)
    return False


def reads_input_edge(y: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``y``'s node takes ``x`` directly (no node in between)."""
    return any(fn is x.grad_fn and nr == x.output_nr for fn, nr in y.grad_fn.next_functions)


SINGLE_OP = [
    pytest.param(lambda: nn.Linear(6, 5), (4, 6), id="linear"),
    pytest.param(lambda: nn.Linear(6, 5, bias=False), (4, 6), id="linear-no-bias"),
    pytest.param(lambda: nn.Conv1d(2, 3, 3), (2, 2, 7), id="conv1d"),
    pytest.param(lambda: nn.Conv2d(2, 3, 3, padding=1), (2, 2, 5, 5), id="conv2d"),
    pytest.param(lambda: nn.Conv3d(2, 3, 2), (1, 2, 3, 4, 4), id="conv3d"),
    pytest.param(lambda: nn.LayerNorm(6), (4, 6), id="layernorm"),
    pytest.param(lambda: nn.LayerNorm(6, elementwise_affine=False), (4, 6), id="layernorm-plain"),
    pytest.param(nn.GELU, (4, 6), id="gelu"),
    pytest.param(lambda: nn.GELU("tanh"), (4, 6), id="gelu-tanh"),
    pytest.param(nn.Tanh, (4, 6), id="tanh"),
    pytest.param(nn.Sigmoid, (4, 6), id="sigmoid"),
    pytest.param(nn.ReLU, (4, 6), id="relu"),
    pytest.param(nn.SiLU, (4, 6), id="silu"),
    pytest.param(nn.LeakyReLU, (4, 6), id="leaky-relu"),
]


@pytest.mark.parametrize(("make", "shape"), SINGLE_OP)
def test_single_op_modules_skip_the_identity_node_and_match_the_reference(mgr, make, shape):
    module = make()
    reference = copy.deepcopy(module)
    source = torch.randn(*shape, requires_grad=True)
    got, hook = recorder()
    mgr.register_backward_hook(hook, m=module)
    x = source * 1.5  # a non-leaf input, as every layer but the first sees
    y = module(x)
    assert reads_input_edge(y, x) and not identity_node_used(y)
    y.pow(2).sum().backward()
    want = reference_grads(reference, {"m": reference}, lambda m: m(source * 1.5).pow(2).sum())
    assert_same_calls(got, want)
    # bit-exact against autograd itself: x feeds only this call
    torch.testing.assert_close(got["m"][0][0][0] * 1.5, source.grad, rtol=0, atol=0)


def test_mlp_with_inplace_relu_and_calls_twice_matches_the_reference(mgr):
    shared = nn.Linear(8, 8)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), shared, nn.Tanh(), shared, nn.GELU())
    reference = copy.deepcopy(model)
    reference[1].inplace = False
    x = torch.randn(5, 6, requires_grad=True)
    got, hook = recorder()
    mgr.register_backward_hook(hook, **dict(model.named_children()))
    model(x).pow(2).sum().backward()
    assert_same_calls(got, reference_grads(reference, dict(reference.named_children()), lambda m: m(x).pow(2).sum()))
    assert len(got["2"]) == 2  # the shared Linear fired once per call


def test_several_forwards_one_backward_and_retain_graph(mgr):
    lin = nn.Linear(4, 4)
    calls, hook = recorder()
    mgr.register_backward_hook(hook, lin=lin)
    source = torch.randn(3, 4, requires_grad=True)
    y1, y2 = lin(source * 2), lin(source * 3)
    loss = y1.pow(2).sum() + y2.pow(3).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert len(calls["lin"]) == 4  # two calls, two passes
    first = [c[0][0] for c in calls["lin"][:2]]
    second = [c[0][0] for c in calls["lin"][2:]]
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(first[0] * 3 + first[1] * 2, source.grad / 2, rtol=1e-6, atol=1e-6)


def test_double_backward(mgr):
    """create_graph: grad_in is itself differentiable, as through the identity node. (The hook
    keeps only a flag: a hook keeping a create_graph gradient makes a reference cycle through
    the autograd graph that Python's collector cannot see; docs/hooks.md.)"""
    lin = nn.Linear(4, 4)
    flags = []
    mgr.register_backward_hook(lambda m, gi, go: flags.append(gi[0].requires_grad), lin=lin)
    source = torch.randn(3, 4, requires_grad=True)
    x = source * 2
    y = lin(x)
    assert reads_input_edge(y, x)
    (g,) = torch.autograd.grad(y.pow(2).sum(), source, create_graph=True)
    assert flags == [True]
    g.sum().backward()
    # the second pass runs the call's node again and fires again, as the identity node did
    assert source.grad is not None and flags == [True, False]


def test_autograd_grad_for_the_weight_only_reports_no_input_gradient(mgr):
    lin = nn.Linear(4, 4)
    calls, hook = recorder()
    mgr.register_backward_hook(hook, lin=lin)
    x = torch.randn(3, 4, requires_grad=True) * 1
    (gw,) = torch.autograd.grad(lin(x).sum(), lin.weight)
    ((grad_in, grad_out),) = calls["lin"]
    assert grad_in[0] is None and grad_out[0] is not None  # as through the identity node (not run)
    assert gw.shape == lin.weight.shape


def test_passive_forward_hooks_keep_the_single_op_path_and_others_do_not(mgr):
    lin = nn.Linear(4, 4)
    calls, hook = recorder()
    seen = []
    mgr.register_forward_hook(passive(lambda m, i, o: seen.append(o[0].detach().clone())), lin=lin)
    mgr.register_backward_hook(hook, lin=lin)
    source = torch.randn(3, 4, requires_grad=True)
    x = source * 2
    y = lin(x)
    assert len(seen) == 1 and reads_input_edge(y, x)
    y.pow(2).sum().backward()
    torch.testing.assert_close(calls["lin"][0][0][0] * 2, source.grad, rtol=0, atol=0)
    # any other forward hook function may compute with the inputs it is handed: identity node
    mgr.register_forward_hook(lambda m, i, o: None, lin=lin)
    assert identity_node_used(lin(source * 2))


@pytest.mark.parametrize("edit", ["zero-a-column", "add-the-input"])
def test_forward_hooks_modifying_the_output_in_place(mgr, edit):
    """Activation patching: the call's grad_in includes what the hook did with its input."""
    lin = nn.Linear(4, 4)
    calls, hook = recorder()

    def patch(module, inputs, outputs):
        if edit == "zero-a-column":
            outputs[0][:, 0] = 0
        else:
            outputs[0].add_(inputs[0])

    mgr.register_forward_hook(patch, lin=lin)
    mgr.register_backward_hook(hook, lin=lin)
    source = torch.randn(3, 4, requires_grad=True)
    lin(source * 1).pow(2).sum().backward()
    torch.testing.assert_close(calls["lin"][0][0][0], source.grad, rtol=0, atol=0)


def test_forward_hook_replacing_the_output(mgr):
    """grad_in is the call's contribution, grad_out the gradient of the replaced output."""
    lin = nn.Linear(4, 4)
    calls, hook = recorder()
    mgr.register_forward_hook(lambda m, i, o: o[0] * 0.5, lin=lin)
    mgr.register_backward_hook(hook, lin=lin)
    source = torch.randn(3, 4, requires_grad=True)
    y = lin(source * 1)
    y.pow(2).sum().backward()
    ((grad_in, grad_out),) = calls["lin"]
    torch.testing.assert_close(grad_out[0], 2 * y.detach(), rtol=0, atol=0)
    torch.testing.assert_close(grad_in[0], source.grad, rtol=0, atol=0)


class _Sub(nn.Linear):
    pass


def _later_pre_hook(m):
    return m.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))


def _forward_hook(m):
    return m.register_forward_hook(lambda mod, args, out: out * 3)


def _global_forward_hook(m):
    return nn.modules.module.register_module_forward_hook(lambda mod, args, out: None)


def _instance_forward(m):
    m.forward = lambda x: nn.functional.linear(x, m.weight, m.bias) * 2


def _linear():
    return nn.Linear(6, 5)


def _full_backward_hook(m):
    return m.register_full_backward_hook(lambda mod, gi, go: None)


def _full_backward_pre_hook(m):
    return m.register_full_backward_pre_hook(lambda mod, go: None)


def _global_full_backward_hook(m):
    return nn.modules.module.register_module_full_backward_hook(lambda mod, gi, go: None)


class _Int8Weight(torch.Tensor):
    """A weight that runs F.linear as several ops (as weight-only quantisation does)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.linear:
            x, w, b = args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias")
            with torch._C.DisableTorchFunctionSubclass():
                return torch.mm(x.reshape(-1, x.shape[-1]), w.t()) + b
        return super().__torch_function__(func, types, args, kwargs)


def _quantised_linear():
    lin = nn.Linear(6, 5)
    lin.weight = nn.Parameter(lin.weight.detach().as_subclass(_Int8Weight))
    return lin


def _later_forward_hook(m):
    return m.register_forward_hook(lambda mod, args, out: out + args[0])


def _second_manager_forward_hook(m):
    other = HookManager()
    other.register_forward_hook(lambda mod, i, o: o[0] + i[0], lin=m)
    return _Removal(other.remove_all_hooks)


class _Removal:
    def __init__(self, remove):
        self.remove = remove


@contextlib.contextmanager
def _patched(owner, name, replacement):
    original = getattr(owner, name)
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _patched_torch_relu():
    return _patched(torch, "relu", lambda x: x * (x > 0))


def _patched_torch_layer_norm():
    original = torch.layer_norm
    return _patched(torch, "layer_norm", lambda x, *a, **k: original(x * 1, *a, **k))


@contextlib.contextmanager
def _quick_gelu():
    """A patched torch.nn.functional.gelu that makes a Mul node holding the input's edge."""
    original = nn.functional.gelu
    nn.functional.gelu = lambda x, approximate="none": x * torch.sigmoid(1.702 * x)
    try:
        yield
    finally:
        nn.functional.gelu = original


FALLBACKS = [  # make, input shape, set up before / after the manager's registration, context
    pytest.param(_linear, (2, 4, 6), None, None, None, id="linear-3d-input"),
    pytest.param(lambda: _Sub(6, 5), (4, 6), None, None, None, id="subclass"),
    pytest.param(lambda: nn.ReLU(inplace=True), (4, 6), None, None, None, id="inplace-relu"),
    pytest.param(lambda: nn.Conv2d(2, 3, 3), (2, 5, 5), None, None, None, id="conv-unbatched"),
    pytest.param(lambda: nn.Conv2d(2, 3, 3, padding=1, padding_mode="reflect"), (1, 2, 5, 5), None, None, None,
                 id="conv-reflect"),
    pytest.param(_linear, (4, 6), None, None, lambda: torch.autocast("cpu", dtype=torch.bfloat16), id="autocast"),
    pytest.param(_linear, (4, 6), None, None, lambda: torch.device("cpu"), id="torch-function-mode"),
    pytest.param(_linear, (4, 6), None, _later_pre_hook, None, id="user-pre-hook-after"),
    pytest.param(_linear, (4, 6), _forward_hook, None, None, id="user-forward-hook-before"),
    pytest.param(_linear, (4, 6), None, _global_forward_hook, None, id="global-forward-hook"),
    pytest.param(_linear, (4, 6), _instance_forward, None, None, id="instance-forward"),
    pytest.param(_linear, (4, 6), None, _full_backward_hook, None, id="torch-full-backward-hook"),
    pytest.param(_linear, (4, 6), None, _full_backward_pre_hook, None, id="torch-full-backward-pre-hook"),
    pytest.param(_linear, (4, 6), None, _global_full_backward_hook, None, id="global-full-backward-hook"),
    pytest.param(lambda: nn.Conv1d(2, 3, 4, padding="same"), (1, 2, 7), None, None, None, id="conv-same-even"),
    pytest.param(_quantised_linear, (4, 6), None, None, None, id="tensor-subclass-weight"),
    pytest.param(nn.GELU, (4, 6), None, None, _quick_gelu, id="patched-functional"),
    pytest.param(nn.ReLU, (4, 6), None, None, _patched_torch_relu, id="patched-torch-relu"),
    pytest.param(lambda: nn.LayerNorm(6), (4, 6), None, None, _patched_torch_layer_norm, id="patched-torch-layer-norm"),
    pytest.param(lambda: nn.Linear(6, 6), (4, 6), None, _later_forward_hook, None, id="torch-forward-hook-after-using-the-input"),
    pytest.param(lambda: nn.Linear(6, 6), (4, 6), None, _second_manager_forward_hook, None, id="second-manager-forward-hook"),
]


@pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")  # torch's own note
@pytest.mark.parametrize(("make", "shape", "before", "after", "context"), FALLBACKS)
def test_conditions_that_could_separate_input_and_op_use_the_identity_node(make, shape, before, after, context):
    """Each case takes the identity node (no shortcut, no warning) and gives the exact grad_in."""
    module = make()
    handles = [before(module)] if before else []
    mgr = HookManager()
    calls, hook = recorder()
    mgr.register_backward_hook(hook, m=module)
    handles += [after(module)] if after else []
    try:
        source = torch.randn(*shape, requires_grad=True)
        with context() if context else contextlib.nullcontext():
            y = module(source * 1.5)
        assert identity_node_used(y, depth=6)
        y.float().pow(2).sum().backward()
        ((grad_in, _),) = calls["m"]
        # the input feeds only this call: its whole gradient is the call's contribution
        torch.testing.assert_close(grad_in[0] * 1.5, source.grad, rtol=0, atol=0)
    finally:
        mgr.remove_all_hooks()
        for h in handles:
            if h is not None:
                h.remove()


def test_leaf_input_uses_the_identity_node(mgr):
    lin = nn.Linear(4, 4)
    calls, hook = recorder()
    mgr.register_backward_hook(hook, lin=lin)
    x = torch.randn(3, 4, requires_grad=True)
    y = lin(x)
    assert identity_node_used(y)
    y.sum().backward()
    torch.testing.assert_close(calls["lin"][0][0][0], x.grad, rtol=0, atol=0)


class _TwoOps(nn.Module):
    def forward(self, x):
        return x * 2 + 1


def test_a_failed_check_warns_reports_none_and_falls_back(mgr, monkeypatch):
    """Should a listed class ever compute its output with more than one op, the call's grad_in
    is None with a warning (never a wrong gradient), and later calls take the identity node."""
    monkeypatch.setitem(single_op._SINGLE_OP, _TwoOps, (lambda m, x: True, ("AddBackward0",)))
    monkeypatch.setitem(single_op._CLASS_FORWARD, _TwoOps, _TwoOps.forward)
    monkeypatch.setitem(single_op._FUNCTIONS, _TwoOps, ((torch, "add", torch.add),))
    m = _TwoOps()
    calls, hook = recorder()
    mgr.register_backward_hook(hook, m=m)
    source = torch.randn(3, requires_grad=True)
    with pytest.warns(RuntimeWarning, match=r"hookline: backward hook .*\[m\].*_TwoOps.*grad_in is None") as w:
        y = m(source * 1)
    assert w[0].filename == __file__  # points at the model call, not into torch or hookline
    y.sum().backward()
    ((grad_in, grad_out),) = calls["m"]
    assert grad_in[0] is None and grad_out[0] is not None
    calls["m"].clear()
    source.grad = None
    y = m(source * 1)
    assert identity_node_used(y)
    y.sum().backward()
    torch.testing.assert_close(calls["m"][0][0][0], source.grad, rtol=0, atol=0)


def test_a_functional_patched_before_import_is_caught_by_the_node_kind(mgr, monkeypatch):
    """A patch older than hookline's snapshot of torch.nn.functional (simulated by putting the
    patched function in the snapshot): the op's node is not the one GELU makes, so the call
    reports None with a warning instead of the Mul node's (wrong) gradient."""
    with _quick_gelu():
        monkeypatch.setitem(single_op._FUNCTIONS, nn.GELU, ((nn.functional, "gelu", nn.functional.gelu),))
        gelu = nn.GELU()
        calls, hook = recorder()
        mgr.register_backward_hook(hook, m=gelu)
        source = torch.randn(3, 4, requires_grad=True)
        with pytest.warns(RuntimeWarning, match="did not compute its output with one op"):
            y = gelu(source * 1)
        assert y.grad_fn.name() == "MulBackward0"
        y.sum().backward()
        assert calls["m"][0][0][0] is None


def test_passive_marks_functions_methods_and_callables_and_refuses_what_it_cannot_mark():
    def f(m, i, o):
        return None

    class Logger:
        def hook(self, m, i, o):
            return None

        def __call__(self, m, i, o):
            return None

    assert not is_passive(f)
    assert passive(f) is f and is_passive(f)
    logger = Logger()
    assert passive(logger.hook) == logger.hook and is_passive(Logger().hook)  # the function is marked
    assert passive(logger) is logger and is_passive(logger) and not is_passive(Logger())

    @functools.wraps(f)
    def wrapper(m, i, o):  # copies f's attributes, the mark among them: not passive itself
        return f(m, i, o)

    assert not is_passive(wrapper)
    assert is_passive(passive(wrapper))
    with pytest.raises(HookTypeError, match="takes a hook function, got int 5"):
        passive(5)
    with pytest.raises(HookTypeError, match="cannot mark <built-in function print>.*wrap it in a function"):
        passive(print)


def test_passive_refuses_a_registration(mgr):
    registered = mgr.register_forward_hook(lambda m, i, o: None, hook_fn_name="log", lin=nn.Linear(2, 2))
    with pytest.raises(HookTypeError, match="not its registration HookFunction.*mark the function before registering"):
        passive(registered)


def test_a_passive_hook_returning_a_replacement_is_refused(mgr):
    lin = nn.Linear(4, 4)
    mgr.register_forward_hook(passive(lambda m, i, o: o[0] * 2), hook_fn_name="scale", lin=lin)
    with pytest.raises(HookOutputError, match=r"hook 'scale\[lin\]' is marked passive but returned a Tensor"):
        lin(torch.randn(3, 4))


@pytest.mark.filterwarnings("ignore:Using a non-full backward hook:FutureWarning")  # torch on its legacy hook
@pytest.mark.parametrize("where", ["parent-legacy-backward-hook", "user-node-post-hook"])
def test_post_hooks_added_to_the_op_node_later_are_seen(mgr, where):
    """Post-hooks put on the op's node after the forward hook (a parent's legacy backward hook
    lands there when the module is its last layer) may change what the op passes on: grad_in is
    what reaches the input, as through the identity node."""
    lin = nn.Linear(4, 3)
    parent = nn.Sequential(lin)
    calls, hook = recorder()
    mgr.register_backward_hook(hook, lin=lin)
    source = torch.randn(2, 4, requires_grad=True)
    x = source * 1
    reaching = []
    x.register_hook(reaching.append)
    handle = None
    if where == "parent-legacy-backward-hook":
        handle = parent.register_backward_hook(lambda m, gi, go: tuple(None if g is None else g / 2 for g in gi))
    y = parent(x)
    assert reads_input_edge(y, x)
    if where == "user-node-post-hook":
        y.grad_fn.register_hook(lambda gi, go: tuple(None if g is None else g.clamp(-0.1, 0.1) for g in gi))
    try:
        y.pow(2).sum().backward()
    finally:
        if handle is not None:
            handle.remove()
    torch.testing.assert_close(calls["lin"][0][0][0], reaching[0], rtol=0, atol=0)
    assert not torch.equal(calls["lin"][0][1][0] @ lin.weight, reaching[0])  # the hook did change it


def test_complex_convolution_uses_the_identity_node(mgr):
    conv = nn.Conv2d(2, 3, 3, dtype=torch.complex64)
    calls, hook = recorder()
    mgr.register_backward_hook(hook, conv=conv)
    source = torch.randn(1, 2, 5, 5, dtype=torch.complex64, requires_grad=True)
    y = conv(source * 1)
    assert identity_node_used(y, depth=6)
    y.abs().sum().backward()
    torch.testing.assert_close(calls["conv"][0][0][0], source.grad, rtol=0, atol=0)


@pytest.mark.parametrize("held_as", ["buffer", "attribute"])
def test_a_tensor_subclass_weight_held_as_buffer_or_attribute_uses_the_identity_node(mgr, held_as):
    lin = nn.Linear(6, 5)
    weight = lin.weight.detach().as_subclass(_Int8Weight)
    del lin.weight
    if held_as == "buffer":
        lin.register_buffer("weight", weight)
    else:
        lin.weight = weight  # not a Parameter: a plain attribute
    calls, hook = recorder()
    mgr.register_backward_hook(hook, lin=lin)
    source = torch.randn(4, 6, requires_grad=True)
    y = lin(source * 1)
    assert identity_node_used(y, depth=6)
    y.pow(2).sum().backward()
    torch.testing.assert_close(calls["lin"][0][0][0], source.grad, rtol=0, atol=0)


@pytest.mark.parametrize("added_from", ["tensor-hook", "node-pre-hook"])
def test_a_post_hook_added_during_backward_is_reported_not_missed(mgr, added_from):
    """A post-hook put on the op's node during the pass, after the manager's reorder, runs after
    the manager's: grad_in is None with a warning (never the value before that hook), and the
    module's later calls take the identity node."""
    lin = nn.Linear(4, 3)
    calls, hook = recorder()
    mgr.register_backward_hook(hook, lin=lin)
    source = torch.randn(2, 4, requires_grad=True)
    x = source * 1
    y = lin(x)
    assert reads_input_edge(y, x)

    def clamp(gi, go):
        return tuple(None if g is None else g.clamp(-0.1, 0.1) for g in gi)

    if added_from == "tensor-hook":
        y.register_hook(lambda g: (y.grad_fn.register_hook(clamp), None)[1])
    else:
        y.grad_fn.register_prehook(lambda go: (y.grad_fn.register_hook(clamp), None)[1])
    with pytest.warns(RuntimeWarning, match="post-hook was added to its op's node during the backward pass"):
        y.pow(2).sum().backward()
    assert calls["lin"][0][0][0] is None
    calls["lin"].clear()
    source.grad = None
    y = lin(source * 1)
    assert identity_node_used(y)
    y.pow(2).sum().backward()
    torch.testing.assert_close(calls["lin"][0][0][0], source.grad, rtol=0, atol=0)
