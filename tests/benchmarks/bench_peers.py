"""hookline beside what people use today, on two realistic models (issue 25's peers table).

Run:  python tests/benchmarks/bench_peers.py [--models m1,m2] [--modes forward,train]
                                             [--variants none,hookline,list,disk,...]
                                             [--rounds 7] [--steps 6] [--load]

Models (torch with one intra-op thread, as in bench_capture.py):
  M1  8 x (Linear(1024) + GELU), batch 256;
  M2  4-layer ``nn.TransformerEncoder`` (d_model 256, 4 heads, seq 128, batch 16, dropout 0,
      train mode so the encoder takes the per-module path, not the fused fast path).
Every submodule's output is captured every step ("forward"), and in "train" also every
submodule's output gradient (a backward hook), then ``loss.backward()``.

Variants, timed in interleaved rounds (the order shuffled each round) in this one process:
  none       no hooks (the reference);
  hookline   ``Recorder(every=1)`` outputs (+ grads) into its HDF5 run;
  list       hooks appending ``.detach().clone()`` to Python lists (cleared between rounds);
  naive      hooks writing each record straight to h5py (``resize`` by one + write, chunks=True);
  disk       the floor of any capture that keeps the bytes on this disk: hooks that clone each
             tensor (the snapshot every asynchronous recorder takes) and hand it to a thread that
             ``pwrite``\ s it to one file, with writeback started every 32 MiB, at most 512 MB
             waiting (the Recorder's default budget: the hook waits beyond it) and an ``fsync``
             at the end (not a hookline variant: a list of clones that also reaches the disk);
  torchlens  ``torchlens.trace(model, x)`` (saves every op's output by default) (forward only; skipped if not installed);
  nnsight    ``NNsight(model).trace(x)`` saving every module's output (forward only; likewise).

Printed per model and mode, each as a median over rounds with the (min, max) across rounds:
  step   wall time per step / none;
  cpu    process CPU time per step (every thread: the training thread and any writer) / none;
  cpu/MB CPU seconds added per captured MB, and its ratio to the list baseline's.
torchlens and nnsight are not hookline dependencies: install them beside it to compare
(``pip install torchlens nnsight``; torchlens 2.36 and nnsight 0.8 were used with torch 2.13).

``--load`` starts one busy process per core beside the benchmark, so that no core is idle for a
background writer to hide in (real training keeps every core busy: data loading, other ranks).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import h5py
import numpy as np
import torch
import torch.nn as nn

from hookline.tracker import HookManager, Recorder

Step = Callable[[], None]


def build(name: str) -> tuple[nn.Module, torch.Tensor]:
    """Return model ``name`` ('m1' or 'm2') and its input batch."""
    torch.manual_seed(0)
    if name == "m1":
        layers: list[nn.Module] = []
        for _ in range(8):
            layers += [nn.Linear(1024, 1024), nn.GELU()]
        model, x = nn.Sequential(*layers), torch.randn(256, 1024)
    else:
        layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.0, batch_first=True)
        model, x = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), torch.randn(16, 128, 256)
    INPUTS[id(model)] = x
    return model, x


_CALLED: dict[int, dict[str, nn.Module]] = {}


def modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every submodule the forward calls (not the root), in the order their outputs appear.

    Containers never called (``layers``) and modules used only through their weights
    (MultiheadAttention's ``out_proj``) have no output to capture; nnsight also needs this order.
    """
    if id(model) not in _CALLED:
        order: list[str] = []
        names = {m: n for n, m in model.named_modules() if n}
        hs = [m.register_forward_hook(lambda m, i, o: order.append(names[m])) for m in names]
        with torch.no_grad():
            model(INPUTS[id(model)])
        for h in hs:
            h.remove()
        byname = dict(model.named_modules())
        _CALLED[id(model)] = {n: byname[n] for n in dict.fromkeys(order)}
    return _CALLED[id(model)]


INPUTS: dict[int, torch.Tensor] = {}


def first_tensor(out) -> torch.Tensor | None:
    """The output tensor of a module (MultiheadAttention returns a tuple)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def make_step(model: nn.Module, x: torch.Tensor, train: bool) -> Step:
    """One training step (forward + backward) or one forward under no_grad."""
    if train:
        def step() -> None:
            model.zero_grad(set_to_none=True)
            out = model(x)
            out.float().pow(2).mean().backward()
    else:
        def step() -> None:
            with torch.no_grad():
                model(x)
    return step


class Variant:
    """A way of capturing: ``arm`` installs it, ``run`` does one step, ``end_round`` drops RAM."""

    def __init__(self, name: str) -> None:
        self.name = name

    def arm(self, model: nn.Module, x: torch.Tensor, train: bool, tmp: Path) -> None:
        self.step = make_step(model, x, train)

    def run(self, i: int) -> None:
        self.step()

    def end_round(self) -> None:
        pass

    def close(self) -> None:
        pass


class HooklineVariant(Variant):
    #: extra Recorder arguments (bench_contention.py sets the writer's priority)
    recorder_kw: dict = {}

    def arm(self, model, x, train, tmp):
        self.step = make_step(model, x, train)
        self.rec = Recorder(tmp / "hookline", every=1, **self.recorder_kw)
        self.mgr = HookManager()
        mods = modules(model)
        self.mgr.register_forward_hook(self.rec.outputs, **mods)
        if train:
            self.mgr.register_backward_hook(self.rec.grads, **mods)
        self.mgr.deactivate_all_hooks()  # the model is shared: off while other variants run

    def run(self, i):
        self.mgr.activate_all_hooks()
        with self.rec.step(i):
            self.step()
        self.mgr.deactivate_all_hooks()

    def close(self):
        self.rec.close()
        self.mgr.remove_all_hooks()


class TorchHookVariant(Variant):
    """Plain torch hooks calling ``sink(name, tensor)``; subclasses define the sink."""

    def arm(self, model, x, train, tmp):
        self.step = make_step(model, x, train)
        self.active = False
        self.handles = []
        for name, mod in modules(model).items():
            self.handles.append(mod.register_forward_hook(self._fwd(name)))
            if train:
                self.handles.append(mod.register_full_backward_hook(self._bwd(name + ".grad")))
        self.open(tmp)

    def _fwd(self, name):
        def hook(mod, inp, out):
            t = first_tensor(out)
            if self.active and t is not None:
                self.sink(name, t)
        return hook

    def _bwd(self, name):
        def hook(mod, gin, gout):
            t = first_tensor(gout)
            if self.active and t is not None:
                self.sink(name, t)
        return hook

    def open(self, tmp: Path) -> None:
        pass

    def run(self, i):
        self.active = True
        self.step()
        self.active = False

    def close(self):
        for h in self.handles:
            h.remove()


class ListVariant(TorchHookVariant):
    def open(self, tmp):
        self.store: dict[str, list[torch.Tensor]] = {}

    def sink(self, name, t):
        self.store.setdefault(name, []).append(t.detach().clone())

    def end_round(self):
        self.store.clear()


class NaiveVariant(TorchHookVariant):
    def open(self, tmp):
        self.f = h5py.File(tmp / "naive.h5", "w")

    def sink(self, name, t):
        a = t.detach().float().numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
        if name not in self.f:
            self.f.create_dataset(name, shape=(0, *a.shape), maxshape=(None, *a.shape),
                                  dtype=a.dtype, chunks=True)
        ds = self.f[name]
        ds.resize(ds.shape[0] + 1, axis=0)
        ds[-1] = a

    def close(self):
        super().close()
        self.f.close()


#: Bytes between two writeback kicks of the floor's ``pwrite`` loop (the writer's own: 32 MiB).
KICK_BYTES = 32 << 20


def pwrite_kicked(fd: int, b: np.ndarray, off: int, since: int) -> int:
    """``pwrite`` ``b`` at ``off``; every :data:`KICK_BYTES` start writeback of what was written
    and drop the pages written before, as the writer does. Returns the bytes since the last kick."""
    os.pwrite(fd, b, off)
    since += b.nbytes
    if since >= KICK_BYTES:
        end = off + b.nbytes
        if hasattr(os, "sync_file_range"):
            os.sync_file_range(fd, end - since, since, os.SYNC_FILE_RANGE_WRITE)
        os.posix_fadvise(fd, 0, max(0, end - 2 * since), os.POSIX_FADV_DONTNEED)
        since = 0
    return since


class DiskFloorVariant(TorchHookVariant):
    """Clones handed to a thread that writes them with ``pwrite`` (see the module docstring)."""

    BUDGET = 512 << 20

    def open(self, tmp):
        import queue
        import threading

        self.fd = os.open(tmp / "floor.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        self.q: queue.Queue = queue.Queue()
        self.cond = threading.Condition()
        self.waiting = 0  # bytes queued and not yet written
        self.off = 0
        self.thread = threading.Thread(target=self._write, daemon=True)
        self.thread.start()

    def sink(self, name, t):
        c = t.detach().clone(memory_format=torch.contiguous_format)
        with self.cond:
            while self.waiting + c.nbytes > self.BUDGET and self.waiting:
                self.cond.wait()
            self.waiting += c.nbytes
        self.q.put(c)

    def _write(self):
        since = 0
        while True:
            c = self.q.get()
            if c is None:
                return
            b = (c.view(torch.uint8) if c.dtype == torch.bfloat16 else c).numpy()
            since = pwrite_kicked(self.fd, b, self.off, since)
            self.off += b.nbytes
            with self.cond:
                self.waiting -= c.nbytes
                self.cond.notify_all()

    def close(self):
        # (like the Recorder's writer, its backlog is written on while other variants run)
        super().close()
        self.q.put(None)
        self.thread.join()
        os.fsync(self.fd)
        os.close(self.fd)


class TorchlensVariant(Variant):
    def arm(self, model, x, train, tmp):
        import torchlens
        self.model, self.x, self.tl = model, x, torchlens

    def run(self, i):
        self.trace = self.tl.trace(self.model, self.x)  # saves every layer by default

    def end_round(self):
        self.trace = None


class NnsightVariant(Variant):
    def arm(self, model, x, train, tmp):
        from nnsight import NNsight
        self.nm, self.x = NNsight(model), x
        self.names = list(modules(model))

    def run(self, i):
        subs = [self.nm.get(n) if hasattr(self.nm, "get") else _attr(self.nm, n) for n in self.names]
        with torch.no_grad(), self.nm.trace(self.x):
            self.saved = [s.output.save() for s in subs]

    def end_round(self):
        self.saved = None


def _attr(root, dotted: str):
    for part in dotted.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


VARIANTS = {"none": Variant, "hookline": HooklineVariant, "list": ListVariant,
            "naive": NaiveVariant, "disk": DiskFloorVariant, "torchlens": TorchlensVariant,
            "nnsight": NnsightVariant}


def captured_bytes(model: nn.Module, x: torch.Tensor, train: bool) -> int:
    """Bytes one step captures (what the list variant keeps)."""
    v = ListVariant("list")
    with tempfile.TemporaryDirectory() as d:
        v.arm(model, x, train, Path(d))
        v.run(0)
        n = sum(t.nbytes for ts in v.store.values() for t in ts)
        v.close()
    return n


def interleave(variants: list[Variant], rounds: int, steps: int, clock: Callable[[], float] = time.process_time,
               before_round: Callable[[], None] | None = None) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Warm every variant up with one step, then time ``steps`` steps of each in ``rounds``
    rounds, in a shuffled order per round. Returns per-round seconds per step: wall, ``clock``."""
    for v in variants:  # warm-up: allocator, lazy imports, first HDF5 files
        v.run(0)
        v.end_round()
    wall: dict[str, list[float]] = {v.name: [] for v in variants}
    cpu: dict[str, list[float]] = {v.name: [] for v in variants}
    i = 1
    for _ in range(rounds):
        if before_round is not None:
            before_round()
        random.shuffle(variants)
        for v in variants:
            w0, c0 = time.perf_counter(), clock()
            for _ in range(steps):
                v.run(i)
                i += 1
            wall[v.name].append((time.perf_counter() - w0) / steps)
            cpu[v.name].append((clock() - c0) / steps)
            v.end_round()
    return wall, cpu


def measure(model_name: str, train: bool, names: list[str], rounds: int, steps: int) -> None:
    model, x = build(model_name)
    if not train:
        names = [n for n in names if n in VARIANTS]
    else:  # torchlens and nnsight record forward passes only here
        names = [n for n in names if n not in ("torchlens", "nnsight")]
    nbytes = captured_bytes(model, x, train)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        variants = []
        for n in names:
            (tmp / n).mkdir()
            v = VARIANTS[n](n)
            try:
                v.arm(model, x, train, tmp / n)
            except ImportError as e:
                print(f"  {n}: not installed ({e}); skipped")
                continue
            variants.append(v)
        wall, cpu = interleave(variants, rounds, steps)
        t0 = time.perf_counter()
        for v in variants:
            v.close()
        close_s = time.perf_counter() - t0
    base_w, base_c = statistics.median(wall["none"]), statistics.median(cpu["none"])
    mode = "train (outputs + grads)" if train else "forward (outputs)"
    print(f"\n{model_name.upper()} {mode}: {nbytes / 2**20:.1f} MB captured per step, "
          f"no hooks {base_w * 1e3:.1f} ms/step wall, {base_c * 1e3:.1f} ms CPU")
    print(f"  {'variant':10s} {'step':>6s} {'(min-max)':>13s} {'cpu':>6s} {'cpu s/GB':>9s} {'vs list':>8s}")
    per_gb = {}
    for n in wall:
        per_gb[n] = (statistics.median(cpu[n]) - base_c) / (nbytes / 2**30)
    for n in wall:
        rw = [w / base_w for w in wall[n]]
        rc = statistics.median(cpu[n]) / base_c
        vs = per_gb[n] / per_gb["list"] if "list" in per_gb and per_gb["list"] > 0 else float("nan")
        extra = "" if n == "none" else f"{per_gb[n]:9.2f} {vs:8.2f}"
        print(f"  {n:10s} {statistics.median(rw):6.3f} ({min(rw):.2f}-{max(rw):.2f}) {rc:6.3f} {extra}")
    print(f"  (closing every variant took {close_s:.2f} s; hookline's close includes fsync)")


def _burn() -> None:
    while True:
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="m1,m2")
    p.add_argument("--modes", default="forward,train")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--load", action="store_true", help="keep every core busy with a CPU burner")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    burners = []
    if a.load:
        burners = [mp.Process(target=_burn, daemon=True) for _ in range(os.cpu_count() or 1)]
        for b in burners:
            b.start()
    print(f"torch {torch.__version__}, 1 intra-op thread, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}, CPU burners: {len(burners)}")
    names = a.variants.split(",")
    if "none" not in names:
        names.insert(0, "none")
    try:
        for m in a.models.split(","):
            for mode in a.modes.split(","):
                measure(m, mode == "train", names, a.rounds, a.steps)
    finally:
        for b in burners:
            b.terminate()


if __name__ == "__main__":
    sys.exit(main())
