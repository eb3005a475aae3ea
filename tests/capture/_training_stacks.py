"""Shared by the training-stack tests: small models, a plain-torch reference recording, and the
recorder's records in the same shape.

The reference never uses hookline: ``register_forward_hook`` storing clones of the outputs and
``register_full_backward_hook`` storing clones of ``grad_input[0]`` / ``grad_output[0]``, on a
twin model trained in plain eager mode with the same data.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from hookline.storage import open_run
from hookline.tracker import HookManager, Recorder

#: (handle id, field) -> list of (step, call, array)
Records = dict[tuple[str, str], list[tuple[int, int, np.ndarray]]]


class MLP(nn.Module):
    """Three Linear layers with a GELU and a residual add (ops Inductor fuses)."""

    def __init__(self, d: int = 8, h: int = 16) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(d, h), nn.Linear(h, h), nn.Linear(h, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.l1(x))
        h = h + torch.tanh(self.l2(h))
        return self.l3(h)


def batches(n: int, d: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, d, generator=g), torch.randn(6, 4, generator=g)) for _ in range(n)]


def train(model: nn.Module, data: list, step_ctx: Callable[[int], Any], *, sampled: Callable[[int], bool] = lambda s: True,
          backward: Callable[[torch.Tensor, int], None] | None = None, opt: torch.optim.Optimizer | None = None,
          params: nn.Module | None = None) -> None:
    """Train ``model`` one SGD step per batch; ``step_ctx(step)`` wraps forward and backward."""
    opt = opt or torch.optim.SGD((params or model).parameters(), lr=0.05)
    for step, (x, y) in enumerate(data):
        with step_ctx(step):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            if backward is None:
                loss.backward()
            else:
                backward(loss, step)
        opt.step()


def reference(model: nn.Module, names: list[str], data: list, *, every: int = 1, grads: bool = True,
              steps: set[int] | None = None) -> Records:
    """Records of the named modules made with plain torch hooks while ``model`` trains eagerly.

    Handle ids are the recorder's defaults (``outputs[<name>]``, ``grads[<name>]``).
    """
    out: Records = defaultdict(list)
    state = {"step": 0, "calls": defaultdict(int)}
    by_name = dict(model.named_modules())

    def note(hid: str, field: str, t: torch.Tensor | None) -> None:
        if t is None or (state["step"] % every if steps is None else state["step"] not in steps):
            return
        out[(hid, field)].append((state["step"], state["calls"][(hid, field)], t.detach().clone().numpy()))
        state["calls"][(hid, field)] += 1

    handles = []
    for n in names:
        handles.append(by_name[n].register_forward_hook(lambda m, i, o, n=n: note(f"outputs[{n}]", "outputs.0", o)))
        if grads:
            def grad_hook(m: nn.Module, gi: tuple, go: tuple, n: str = n) -> None:
                note(f"grads[{n}]", "grad_out.0", go[0])
                note(f"grads[{n}]", "grad_in.0", gi[0])

            handles.append(by_name[n].register_full_backward_hook(grad_hook))

    class Step:
        def __init__(self, s: int) -> None:
            state["step"], state["calls"] = s, defaultdict(int)

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: Any) -> None:
            return None

    train(model, data, Step)
    for h in handles:
        h.remove()
    return dict(out)


def recorded(run_dir: Path) -> Records:
    """Every record of a run as ``(handle id, field) -> [(step, call, array)]``."""
    run = open_run(run_dir)
    out: Records = {}
    for hid in run.handles:
        h = run[hid]
        for f in h.fields:
            field = h[f]
            out[(hid, f)] = [(int(s), int(c), np.asarray(field[i])) for i, (s, c) in enumerate(zip(field.steps, field.calls))]
    return out


def record_run(run_dir: Path, model: nn.Module, names: list[str], data: list, *, every: int = 1, grads: bool = True,
               run_model: nn.Module | None = None, **rec_kw: Any) -> Records:
    """Record ``names`` of ``model`` (outputs, and grads) while ``run_model`` (default: ``model``,
    e.g. its compiled wrapper) trains; returns the records."""
    mgr = HookManager()
    with Recorder(run_dir, every=every, **rec_kw) as rec:
        targets = mods(model, names)
        mgr.register_forward_hook(rec.outputs, **targets)
        if grads:
            mgr.register_backward_hook(rec.grads, **targets)
        train(model if run_model is None else run_model, data, rec.step, params=model)
    return recorded(run_dir)


def assert_same_records(got: Records, want: Records, *, rtol: float = 0.0, atol: float = 0.0) -> None:
    """Same keys, steps, calls and dtypes; values equal (bit-exact by default)."""
    assert sorted(got) == sorted(want)
    for key in want:
        g, w = got[key], want[key]
        assert [(s, c) for s, c, _ in g] == [(s, c) for s, c, _ in w], key
        for (s, c, a), (_, _, b) in zip(g, w):
            assert a.dtype == b.dtype, (key, s, c)
            np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=f"{key} step {s} call {c}")


def mods(model: nn.Module, names: list[str]) -> dict[str, nn.Module]:
    return {n: model.get_submodule(n) for n in names}


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
