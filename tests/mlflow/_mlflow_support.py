"""Helpers for the MLflow adapter tests: run directories with known data."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

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


def _module_name(hid: str) -> str:
    return hid[hid.index("[") + 1: -1] if "[" in hid else hid


def _fn_name(hid: str) -> str:
    return hid[: hid.index("[")] if "[" in hid else hid


def build_run(path: Path, specs: list[HandleSpec], *, records: int = 5, seed: int = 0, rank: int | None = None,
              world_size: int | None = None, close: bool = True, upto: int | None = None) -> BuiltRun:
    """Write a run directory with the real RunWriter.

    ``records`` records are generated; the first ``upto`` (default all) are written. With
    ``close=False`` the writer is left open (flushed) in ``built.writer``.
    """
    rng = np.random.default_rng(seed)
    built = BuiltRun(Path(path))
    for s in specs:
        built.data[s.handle_id] = (rng.standard_normal((records, *s.shape)) * s.scale).astype(np.float32)
        built.steps[s.handle_id] = np.arange(records, dtype=np.int64) * 10
        built.fields[s.handle_id] = s.field
    from hookline.storage import RunWriter

    w = RunWriter(path, rank=rank, world_size=world_size, fsync=False)
    for s in specs:
        w.add_handle(s.handle_id, module_name=_module_name(s.handle_id), module_type=s.module_type,
                     category=s.category, hook_fn_name=_fn_name(s.handle_id))
    append_records(built, w, 0, records if upto is None else upto)
    if close:
        w.close()
    else:
        w.flush()
        built.writer = w
    return built


def append_records(built: BuiltRun, w, start: int, stop: int) -> None:
    """Write records ``start:stop`` of ``built``'s data with the RunWriter ``w``."""
    for i in range(start, stop):
        for hid, data in built.data.items():
            w.write(hid, int(built.steps[hid][i]), 0, {built.fields[hid]: data[i].copy()})
