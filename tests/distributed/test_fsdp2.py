"""FSDP2 (``fully_shard``) under 2 gloo processes records what the unsharded model computes on the
same rank's data (SPEC §15): plain, bf16 mixed precision without resharding after forward,
activation checkpointing, and ``torch.compile`` (``aot_eager``). One spawn records every variant;
each is checked against plain torch hooks on an unsharded copy in the same worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _fsdp_worker import STEPS, VARIANTS, train
from _launch import spawn
from hookline.storage import open_run

pytestmark = pytest.mark.slow  # gloo process groups: process start-up dominates


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    results = spawn(train, 2, root / "out", 2, str(root / "init"), str(root / "runs"), str(root / "out"))
    return root / "runs", results


def _np(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fsdp2_records_equal_the_unsharded_model(fsdp, variant):
    runs, results = fsdp
    run = open_run(runs / variant)
    assert run.ranks == [0, 1]
    for res in results:
        out = res[variant]
        assert out["sharded"]  # the parameters really were sharded (DTensor)
        rank = res["rank"]
        assert len(out["names"]) == 5
        for name in out["names"]:
            for kind, handle, field in (("outputs", "outputs", "outputs.0"), ("grad_out", "grads", "grad_out.0"),
                                        ("grad_in", "grads", "grad_in.0")):
                f = run.handle(f"{handle}[{name}]", rank=rank)[field]
                ref = out["seen"][kind][name]
                assert list(f.steps) == list(range(STEPS)) and len(ref) == STEPS, (variant, name, kind)
                assert f.dtype_name == ("bfloat16" if variant == "bf16" else "float32")
                for i, t in enumerate(ref):
                    # same ops on the same rank's data: bit for bit
                    np.testing.assert_array_equal(f[i], _np(t), err_msg=f"{variant} {name} {kind} step {i}")
