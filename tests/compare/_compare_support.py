"""Helpers for the representation-comparison tests: runs written with the real RunWriter, runs
recorded from real torch models, direct numpy references of the metrics."""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np


def write_run(path: Path, records: Mapping[str, Sequence[np.ndarray]], *, steps: Sequence[int] | None = None) -> Path:
    """A run with one handle ``outputs[<module>]`` per entry of ``records`` (module -> one array per step)."""
    from hookline.storage import RunWriter

    w = RunWriter(path)
    for mod, arrays in records.items():
        hid = f"outputs[{mod}]"
        w.add_handle(hid, module_name=mod, module_type="torch.nn.modules.linear.Linear", category="forward_hook",
                     hook_fn_name="outputs")
        for k, a in enumerate(arrays):
            w.write(hid, k if steps is None else steps[k], 0, {"outputs.0": np.ascontiguousarray(a)})
    w.close()
    return Path(path)


def record_model(path: Path, model, inputs: Sequence, pattern: str = "*") -> Path:
    """Record the Linear outputs of ``model`` (selected by ``pattern``) for each input, one step each."""
    import torch

    from hookline.tracker import HookManager, Recorder, select

    mgr = HookManager()
    with Recorder(path) as rec, torch.no_grad():
        mgr.register_forward_hook(rec.outputs, **select(model, pattern, types=torch.nn.Linear))
        for step, x in enumerate(inputs):
            with rec.step(step):
                model(x)
    return Path(path)


def mlp(seed: int = 0, d: int = 8):
    """A tiny MLP (fc1 -> tanh -> fc2) on ``d`` features."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(d, d), act=torch.nn.Tanh(), fc2=torch.nn.Linear(d, d)))


def centred(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x - x.mean(axis=0)


def ref_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA as Kornblith et al. write it, on (samples, features) matrices."""
    x, y = centred(x), centred(y)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def ref_procrustes(x: np.ndarray, y: np.ndarray) -> float:
    """Angular Procrustes distance: the optimal orthogonal map solved explicitly (narrower side
    zero-padded), then the angle between ``x`` and the mapped ``y``."""
    x, y = centred(x), centred(y)
    w = max(x.shape[1], y.shape[1])
    x = np.pad(x, ((0, 0), (0, w - x.shape[1]))) / np.linalg.norm(x)
    y = np.pad(y, ((0, 0), (0, w - y.shape[1]))) / np.linalg.norm(y)
    u, _, vt = np.linalg.svd(y.T @ x)
    return float(np.arccos(np.clip(np.sum(x * (y @ (u @ vt))), -1.0, 1.0)))


#: metric name -> its numpy reference.
REFS = {"cka": ref_cka, "procrustes": ref_procrustes}
