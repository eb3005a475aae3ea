"""Helpers for the integration tests: a tiny random-init GPT-2 and its data, reference hooks,
counting the hooks left on a model, MLflow look-ups."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

VOCAB = 64
SEQ = 8

#: torch's per-module hook tables (a hook left behind shows up in one of them)
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A 2-layer GPT-2 with random weights (nothing downloaded)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def token_dataset(n: int = 32, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Language-model examples as token ids (no tokenizer): labels are the inputs."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(output_dir, *, report_to: list[str], max_steps: int = 4, accumulation: int = 2, **kw):
    """CPU TrainingArguments for short, quiet runs (no checkpoints, no progress bar)."""
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(output_dir), max_steps=max_steps, gradient_accumulation_steps=accumulation,
                             per_device_train_batch_size=2, report_to=report_to, use_cpu=True, logging_steps=1,
                             save_strategy="no", disable_tqdm=True, dataloader_num_workers=0, **kw)


def hook_count(model: nn.Module) -> int:
    """How many torch hooks the model's modules hold, of every kind."""
    return sum(len(getattr(m, t, {})) for m in model.modules() for t in _HOOK_TABLES)


def named_modules_with_names(model: nn.Module) -> list[str]:
    """Modules that carry a ``name`` attribute (hookline's HookManager sets one while it hooks them)."""
    return [n for n, m in model.named_modules() if "name" in m.__dict__]


class Reference:
    """Plain torch hooks (no hookline) on some modules: every forward output and every
    gradient w.r.t. the output, in firing order, as the reference for hookline's records."""

    def __init__(self, modules: dict[str, nn.Module], grads: bool = True) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.grad_out: dict[str, list[torch.Tensor]] = defaultdict(list)
        self.handles = []
        for name, m in modules.items():
            self.handles.append(m.register_forward_hook(
                lambda mod, i, o, name=name: self.outputs[name].append(o.detach().clone())))
            if grads:
                self.handles.append(m.register_full_backward_hook(
                    lambda mod, gi, go, name=name: self.grad_out[name].append(go[0].detach().clone())))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def experiment_runs(uri: str, name: str) -> list:
    """Every run of the MLflow experiment ``name`` at ``uri``."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(name)
    assert exp is not None, f"no experiment {name!r} at {uri}"
    return client.search_runs([exp.experiment_id])


def artifact_files(uri: str, run_id: str, path: str = "hookline") -> list[str]:
    """Every artifact file under ``path`` of the run (recursively)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    out, todo = [], [path]
    while todo:
        for a in client.list_artifacts(run_id, todo.pop()):
            (todo if a.is_dir else out).append(a.path)
    return sorted(out)
