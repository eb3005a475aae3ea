"""A 2-D mesh under 4 gloo processes (SPEC §15): FSDP2 on the data-parallel mesh dimension,
tensor parallelism on the other, as torchtitan composes them. Each data-parallel group's logical
tensors equal the unsharded model's on that group's data (plain torch hooks in the same worker)."""

from __future__ import annotations

import numpy as np
import pytest

from _launch import spawn
from _tp_worker import NAMES, STEPS, train
from hookline.storage import open_run

pytestmark = pytest.mark.slow  # gloo process groups: process start-up dominates


@pytest.fixture(scope="module")
def mesh2d(tmp_path_factory):
    root = tmp_path_factory.mktemp("mesh2d")
    results = spawn(train, 4, root / "out", 4, str(root / "init"), str(root), str(root / "out"), (2, 2))
    return root, results


def test_each_data_parallel_group_records_the_unsharded_model(mesh2d):
    root, results = mesh2d
    assert [r["dp"] for r in results] == [0, 0, 1, 1]
    assert all(r["sharded"] == ["DTensor"] * len(r["sharded"]) for r in results)
    for r in results:  # no collective in hooks: a recorded step runs the collectives of a paused one
        assert r["comm"]["recorded"] == [r["comm"]["paused"]] * STEPS and r["comm"]["paused"] > 0
    run = open_run(root / "tp")
    assert run.ranks == [0, 1, 2, 3]
    for kind, handle, field in (("outputs", "outputs", "outputs.0"), ("grad_out", "grads", "grad_out.0"),
                                ("grad_in", "grads", "grad_in.0")):
        for name in NAMES:
            if kind == "grad_in" and name == "inp":
                continue  # the model input needs no gradient
            f = run[f"{handle}[{name}]"][field]
            # one logical record per tp group and step; a group's records carry its lead rank
            assert f.meshes == [[0, 1], [2, 3]] and f.ranks.tolist() == [0] * STEPS + [2] * STEPS
            for g, lead in enumerate((0, 2)):
                ref = results[lead]["seen"][kind][name]
                for i in range(STEPS):
                    np.testing.assert_allclose(f[g * STEPS + i], ref[i].numpy(), rtol=1e-5, atol=1e-6,
                                               err_msg=f"{handle}[{name}] {field} group {g} step {i}")
    # the groups saw different data
    up = run["outputs[up]"]["outputs.0"]
    assert not np.allclose(up[0], up[STEPS])
    # replicated outputs: one copy per tp group (ranks 0 and 2), none on ranks 1 and 3
    for r in range(4):
        assert ("outputs.0" in run.handle("outputs[down]", rank=r).fields) == (r in (0, 2))
