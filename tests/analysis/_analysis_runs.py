"""Runs for the analysis tests, written with the real RunWriter (imported as a top-level module:
tests have no packages)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hookline.storage import RunWriter

HID = "outputs[fc1]"
GID = "grads[fc1]"
SID = "outputs.stats[fc2]"
STATS = ("norm", "mean", "std", "min", "max", "absmax")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 values (truncated: exact values of the stored field)."""
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def write_run(path: Path, n: int = 12, seed: int = 0, rank: int | None = None, world_size: int | None = None,
              close: bool = True, flush_every: int | None = None) -> RunWriter:
    """A run of ``n`` records at steps ``i // 2`` (two calls per step) of three handles:

    * ``outputs[fc1]``: ``outputs.0`` float32 (4, 8), ``outputs.1`` int64 ragged, ``outputs.2``
      bfloat16 (3,);
    * ``grads[fc1]``: ``grad_out.0`` float32 (4, 8) on even records only;
    * ``outputs.stats[fc2]``: a ``mode="stats"`` handle (``outputs.0.<stat>`` scalars and a 4-bin
      ``outputs.0.hist``), as the Recorder writes it.
    """
    rng = np.random.default_rng(seed)
    w = RunWriter(path, rank=rank, world_size=world_size, fsync=False)
    w.add_handle(HID, module_name="fc1", module_type="torch.nn.modules.linear.Linear", category="forward_hook",
                 hook_fn_name="outputs")
    w.add_handle(GID, module_name="fc1", module_type="torch.nn.modules.linear.Linear", category="backward_hook",
                 hook_fn_name="grads")
    w.add_handle(SID, module_name="fc2", module_type="torch.nn.modules.linear.Linear", category="forward_hook",
                 hook_fn_name="outputs.stats", meta={"stats": [*STATS, "hist"], "hist_edges": [-2, -1, 0, 1, 2]})
    for i in range(n):
        x = rng.standard_normal((4, 8)).astype(np.float32)
        w.write(HID, i // 2, i % 2, {"outputs.0": x, "outputs.1": np.arange(i % 3 + 1, dtype=np.int64) * i,
                                     "outputs.2": (bf16_bits(x[0, :3]), "bfloat16")})
        w.write(GID, i // 2, i % 2, {"grad_out.0": -x} if i % 2 == 0 else {})
        stats = {f"outputs.0.{s}": np.float64(v) for s, v in zip(
            STATS, [np.linalg.norm(x), x.mean(), x.std(), x.min(), x.max(), np.abs(x).max()])}
        stats["outputs.0.hist"] = np.histogram(x, bins=4, range=(-2, 2))[0].astype(np.float64)
        w.write(SID, i // 2, i % 2, stats)
        if flush_every and (i + 1) % flush_every == 0:
            w.flush()
    if close:
        w.close()
    return w


def write_big(path: Path, records: int, shape: tuple[int, ...] = (128, 128), dtype=np.float32) -> np.ndarray:
    """One handle ``outputs[big]`` with ``records`` records of ``shape`` (64 KiB each at the
    default: 16 per 1 MiB storage chunk); returns the data written."""
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((records, *shape)) * 100).astype(dtype)
    w = RunWriter(path, fsync=False)
    w.add_handle("outputs[big]", module_name="big", module_type="torch.nn.modules.linear.Linear",
                 category="forward_hook", hook_fn_name="outputs")
    for i in range(records):
        w.write("outputs[big]", i, 0, {"outputs.0": data[i].copy()})
    w.close()
    return data
