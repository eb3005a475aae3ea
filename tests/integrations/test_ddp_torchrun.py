"""The Hugging Face Trainer under ``torchrun --nproc_per_node 2`` (DDP on gloo, CPU): every rank
records its own files into the Trainer's one MLflow run (SPEC §7, §11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the transformers extra is part of hookline[test]")

#: The slower, fuller variant of tests/distributed/test_ddp.py (two gloo ranks, one run, one MLflow
#: run) and of the single-process Trainer tests: not in the default run; `pytest -m slow` (CI).
pytestmark = pytest.mark.slow

from _integ_support import artifact_files, experiment_runs  # noqa: E402

from hookline.storage import open_run  # noqa: E402

WORKER = Path(__file__).with_name("_hf_ddp_worker.py")


def _torchrun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(WORKER), str(tmp_path), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=150)


def test_both_ranks_record_into_the_trainers_one_mlflow_run(tmp_path, mlflow_experiment):
    uri, experiment = mlflow_experiment
    proc = _torchrun(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world_size"] for r in results] == [2, 2]
    assert {r["ddp"] for r in results} == {"DistributedDataParallel"}
    assert all(r["hooks_left"] == 0 for r in results)
    run_id = results[0]["run_id"]
    assert run_id and results[1]["run_id"] == run_id  # rank 0's id reached rank 1

    (mlrun,) = experiment_runs(uri, experiment)  # the Trainer's run, no other
    assert mlrun.info.run_id == run_id and "loss" in mlrun.data.metrics
    files = set(artifact_files(uri, run_id))
    for r in range(2):
        assert {f"hookline/outputs/transformer.h.0.mlp.rank{r}.h5", f"hookline/grads/transformer.h.1.mlp.rank{r}.h5",
                f"hookline/manifest.rank{r}.json"} <= files, files

    local = open_run(tmp_path / "trainer" / "hookline")
    remote = open_run(f"runs:/{run_id}", tracking_uri=uri, cache_dir=tmp_path / "cache")
    for run in (local, remote):
        assert run.ranks == [0, 1]
        for r in range(2):
            f = run.handle("outputs[transformer.h.0.mlp]", rank=r)["outputs.0"]
            assert f.steps.tolist() == [0, 1] and f.calls.tolist() == [0, 0]
            np.testing.assert_allclose(f.read(), np.array(results[r]["outputs"], dtype=np.float32), rtol=0, atol=0)
    # the ranks trained on different shards of the data
    assert not np.array_equal(results[0]["outputs"][0], results[1]["outputs"][0])


def test_a_rank_that_fails_alone_closes_its_recording_without_waiting_for_the_others(tmp_path, mlflow_experiment):
    """Rank 1 raises in step 1 while rank 0 waits in DDP's gradient all-reduce: rank 1 closes its
    recording with no collective (one would hang or fail against rank 0's all-reduce), uploads
    it, and exits; torchrun then stops rank 0."""
    uri, experiment = mlflow_experiment
    proc = _torchrun(tmp_path, "fail")
    assert proc.returncode != 0
    result = json.loads((tmp_path / "rank1.json").read_text())
    assert result == {"error": "boom on rank 1", "closed": True, "run_id": result["run_id"]}, proc.stderr[-6000:]
    run = open_run(tmp_path / "trainer" / "hookline")
    assert run.manifests[1]["rank"] == 1 and run.manifests[1]["status"] == "closed"
    f = run.handle("outputs[transformer.h.0.mlp]", rank=1)["outputs.0"]
    assert f.steps.tolist() == [0, 1]  # step 1's forward happened before the failure
    assert run.handle("grads[transformer.h.1.mlp]", rank=1)["grad_out.0"].steps.tolist() == [0]
    (mlrun,) = experiment_runs(uri, experiment)
    assert mlrun.info.run_id == result["run_id"]
    assert "hookline/outputs/transformer.h.0.mlp.rank1.h5" in artifact_files(uri, result["run_id"])
