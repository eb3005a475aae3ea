"""Helpers for the MLflow adapter tests: run directories with known data."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from hookline.storage import handle_key

LINEAR = "torch.nn.modules.linear.Linear"
RELU = "torch.nn.modules.activation.ReLU"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass
class HandleSpec:
    """One handle of a synthetic run: ``records`` records (one per step ``0, 10, 20...``) of
    ``field`` with the given per-record shape, values ``scale * N(0, 1)``."""

    handle_id: str
    module_type: str = LINEAR
    field: str = "outputs.0"
    shape: tuple[int, ...] = (4, 3)
    scale: float = 1.0
    category: str = "forward_hook"


@dataclass
class BuiltRun:
    """A run directory plus the data written into it."""

    path: Path
    data: dict[str, np.ndarray] = field(default_factory=dict)  # handle id -> (records, *shape)
    steps: dict[str, np.ndarray] = field(default_factory=dict)
    fields: dict[str, str] = field(default_factory=dict)
    writer: object | None = None  # an open RunWriter (for build_run(..., close=False))

    def norms(self, hid: str) -> np.ndarray:
        d = self.data[hid].astype(np.float64)
        return np.sqrt((d.reshape(len(d), -1) ** 2).sum(axis=1))


def _have_writer() -> bool:
    try:
        from hookline.storage import RunWriter  # noqa: F401

        return True
    except (ImportError, AttributeError):
        return False


def _module_name(hid: str) -> str:
    return hid[hid.index("[") + 1: -1] if "[" in hid else hid


def _fn_name(hid: str) -> str:
    return hid[: hid.index("[")] if "[" in hid else hid


def build_run(path: Path, specs: list[HandleSpec], *, records: int = 5, seed: int = 0, rank: int | None = None,
              world_size: int | None = None, close: bool = True) -> BuiltRun:
    """Write a run directory with the real RunWriter (plain h5py + manifest until it exists)."""
    rng = np.random.default_rng(seed)
    built = BuiltRun(Path(path))
    for s in specs:
        built.data[s.handle_id] = (rng.standard_normal((records, *s.shape)) * s.scale).astype(np.float32)
        built.steps[s.handle_id] = np.arange(records, dtype=np.int64) * 10
        built.fields[s.handle_id] = s.field
    if _have_writer():
        from hookline.storage import RunWriter

        w = RunWriter(path, rank=rank, world_size=world_size)
        for s in specs:
            w.add_handle(s.handle_id, module_name=_module_name(s.handle_id), module_type=s.module_type,
                         category=s.category, hook_fn_name=_fn_name(s.handle_id))
        for i in range(records):
            for s in specs:
                w.write(s.handle_id, int(built.steps[s.handle_id][i]), 0, {s.field: built.data[s.handle_id][i].copy()})
        if close:
            w.close()
        else:
            w.flush()
            built.writer = w
        return built
    import h5py

    path.mkdir(parents=True, exist_ok=True)
    suffix = f".rank{rank}" if world_size and world_size > 1 else ""
    man = {"format": "hookline-run", "format_version": 1, "hookline_version": "0.1.0",
           "created": "2026-11-22T04:40:00+00:00", "status": "closed", "rank": rank, "world_size": world_size,
           "meta": {}, "handles": {}}
    for s in specs:
        key = handle_key(s.handle_id)
        rel = f"{key}{suffix}.h5"
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        with h5py.File(path / rel, "w") as f:
            f["step"] = built.steps[s.handle_id]
            f["call"] = np.zeros(records, np.int64)
            f[s.field] = built.data[s.handle_id]
        man["handles"][s.handle_id] = {
            "key": key, "file": rel, "module_name": _module_name(s.handle_id), "module_type": s.module_type,
            "category": s.category, "hook_fn_name": _fn_name(s.handle_id), "records": records,
            "bytes": int(built.data[s.handle_id].nbytes), "dropped": 0, "steps": [0, int(built.steps[s.handle_id][-1])],
            "fields": {s.field: {"dtype": "float32", "shape": list(s.shape)}}, "meta": {}}
    (path / f"manifest{suffix}.json").write_text(json.dumps(man))
    return built
