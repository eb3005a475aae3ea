"""Self-identifying runs for the RecordDataset and Arrow export tests, and the worker of the
two-rank test (imported by torch.multiprocessing.spawn children).

Every row says where it comes from: channel 0 is the step, 1 the call, 2 the sample (position of
the row within its record), 3 the handle's code; bfloat16 runs add channels with bit patterns
that only an exact path keeps (-0.0, a NaN payload, a denormal).
"""

from __future__ import annotations

import faulthandler
import traceback
from pathlib import Path

import numpy as np

from hookline.storage import RunWriter

HANDLES = {"outputs[a]": 1, "outputs[b]": 2}
A, B = "outputs[a]/outputs.0", "outputs[b]/outputs.0"
#: bfloat16 bit patterns in channels 4.. of bfloat16 runs: -0.0, a NaN with a payload, a denormal.
BF16_SPECIAL = np.array([0x8000, 0x7FC1, 0x0001], np.uint16)


def record(step: int, call: int, code: int, batch: int, seq: int, d: int) -> np.ndarray:
    """One (batch, seq, d) float32 record whose rows encode (step, call, sample, code)."""
    x = np.zeros((batch, seq, d), np.float32)
    x[..., 0], x[..., 1], x[..., 3] = step, call, code
    x[..., 2] = np.arange(batch * seq).reshape(batch, seq)
    return x


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 values that bfloat16 holds exactly (small integers), with the
    special patterns in channels 4..6."""
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    bits[..., 4:7] = BF16_SPECIAL
    return bits


def write_run(run_dir: Path, *, steps: int = 12, calls: int = 2, batch: int = 2, seq: int = 3, d: int = 4,
              bf16: bool = False, skip_b: tuple[int, ...] = (), labels: bool = False,
              ragged: bool = False, compression: str | None = None, merge: bool = True) -> Path:
    """A closed run with handles ``outputs[a]`` and ``outputs[b]`` (``skip_b``: steps that b did
    not record); ``labels``: a handle ``inputs[emb]`` with (batch, seq) int64 token ids equal to
    ``step * 100 + sample``; ``ragged``: seq varies with the step (``seq + step % 3``);
    ``compression``: the writer's (compressed fields are read through HDF5, plain ones from mapped
    files); ``merge=False``: a segment file per flush (a field spread over several files)."""
    d = max(d, 7) if bf16 else d
    with RunWriter(run_dir, compression=compression, merge_on_close=merge) as w:
        for h in HANDLES:
            w.add_handle(h, module_name=h[8:-1], module_type="torch.nn.Linear", category="forward_hook",
                         hook_fn_name="outputs")
        if labels:
            w.add_handle("inputs[emb]", module_name="emb", module_type="torch.nn.Embedding",
                         category="forward_pre_hook", hook_fn_name="inputs")
        for s in range(steps):
            t = seq + s % 3 if ragged else seq
            for c in range(calls):
                for h, code in HANDLES.items():
                    if h == "outputs[b]" and s in skip_b:
                        continue
                    x = record(s, c, code, batch, t, d)
                    w.write(h, s, c, {"outputs.0": (bf16_bits(x), "bfloat16") if bf16 else x})
                if labels:
                    ids = (s * 100 + np.arange(batch * t)).reshape(batch, t).astype(np.int64)
                    w.write("inputs[emb]", s, c, {"inputs.0": ids})
            if not merge and s % 4 == 3:
                w.flush()  # (seals a segment file per handle)
    return run_dir


def expected_keys(steps: int = 12, calls: int = 2, batch: int = 2, seq: int = 3, skip: tuple[int, ...] = (),
                  ragged: bool = False) -> list[tuple[int, int, int]]:
    """(step, call, sample) of every row of a :func:`write_run` run, in record order."""
    return [(s, c, k) for s in range(steps) if s not in skip for c in range(calls)
            for k in range(batch * (seq + s % 3 if ragged else seq))]


def keys_of(rows) -> list[tuple[int, int, int]]:
    """(step, call, sample) of rows (a (n, d) tensor or array whose channels encode them)."""
    arr = np.asarray(rows[:, :3], dtype=np.float64)
    return [tuple(int(v) for v in r) for r in arr]


def rank_worker(rank: int, world: int, init_file: str, run_dir: str, out_dir: str) -> None:
    """One rank of the two-rank test: read its share of a shuffled epoch through a DataLoader
    with two forked workers, and save the rows' keys (or the error)."""
    faulthandler.dump_traceback_later(150, exit=True)
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    from hookline.storage import RecordDataset

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    result: dict = {"rank": rank}
    try:
        ds = RecordDataset(run_dir, [A, B], shuffle=True, seed=3, unit_bytes=96)
        ds.set_epoch(1)
        loader = DataLoader(ds, batch_size=5, num_workers=2, multiprocessing_context="fork")
        keys, aligned = [], True
        for batch in loader:
            keys += keys_of(batch[A])
            aligned &= bool(torch.equal(batch[A][:, :3], batch[B][:, :3]))
        result.update(keys=keys, aligned=aligned, shard=ds.shard(0, 2))
        dist.barrier()
    except Exception:
        result["error"] = traceback.format_exc()
    finally:
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()
