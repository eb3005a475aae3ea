"""Forward and pre-hooks: arguments, replacement rules, order, errors."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from hookline.tracker import HookFunctionError, HooklineError, HookOutputError, Leaves


class Kw(nn.Module):
    def forward(self, x, y=None, *, mask, scale=1.0):
        return x * mask * scale + (0 if y is None else y)


def test_hook_arguments_are_leaves_with_paths(mgr):
    seen = {}
    m = Kw()
    mgr.register_forward_pre_hook(lambda mod, i: seen.update(pre=i), m=m)
    mgr.register_forward_hook(lambda mod, i, o: seen.update(fwd=(i, o)), m=m)
    x, mask = torch.ones(2), torch.zeros(2)
    m(x, None, mask=mask, scale=2.0)
    pre = seen["pre"]
    assert isinstance(pre, Leaves) and pre.paths == ("0", "mask") and pre.skipped == ("1", "scale")
    assert pre[0] is x and pre[1] is mask
    inputs, outputs = seen["fwd"]
    assert inputs.paths == ("0", "mask") and outputs.paths == ("0",)


def test_pre_hook_replaces_positional_and_keyword_inputs(mgr):
    m = Kw()
    mgr.register_forward_pre_hook(lambda mod, i: (i[0] * 10, torch.ones(2)), m=m)
    out = m(torch.ones(2), mask=torch.zeros(2), scale=3.0)
    torch.testing.assert_close(out, torch.full((2,), 30.0))


def test_forward_hook_replacement_tuple_tensor_none(mgr):
    lin = nn.Linear(2, 2)
    x = torch.randn(1, 2)
    plain = lin(x)
    hf = mgr.register_forward_hook(lambda mod, i, o: o[0] * 2, lin=lin)  # bare tensor, one leaf
    torch.testing.assert_close(lin(x), plain * 2)
    hf.module_to_handle[lin].remove()
    mgr.register_forward_hook(lambda mod, i, o: (o[0] + 1,), lin=lin)  # tuple
    mgr.register_forward_hook(lambda mod, i, o: None, lin=lin)  # keep
    torch.testing.assert_close(lin(x), plain + 1)


def test_returning_the_same_leaves_keeps_the_output_object(mgr):
    out_obj = {"a": torch.ones(2), "b": [torch.zeros(2), "text"]}
    m = ConstOut(out_obj)
    mgr.register_forward_hook(lambda mod, i, o: o, m=m)
    assert m(torch.ones(1)) is out_obj


class ConstOut(nn.Module):
    def __init__(self, out):
        super().__init__()
        self.out = out

    def forward(self, x):
        return self.out


NT = namedtuple("NT", "logits hidden")


@dataclasses.dataclass
class DC:
    last_hidden_state: torch.Tensor
    attention: torch.Tensor | None = None
    note: str = "x"


@pytest.mark.parametrize("out", [
    {"a": torch.ones(2), "n": None, "b": [torch.zeros(2), 5]},
    OrderedDict(a=torch.ones(2), b=torch.zeros(2)),
    NT(torch.ones(2), (torch.zeros(2), torch.ones(2))),
    DC(torch.ones(2)),
    [torch.ones(2), (torch.zeros(2),)],
], ids=["dict", "ordereddict", "namedtuple", "dataclass", "list"])
def test_replacement_is_unflattened_into_the_original_structure(mgr, out):
    m = ConstOut(out)
    mgr.register_forward_hook(lambda mod, i, o: tuple(t + 100 for t in o), m=m)
    new = m(torch.ones(1))
    assert type(new) is type(out)
    from hookline.tracker.hooks.pytree import flatten

    old_leaves, new_leaves = flatten(out)[0], flatten(new)[0]
    assert new_leaves.paths == old_leaves.paths and new_leaves.skipped == old_leaves.skipped
    for a, b in zip(old_leaves, new_leaves):
        torch.testing.assert_close(b, a + 100)
    assert flatten(out)[0][0].max() <= 1  # the original object was not modified


def test_hooks_fire_in_registration_order_each_seeing_the_previous_replacement(mgr):
    lin = nn.Identity()
    order = []

    def make(tag, factor):
        def hook(mod, i, o):
            order.append((tag, o[0].item()))
            return o[0] * factor
        return hook

    first = mgr.register_forward_hook(make("first", 2), hook_fn_name="first", m=lin)
    mgr.register_forward_hook(make("second", 3), hook_fn_name="second", m=lin)
    assert lin(torch.tensor(1.0)).item() == 6
    assert order == [("first", 1.0), ("second", 2.0)]
    first.module_to_handle[lin].deactivate()
    first.module_to_handle[lin].activate()  # order is registration order, not activation order
    order.clear()
    lin(torch.tensor(1.0))
    assert [t for t, _ in order] == ["first", "second"]


def test_wrong_length_or_type_raises_hook_output_error(mgr):
    lin = nn.Linear(2, 2)
    mgr.register_forward_hook(lambda mod, i, o: (o[0], o[0]), hook_fn_name="two", lin=lin)
    with pytest.raises(HookOutputError) as e:
        lin(torch.ones(1, 2))
    assert isinstance(e.value, ValueError) and isinstance(e.value, HooklineError)
    assert "'two[lin]'" in str(e.value) and "2 outputs" in str(e.value)
    assert "has 1" in str(e.value)
    mgr.remove_all_hooks()
    mgr.register_forward_pre_hook(lambda mod, i: {"x": i[0]}, hook_fn_name="dict", lin=lin)
    with pytest.raises(HookOutputError, match=r"'dict\[lin\]' returned a dict"):
        lin(torch.ones(1, 2))
    mgr.remove_all_hooks()
    mgr.register_forward_hook(lambda mod, i, o: (None,), hook_fn_name="none", lin=lin)
    with pytest.raises(HookOutputError, match=r"'none\[lin\]' returned a NoneType for output '0'"):
        lin(torch.ones(1, 2))


def test_hook_exception_is_wrapped_with_handle_id(mgr):
    lin = nn.Linear(2, 2)

    def bad(mod, i, o):
        raise TypeError("no good")

    mgr.register_forward_hook(bad, hook_fn_name="bad", lin=lin)
    with pytest.raises(HookFunctionError) as e:
        lin(torch.ones(1, 2))
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, HooklineError)
    assert "'bad[lin]'" in str(e.value) and "TypeError: no good" in str(e.value)
    assert isinstance(e.value.__cause__, TypeError)


def test_forward_that_raises_leaves_no_pending_state(mgr):
    class Fails(nn.Module):
        def forward(self, x):
            raise KeyError("inside")

    m = Fails()
    mgr.register_backward_hook(lambda *a: None, m=m)
    with pytest.raises(KeyError, match="inside"):
        m(torch.ones(2, requires_grad=True))
    assert mgr._slots[m]._pending == []


def test_forward_that_raises_does_not_call_forward_hooks(mgr):
    class Fails(nn.Module):
        def forward(self, x):
            raise KeyError("inside")

    m = Fails()
    calls = []
    mgr.register_forward_hook(lambda mod, i, o: calls.append(o), m=m)
    try:
        raise ValueError("the caller's own")
    except ValueError:
        with pytest.raises(KeyError, match="inside"):
            m(torch.ones(2))
    assert calls == []


def test_module_returning_none_inside_an_except_block_gets_its_hooks(mgr):
    """The caller handling an exception of its own is not the module's forward raising (the
    hooks were skipped before)."""

    class Logs(nn.Module):
        def forward(self, x):
            return None

    m = Logs()
    calls = []
    mgr.register_forward_hook(lambda mod, i, o: calls.append(len(o)), m=m)
    mgr.register_backward_hook(lambda *a: None, m=m)
    try:
        raise KeyError("unrelated")
    except KeyError:
        m(torch.randn(2, requires_grad=True))
    assert calls == [0]
    assert mgr._slots[m]._pending == []


def test_backward_sees_replaced_inputs_and_outputs(mgr):
    lin = nn.Linear(2, 2)
    got = []
    mgr.register_forward_pre_hook(lambda mod, i: i[0] * 3, lin=lin)
    mgr.register_forward_hook(lambda mod, i, o: o[0] * 2, lin=lin)
    mgr.register_backward_hook(lambda mod, gi, go: got.append((gi[0], go[0])), lin=lin)
    x = torch.randn(4, 2, requires_grad=True)
    lin(x).sum().backward()
    (grad_in, grad_out), = got
    torch.testing.assert_close(grad_out, torch.ones(4, 2))  # gradient of the replaced output
    torch.testing.assert_close(grad_in, 2 * torch.ones(4, 2) @ lin.weight)  # w.r.t. the replaced input
    torch.testing.assert_close(x.grad, 3 * grad_in)
