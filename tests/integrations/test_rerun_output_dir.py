"""Training again into the same output directory records a new run beside the earlier one, each
in its own MLflow run; a run directory that must be refused is refused before the Trainer starts
an MLflow run (real Trainer, tiny random-init GPT-2, the real MLflow server)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the transformers extra is part of hookline[test]")

from _integ_support import artifact_files, experiment_runs, tiny_gpt2, token_dataset, training_args  # noqa: E402
from transformers import Trainer  # noqa: E402

from hookline.storage import open_run  # noqa: E402
from hookline.storage.errors import InvalidArgumentError, RunExistsError  # noqa: E402
from hookline.tracker.integrations.session import numbered_run_dir  # noqa: E402
from hookline.tracker.integrations.transformers import HooklineCallback  # noqa: E402

MLP = "transformer.h.0.mlp"


def _train(out, cb: HooklineCallback, seed: int) -> None:
    trainer = Trainer(model=tiny_gpt2(seed), args=training_args(out, report_to=["mlflow"], max_steps=2, accumulation=1),
                      train_dataset=token_dataset(8), callbacks=[cb])
    trainer.train()


def _snapshot(run_dir) -> dict[str, bytes]:
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_two_trainings_into_one_output_dir_make_two_runs_and_refusals_start_none(tmp_path, mlflow_experiment):
    uri, experiment = mlflow_experiment
    out = tmp_path / "out"
    late = HooklineCallback(grads=MLP, run_dir=out / "hookline")  # made while the directory is free
    first = HooklineCallback(grads=MLP)
    _train(out, first, seed=0)
    assert first.recorder.run_dir == out / "hookline"
    before = _snapshot(out / "hookline")
    second = HooklineCallback(grads=MLP)
    _train(out, second, seed=1)
    assert second.recorder.run_dir == out / "hookline-2"
    assert _snapshot(out / "hookline") == before  # the earlier run is untouched

    runs = experiment_runs(uri, experiment)
    assert len(runs) == 2
    assert {r.info.run_id for r in runs} == {first.recorder.mlflow_run_id, second.recorder.mlflow_run_id}
    for cb in (first, second):
        local = open_run(cb.recorder.run_dir)
        assert local.meta["mlflow_run_id"] == cb.recorder.mlflow_run_id
        assert local[f"grads[{MLP}]"]["grad_out.0"].steps.tolist() == [0, 1]
        files = artifact_files(uri, cb.recorder.mlflow_run_id)  # no empty run: each holds its own files
        assert {"hookline/manifest.json", f"hookline/grads/{MLP}.h5"} <= set(files), files
    assert numbered_run_dir(out / "hookline", resume=True) == out / "hookline-2"
    assert numbered_run_dir(out / "hookline") == out / "hookline-3"

    # refusals: when train() is called (a run_dir= that holds a run by now, a pattern that selects
    # nothing) or when the callback is made; none of them starts an MLflow run
    with pytest.raises(RunExistsError, match="already holds a run.*Leave run_dir unset"):
        _train(out, late, seed=2)
    with pytest.raises(InvalidArgumentError, match="selects no module"):
        _train(out, HooklineCallback(grads="layers.*"), seed=2)
    with pytest.raises(RunExistsError, match="already holds a run"):
        HooklineCallback(grads=MLP, run_dir=out / "hookline-2")
    assert len(experiment_runs(uri, experiment)) == 2
    assert _snapshot(out / "hookline") == before
