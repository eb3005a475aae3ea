"""One rank of the Hugging Face Trainer under ``torchrun --nproc_per_node 2`` (DDP on gloo, CPU),
recording with HooklineCallback; writes what it saw to ``<out>/rank<r>.json``.

Usage: python -m torch.distributed.run --standalone --nproc_per_node 2 _hf_ddp_worker.py OUT_DIR [fail]

With ``fail``, rank 1 raises in its second forward (step 1) while rank 0 goes on into the
gradient all-reduce that rank 1 never joins: rank 1 must close its recording alone and exit (1),
and torchrun then stops rank 0.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from _integ_support import Reference, hook_count, tiny_gpt2, token_dataset, training_args
from transformers import Trainer

from hookline.tracker import select
from hookline.tracker.integrations.transformers import HooklineCallback


def main(out: Path, fail: bool) -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    model = tiny_gpt2()
    baseline = hook_count(model)
    ref = Reference(select(model, "transformer.h.0.mlp"), grads=False)
    cb = HooklineCallback(outputs="transformer.h.0.mlp", grads="transformer.h.1.mlp")
    args = training_args(out / "trainer", report_to=["mlflow"], max_steps=2, accumulation=1, ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=token_dataset(), callbacks=[cb])
    if fail and rank == 1:
        forwards = []

        def explode(module, args):
            forwards.append(1)
            if len(forwards) == 2:
                raise RuntimeError("boom on rank 1")

        model.lm_head.register_forward_pre_hook(explode)
        try:
            trainer.train()
        except RuntimeError as e:
            closed = "closed=True" in repr(cb.recorder)
            (out / "rank1.json").write_text(json.dumps({"error": str(e), "closed": closed,
                                                        "run_id": cb.recorder.mlflow_run_id}))
            sys.exit(1)
    trainer.train()
    ref.remove()
    outputs = [t.tolist() for t in ref.outputs["transformer.h.0.mlp"]]
    result = {"rank": rank, "world_size": trainer.args.world_size, "run_id": cb.recorder.mlflow_run_id,
              "ddp": type(trainer.model_wrapped).__name__, "hooks_left": hook_count(model) - baseline,
              "outputs": outputs}
    (out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:] == ["fail"])
