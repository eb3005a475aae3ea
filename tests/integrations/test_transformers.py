"""The Hugging Face Trainer callback with the real Trainer, a tiny random-init GPT-2 and the real
MLflow server (SPEC §11)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers", reason="the transformers extra is part of hookline[test]")

from _integ_support import (  # noqa: E402
    Reference,
    artifact_files,
    experiment_runs,
    hook_count,
    named_modules_with_names,
    tiny_gpt2,
    token_dataset,
    training_args,
)
from transformers import Trainer  # noqa: E402

from hookline.storage import open_run  # noqa: E402
from hookline.storage.errors import HookTypeError, InvalidArgumentError, WriterClosedError  # noqa: E402
from hookline.tracker import select  # noqa: E402
from hookline.tracker.integrations.transformers import HooklineCallback  # noqa: E402

MLP = "transformer.h.?.mlp"


@pytest.mark.parametrize("order", ["after_mlflow", "before_mlflow"])
def test_trainer_records_optimizer_steps_and_micro_batches_into_the_trainers_mlflow_run(
        tmp_path, mlflow_experiment, order):
    """``after_mlflow``: the usual order (the Trainer's MLflowCallback starts its run before
    hookline's callback begins and ends it before hookline's closes: the upload lands in the
    finished run). ``before_mlflow``: hookline's callback first, it has the MLflowCallback start
    its run."""
    uri, experiment = mlflow_experiment
    model = tiny_gpt2()
    baseline = hook_count(model)
    ref = Reference(select(model, MLP))  # plain torch hooks in the same run
    cb = HooklineCallback(outputs=MLP, grads=MLP, every=2)
    trainer = Trainer(model=model, args=training_args(tmp_path / "out", report_to=["mlflow"]),
                      train_dataset=token_dataset(), callbacks=[cb])
    names = [type(c).__name__ for c in trainer.callback_handler.callbacks]
    assert names.index("MLflowCallback") < names.index("HooklineCallback")
    if order == "before_mlflow":
        trainer.callback_handler.callbacks.remove(cb)
        trainer.callback_handler.callbacks.insert(0, cb)
    trainer.train()
    ref.remove()

    # hooks off, recorder closed
    assert hook_count(model) == baseline and named_modules_with_names(model) == []
    with pytest.raises(WriterClosedError):
        cb.recorder.flush()
    # max_steps=4, 2 micro-batches per step, every=2: steps 0 and 2, calls 0 and 1 of each
    run = open_run(tmp_path / "out" / "hookline")  # the default run_dir: <output_dir>/hookline
    assert run.status == "closed"
    assert sorted(run.handles) == ["grads[transformer.h.0.mlp]", "grads[transformer.h.1.mlp]",
                                   "outputs[transformer.h.0.mlp]", "outputs[transformer.h.1.mlp]"]
    micro = [0, 1, 4, 5]  # the forwards (and backwards) of steps 0 and 2, in order
    for name in ("transformer.h.0.mlp", "transformer.h.1.mlp"):
        assert len(ref.outputs[name]) == len(ref.grad_out[name]) == 8
        out = run[f"outputs[{name}]"]["outputs.0"]
        grad = run[f"grads[{name}]"]["grad_out.0"]
        for f in (out, grad):
            assert f.steps.tolist() == [0, 0, 2, 2] and f.calls.tolist() == [0, 1, 0, 1]
        for i, m in enumerate(micro):
            np.testing.assert_array_equal(out[i], ref.outputs[name][m].numpy())
            np.testing.assert_array_equal(grad[i], ref.grad_out[name][m].numpy())

    # one MLflow run: the Trainer's (with its loss), holding hookline's files, tags and metrics
    (mlrun,) = experiment_runs(uri, experiment)
    assert mlrun.info.run_id == cb.recorder.mlflow_run_id
    assert "loss" in mlrun.data.metrics and mlrun.info.status == "FINISHED"
    assert any(k.startswith("hookline") for k in mlrun.data.tags)
    assert any(k.startswith("hookline.grads/transformer.h.0.mlp/") for k in mlrun.data.metrics)
    files = artifact_files(uri, mlrun.info.run_id)
    assert {"hookline/outputs/transformer.h.0.mlp.h5", "hookline/grads/transformer.h.1.mlp.h5",
            "hookline/manifest.json"} <= set(files), files
    remote = open_run(f"runs:/{mlrun.info.run_id}", tracking_uri=uri, cache_dir=tmp_path / "cache")
    np.testing.assert_array_equal(remote["grads[transformer.h.1.mlp]"]["grad_out.0"].read(),
                                  run["grads[transformer.h.1.mlp]"]["grad_out.0"].read())


@pytest.mark.parametrize("how, error", [("constructor", RuntimeError), ("add_callback", KeyboardInterrupt)])
def test_a_step_that_raises_closes_the_recorder_and_removes_the_hooks(tmp_path, how, error):
    """Trainer calls no callback when training raises: the callback's guard closes the recorder."""
    model = tiny_gpt2()
    baseline = hook_count(model)
    forwards = []

    def explode(module, args):  # the 4th forward (step 1, call 1) raises before the loss
        forwards.append(1)
        if len(forwards) == 4:
            raise error("boom in step 1")

    handle = model.lm_head.register_forward_pre_hook(explode)
    cb = HooklineCallback(outputs=MLP, grads=MLP, run_dir=tmp_path / "rec")
    args = training_args(tmp_path / "out", report_to=[])
    if how == "constructor":
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset(), callbacks=[cb])
    else:
        trainer = Trainer(model=model, args=args, train_dataset=token_dataset())
        trainer.add_callback(cb)
    with pytest.raises(error, match="boom in step 1"):
        trainer.train()
    handle.remove()

    assert hook_count(model) == baseline and named_modules_with_names(model) == []
    with pytest.raises(WriterClosedError):
        cb.recorder.flush()
    assert cb.recorder.mlflow_run_id is None  # no report_to: recorded locally only
    run = open_run(tmp_path / "rec")
    assert run.status == "closed"
    out = run["outputs[transformer.h.0.mlp]"]["outputs.0"]
    grad = run["grads[transformer.h.0.mlp]"]["grad_out.0"]
    assert list(zip(out.steps.tolist(), out.calls.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert list(zip(grad.steps.tolist(), grad.calls.tolist())) == [(0, 0), (0, 1), (1, 0)]  # no backward of the 4th
    assert all(np.isfinite(out[i]).all() for i in range(4))


def test_evaluation_between_steps_is_not_recorded(tmp_path):
    model = tiny_gpt2()
    cb = HooklineCallback(outputs="transformer.h.0.mlp")
    args = training_args(tmp_path / "out", report_to=[], max_steps=2, accumulation=1,
                         eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(), eval_dataset=token_dataset(8, seed=2),
                      callbacks=[cb])
    trainer.train()
    f = open_run(tmp_path / "out" / "hookline")["outputs[transformer.h.0.mlp]"]["outputs.0"]
    assert f.steps.tolist() == [0, 1] and f.calls.tolist() == [0, 0]  # 2 training forwards, not the 4 evaluation ones
    assert f[0].shape == (2, 8, 32)


def test_bad_keywords_fail_when_the_callback_is_made(tmp_path):
    with pytest.raises(InvalidArgumentError, match="records nothing"):
        HooklineCallback()
    with pytest.raises(HookTypeError, match="unknown keyword 'evry'.*did you mean 'every'"):
        HooklineCallback(outputs="*", evry=2)
    with pytest.raises(HookTypeError, match="outputs= takes a select pattern"):
        HooklineCallback(outputs=3)
    with pytest.raises(InvalidArgumentError, match="unknown capture mode 'stat'"):
        HooklineCallback(outputs="*", mode="stat")
    with pytest.raises(InvalidArgumentError, match="every must be a positive int"):
        HooklineCallback(outputs="*", every=0)


def test_a_pattern_that_selects_nothing_fails_before_anything_is_recorded(tmp_path):
    model = tiny_gpt2()
    baseline = hook_count(model)
    cb = HooklineCallback(outputs=["transformer.h.?.mlp", "transformer.blocks.*"], run_dir=tmp_path / "rec")
    trainer = Trainer(model=model, args=training_args(tmp_path / "out", report_to=[]),
                      train_dataset=token_dataset(), callbacks=[cb])
    with pytest.raises(InvalidArgumentError, match=r"outputs='transformer.blocks.\*' selects no module.*'transformer'"):
        trainer.train()
    assert not (tmp_path / "rec").exists() and hook_count(model) == baseline


def test_a_batch_size_retry_within_one_train_call_keeps_recording(tmp_path):
    """auto_find_batch_size: an out-of-memory step is retried with half the batch inside the same
    train(); on_train_begin comes again, and the same recording goes on."""
    model = tiny_gpt2()
    baseline = hook_count(model)
    forwards = []

    def out_of_memory_once(module, args):
        forwards.append(args[0].shape[0])
        if len(forwards) == 2:  # step 0, call 1 (before the loss: no backward of it)
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    handle = model.lm_head.register_forward_pre_hook(out_of_memory_once)
    cb = HooklineCallback(outputs="transformer.h.0.mlp")
    args = training_args(tmp_path / "out", report_to=[], max_steps=1, auto_find_batch_size=True)
    Trainer(model=model, args=args, train_dataset=token_dataset(), callbacks=[cb]).train()
    handle.remove()
    assert forwards == [2, 2, 1, 1]  # the retry ran with half the batch
    assert hook_count(model) == baseline
    f = open_run(tmp_path / "out" / "hookline")["outputs[transformer.h.0.mlp]"]["outputs.0"]
    assert f.steps.tolist() == [0, 0, 0, 0] and f.calls.tolist() == [0, 1, 2, 3]
    assert [f[i].shape[0] for i in range(4)] == [2, 2, 1, 1]
