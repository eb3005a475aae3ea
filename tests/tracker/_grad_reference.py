"""Independent gradient references for backward-hook tests.

The reference runs a *plain* model (no hookline hooks; in-place ops replaced by out-of-place
ones, which leaves every gradient value unchanged) with torch's own forward pre-hooks that feed
each module call a fresh ``view_as`` of every grad-requiring input, and forward hooks that keep
the output tensors. ``torch.autograd.grad(loss, those tensors)`` then gives, per call, the
gradient flowing through that call into each input (its own contribution) and the gradient of
each output, with ``None`` where no gradient exists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hookline.tracker.hooks.pytree import flatten, flatten_call, unflatten_call

Grads = tuple[tuple, tuple]  # (grad_in, grad_out) of one call


def reference_grads(
    model: nn.Module, modules: dict[str, nn.Module], loss_fn: Callable[[nn.Module], torch.Tensor]
) -> dict[str, list[Grads]]:
    """Per module name, ``(grad_in, grad_out)`` for each call, in forward order."""
    calls: list[tuple[str, list, list]] = []  # name, input slots, output tensors
    stack: list[list] = []
    handles = []
    for name, module in modules.items():
        def pre(mod, args, kwargs, name=name):
            leaves, spec = flatten_call(args, kwargs)
            new = [t.view_as(t) if t.requires_grad else t for t in leaves]
            stack.append([(t if t.requires_grad else None) for t in new])
            return unflatten_call(spec, new)

        def post(mod, args, kwargs, output, name=name):
            outs = [t if t.requires_grad else None for t in flatten(output)[0]]
            calls.append((name, stack.pop(), outs))

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    try:
        loss = loss_fn(model)
    finally:
        for h in handles:
            h.remove()
    wanted = [t for _, ins, outs in calls for t in ins + outs if t is not None]
    grads = iter(torch.autograd.grad(loss, wanted, allow_unused=True))
    result: dict[str, list[Grads]] = {name: [] for name in modules}
    for name, ins, outs in calls:
        gi = tuple(None if t is None else next(grads) for t in ins)
        go = tuple(None if t is None else next(grads) for t in outs)
        result[name].append((gi, go))
    return result


def same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def assert_same_calls(got: dict[str, list[Grads]], want: dict[str, list[Grads]]) -> None:
    """Every module fired once per reference call, each firing equal to a distinct call."""
    for name, ref_calls in want.items():
        fired = got.get(name, [])
        assert len(fired) == len(ref_calls), f"{name!r}: fired {len(fired)} times, {len(ref_calls)} calls"
        unmatched = list(ref_calls)
        for gi, go in fired:
            for i, (rgi, rgo) in enumerate(unmatched):
                if len(gi) == len(rgi) and len(go) == len(rgo) and all(map(same, gi, rgi)) and all(map(same, go, rgo)):
                    del unmatched[i]
                    break
            else:
                raise AssertionError(
                    f"{name!r}: a firing matches no reference call:\n"
                    f" grad_in={[None if g is None else g.flatten()[:4] for g in gi]}\n"
                    f" grad_out={[None if g is None else g.flatten()[:4] for g in go]}\n reference="
                    + "\n  ".join(f"{[None if g is None else g.flatten()[:4] for g in r[0]]} / "
                                  f"{[None if g is None else g.flatten()[:4] for g in r[1]]}" for r in unmatched)
                )


def recorder() -> tuple[dict[str, list[Grads]], Callable]:
    """A backward hook that records ``(grad_in, grad_out)`` per ``module.name``."""
    got: dict[str, list[Grads]] = {}

    def hook(module, grad_in, grad_out):
        got.setdefault(module.name, []).append((tuple(grad_in), tuple(grad_out)))

    return got, hook
