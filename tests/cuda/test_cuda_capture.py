"""Capture on a CUDA model (marked ``cuda``; skipped with a reason where no GPU is visible).

What runs only on a GPU: the packer's pinned host blocks, ``non_blocking`` copies and events, a
GradScaler whose scale lives on the device, and an Inductor-compiled CUDA model. Every test runs
its training step under ``torch.cuda.set_sync_debug_mode("error")``, so a device
synchronisation inside any hook (an ``.item()``, a blocking copy) raises. References are plain
torch hooks copying to the CPU (``.cpu()``, a blocking copy made outside the sync check's reach:
the reference hooks switch the mode off while they copy), on the same model in the same run.

``HOOKLINE_CUDA_TESTS_DEVICE=cpu`` runs the same tests on the CPU (a dry run of their logic on a
machine without a GPU; the sync check is then a no-op).
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import defaultdict

import numpy as np
import pytest
import torch
from torch import nn

from hookline.storage import open_run
from hookline.tracker import HookManager, Recorder

DEVICE = os.environ.get("HOOKLINE_CUDA_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                       reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]
NAMES = ("l1", "l2", "l3")


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.l1(x))
        return self.l3(h + torch.tanh(self.l2(h)))


@contextlib.contextmanager
def no_sync():
    """Any device synchronisation inside raises (CUDA's sync debug mode)."""
    if DEVICE != "cuda":
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _to_cpu(t: torch.Tensor) -> np.ndarray:
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("default")  # the reference's own blocking copy
    try:
        return t.detach().float().cpu().numpy()
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")


def _plain_hooks(model: nn.Module, ref: dict, step: list[int]) -> list:
    handles = []
    for n in NAMES:
        m = model.get_submodule(n)
        handles.append(m.register_forward_hook(
            lambda m, i, o, n=n: ref[(f"outputs[{n}]", "outputs.0")].append((step[0], _to_cpu(o), o.dtype))))

        def grad_hook(m, gi, go, n=n):
            ref[(f"grads[{n}]", "grad_out.0")].append((step[0], _to_cpu(go[0]), go[0].dtype))

        handles.append(m.register_full_backward_hook(grad_hook))
    return handles


def _train(tmp_path, model, *, steps=3, autocast=None, scaler=None, grad_scaler=None, compiled=None, poison=None):
    """Record outputs and grads of NAMES, with plain-hook references of the same run."""
    torch.manual_seed(1)
    data = [(torch.randn(16, 32, device=DEVICE), torch.randn(16, 8, device=DEVICE)) for _ in range(steps)]
    ref: dict = defaultdict(list)
    step = [0]
    handles = _plain_hooks(model, ref, step)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mgr = HookManager()
    run = model if compiled is None else compiled
    scales = []  # the scale each step's backward runs with (read before the step: it syncs)
    with Recorder(tmp_path / "run", grad_scaler=grad_scaler) as rec:
        targets = {n: model.get_submodule(n) for n in NAMES}
        mgr.register_forward_hook(rec.outputs, **targets)
        mgr.register_backward_hook(rec.grads, **targets)
        for s, (x, y) in enumerate(data):
            step[0] = s
            if s == poison:
                x = x * float("inf")
            scales.append(scaler.get_scale() if scaler else 1.0)
            with rec.step(s), no_sync():
                with torch.autocast(DEVICE, dtype=autocast) if autocast else contextlib.nullcontext():
                    out = run(x)
                loss = torch.nn.functional.mse_loss(out.float(), y)
                opt.zero_grad()
                (scaler.scale(loss) if scaler else loss).backward()
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
    for h in handles:
        h.remove()
    return open_run(tmp_path / "run"), ref, scales


def _check(run, ref) -> None:
    for (hid, field), want in ref.items():
        f = run[hid][field]
        assert list(f.steps) == [s for s, _, _ in want], hid
        for i, (_, arr, dtype) in enumerate(want):
            assert f.torch_dtype_name == str(dtype).removeprefix("torch."), hid
            np.testing.assert_array_equal(f[i].astype(np.float32), arr, err_msg=hid)


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP().to(DEVICE)


def test_fp32_capture_equals_a_cpu_copy(tmp_path):
    run, ref, scales = _train(tmp_path, _model())
    _check(run, ref)


def test_bf16_autocast_keeps_dtype_and_bits(tmp_path):
    run, ref, scales = _train(tmp_path, _model(), autocast=torch.bfloat16)
    assert run["outputs[l2]"]["outputs.0"].torch_dtype_name == "bfloat16"
    _check(run, ref)


def test_grad_scaler_on_the_device_unscales_without_sync(tmp_path):
    """Scale 2**10 (2**9 after the poisoned step): the recorded gradients are the scaled ones a
    plain hook saw divided by the scale (exact: powers of two); the poisoned step is listed."""
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**10)
    run, ref, scales = _train(tmp_path, _model(), steps=4, scaler=scaler, grad_scaler=scaler, poison=2)
    assert run.meta["found_inf_steps"] == [2]
    grads = {k: v for k, v in ref.items() if k[0].startswith("grads")}
    clean = {k: [r for r in v if r[0] != 2] for k, v in grads.items()}
    for (hid, field), want in clean.items():
        f = run[hid][field]
        assert f.torch_dtype_name == "float32"
        got = {int(s): f[i] for i, s in enumerate(f.steps)}
        for s, arr, _ in want:
            np.testing.assert_array_equal(got[s], arr / scales[s], err_msg=f"{hid} step {s}")
    assert scales[:4] == [2.0**10, 2.0**10, 2.0**10, 2.0**9]


@pytest.mark.slow
def test_compiled_model_records_what_its_eager_twin_records(tmp_path):
    torch._dynamo.reset()
    model = _model()
    twin = copy.deepcopy(model)
    _, eager_ref, _ = _train(tmp_path / "eager", twin)
    run, _, _ = _train(tmp_path / "compiled", model, compiled=torch.compile(model, backend="inductor"))
    for (hid, field), want in eager_ref.items():
        f = run[hid][field]
        assert list(f.steps) == [s for s, _, _ in want]
        for i, (_, arr, _) in enumerate(want):
            np.testing.assert_allclose(f[i], arr, rtol=1e-5, atol=1e-5, err_msg=hid)
    torch._dynamo.reset()
