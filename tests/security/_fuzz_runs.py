"""The base runs the fuzz suite mutates, their original records, and the sentinel check.

``record_rec`` records a closed run with the real Recorder (a Linear applied to a batch whose
length varies per step, so its outputs and gradients are ragged, and a Linear with a fixed shape).
``record_seg`` writes a run with :class:`~hookline.storage.RunWriter` that closes without merging
(several sealed segments per handle, a field that turns ragged, an int64 field, records without a
gradient). The same function with another seed records the *sentinel* run: same names, other
values, so data read from the sentinel instead of the run does not pass as correct.
"""

from __future__ import annotations

import hashlib
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from _fuzz_mutations import FILES, HANDLES


def record_rec(run_dir: Path, seed: int) -> Path:
    """A closed run recorded by the Recorder: outputs and grads of ``fc1`` (ragged) and ``head``."""
    import torch

    from hookline.tracker import HookManager, Recorder, select

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 16)
            self.head = torch.nn.Linear(16, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(torch.tanh(self.fc1(x)).mean(0, keepdim=True))

    torch.manual_seed(seed)
    model, gen, mgr = Net(), torch.Generator().manual_seed(seed + 1), HookManager()
    with Recorder(run_dir, every=1) as rec:
        layers = select(model, "*", types=torch.nn.Linear)
        mgr.register_forward_hook(rec.outputs, **layers)
        mgr.register_backward_hook(rec.grads, **layers)
        for step in range(10):
            with rec.step(step):
                model(torch.randn(2 + step % 4, 8, generator=gen)).pow(2).sum().backward()
    return run_dir


def record_seg(run_dir: Path, seed: int) -> Path:
    """A run of sealed segments (closed with ``merge_on_close=False``, flushed every 4 records)."""
    from hookline.storage import RunWriter

    rng = np.random.default_rng(seed)
    w = RunWriter(run_dir, merge_on_close=False, meta={"seed": seed})
    for hid in HANDLES["seg"]:
        kind = hid.split("[")[0]
        w.add_handle(hid, module_name="a", module_type="torch.nn.modules.linear.Linear",
                     category="forward_hook" if kind == "outputs" else "backward_hook", hook_fn_name=kind)
    for i in range(12):
        w.write("outputs[a]", i, 0, {"outputs.0": rng.standard_normal((3, 4)).astype(np.float32),
                                     "outputs.1": np.arange(i % 3 + 1, dtype=np.int64) + seed})
        grad = {"grad_out.0": rng.standard_normal((i % 4 + 1, 4)).astype(np.float32)} if i % 2 == 0 else {}
        w.write("grads[a]", i, 0, grad)
        if i % 4 == 3:
            w.flush()
    w.close()
    return run_dir


RECORDERS = {"rec": record_rec, "seg": record_seg}


@dataclass
class Original:
    """The records of one base run, as the reader returns them from the undamaged files.

    Attributes:
        records: handle id -> field -> (step, call) -> record.
        norms: handle id -> field -> (step, call) -> stored norm (float fields only).
        counts: handle id -> records of the handle.
        digests: sha256 of every file of the run (relative path -> hex).
    """

    records: dict[str, dict[str, dict[tuple[int, int], np.ndarray]]]
    norms: dict[str, dict[str, dict[tuple[int, int], float]]]
    counts: dict[str, int]
    digests: dict[str, str]


def read_original(run_dir: Path, base: str) -> Original:
    """The records of an undamaged base run (checked against the names the plan expects)."""
    from hookline.storage import open_run

    records: dict = {}
    norms: dict = {}
    counts: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (an undamaged run reads without a warning)
        with open_run(run_dir) as run:
            assert sorted(run.handles) == sorted(HANDLES[base]), run.handles
            for hid in run.handles:
                h = run[hid]
                assert h.fields == HANDLES[base][hid][1] and not h.problems, (hid, h.fields, h.problems)
                counts[hid] = len(h)
                records[hid], norms[hid] = {}, {}
                for name in h.fields:
                    f = h[name]
                    keys = list(zip(f.steps.tolist(), f.calls.tolist()))
                    assert len(set(keys)) == len(keys) > 0, (hid, name, keys)
                    records[hid][name] = {k: np.asarray(f[i]) for i, k in enumerate(keys)}
                    if f.dtype.kind in "fc":
                        norms[hid][name] = dict(zip(keys, f.norms().tolist()))
    for rel in FILES[base]:
        assert (run_dir / rel).is_file(), f"the base run {base!r} lacks {rel}"
    return Original(records, norms, counts, file_digests(run_dir))


def file_digests(root: Path) -> dict[str, str]:
    """sha256 of every regular file under ``root`` (not following symlinks)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            p = Path(dirpath, name)
            if p.is_file() and not p.is_symlink():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -------------------------------------------------------------------------------------------- sentinel
def snapshot(ws: Path, run: Path) -> dict[str, Any]:
    """Everything under ``ws`` except ``run``: type, mode, size, mtime and bytes' sha256 of every
    entry (symlinks not followed), and the listing of ``ws`` and of its parent."""
    out: dict[str, Any] = {"<parent>": sorted(os.listdir(ws.parent))}
    for dirpath, dirs, files in os.walk(ws):
        here = Path(dirpath)
        if here == run:
            dirs[:] = []
            continue
        for name in sorted(dirs + files):
            p = here / name
            if p == run:
                continue
            st = p.lstat()
            digest = None
            if stat.S_ISREG(st.st_mode):
                digest = hashlib.sha256(p.read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                digest = os.readlink(p)
            out[str(p.relative_to(ws))] = (stat.S_IFMT(st.st_mode), st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def snapshot_diff(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """What changed between two :func:`snapshot` results (empty when nothing did)."""
    out = []
    for k in sorted(before.keys() | after.keys()):
        if k not in after:
            out.append(f"{k} removed")
        elif k not in before:
            out.append(f"{k} created")
        elif before[k] != after[k]:
            out.append(f"{k} changed ({before[k]} -> {after[k]})" if k == "<parent>" else f"{k} changed")
    return out
