"""Two gloo processes training a DDP model record into one run and one MLflow run (SPEC §7); ranks
that disagree fail clearly. One pair of processes runs every scenario in turn."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from click.testing import CliRunner
from mlflow import MlflowClient

from _ddp_worker import train
from hookline.cli.main import cli
from hookline.storage import open_run


#: The scenarios, all run in one pair of gloo processes (their start costs far more than a scenario).
SCENARIOS = [
    {"name": "one_run", "mlflow": True},
    {"name": "different_handles", "extra_handle_on_rank": 1},
    {"name": "different_run_ids", "run_ids": ("a" * 32, "b" * 32)},
    {"name": "run_of_one_rank"},  # (rank 1's manifest is made first: see the fixture)
]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, mlflow_server):
    """``scenario name -> (tmp dir, [rank 0's result, rank 1's])`` of the two ranks' runs."""
    from hookline.tracker import Recorder

    root = tmp_path_factory.mktemp("ddp")
    out = root / "out"
    out.mkdir()
    scenarios = [dict(sc, run_dir=str(root / sc["name"] / "run")) for sc in SCENARIOS]
    Recorder(root / "run_of_one_rank" / "run", rank=1, world_size=2).close()
    ctx = mp.spawn(train, args=(2, str(root / "init"), scenarios, mlflow_server, str(out)), nprocs=2, join=False)
    exits = []
    while True:
        try:
            if ctx.join(timeout=300):
                break
        except mp.ProcessExitedException as e:
            # gloo occasionally aborts a process while tearing the group down ("terminate called
            # without an active exception"), after the worker saved its results; every result is
            # still checked below, and a process that died before saving fails the test.
            exits.append(str(e))
            if all(not p.is_alive() for p in ctx.processes):
                break
    results = {}
    for sc in SCENARIOS:
        files = [out / f"{sc['name']}.rank{r}.pt" for r in range(2)]
        missing = [r for r, f in enumerate(files) if not f.exists()]
        assert not missing, f"{sc['name']}: ranks {missing} died before reporting: {exits}"
        results[sc["name"]] = (root / sc["name"], [torch.load(f, weights_only=False) for f in files])
    return results


def test_ddp_two_ranks_one_run(ddp, mlflow_server):
    tmp_path, results = ddp["one_run"]
    for r in results:
        assert "error" not in r, r.get("traceback")
        assert r["names"] == ["0", "2"]
    run_id = results[0]["run_id"]
    assert run_id and results[1]["run_id"] == run_id  # rank 0's id reached rank 1

    run = open_run(tmp_path / "run")
    assert run.ranks == [0, 1]
    assert sorted(run.handles) == ["grads[0]", "grads[2]", "outputs[0]", "outputs[2]"]
    for r in range(2):
        for name in ("0", "2"):
            f = run.handle(f"outputs[{name}]", rank=r)["outputs.0"]
            assert list(f.steps) == [0, 1, 2]
            for i, t in enumerate(results[r]["seen"][name]):
                np.testing.assert_array_equal(f[i], t.numpy())
            g = run.handle(f"grads[{name}]", rank=r)["grad_out.0"]
            assert len(results[r]["seen_grad"][name]) == len(g) == 3
            for i, t in enumerate(results[r]["seen_grad"][name]):  # local (not all-reduced) grads
                np.testing.assert_array_equal(g[i], t.numpy())
    merged = run["outputs[0]"]
    assert sorted(merged.ranks.tolist()) == [0, 0, 0, 1, 1, 1]
    # the ranks saw different data, so their records differ
    assert not np.array_equal(run.handle("outputs[0]", rank=0)["outputs.0"][0],
                              run.handle("outputs[0]", rank=1)["outputs.0"][0])

    client = MlflowClient(mlflow_server)
    arts = {a.path for a in client.list_artifacts(run_id, "hookline/outputs")}
    assert {"hookline/outputs/0.rank0.h5", "hookline/outputs/0.rank1.h5"} <= arts, arts
    remote = open_run(f"runs:/{run_id}", tracking_uri=mlflow_server, cache_dir=tmp_path / "cache")
    assert remote.ranks == [0, 1]
    np.testing.assert_array_equal(remote.handle("outputs[2]", rank=1)["outputs.0"].read(),
                                  run.handle("outputs[2]", rank=1)["outputs.0"].read())

    res = CliRunner().invoke(cli, ["show", str(tmp_path / "run"), "--json"])
    assert res.exit_code == 0, res.output
    shown = {h["handle"]: h for h in json.loads(res.output)["handles"]}
    assert shown["outputs[0]"]["ranks"] == [0, 1] and shown["outputs[0]"]["records"] == 6

    # rank 0 against rank 1 of the same run: they saw different data
    res = CliRunner().invoke(cli, ["compare", str(tmp_path / "run"), str(tmp_path / "run"),
                                   "--rank-a", "0", "--rank-b", "1", "--handle", "outputs[0]", "--json"])
    assert res.exit_code == 0, res.output
    (cmp,) = json.loads(res.output)["results"]
    assert cmp["status"] == "ok" and cmp["steps"] == [0, 1, 2]
    a0 = run.handle("outputs[0]", rank=0)["outputs.0"].read().reshape(3, -1).astype(np.float64)
    a1 = run.handle("outputs[0]", rank=1)["outputs.0"].read().reshape(3, -1).astype(np.float64)
    cos = (a0 * a1).sum(1) / np.linalg.norm(a0, axis=1) / np.linalg.norm(a1, axis=1)
    np.testing.assert_allclose(cmp["cosine"], cos, rtol=1e-9)
    # the whole run against itself pairs (step, call, rank): identical
    res = CliRunner().invoke(cli, ["compare", str(tmp_path / "run"), str(tmp_path / "run"), "--json"])
    assert all(r["status"] == "ok" and all(c == pytest.approx(1.0) for c in r["cosine"])
               for r in json.loads(res.output)["results"])


def test_ranks_with_different_handles_fail_clearly_without_hanging(ddp):
    tmp_path, results = ddp["different_handles"]
    for r in results:
        assert "ranks registered different hook handles" in r.get("error", ""), r
        assert "inputs[relu]" in r["error"]
    # each rank's files are complete all the same
    assert open_run(tmp_path / "run").ranks == [0, 1]


def test_ranks_with_different_mlflow_run_ids_fail_clearly(ddp):
    a, b = "a" * 32, "b" * 32
    _, results = ddp["different_run_ids"]
    for r in results:  # raised on every rank, right at construction, no hang
        assert "ranks disagree on mlflow_run_id" in r.get("error", ""), r
        assert a in r["error"] and b in r["error"]


def test_a_run_only_one_rank_would_mix_into_is_refused_on_every_rank(ddp):
    """Rank 1's manifest is there (rank 0's is not): only rank 1 sees a run of its own, yet every
    rank raises at construction (an agreed check), so none goes on to hang in a collective (and
    both go on to the next scenario)."""
    tmp_path, results = ddp["run_of_one_rank"]
    for r in results:
        assert r.get("error", "").startswith("RunExistsError"), r
        assert "manifest.rank1.json" in r["error"]
    assert not (tmp_path / "run" / "manifest.rank0.json").exists()
