"""Mixed precision: autocast records keep their dtype bit-exactly; under a GradScaler the recorded
gradients are the unscaled ones, and the steps whose scaler found inf/NaN are listed.

References: plain torch hooks (clones) in the same or in an unscaled run; never hookline code.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from torch import nn

from hookline.cli.main import cli
from hookline.storage import open_run
from hookline.tracker import HookManager, HookTypeError, Recorder

from _training_stacks import MLP, assert_same_records, batches, mods, recorded, twin

NAMES = ["l1", "l2", "l3"]


def _model() -> MLP:
    torch.manual_seed(0)
    return MLP()


def _scaled_run(run_dir, model, data, scaler, *, grad_scaler=None, poison: int | None = None, every: int = 1):
    """Train with ``scaler`` (the usual AMP loop); grads recorded in tensor and stats mode."""
    mgr = HookManager()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with Recorder(run_dir, grad_scaler=grad_scaler, every=every) as rec:
        mgr.register_forward_hook(rec.outputs, **mods(model, NAMES))
        mgr.register_backward_hook(rec.grads, **mods(model, NAMES))
        mgr.register_backward_hook(rec.hook("grads", mode="stats"), **mods(model, ["l2"]))
        for step, (x, y) in enumerate(data):
            if step == poison:
                x = x * math.inf  # inf/NaN gradients on this step: the scaler skips it
            with rec.step(step):
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return recorded(run_dir)


def test_grad_scaler_run_records_what_an_unscaled_run_records(tmp_path):
    """Scale 2**10 (a power of two: unscaling is exact): every record, tensors and stats, equals
    the run without a scaler bit for bit."""
    model, data = _model(), batches(4)
    plain = _scaled_run(tmp_path / "plain", twin(model), data, torch.amp.GradScaler("cpu", enabled=False))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    got = _scaled_run(tmp_path / "scaled", model, data, scaler, grad_scaler=scaler)
    assert_same_records(got, plain)
    assert open_run(tmp_path / "scaled").meta["found_inf_steps"] == []
    # without grad_scaler= the records are the scaled gradients: the comparison above can fail
    scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    raw = _scaled_run(tmp_path / "raw", twin(_model()), data, scaler2)
    g = raw[("grads[l3]", "grad_out.0")][0][2]
    np.testing.assert_array_equal(g, plain[("grads[l3]", "grad_out.0")][0][2] * 2.0**10)


def test_scaler_step_with_inf_is_recorded_and_listed(tmp_path):
    model, data = _model(), batches(4)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    got = _scaled_run(tmp_path / "run", model, data, scaler, grad_scaler=scaler, poison=2)
    grads = {s: a for s, _, a in got[("grads[l3]", "grad_out.0")]}
    assert sorted(grads) == [0, 1, 2, 3]  # the inf step is recorded, not dropped
    assert not np.isfinite(grads[2]).all() and np.isfinite(grads[3]).all()
    run = open_run(tmp_path / "run")
    assert run.meta["found_inf_steps"] == [2]
    res = CliRunner().invoke(cli, ["show", str(tmp_path / "run")], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "found inf/NaN at steps [2]" in res.output


def test_inf_on_a_step_that_is_not_sampled_is_listed_too(tmp_path):
    model, data = _model(), batches(5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    got = _scaled_run(tmp_path / "run", model, data, scaler, grad_scaler=scaler, poison=3, every=2)
    assert [s for s, _, _ in got[("grads[l3]", "grad_out.0")]] == [0, 2, 4]
    assert open_run(tmp_path / "run").meta["found_inf_steps"] == [3]


def test_half_gradients_are_unscaled_in_float32(tmp_path):
    """fp16 gradients (autocast) are stored as float32, divided by the scale: exactly the
    scaled gradient a plain torch hook saw, times the inverse scale."""
    model, (x, y) = _model(), batches(1)[0]
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    seen = []
    model.l2.register_full_backward_hook(lambda m, gi, go: seen.append(go[0].clone()))
    mgr = HookManager()
    with Recorder(tmp_path / "run", grad_scaler=scaler) as rec:
        mgr.register_backward_hook(rec.grads, l2=model.l2)
        with rec.step(0):
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
            loss = torch.nn.functional.mse_loss(out.float(), y)
            scaler.scale(loss).backward()
    (scaled,) = seen
    assert scaled.dtype == torch.float16
    field = open_run(tmp_path / "run")["grads[l2]"]["grad_out.0"]
    assert field.torch_dtype_name == "float32"
    np.testing.assert_array_equal(field[0], (scaled.float() * 2.0**-16).numpy())


def test_grad_scaler_must_be_a_grad_scaler(tmp_path):
    with pytest.raises(HookTypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        Recorder(tmp_path / "run", grad_scaler=2.0**16)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_records_keep_their_dtype_bit_exactly(tmp_path, dtype):
    """Outputs and gradients under CPU autocast: the autocast dtype, the bits plain hooks saw."""
    model, (x, y) = _model(), batches(1)[0]
    seen: dict[str, torch.Tensor] = {}
    model.l2.register_forward_hook(lambda m, i, o: seen.update({"outputs.0": o.detach().clone()}))
    model.l2.register_full_backward_hook(lambda m, gi, go: seen.update({"grad_out.0": go[0].clone()}))
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, l2=model.l2)
        mgr.register_backward_hook(rec.grads, l2=model.l2)
        with rec.step(0):
            with torch.autocast("cpu", dtype=dtype):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)
            loss.backward()
    run = open_run(tmp_path / "run")
    name = str(dtype).removeprefix("torch.")
    for hid, field in (("outputs[l2]", "outputs.0"), ("grads[l2]", "grad_out.0")):
        f = run[hid][field]
        assert seen[field].dtype == dtype and f.torch_dtype_name == name
        # the stored form decodes exactly (bf16 -> float32, fp16 -> float16): compare the bits
        np.testing.assert_array_equal(f[0], seen[field].float().numpy().astype(f.dtype))
