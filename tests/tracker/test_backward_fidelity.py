"""Backward hooks against independently computed gradients (see _grad_reference.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from _grad_reference import assert_same_calls, recorder, reference_grads
from torch import nn

from hookline.tracker import HookManager, select


def check(mgr: HookManager, model: nn.Module, reference_model: nn.Module, loss_fn, pattern="*", **select_kw):
    got, hook = recorder()
    mgr.register_backward_hook(hook, **select(model, pattern, **select_kw))
    loss_fn(model).backward()
    want = reference_grads(reference_model, select(reference_model, pattern, **select_kw), loss_fn)
    assert_same_calls(got, want)
    return got


class Block(nn.Module):
    """ResNet basic block: in-place ReLU module used twice, ``out += identity``."""

    def __init__(self, c: int, inplace: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.inplace = inplace

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.inplace:
            out += identity
        else:
            out = out + identity
        return self.relu(out)


def resnet(inplace: bool) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(inplace=inplace), Block(4, inplace), Block(4, inplace))


def out_of_place(model: nn.Module) -> nn.Module:
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if hasattr(m, "inplace"):
            m.inplace = False
    return ref


@pytest.mark.parametrize("input_grad", [True, False])
def test_mlp(mgr, input_grad):
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    x = torch.randn(5, 6, requires_grad=input_grad)
    got = check(mgr, model, copy.deepcopy(model), lambda m: m(x).pow(2).sum())
    assert (got["0"][0][0][0] is None) == (not input_grad)


def test_resnet_block_inplace_relu_and_residual(mgr):
    model = resnet(inplace=True)
    x = torch.randn(2, 3, 6, 6, requires_grad=True)
    got = check(mgr, model, out_of_place(model), lambda m: m(x).pow(2).sum())
    assert len(got["2.relu"]) == 2 and len(got["3.relu"]) == 2  # the shared ReLU fires per call


def test_resnet_input_without_grad(mgr):
    model = resnet(inplace=True)
    x = torch.randn(2, 3, 6, 6)
    check(mgr, model, out_of_place(model), lambda m: m(x).pow(2).sum())


def test_transformer_encoder_layer(mgr):
    layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    mask = torch.zeros(5, 5, dtype=torch.bool)
    mask[0, 4] = True
    check(mgr, layer, copy.deepcopy(layer), lambda m: m(x, src_mask=mask).pow(2).sum())


def test_lstm_tuple_of_tuple_output(mgr):
    lstm = nn.LSTM(4, 6, batch_first=True)
    x = torch.randn(2, 3, 4, requires_grad=True)
    h0 = (torch.randn(1, 2, 6, requires_grad=True), torch.randn(1, 2, 6))

    def loss(m):
        out, (h, c) = m(x, h0)
        return out.pow(2).sum() + h.sum()  # c unused: its grad_out is None

    got = check(mgr, lstm, copy.deepcopy(lstm), loss)
    (grad_in, grad_out), = got[""]
    assert [g is None for g in grad_in] == [False, False, True]  # x, h0, c0 (no grad)
    assert [g is None for g in grad_out] == [False, False, True]  # out, h, c (unused)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, a, b):
        return self.lin(a) * b + a


def test_two_inputs_one_frozen(mgr):
    m = TwoInputs()
    a = torch.randn(3, 4, requires_grad=True)
    b = torch.randn(3, 4)  # does not require grad
    got = check(mgr, m, copy.deepcopy(m), lambda mod: mod(a, b).sum(), pattern="")
    assert got[""][0][0][1] is None


def test_output_used_twice(mgr):
    m = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)

    def loss(mod):
        y = mod(x)
        return (y * y).sum() + y.sum()

    check(mgr, m, copy.deepcopy(m), loss)


def test_tensor_passed_twice(mgr):
    m = TwoInputs()
    x = torch.randn(3, 4, requires_grad=True)
    got = check(mgr, m, copy.deepcopy(m), lambda mod: mod(x, x).pow(2).sum(), pattern="")
    grad_a, grad_b = got[""][0][0]
    assert not torch.allclose(grad_a, grad_b)  # each position gets its own contribution


def test_residual_input_gets_own_contribution(mgr):
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    h = x * 2
    got, hook = recorder()
    mgr.register_backward_hook(hook, lin=lin)
    (lin(h) + h).pow(2).sum().backward()
    (grad_in,), (grad_out,) = got["lin"][0]
    torch.testing.assert_close(grad_in, grad_out @ lin.weight)  # not the total gradient of h


def test_module_called_three_times(mgr):
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    model = nn.Sequential(lin, lin, lin)
    check(mgr, model, copy.deepcopy(model), lambda m: m(x).pow(2).sum(), pattern="0")


def test_two_forwards_one_backward(mgr):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    x1, x2 = torch.randn(2, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    check(mgr, m, out_of_place(m), lambda mod: mod(x1).sum() + mod(x2).pow(2).sum())


def test_inplace_module_input_reused_by_caller(mgr):
    """The hooked in-place ReLU modifies the caller's tensor; the caller keeps using it."""

    class Caller(nn.Module):
        def __init__(self, inplace: bool) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.act = nn.ReLU(inplace=inplace)

        def forward(self, x):
            h = self.lin(x)
            y = self.act(h)
            # h IS y after the in-place ReLU; the out-of-place reference says so explicitly
            return y * 3 + (h if self.act.inplace else y) * 5

    m = Caller(True)
    x = torch.randn(3, 4, requires_grad=True)
    check(mgr, m, out_of_place(m), lambda mod: mod(x).pow(2).sum())


def test_inplace_after_hooked_module(mgr):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Dropout(0.0, inplace=True))
    x = torch.randn(3, 4, requires_grad=True)
    check(mgr, m, out_of_place(m), lambda mod: mod(x).pow(2).sum(), pattern="[02]")


@pytest.mark.parametrize("module", [nn.Identity(), nn.Dropout(0.5).eval(), nn.Dropout(0.5, inplace=True).eval()],
                         ids=["identity", "eval-dropout", "eval-dropout-inplace"])
def test_identity_like_modules(mgr, module):
    model = nn.Sequential(nn.Linear(4, 4), module, nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=True)

    def loss(m):
        h = m[0](x)
        return m[2](m[1](h)).pow(2).sum() + h.sum()  # the input also feeds a residual use

    check(mgr, model, out_of_place(model), loss)


class ViewAndValue(nn.Module):
    """Returns a view of its input and a value computed from it."""

    def forward(self, x):
        return x.view(-1), x.sin()


class Lambda(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


_VIEW_MODULES = {
    "identity": nn.Identity, "eval-dropout": lambda: nn.Dropout(0.5).eval(), "flatten": lambda: nn.Flatten(0),
    "unflatten": lambda: nn.Unflatten(1, (2, 2)), "transpose": lambda: Lambda(lambda x: x.t()),
    "slice": lambda: Lambda(lambda x: x[1:]), "view-and-value": ViewAndValue,
}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("make", list(_VIEW_MODULES.values()), ids=list(_VIEW_MODULES))
def test_modules_returning_a_view_of_their_input(mgr, make):
    """grad_in / grad_out of a call whose output is a view of its input (the input is also used
    elsewhere), against the independent reference."""
    model = nn.Sequential(nn.Linear(4, 4), make(), nn.Linear(4, 2))
    x = torch.randn(3, 4, requires_grad=True)

    def loss(m):
        h = m[0](x)
        out = m[1](h)
        extra = out[1].sum() * 3 if isinstance(out, tuple) else 0
        return (_first(out).reshape(-1, 4) * 2).pow(2).sum() + m[2](h).sum() + extra

    check(mgr, model, copy.deepcopy(model), loss)


@pytest.mark.parametrize("make", list(_VIEW_MODULES.values()), ids=list(_VIEW_MODULES))
def test_in_place_op_on_a_view_output_used_alone_keeps_gradients_exact(mgr, make):
    """An in-place op on the output of a module that returns a view of its input, with only the
    output used later (``x = dropout(x); x += residual`` in eval mode), keeps every gradient
    exact. (Later uses of the *input* after such an op are a documented limitation.)"""

    def run(model, hooked):
        fired = []
        if hooked:
            mgr.register_backward_hook(lambda m, gi, go: fired.append((gi, go)), mid=model[1])
        h = model[0](x)
        v = _first(model[1](h))
        v.mul_(3)
        model[2](v.reshape(-1, 4)).pow(2).sum().backward()
        return fired

    model = nn.Sequential(nn.Linear(4, 4), make(), nn.Linear(4, 4))
    plain = copy.deepcopy(model)
    x = torch.randn(3, 4)
    fired = run(model, hooked=True)
    run(plain, hooked=False)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=f"gradient of {name}")
    assert len(fired) == 1 and fired[0][0][0] is not None  # (grad_out may be None: see hooks.md)


def test_frozen_parameters(mgr):
    m = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    m[0].requires_grad_(False)
    x = torch.randn(3, 4, requires_grad=True)
    check(mgr, m, copy.deepcopy(m), lambda mod: mod(x).pow(2).sum())


def test_inplace_module_on_a_view_input(mgr):
    """A hooked in-place ReLU on a slice of a larger tensor that the caller keeps using."""
    a = torch.randn(4, 3, requires_grad=True)
    weights = torch.arange(3.0)
    relu = nn.ReLU(inplace=True)
    got, hook = recorder()
    mgr.register_backward_hook(hook, relu=relu)
    base = a * 1
    y = relu(base[1:])
    ((y * 2).sum() + (base * weights).sum()).backward()

    a2 = a.detach().requires_grad_()
    base2 = a2 * 1
    v = base2[1:].view_as(base2[1:])
    y2 = torch.relu(v)
    new_base = torch.cat([base2[:1], y2])  # what the in-place op makes of `base`
    loss = (y2 * 2).sum() + (new_base * weights).sum()
    grad_v, grad_y, grad_a = torch.autograd.grad(loss, [v, y2, a2])
    ((grad_in,), (grad_out,)), = got["relu"]
    torch.testing.assert_close(grad_in, grad_v)
    torch.testing.assert_close(grad_out, grad_y)
    torch.testing.assert_close(a.grad, grad_a)


class Double(nn.Module):
    """Doubles its input, in place when ``inplace`` (like ReLU(inplace=True), but never a no-op)."""

    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x):
        return x.mul_(2) if self.inplace else x * 2


def test_nested_modules_modifying_the_outer_input_in_place(mgr):
    """In-place ops of two inner modules modify the input of every enclosing hooked module."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Sequential(Double()), nn.ReLU(inplace=True)))
    x = torch.randn(3, 4)

    def loss(m):
        h = m[0](x)
        y = m[1](h)
        inplace = m[1][1].inplace  # with in-place ops, h IS y afterwards
        return (y * 3).sum() + ((y if not inplace else h) * torch.arange(4.0)).sum()

    got, hook = recorder()
    reference = out_of_place(model)
    mgr.register_backward_hook(hook, **select(model, "*"))
    loss(model).backward()
    assert_same_calls(got, reference_grads(reference, select(reference, "*"), loss))
    loss(reference).backward()
    torch.testing.assert_close(model[0].weight.grad, reference[0].weight.grad)


class KeepsReference(nn.Module):
    """Keeps a reference to a tensor that two in-place modules modify afterwards."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.times2 = Double()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.lin(x)
        keep = h  # the same tensor as y below, as without hooks
        y = self.relu(self.times2(h))
        return (y * 3).sum() + (keep * torch.arange(4.0)).sum()


@pytest.mark.parametrize("pattern", ["*", "times2", "relu"])
def test_caller_reference_sees_later_in_place_ops(mgr, pattern):
    model = KeepsReference()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4)
    mgr.register_backward_hook(lambda *a: None, **select(model, pattern))
    model(x).backward()
    reference(x).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
