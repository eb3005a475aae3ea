"""Firing order and counts on a nested model, like torch's test/nn/test_module_hooks.py."""

from __future__ import annotations

import torch
from torch import nn

from hookline.tracker import select


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq1 = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.seq2 = nn.Sequential(nn.Linear(4, 4))

    def forward(self, x):
        return self.seq2(self.seq1(x))


class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = Net()
        self.net2 = Net()

    def forward(self, x):
        return self.net2(self.net1(x))


NAMES = list(select(ToyModel()))


def expected_forward():
    """Pre-hooks on the way down, forward hooks on the way up (depth first)."""
    events = []

    def visit(prefix, children):
        events.append(("pre", prefix))
        for child, grandchildren in children:
            visit(child, grandchildren)
        events.append(("fwd", prefix))

    def net(p):
        return [(f"{p}.seq1", [(f"{p}.seq1.0", []), (f"{p}.seq1.1", [])]), (f"{p}.seq2", [(f"{p}.seq2.0", [])])]

    visit("", [("net1", net("net1")), ("net2", net("net2"))])
    return events


def test_forward_and_backward_order(mgr):
    model = ToyModel()
    events = []
    modules = select(model)
    mgr.register_forward_pre_hook(lambda m, i: events.append(("pre", m.name)), **modules)
    mgr.register_forward_hook(lambda m, i, o: events.append(("fwd", m.name)), **modules)
    mgr.register_backward_hook(lambda m, gi, go: events.append(("bwd", m.name)), **modules)
    x = torch.randn(2, 4, requires_grad=True)
    out = model(x)
    assert events == expected_forward()
    events.clear()
    out.sum().backward()
    pre_order = [n for kind, n in expected_forward() if kind == "pre"]
    assert events == [("bwd", n) for n in reversed(pre_order)]


def test_backward_order_matches_torch_full_backward_hooks(mgr):
    model = ToyModel()
    x = torch.randn(2, 4, requires_grad=True)
    torch_order = []
    handles = [m.register_full_backward_hook(lambda mod, gi, go, n=n: torch_order.append(n))
               for n, m in model.named_modules()]
    model(x).sum().backward()
    for h in handles:
        h.remove()
    ours = []
    mgr.register_backward_hook(lambda m, gi, go: ours.append(m.name), **select(model))
    model(x).sum().backward()
    assert ours == torch_order


def test_counts_with_two_forwards_and_disabled_hooks(mgr):
    model = ToyModel()
    counts = {n: 0 for n in NAMES}

    def count(m, gi, go):
        counts[m.name] += 1

    mgr.register_backward_hook(count, **select(model))
    fwd_counts = {n: 0 for n in NAMES}
    hf = mgr.register_forward_hook(lambda m, i, o: fwd_counts.__setitem__(m.name, fwd_counts[m.name] + 1),
                                   hook_fn_name="fwd_count", **select(model))
    x = torch.randn(2, 4, requires_grad=True)
    (model(x) + model(x)).sum().backward()
    assert set(counts.values()) == {2} and set(fwd_counts.values()) == {2}
    mgr.deactivate_all_hooks(hook_types=[hf])
    model(x).sum().backward()
    assert set(counts.values()) == {3} and set(fwd_counts.values()) == {2}
    mgr.deactivate_module_hooks(model.net1)
    model(x).sum().backward()
    assert counts["net1"] == 3 and counts["net2"] == 4
