"""Activation checkpointing: a forward recomputed during backward is not a new call.

A checkpointed run records exactly what a run without checkpointing records (same handles,
steps, calls, values, and gradients paired with the same calls), for ``torch.utils.checkpoint``
reentrant and not, and for a Hugging Face GPT-2 with ``gradient_checkpointing_enable()``. The
reference is plain torch hooks on a twin without checkpointing (tests/capture/_training_stacks.py).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from hookline.tracker import HookManager, Recorder, is_recomputing, select

from _training_stacks import assert_same_records, batches, record_run, recorded, reference, train, twin

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # the eager twin's first layer


class Block(nn.Module):
    """A residual block calling one of its Linears twice (calls 0 and 1 in a step)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.mix, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        z = torch.nn.functional.gelu(self.fc1(h))
        z = self.mix(torch.tanh(self.mix(z)))
        return h + self.fc2(z)


class Net(nn.Module):
    def __init__(self, reentrant: bool | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 4)
        self.reentrant = reentrant  # None: no checkpointing

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = b(h) if self.reentrant is None else checkpoint(b, h, use_reentrant=self.reentrant)
        return self.head(h)


NAMES = ["inp", "blocks.0", "blocks.0.fc1", "blocks.0.mix", "blocks.1.fc2", "head"]


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpointed_run_records_what_a_plain_run_records(tmp_path, reentrant):
    model, data = _net(), batches(3)
    want = reference(twin(model), NAMES, data)
    assert [(s, c) for s, c, _ in want[("outputs[blocks.0.mix]", "outputs.0")]][:2] == [(0, 0), (0, 1)]
    model.reentrant = reentrant
    got = record_run(tmp_path / "run", model, NAMES, data)
    assert_same_records(got, want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_user_hooks_still_fire_on_the_recompute_and_can_tell(tmp_path, reentrant):
    """The manager keeps torch's semantics: a user's forward hook fires again on the
    recomputation; is_recomputing() tells the two firings apart. The recorder records once."""
    model, data = _net(), batches(1)
    model.reentrant = reentrant
    seen: list[bool] = []
    mgr = HookManager()
    mgr.register_forward_hook(lambda m, i, o: seen.append(is_recomputing()), fc1=model.blocks[0].fc1)
    with Recorder(tmp_path / "run") as rec:
        mgr.register_forward_hook(rec.outputs, fc1=model.blocks[0].fc1)
        train(model, data, rec.step, params=model)
    assert seen == [False, True]
    assert not is_recomputing()
    assert [(s, c) for s, c, _ in recorded(tmp_path / "run")[("outputs[fc1]", "outputs.0")]] == [(0, 0)]


def _gpt2(checkpointing: bool):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable()
        assert model.is_gradient_checkpointing
    return model


def _record_gpt2(run_dir, model) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 64, (2, 12), generator=g) for _ in range(3)]
    mgr = HookManager()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Recorder(run_dir) as rec:
        mgr.register_forward_hook(rec.outputs, **select(model, "transformer.h.*.mlp.c_fc"))
        mgr.register_backward_hook(rec.grads, **select(model, "transformer.h.*.mlp.c_fc"))
        mgr.register_forward_hook(rec.outputs, **select(model, "transformer.h.?"))
        mgr.register_backward_hook(rec.grads, **select(model, "transformer.h.?"))
        for step, x in enumerate(ids):
            with rec.step(step):
                loss = model(input_ids=x, labels=x).loss
                opt.zero_grad()
                loss.backward()
            opt.step()
    return recorded(run_dir)


def test_hugging_face_gradient_checkpointing_records_what_a_plain_run_records(tmp_path):
    want = _record_gpt2(tmp_path / "plain", _gpt2(False))
    got = _record_gpt2(tmp_path / "ckpt", _gpt2(True))
    assert ("grads[transformer.h.1.mlp.c_fc]", "grad_out.0") in want
    assert all(len(v) == 3 for v in want.values())  # one call per step: nothing recorded twice
    assert_same_records(got, want)
