"""Tensor parallelism under 2 gloo processes (SPEC §15): DTensor outputs and gradients are recorded
as local shards with their layout, replicated ones once; the reader's logical tensors equal the
unsharded model's (plain torch hooks in the same worker), and ``compare_runs`` pairs them with a
single-process run. A recorder closed after the process group was destroyed loses nothing."""

from __future__ import annotations

import numpy as np
import pytest

from _launch import spawn
from _tp_worker import BATCH, HIDDEN, NAMES, SEQ, STEPS, D, train
from hookline.storage import LogicalField, compare_runs, open_run

pytestmark = pytest.mark.slow  # gloo process groups: process start-up dominates


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    results = spawn(train, 2, root / "out", 2, str(root / "init"), str(root), str(root / "out"), (2,))
    return root, results


def test_logical_outputs_and_gradients_equal_the_unsharded_model(tp):
    root, (r0, r1) = tp
    run = open_run(root / "tp")
    seen = r0["seen"]
    for kind, handle, field in (("outputs", "outputs", "outputs.0"), ("grad_out", "grads", "grad_out.0"),
                                ("grad_in", "grads", "grad_in.0")):
        for name in NAMES:
            ref = seen[kind][name]
            if kind == "grad_in" and name == "inp":
                assert ref == [] and "grad_in.0" not in run[f"grads[{name}]"].fields  # x needs no grad
                continue
            f = run[f"{handle}[{name}]"][field]
            assert isinstance(f, LogicalField), (name, field)
            assert len(f) == STEPS and list(f.steps) == list(range(STEPS)) and f.ranks.tolist() == [-1] * STEPS
            assert f.shape == tuple(ref[0].shape)
            for i in range(STEPS):
                # partial gradients (grad_in of the Colwise layer) are summed by the reader
                np.testing.assert_allclose(f[i], ref[i].numpy(), rtol=1e-5, atol=1e-6,
                                           err_msg=f"{handle}[{name}] {field} step {i}")
            np.testing.assert_allclose(f.at_step(1)[0], ref[1].numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(f.norms(), [np.linalg.norm(t.numpy()) for t in ref], rtol=1e-5)


def test_no_collective_in_hooks(tp):
    """A recorded step runs exactly the collectives of the same step with the hooks suspended."""
    _, results = tp
    for r in results:
        assert r["comm"]["paused"] > 0  # (the count sees the model's own collectives)
        assert r["comm"]["recorded"] == [r["comm"]["paused"]] * STEPS


def test_layouts_local_shards_and_replicated_stored_once(tp):
    root, _ = tp
    run = open_run(root / "tp")
    meta = {r: run.handle("outputs[up]", rank=r).meta["dtensor"]["outputs.0"] for r in (0, 1)}
    assert meta[0]["placements"] == ["shard:2"] and meta[0]["mesh_ranks"] == [0, 1]
    assert [meta[r]["coordinate"] for r in (0, 1)] == [[0], [1]] and meta[0]["mesh_dim_names"] == ["tp"]
    # Colwise output: each rank holds half of the hidden features; the logical tensor is both
    up = run["outputs[up]"]["outputs.0"]
    shards = up.shards(0)
    assert {r: s.shape for r, s in shards.items()} == {0: (BATCH, SEQ, HIDDEN // 2), 1: (BATCH, SEQ, HIDDEN // 2)}
    np.testing.assert_array_equal(up[0], np.concatenate([shards[0], shards[1]], axis=2))
    np.testing.assert_array_equal(up.local(1)[0], run.handle("outputs[up]", rank=1)["outputs.0"][0])
    # SequenceParallel: the LayerNorm's output is sharded along the sequence
    norm = run.handle("outputs[norm]", rank=1)
    assert norm.meta["dtensor"]["outputs.0"]["placements"] == ["shard:1"]
    assert norm["outputs.0"].shape == (BATCH, SEQ // 2, D)
    # Rowwise output and the Colwise input are replicated: stored by mesh coordinate 0 only
    for hid, field in (("outputs[down]", "outputs.0"), ("inputs[up]", "inputs.0")):
        assert run.handle(hid, rank=0)[field].shape == (BATCH, SEQ, D)
        assert field not in run.handle(hid, rank=1).fields, hid
        assert run.handle(hid, rank=1).meta["dtensor"][field]["stored"] is False
        assert len(run.handle(hid, rank=1)) == STEPS  # the records are there, without the copy
    # a partial gradient: each rank's partial is stored, the logical value is their sum
    gi = run["grads[up]"]["grad_in.0"]
    assert gi.placements == ["partial:sum"]
    parts = gi.shards(1)
    np.testing.assert_allclose(gi[1], parts[0] + parts[1], rtol=0, atol=0)
    assert not np.allclose(parts[0], gi[1])


def test_stats_and_batch_slice_of_dtensor_fields(tp):
    root, results = tp
    run = open_run(root / "tp")
    for r in (0, 1):  # stats summarise the rank's local shard
        local = run.handle("outputs[up]", rank=r)["outputs.0"]
        norms = run.handle("outputs.stats[up]", rank=r)["outputs.0.norm"].read()
        np.testing.assert_allclose(norms.ravel(), [np.linalg.norm(local[i]) for i in range(STEPS)], rtol=1e-5)
    assert "outputs.0" in run.handle("outputs.stats[up]", rank=0).meta["dtensor"]
    first = run["first[up]"]["outputs.0"]  # sharded along the features: the logical first item
    ref = results[0]["seen"]["outputs"]["up"]
    assert first.shape == (1, SEQ, HIDDEN)
    for i in range(STEPS):
        np.testing.assert_allclose(first[i], ref[i][:1].numpy(), rtol=1e-5, atol=1e-6)
    for r in results:  # ... and refused where the shards split dimension 0
        assert "sharded along dimension 0" in r["refused"] and "batch_slice=1" in r["refused"]


def test_compare_tensor_parallel_with_a_single_process_run(tp):
    root, _ = tp
    res = compare_runs(root / "tp", root / "ref", handles="outputs[*]")
    by = {(r.handle, r.field): r for r in res}
    assert {h for h, _ in by} == {f"outputs[{n}]" for n in NAMES}
    for (h, f), r in by.items():
        assert r.status == "ok", (h, f, r.message)
        assert list(r.steps) == list(range(STEPS))
        np.testing.assert_allclose(r.values["cosine"], 1.0, atol=1e-6)
        np.testing.assert_allclose(r.values["rel_l2"], 0.0, atol=1e-5)


def test_a_recorder_closed_after_the_process_group_was_destroyed_keeps_everything(tp):
    root, results = tp
    run = open_run(root / "late")
    assert run.status == "closed" and run.ranks == [0, 1]
    for res in results:
        said = [m for m in res["said"] if "process group was destroyed" in m]
        assert len(said) == 1, res["said"]  # said once, though close() ran twice
        assert "handle sets" in said[0]
    up = run["outputs[up]"]["outputs.0"]
    tp_up = open_run(root / "tp")["outputs[up]"]["outputs.0"]
    assert len(up) == STEPS
    for i in range(STEPS):
        np.testing.assert_array_equal(up[i], tp_up[i])
    assert len(run.handle("outputs[down]", rank=0)["outputs.0"]) == STEPS
