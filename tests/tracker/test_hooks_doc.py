"""docs/hooks.md holds: its quick-start example runs as written, and the behaviours the page
states that no other test pins (what ``grad_out`` counts, which tensors forward hooks receive)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from hookline.tracker import HookManager, passive

DOC = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def test_quick_start_runs(capsys):
    block = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S).group(1)
    exec(compile(block, str(DOC), "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["0", "2", "2", "1", "0", "0", "2"]
    assert all("('0',)" in line for line in lines[2:5])


# --- grad_out of a tensor the module both uses and returns -------------------------------------

class UsesAndReturns(nn.Module):
    """Eager attention in miniature: returns the probabilities it also multiplies by ``v``."""

    def __init__(self, v: torch.Tensor, view: bool = False) -> None:
        super().__init__()
        self.v, self.view = v, view

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        p = x.softmax(-1)
        return p @ self.v, (p.view(p.shape) if self.view else p)


def _grads(register, module: nn.Module, caller_uses_p: bool, w: torch.Tensor) -> tuple:
    """(grad_in, grad_out) the hook got, and the input's true gradient."""
    got = {}
    x = torch.randn(4, 5, requires_grad=True)
    handle = register(module, lambda m, gi, go: got.update(gi=tuple(gi), go=tuple(go)))
    try:
        out, p = module(x)
        loss = out.sum() + ((p * w).sum() if caller_uses_p else 0)
        loss.backward()
    finally:
        handle.remove()
    return got["gi"], got["go"], x.grad


def _torch_hook(module, fn):
    return module.register_full_backward_hook(fn)


def _hookline_hook(module, fn):
    mgr = HookManager()
    hf = mgr.register_backward_hook(fn, m=module)
    return hf.module_to_handle[module]


@pytest.mark.parametrize("caller_uses_p", [False, True])
def test_grad_out_counts_the_modules_own_use_of_a_returned_tensor(caller_uses_p):
    v, w = torch.randn(5, 3), torch.randn(4, 5)
    module = UsesAndReturns(v)
    internal = torch.ones(4, 3) @ v.T  # gradient reaching p through p @ v (loss: out.sum())
    external = w if caller_uses_p else None

    gi, go, x_grad = _grads(_hookline_hook, module, caller_uses_p, w)
    torch.testing.assert_close(go[1], internal + (external if caller_uses_p else 0))
    torch.testing.assert_close(gi[0], x_grad)

    gi_t, go_t, x_grad_t = _grads(_torch_hook, module, caller_uses_p, w)
    if caller_uses_p:
        torch.testing.assert_close(go_t[1], external)  # the caller's use only
    else:
        assert go_t[1] is None
    torch.testing.assert_close(gi_t[0], x_grad_t)  # grad_in means the same in both


def test_grad_out_of_a_returned_view_counts_only_the_views_uses():
    v = torch.randn(5, 3)
    module = UsesAndReturns(v, view=True)
    _, go, _ = _grads(_hookline_hook, module, False, torch.randn(4, 5))
    _, go_t, _ = _grads(_torch_hook, module, False, torch.randn(4, 5))
    assert go[1] is None and go_t[1] is None


# --- which tensors forward hooks receive --------------------------------------------------------

def _seen(mgr: HookManager, module: nn.Module, x: torch.Tensor, *, passive_hook: bool = True,
          backward: bool = True) -> tuple[dict, torch.Tensor]:
    seen: dict = {}

    def fwd(m, inputs, outputs):
        seen["in"], seen["out"] = inputs[0], outputs[0]

    mgr.register_forward_pre_hook(lambda m, inputs: seen.update(pre=inputs[0]), m=module)
    mgr.register_forward_hook(passive(fwd) if passive_hook else fwd, m=module)
    if backward:
        mgr.register_backward_hook(lambda m, gi, go: None, m=module)
    return seen, module(x)


def test_single_op_call_hands_forward_hooks_the_callers_tensor(mgr):
    x = torch.randn(3, 8, requires_grad=True) * 1.0  # non-leaf, 2-d: Linear's single-op path
    seen, y = _seen(mgr, nn.Linear(8, 8), x)
    assert seen["pre"] is x and seen["in"] is x and seen["out"] is y


@pytest.mark.parametrize("case", ["unmarked forward hook", "leaf input", "3-d input", "no single-op class"])
def test_identity_node_call_hands_forward_hooks_an_alias(mgr, case):
    module = nn.Softmax(-1) if case == "no single-op class" else nn.Linear(8, 8)
    x = torch.randn(2, 3, 8, requires_grad=True) if case == "3-d input" else torch.randn(3, 8, requires_grad=True)
    if case != "leaf input":
        x = x * 1.0
    seen, y = _seen(mgr, module, x, passive_hook=case != "unmarked forward hook")
    alias = seen["in"]
    assert seen["pre"] is x  # the manager's pre-hooks run before the input is wrapped
    assert alias is not x and alias.data_ptr() == x.data_ptr() and alias._base is None
    assert alias.grad_fn is not None and alias.grad_fn is not x.grad_fn
    version = x._version
    with torch.no_grad():
        alias.add_(0)
    assert x._version == version + 1  # one version counter
    assert seen["out"] is y


@pytest.mark.parametrize("case", ["no backward hook", "input without grad", "no_grad"])
def test_forward_hooks_get_the_callers_tensor_without_backward_machinery(mgr, case):
    x = torch.randn(3, 8) if case == "input without grad" else torch.randn(3, 8, requires_grad=True)
    with torch.set_grad_enabled(case != "no_grad"):
        seen, _ = _seen(mgr, nn.Softmax(-1), x, backward=case != "no backward hook")
    assert seen["in"] is x


def test_in_place_module_hands_forward_hooks_the_alias_and_the_caller_its_own_tensor(mgr):
    x = torch.randn(3, 8, requires_grad=True) * 1.0
    seen, y = _seen(mgr, nn.ReLU(inplace=True), x)
    assert seen["in"] is not x and seen["out"] is seen["in"]  # the module returned the alias
    assert y is x  # re-based onto the module's in-place result
