"""End-to-end capture: real models -> Recorder -> HDF5 -> open_run, checked against plain torch.

References are computed with plain torch (``register_forward_hook`` storing clones, and
``torch.autograd.grad`` w.r.t. the outputs of a copy of the model without in-place ops), never
with hookline's own code.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import numpy as np
import pytest
import torch
from torch import nn

from hookline.storage import InvalidArgumentError, WriterClosedError, open_run
from hookline.tracker import HookFunctionError, HookManager, Recorder, select


# --- models ---------------------------------------------------------------------------------
class Block(nn.Module):
    """ResNet-style block: shared in-place ReLU, residual add in place."""

    def __init__(self, c: int, inplace: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1)
        self.relu = nn.ReLU(inplace=inplace)
        self.inplace = inplace

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.conv2(out)
        if self.inplace:
            out += x
        else:
            out = out + x
        return self.relu(out)


class CNN(nn.Module):
    def __init__(self, inplace: bool = True) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.block = Block(8, inplace)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(self.stem(x)).mean((2, 3)))


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 4), nn.Linear(6, 3)

    def forward(self, x):
        return {"hidden": self.a(x), "logits": self.b(x), "n": 3}


class DictModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = DictOut()

    def forward(self, x):
        o = self.enc(x)
        return o["hidden"].sum() + o["logits"].square().sum()


class Shared(nn.Module):
    """One Linear called twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


def plain_outputs(model: nn.Module, names: list[str]) -> tuple[dict, list]:
    """Plain torch forward hooks storing clones of the first output tensor per call."""
    seen: dict[str, list[torch.Tensor]] = defaultdict(list)
    handles = []
    mods = dict(model.named_modules())
    for n in names:
        def hook(m, i, o, n=n):
            t = o[0] if isinstance(o, tuple) else o
            seen[n].append(t.detach().clone())
        handles.append(mods[n].register_forward_hook(hook))
    return seen, handles


def reference_grad_out(model: nn.Module, names: list[str], loss_fn) -> dict[str, list[torch.Tensor]]:
    """d loss / d output of each call of each named module, by torch.autograd.grad."""
    outs: dict[str, list[torch.Tensor]] = defaultdict(list)
    mods = dict(model.named_modules())
    handles = [mods[n].register_forward_hook(lambda m, i, o, n=n: outs[n].append(o)) for n in names]
    try:
        loss = loss_fn(model)
    finally:
        for h in handles:
            h.remove()
    flat = [(n, k) for n in names for k in range(len(outs[n]))]
    grads = torch.autograd.grad(loss, [outs[n][k] for n, k in flat], allow_unused=True)
    res: dict[str, list[torch.Tensor]] = defaultdict(list)
    for (n, _), g in zip(flat, grads):
        res[n].append(g)
    return res


# --- tests ----------------------------------------------------------------------------------
def test_mlp_outputs_and_grads_equal_plain_torch(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    names = ["0", "2"]
    mgr = HookManager()
    seen, handles = plain_outputs(model, names)
    xs = [torch.randn(5, 8) for _ in range(4)]
    ref_grads = [reference_grad_out(copy.deepcopy(model), names, lambda m, x=x: m(x).square().sum()) for x in xs]
    seen.clear()
    with Recorder(tmp_path / "run", every=1) as rec:
        mgr.register_forward_hook(rec.outputs, **select(model, "*", types=nn.Linear))
        mgr.register_backward_hook(rec.grads, **select(model, "*", types=nn.Linear))
        for step, x in enumerate(xs):
            with rec.step(step):
                model(x).square().sum().backward()
    for h in handles:
        h.remove()
    run = open_run(tmp_path / "run")
    assert sorted(run.handles) == ["grads[0]", "grads[2]", "outputs[0]", "outputs[2]"]
    for n in names:
        out = run[f"outputs[{n}]"]
        assert list(out.steps) == [0, 1, 2, 3] and list(out.calls) == [0, 0, 0, 0]
        for step in range(4):
            np.testing.assert_array_equal(out["outputs.0"][step], seen[n][step].numpy())  # bit-exact
            np.testing.assert_array_equal(run[f"grads[{n}]"]["grad_out.0"][step], ref_grads[step][n][0].numpy())
        assert run[f"outputs[{n}]"].module_type == "torch.nn.modules.linear.Linear"
        assert run[f"outputs[{n}]"].module_name == n and run[f"grads[{n}]"].category == "backward_hook"
    # the first layer's input does not require grad: grad_in.0 is absent, not zeros
    assert "grad_in.0" not in run["grads[0]"].fields
    assert "grad_in.0" in run["grads[2]"].fields


def test_cnn_inplace_relu_and_residual(tmp_path):
    torch.manual_seed(0)
    model = CNN(inplace=True)
    ref_model = CNN(inplace=False)
    ref_model.load_state_dict(model.state_dict())
    names = ["stem", "block.conv1", "block.bn1", "block.conv2", "block", "head"]
    x = torch.randn(2, 3, 6, 6)
    ref = reference_grad_out(ref_model, names, lambda m: m(x).square().sum())
    mgr = HookManager()
    seen, handles = plain_outputs(ref_model, names)
    ref_model(x)
    for h in handles:
        h.remove()
    with Recorder(tmp_path / "run") as rec:
        mods = {n: m for n, m in model.named_modules() if n in names}
        mgr.register_forward_hook(rec.outputs, **mods)
        mgr.register_backward_hook(rec.grads, **mods)
        # the shared in-place ReLU fires twice per forward
        mgr.register_forward_pre_hook(rec.inputs, relu=model.block.relu)
        with rec.step(0):
            model(x).square().sum().backward()
    run = open_run(tmp_path / "run")
    for n in names:
        np.testing.assert_allclose(run[f"outputs[{n}]"]["outputs.0"][0], seen[n][0].numpy(), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(run[f"grads[{n}]"]["grad_out.0"][0], ref[n][0].numpy(), rtol=1e-5, atol=1e-6)
    relu_in = run["inputs[relu]"]
    assert list(relu_in.calls) == [0, 1] and list(relu_in.steps) == [0, 0]
    # what the ReLU saw before modifying it in place: negative values survive in the record
    assert (relu_in["inputs.0"][0] < 0).any()


def test_transformer_encoder_tuple_with_none_weight(tmp_path):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, **select(model, "layers.*.self_attn"))
        mgr.register_backward_hook(rec.grads, **select(model, "layers.*.self_attn"))
        with rec.step(0):
            model(torch.randn(3, 7, 16)).sum().backward()
        summary = rec.summary()
    run = open_run(tmp_path / "run")
    h = run["outputs[layers.0.self_attn]"]
    assert h["outputs.0"].shape == (3, 7, 16)
    assert "outputs.1" not in h.fields  # need_weights=False inside the encoder -> None weight
    assert "outputs.1" in summary.handles["outputs[layers.0.self_attn]"].skipped_fields
    assert "outputs.1" in h.meta["skipped_fields"]  # listed in the run's metadata too
    assert run["grads[layers.1.self_attn]"]["grad_out.0"][0].shape == (3, 7, 16)


def test_lstm_nested_tuple_output_fields(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("lstm", nn.LSTM(4, 6, batch_first=True))
    mgr = HookManager()
    x = torch.randn(2, 5, 4)
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, lstm=model.lstm)
        with rec.step(0):
            out, (h, c) = model.lstm(x)
    run = open_run(tmp_path / "run")
    fields = run["outputs[lstm]"]
    assert set(fields.fields) == {"outputs.0", "outputs.1.0", "outputs.1.1"}
    np.testing.assert_array_equal(fields["outputs.1.0"][0], h.detach().numpy())
    np.testing.assert_array_equal(fields["outputs.1.1"][0], c.detach().numpy())


def test_dict_output_fields_and_grads(tmp_path):
    torch.manual_seed(0)
    model = DictModel()
    x = torch.randn(3, 6)
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, enc=model.enc)
        mgr.register_backward_hook(rec.grads, enc=model.enc)
        with rec.step(0):
            model(x).backward()
    run = open_run(tmp_path / "run")
    out = run["outputs[enc]"]
    assert set(out.fields) == {"outputs.hidden", "outputs.logits"}
    np.testing.assert_array_equal(out["outputs.hidden"][0], model.enc.a(x).detach().numpy())
    g = run["grads[enc]"]
    np.testing.assert_array_equal(g["grad_out.hidden"][0], np.ones((3, 4), np.float32))
    np.testing.assert_allclose(g["grad_out.logits"][0], 2 * model.enc.b(x).detach().numpy(), rtol=1e-6)


def test_shared_module_called_twice_gives_two_calls(tmp_path):
    torch.manual_seed(0)
    model = Shared()
    x = torch.randn(2, 5, requires_grad=True)
    ref = reference_grad_out(copy.deepcopy(model), ["lin"], lambda m: m(x).sum())
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, lin=model.lin)
        mgr.register_backward_hook(rec.grads, lin=model.lin)
        for step in range(2):
            with rec.step(step):
                model(x).sum().backward()
    run = open_run(tmp_path / "run")
    out = run["outputs[lin]"]
    assert list(out.steps) == [0, 0, 1, 1] and list(out.calls) == [0, 1, 0, 1]
    first = model.lin(x)
    np.testing.assert_array_equal(out["outputs.0"][0], first.detach().numpy())
    np.testing.assert_array_equal(out["outputs.0"][1], model.lin(torch.tanh(first)).detach().numpy())
    g = run["grads[lin]"]["grad_out.0"]
    assert len(g) == 4
    # backward runs the second call first: grads' call index follows backward firing order
    recorded = sorted(g.at_step(0), key=lambda a: float(np.abs(a).sum()))
    expected = sorted([r.numpy() for r in ref["lin"]], key=lambda a: float(np.abs(a).sum()))
    for a, b in zip(recorded, expected):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_variable_sequence_lengths_are_ragged_and_exact(tmp_path):
    torch.manual_seed(0)
    emb = nn.Embedding(10, 4)
    mgr = HookManager()
    seen = []
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, emb=emb)
        for step, length in enumerate([3, 7, 5]):
            with rec.step(step):
                seen.append(emb(torch.randint(0, 10, (2, length))).detach().clone())
    f = open_run(tmp_path / "run")["outputs[emb]"]["outputs.0"]
    assert f.shape is None and len(f) == 3
    for i, t in enumerate(seen):
        np.testing.assert_array_equal(f[i], t.numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_round_trip_bit_exactly(tmp_path, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2)).to(dtype)
    seen, handles = plain_outputs(model, ["0", "2"])
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, **select(model, "*", types=nn.Linear))
        mgr.register_backward_hook(rec.grads, **select(model, "*", types=nn.Linear))
        with rec.step(0):
            model(torch.randn(4, 8, dtype=dtype)).float().sum().backward()
    for h in handles:
        h.remove()
    run = open_run(tmp_path / "run")
    f = run["outputs[0]"]["outputs.0"]
    got = f.to_torch(0)
    assert got.dtype == dtype and torch.equal(got.view(torch.int16), seen["0"][0].view(torch.int16))
    # numpy reads: bfloat16 as exact float32, float16 as float16
    np.testing.assert_array_equal(f[0], seen["0"][0].float().numpy() if dtype == torch.bfloat16 else seen["0"][0].numpy())
    assert run["grads[2]"]["grad_out.0"].to_torch(0).dtype == dtype


def test_sampling_every_and_steps(tmp_path):
    model = nn.Linear(3, 3)
    mgr = HookManager()
    with Recorder(tmp_path / "every", every=3) as rec:
        mgr.register_forward_hook(rec.outputs, lin=model)
        for step in range(10):
            with rec.step(step):
                model(torch.randn(1, 3))
                # on skipped steps the recorder's torch hooks are gone (zero cost)
                assert bool(model._forward_hooks) == rec.is_sampled(step)
    assert list(open_run(tmp_path / "every")["outputs[lin]"].steps) == [0, 3, 6, 9]
    mgr2 = HookManager()
    with Recorder(tmp_path / "steps", steps=[1, 4]) as rec:
        mgr2.register_forward_hook(rec.outputs, lin=model)
        for step in range(6):
            rec.set_step(step)
            model(torch.randn(1, 3))
    assert list(open_run(tmp_path / "steps")["outputs[lin]"].steps) == [1, 4]
    assert not model._forward_hooks  # closing removed the recorder's hooks


def test_user_deactivated_handles_stay_deactivated(tmp_path):
    model = nn.Linear(3, 3)
    mgr = HookManager()
    with Recorder(tmp_path / "run", every=2) as rec:
        mgr.register_forward_hook(rec.outputs, lin=model)
        mgr.deactivate_all_hooks()
        for step in range(4):
            with rec.step(step):
                model(torch.randn(1, 3))
    assert open_run(tmp_path / "run")["outputs[lin]"].steps.size == 0


def test_batch_slice_and_dtype_cast(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 6)
    x = torch.randn(10, 4)
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.hook("outputs", batch_slice=3, dtype=torch.bfloat16), lin=model)
        with rec.step(0):
            y = model(x)
    run = open_run(tmp_path / "run")
    assert run.handles == ["outputs.b3.bfloat16[lin]"]
    f = run["outputs.b3.bfloat16[lin]"]["outputs.0"]
    assert f.shape == (3, 6)
    assert torch.equal(f.to_torch(0), y[:3].detach().to(torch.bfloat16))


def test_stats_mode_matches_numpy_on_full_tensors(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.ReLU())
    x = torch.randn(16, 4)
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.hook("outputs", mode="stats"), relu=model[1])
        with rec.step(0):
            y = model(x).detach().double().numpy()
    h = open_run(tmp_path / "run")["outputs.stats[relu]"]
    np.testing.assert_array_equal(h.meta["hist_edges"], np.linspace(-8, 8, 65))
    np.testing.assert_allclose(h["outputs.0.norm"][0], np.linalg.norm(y), rtol=1e-12)
    np.testing.assert_allclose(h["outputs.0.std"][0], y.std(), rtol=1e-12)
    np.testing.assert_allclose(h["outputs.0.mean"][0], y.mean(), rtol=1e-12)
    assert h["outputs.0.min"][0] == 0.0 and h["outputs.0.max"][0] == y.max() == h["outputs.0.absmax"][0]
    counts, _ = np.histogram(np.clip(y, -8, 8), bins=np.linspace(-8, 8, 65))
    np.testing.assert_array_equal(h["outputs.0.hist"][0], counts)


def test_recording_outside_a_step_is_a_clear_error(tmp_path):
    model = nn.Linear(3, 3)
    mgr = HookManager()
    rec = Recorder(tmp_path / "run")
    mgr.register_forward_hook(rec.outputs, lin=model)
    with pytest.raises(HookFunctionError, match=r"outputs\[lin\].*rec\.step") as e:
        model(torch.randn(1, 3))
    assert isinstance(e.value.__cause__, InvalidArgumentError)
    with rec.paused():
        model(torch.randn(1, 3))  # not recorded, no error
    with rec.step(0):
        model(torch.randn(1, 3))
    rec.close()
    assert rec.close() is not None  # idempotent
    with pytest.raises(WriterClosedError, match="closed"):
        rec.set_step(1)
    model(torch.randn(1, 3))  # hooks were removed at close: the model runs freely
    assert list(open_run(tmp_path / "run")["outputs[lin]"].steps) == [0]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(every=0), "every"),
        (dict(every=2, steps=[1]), "either"),
        (dict(steps=[-1]), "step"),
    ],
)
def test_bad_recorder_arguments(tmp_path, kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Recorder(tmp_path / "run", **kwargs)


def test_wrong_category_and_bad_options(tmp_path):
    model = nn.Linear(3, 3)
    mgr = HookManager()
    with Recorder(tmp_path / "run") as rec:
        with pytest.raises(InvalidArgumentError, match="register_backward_hook"):
            mgr.register_forward_hook(rec.grads, lin=model)
        with pytest.raises(InvalidArgumentError, match="batch_slice"):
            rec.hook("outputs", batch_slice=0)
        with pytest.raises(InvalidArgumentError, match="kind"):
            rec.hook("weights")
        with pytest.raises(InvalidArgumentError, match="dtype"):
            rec.hook("outputs", dtype=torch.int8)


def test_summary_counts_records_bytes_and_hook_time(tmp_path):
    model = nn.Linear(4, 8)
    mgr = HookManager()
    rec = Recorder(tmp_path / "run")
    mgr.register_forward_hook(rec.outputs, lin=model)
    for step in range(3):
        with rec.step(step):
            model(torch.randn(2, 4))
    summary = rec.close()
    h = summary.handles["outputs[lin]"]
    assert h.records == 3 and h.bytes == 3 * 2 * 8 * 4 and h.dropped == 0 and h.hook_seconds > 0
    assert "outputs[lin]" in str(summary)


def test_drop_policy_counts_every_dropped_record(tmp_path, monkeypatch):
    import time

    from hookline.storage.writer.queue import WriteQueue

    release = WriteQueue.release  # a disk far slower than capture: 0.5 s per MiB written
    monkeypatch.setattr(WriteQueue, "release", lambda q, n: (time.sleep(0.5 * n / 2**20), release(q, n))[1])
    model = nn.Linear(4, 64 * 1024)  # 256 KiB per record (batch 1)
    mgr = HookManager()
    rec = Recorder(tmp_path / "run", max_buffer_mb=1, policy="drop")
    mgr.register_forward_hook(rec.outputs, lin=model)
    with torch.no_grad():
        for step in range(40):
            with rec.step(step):
                model(torch.randn(1, 4))
    summary = rec.close()
    h = summary.handles["outputs[lin]"]
    assert h.dropped > 0 and h.records + h.dropped == 40
    assert "DROPPED" in str(summary)
    assert len(open_run(tmp_path / "run")["outputs[lin]"].steps) == h.records


def test_write_error_surfaces_at_next_step_and_keeps_flushed(tmp_path, monkeypatch):
    import errno

    from hookline.storage import StorageError
    from hookline.storage import _h5write

    model = nn.Linear(4, 8)
    mgr = HookManager()
    rec = Recorder(tmp_path / "run", max_buffer_mb=1)
    mgr.register_forward_hook(rec.outputs, lin=model)
    for step in range(3):
        with rec.step(step):
            model(torch.randn(2, 4))
    rec.flush()

    def failing(self, block):
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    monkeypatch.setattr(_h5write.FieldOut, "append", failing)
    monkeypatch.setattr(_h5write.FieldOut, "append_records", failing)  # (a one-record chunk's path)
    with rec.step(3):
        model(torch.randn(2, 4))
    with pytest.raises(StorageError, match="28|space"):
        rec.flush()
    with pytest.raises(StorageError):
        rec.set_step(4)  # reported again at the next step, never silently
    with pytest.raises(StorageError):
        rec.close()
    assert not model._forward_hooks  # close still removed the hooks
    monkeypatch.undo()
    assert list(open_run(tmp_path / "run")["outputs[lin]"].steps) == [0, 1, 2]
    summary = rec.close()  # closing again (a with-block, atexit) tells the truth about the disk
    h = summary.handles["outputs[lin]"]
    assert summary.failed and h.records == 4 and h.on_disk == 3
    assert str(summary).startswith(f"hookline run {tmp_path / 'run'}: WRITING FAILED: ")
    assert "of 4 records captured, 3 reached the disk" in str(summary)


def test_budget_covers_open_blocks_and_writer_queue(tmp_path):
    """max_buffer_mb bounds both: a quarter for blocks being filled, the rest for the writer."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(12)])
    mgr = HookManager()
    rec = Recorder(tmp_path / "run", max_buffer_mb=8)
    assert rec._writer.max_buffer_bytes == 6 << 20 and rec._packer.max_open_bytes == 2 << 20
    assert rec._pool.max_bytes == 2 << 20  # free buffers kept for reuse: bounded alike
    mgr.register_forward_hook(rec.outputs, **dict(model.named_children()))
    peak_open = 0
    with torch.no_grad():
        for step in range(40):
            with rec.step(step):
                model(torch.randn(64, 256))  # 12 x 64 KiB per step; a full block is 1 MiB
            peak_open = max(peak_open, rec._packer._open_bytes)
    summary = rec.close()
    assert peak_open <= 2 << 20
    assert summary.storage.peak_buffer_bytes <= 6 << 20
    run = open_run(tmp_path / "run")
    assert all(len(run[h].steps) == 40 for h in run.handles)


def test_blocks_shrink_to_one_chunk_when_many_handles_share_the_budget(tmp_path):
    """Blocks grow to 4 chunks for a few handles, but never so big that the handles together
    outgrow the open-block budget (partly filled hand-overs would cost the writer a copy)."""
    few = nn.Sequential(*[nn.Linear(256, 256) for _ in range(2)])
    many = nn.Sequential(*[nn.Linear(256, 256) for _ in range(40)])
    for model, cap in ((few, 64), (many, 16)):  # 64 KiB records: 16 per 1 MiB chunk
        mgr = HookManager()
        rec = Recorder(tmp_path / f"run{cap}", max_buffer_mb=256)  # 64 MiB for open blocks
        rec._packer.max_age_s = float("inf")  # sizes only: no hand-over by age on a slow machine
        mgr.register_forward_hook(rec.outputs, **dict(model.named_children()))
        assert rec._packer.handles == len(model)
        handed_over_partly = []
        write_block = rec._packer._write_block
        rec._packer._write_block = lambda hid, st, ca, f: (handed_over_partly.append(len(st) < cap),
                                                            write_block(hid, st, ca, f))[1]
        with torch.no_grad():
            for step in range(cap):
                with rec.step(step):
                    model(torch.randn(64, 256))
        assert {b.cap for b in rec._packer._open.values()} <= {cap}
        assert handed_over_partly == [False] * len(model)  # every block went full, none early
        mgr.remove_hook_function(rec.outputs)
        assert rec._packer.handles == 0
        rec.close()
        assert all(len(open_run(tmp_path / f"run{cap}")[h].steps) == cap for h in open_run(tmp_path / f"run{cap}").handles)


def test_partly_filled_blocks_reach_the_writer_at_the_next_step_once_stale(tmp_path):
    model = nn.Linear(4, 8)  # tiny records: a block would hold 256 of them
    mgr = HookManager()
    rec = Recorder(tmp_path / "run")
    rec._packer.max_age_s = 3600.0  # (not stale however slow the machine)
    mgr.register_forward_hook(rec.outputs, lin=model)
    with rec.step(0):
        model(torch.randn(2, 4))
    rec.set_step(1)
    assert rec.summary().records == 0  # still in its block: younger than max_age_s
    rec._packer.max_age_s = 0.0
    with rec.step(2):
        model(torch.randn(2, 4))
    rec.set_step(3)  # the step boundary hands the stale block over
    assert rec.summary().records == 2
    rec.flush()
    assert list(open_run(tmp_path / "run")["outputs[lin]"].steps) == [0, 2]
    rec.close()
