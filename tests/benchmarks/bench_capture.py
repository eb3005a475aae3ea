"""Capture benchmarks (SPEC §8): overhead, throughput, sampling, and what users do today.

Run:  python tests/benchmarks/bench_capture.py [--quick] [--section overhead|throughput]
                                               [--widths 1024,2048] [--rounds 60] [--decompose]
                                               [--malloc default|tuned] [--transformer]

Prints ratios measured in this one run:
  1. compute-bound model, all Linear outputs + grads every step: step time with capture / without
     (target <= 1.05x), for MLP widths 1024 and 2048 (the wider one computes 4x more per step
     for 2x the bytes: half the capture rate; 4 modules of 5-19 ms each: a stress test of the
     per-call costs) and, with ``--transformer``, a 2-layer ``nn.TransformerEncoder`` (d 512,
     ~220 ms steps, ~135 MB/s of capture: per-call costs amortised as in real training). Two reference rows: an A/A control (no hooks,
     timed like a variant: the noise floor of the machine) and hooks that only copy what they
     see into fixed buffers (the floor of any capture that must copy). Each ratio comes with a bootstrap interval
     and a verdict that says "unresolved" when the interval spans the target;
  2. non-sampled steps (every=10**9) and deactivated hooks / without (target <= 1.02x);
  3. two IO-bound models (few 4 MiB records; many 64 KiB records): capture throughput / raw
     numpy ``tofile`` of the same bytes (target >= 0.7x) and / a naive per-record h5py hook
     (target >= 3x): ``resize`` by one + write per record into datasets created the way the
     common recipe does (``maxshape=(None, ...)``, ``chunks=True``: h5py picks the chunks),
     printed beside the same hook with one record per chunk (a hand-tuned hook, for reference);
  4. the two things users do today on the IO-bound models: hooks appending
     ``.detach().cpu().clone()`` to lists then ``torch.save`` (memory growth), and hooks writing
     each record straight to h5py (resize + write per record).

torch runs with 1 intra-op thread so the background writer has the second core (see docs).

``--malloc tuned`` re-runs the script with glibc's heap trimming and mmap threshold raised
(``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``). With glibc's defaults, CPU torch
returns freed activation and gradient memory to the kernel and faults it back in on the next step
(~1,400-4,000 minor page faults per step of this MLP); how many depends on the order of
allocations, which any hook changes, so those faults blur every ratio. Each overhead row prints its
minor page faults per step.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import shutil
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import h5py
import numpy as np
import torch

from hookline.tracker import HookManager, Recorder, passive, select


#: glibc settings of ``--malloc tuned``: keep freed memory in the heap instead of returning it to
#: the kernel (and faulting it back in on the next step); allocations below 32 MiB (the largest
#: mmap threshold glibc accepts on 64-bit; it ignores larger values) come from the heap.
TUNED_MALLOC = {"MALLOC_TRIM_THRESHOLD_": str(2**31 - 1), "MALLOC_MMAP_THRESHOLD_": str(32 << 20)}


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def mlp(width: int, depth: int) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def paired_ratio(run, variants: dict, rounds: int, steps: int, seed: int = 0) -> dict[str, dict]:
    """Step time per variant and its ratio to the baseline, paired within rounds.

    Every round times ``steps`` steps of the baseline, of an identical second baseline (the A/A
    control: how far two identical setups drift apart on this machine) and of each variant, in a
    random order (so no variant always follows the baseline, or a capture's background writes),
    after one warm-up step each. Ratios are taken within a round, so drift of the machine
    between rounds cancels. ``variants`` maps a name to ``(enter, leave)`` callables that switch
    the variant on and off; ``counter`` keeps a running step number for recorders.

    Returns:
        name -> ``{"time": median step time, "ratio": median per-round ratio, "lo", "hi":
        bootstrap 90% interval of that median, "faults": median minor page faults per step}``,
        with ``"base"`` and ``"A/A"`` included.
    """
    rng = random.Random(seed)
    counter = [0]
    everything = {"base": (None, None), "A/A": (None, None), **variants}
    times: dict[str, list[float]] = {k: [] for k in everything}
    faults: dict[str, list[float]] = {k: [] for k in everything}

    def timed(enter=None, leave=None) -> tuple[float, float]:
        if enter:
            enter(counter)
        run(counter)
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        for _ in range(steps):
            run(counter)
        dt = (time.perf_counter() - t0) / steps
        df = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / steps
        if leave:
            leave()
        return dt, df

    names = list(everything)
    for _ in range(rounds):
        rng.shuffle(names)
        for k in names:
            dt, df = timed(*everything[k])
            times[k].append(dt)
            faults[k].append(df)
    out = {}
    for k in everything:
        ratios = [v / b for v, b in zip(times[k], times["base"])]
        med = statistics.median(ratios)
        boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
        out[k] = {"time": statistics.median(times[k]), "ratio": med, "lo": boot[100], "hi": boot[1899],
                  "faults": statistics.median(faults[k])}
    return out


def verdict(r: dict, target: float) -> str:
    """'met' / 'NOT met' when the 90% interval lies on one side of the target, else 'unresolved'."""
    if r["hi"] <= target:
        return "met"
    if r["lo"] > target:
        return "NOT met"
    return "unresolved (interval spans the target: more --rounds)"


def transformer() -> tuple[torch.nn.Module, torch.Tensor, str]:
    """A compute-bound model as people train them: 2 `nn.TransformerEncoderLayer`s, d_model 512,
    8 heads, feed-forward 2048, batch 4 x 128 tokens (its Linears: attention out_proj, linear1,
    linear2; the attention's input projection is a parameter, not a Linear)."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, dropout=0.0, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    return model, torch.randn(4, 128, 512), "TransformerEncoder 2 x (d 512, ff 2048), batch 4 x 128 tokens"


def captured_mb_per_step(model: torch.nn.Module, x: torch.Tensor, lin: dict) -> float:
    """MB one step captures (outputs + grad_in + grad_out of ``lin``), counted by hooks."""
    total = [0]

    def count(*groups) -> None:
        total[0] += sum(t.nbytes for g in groups for t in g if t is not None)

    mgr = HookManager()
    mgr.register_forward_hook(lambda m, i, o: count(o), hook_fn_name="n_out", **lin)
    mgr.register_backward_hook(lambda m, gi, go: count(gi, go), hook_fn_name="n_grad", **lin)
    model(x).square().mean().backward()
    mgr.remove_all_hooks()
    model.zero_grad(set_to_none=True)
    return total[0] / 2**20


def bench_overhead(tmp: Path, rounds: int, width: int = 1024, steps: int = 5, decompose: bool = False,
                   model_x_label: tuple | None = None) -> None:
    torch.manual_seed(0)
    if model_x_label is None:
        model, x = mlp(width, 4), torch.randn(64, width)
        label = f"MLP 4x Linear({width}) batch 64"
    else:
        model, x, label = model_x_label
        width = 0  # names the run directories
    lin = select(model, "*", types=torch.nn.Linear)
    recs: dict[str, Recorder] = {}

    def run(counter):
        rec = recs.get("active")
        if rec is not None:
            rec.set_step(counter[0])
        counter[0] += 1
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()

    def recorder(name: str, every: int, patch=None):
        mgr = HookManager()
        rec = Recorder(tmp / f"{name}-{width}", every=every)
        if patch is not None:
            patch(rec)
        mgr.register_forward_hook(rec.outputs, **lin)
        mgr.register_backward_hook(rec.grads, **lin)
        rec.set_step(1)  # not sampled for every > 1: hooks off until entered
        paused = rec.paused()
        paused.__enter__()
        state = {"paused": paused}

        def enter(counter):
            state["paused"].__exit__(None, None, None)
            recs["active"] = rec

        def leave():
            recs.pop("active", None)
            state["paused"] = rec.paused()
            state["paused"].__enter__()

        return rec, (enter, leave)

    cap, cap_v = recorder("every1", 1)
    skip, skip_v = recorder("skipped", 10**9)
    noop = HookManager()
    # Forward hooks that only read are marked passive, as the recorder's are (same backward
    # machinery in every row: docs/hooks.md, single-op calls).
    noop.register_forward_hook(passive(lambda m, i, o: None), hook_fn_name="noop", **lin)
    noop.register_backward_hook(lambda m, gi, go: None, hook_fn_name="noopb", **lin)
    noop.deactivate_all_hooks()
    # The floor of any capture that must copy (the tensors may be modified in place later): the
    # same manager hooks copying what they see into fixed buffers, one per hook and tensor
    # position (the cheapest copy there is: no allocation, the smallest cache footprint); no
    # writer, no disk.
    fixed: dict[tuple, torch.Tensor] = {}

    def copy(key: tuple, *groups) -> None:
        for j, t in enumerate(t for g in groups for t in g):
            if t is not None:
                buf = fixed.get((*key, j))
                if buf is None:
                    buf = fixed[(*key, j)] = torch.empty_like(t)
                buf.copy_(t.detach())  # detached: else autograd records the copy

    floor = HookManager()
    floor.register_forward_hook(passive(lambda m, i, o: copy((id(m), "f"), o)), hook_fn_name="copyf", **lin)
    floor.register_backward_hook(lambda m, gi, go: copy((id(m), "b"), gi, go), hook_fn_name="copyb", **lin)
    floor.deactivate_all_hooks()
    floor_v = (lambda c: floor.activate_all_hooks(), lambda: floor.deactivate_all_hooks())
    variants = {"capture": cap_v, "floor": floor_v, "skipped": skip_v,
                "deactivated": (lambda c: None, lambda: None)}
    parts: list[Recorder] = []
    if decompose:  # each variant adds one part of the recorder (patched private hooks: a benchmark)
        variants["hooks"] = (lambda c: noop.activate_all_hooks(), lambda: noop.deactivate_all_hooks())

        def no_writer(rec: Recorder) -> None:
            rec._packer._write_block = lambda *a: True  # blocks dropped: buffers back to the pool

        def no_staging(rec: Recorder) -> None:
            w = rec._writer
            w._stage = lambda h, steps, calls, fields, nbytes: w._release(nbytes)

        for name, patch in (("no writer", no_writer), ("no staging", no_staging)):
            rec, variants[name] = recorder(name.replace(" ", "-"), 1, patch)
            parts.append(rec)
    res = paired_ratio(run, variants, rounds, steps)
    cap.close()
    skip.close()
    for rec in parts:
        try:
            rec.close()
        except Exception:  # noqa: BLE001 - the patched writers wrote nothing consistent
            pass
    noop.remove_all_hooks()
    floor.remove_all_hooks()
    per_step_mb = captured_mb_per_step(model, x, lin)
    b = res["base"]["time"]
    print(f"[overhead] {label}, {len(lin)} Linear modules, {per_step_mb:.1f} MB captured per step "
          f"({per_step_mb / b:.0f} MB/s of capture); median of {rounds} rounds of {steps} steps, "
          f"random order per round; [90% bootstrap interval]")
    print(f"  step without hooks           {b * 1e3:8.2f} ms  {res['base']['faults']:6.0f} page faults/step")
    rows = [("A/A", "no hooks again (A/A control)", None)]
    if decompose:
        rows.append(("hooks", "no-op hooks (active)", None))
    rows.append(("floor", "hooks that only copy (floor)", None))
    if decompose:
        rows += [("no writer", "recorder, blocks dropped", None),
                 ("no staging", "+ writer takes the blocks", None)]
    for k, label, target in (*rows,
                             ("capture", "capture every step", 1.05),
                             ("skipped", "capture, non-sampled steps", 1.02),
                             ("deactivated", "deactivated hooks", 1.02)):
        r = res[k]
        line = (f"  {label:<28} {r['time'] * 1e3:8.2f} ms  {r['faults']:6.0f} page faults/step  "
                f"ratio {r['ratio']:.3f}x [{r['lo']:.3f}, {r['hi']:.3f}]")
        if target is not None:
            line += f"  target <= {target}x: {verdict(r, target)}"
        print(line)


def io_model():
    """Cheap compute, big activations: every module's output is recorded (3 x 4 MiB per step)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 8192), torch.nn.ReLU(), torch.nn.Tanh())


def io_model_small():
    """Cheap compute, many small activations: 32 x (Linear(256), ReLU), batch 64, every module's
    output recorded = 64 records of 64 KiB per step (where per-record costs decide)."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(32):
        layers += [torch.nn.Linear(256, 256), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers)


def _raw(tmp: Path, per_step: int, n: int) -> float:
    """numpy tofile of the same bytes, fsynced: seconds."""
    block = np.random.default_rng(0).standard_normal(per_step // 4, dtype=np.float32)
    t0 = time.perf_counter()
    with open(tmp / "raw.bin", "wb") as f:
        for _ in range(n):
            block.tofile(f)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    os.remove(tmp / "raw.bin")
    return dt


def _hookline(tmp: Path, model, x, n: int) -> float:
    mgr = HookManager()
    t0 = time.perf_counter()
    rec = Recorder(tmp / "io", every=1, max_buffer_mb=256)
    mgr.register_forward_hook(rec.outputs, **dict(model.named_children()))  # every child module
    with torch.no_grad():
        for i in range(n):
            with rec.step(i):
                model(x)
    rec.close()  # includes merging, fsync and the manifest
    dt = time.perf_counter() - t0
    shutil.rmtree(tmp / "io")
    return dt


def _naive_h5py(tmp: Path, model, x, n: int, tuned: bool = False) -> float:
    """A hook appending each record to an h5py dataset (``resize`` by one, then write), fsynced.

    ``tuned=False`` creates the datasets as the common recipe does (``chunks=True``: h5py guesses
    the chunks, (1, 8, 1024) for a 128 x 8192 float32 record); ``tuned=True`` gives each record
    its own chunk, which takes knowing HDF5 (the naive hook at its best)."""
    f = h5py.File(tmp / "naive.h5", "w")
    dsets = {}

    def naive(m, i, o):
        a = o.detach().cpu().numpy()
        d = dsets.get(id(m))
        if d is None:
            d = dsets[id(m)] = f.create_dataset(str(len(dsets)), shape=(0, *a.shape), maxshape=(None, *a.shape),
                                                dtype=a.dtype, chunks=(1, *a.shape) if tuned else True)
        d.resize(d.shape[0] + 1, axis=0)
        d[-1] = a

    handles = [m.register_forward_hook(naive) for m in model]
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(n):
            model(x)
    f.flush()
    os.fsync(f.id.get_vfd_handle())
    f.close()
    dt = time.perf_counter() - t0
    for h in handles:
        h.remove()
    os.remove(tmp / "naive.h5")
    return dt


def _list_then_save(tmp: Path, model, x, n: int) -> tuple[float, float]:
    gc.collect()
    rss0 = rss_mb()
    store: list[torch.Tensor] = []
    handles = [m.register_forward_hook(lambda m, i, o: store.append(o.detach().cpu().clone())) for m in model]
    t0 = time.perf_counter()
    with torch.no_grad():
        for _ in range(n):
            model(x)
    growth = rss_mb() - rss0
    torch.save(store, tmp / "list.pt")
    dt = time.perf_counter() - t0
    for h in handles:
        h.remove()
    store.clear()
    os.remove(tmp / "list.pt")
    return dt, growth


def bench_throughput(tmp: Path, n: int, reps: int, small: bool = False) -> None:
    if small:
        model, x = io_model_small(), torch.randn(64, 256)
        per_step = 64 * 64 * 256 * 4  # 64 outputs of 64 KiB
        n *= 3
        label = "IO-bound model, many small records (64 outputs of 64x256 float32 per step)"
    else:
        model, x = io_model(), torch.randn(128, 16)
        per_step = 3 * 128 * 8192 * 4  # three outputs, float32
        label = "IO-bound model, few large records (3 outputs of 128x8192 float32 per step)"
    total = per_step * n
    raw, hl, naive, tuned = [], [], [], []
    runs = {"raw": (raw, lambda: _raw(tmp, per_step, n)), "hookline": (hl, lambda: _hookline(tmp, model, x, n)),
            "naive": (naive, lambda: _naive_h5py(tmp, model, x, n)),
            "tuned": (tuned, lambda: _naive_h5py(tmp, model, x, n, tuned=True))}
    order = list(runs)
    for rep in range(reps):  # interleaved in a rotating order: drift of the disk cancels in the ratios
        k = rep % len(order)
        for name in order[k:] + order[:k]:
            out, fn = runs[name]
            out.append(fn())
    with torch.no_grad():  # what the model alone could produce: IO-bound means >> the disk
        t0 = time.perf_counter()
        for _ in range(n):
            model(x)
        compute_only = time.perf_counter() - t0
    # RSS growth is only meaningful in a process that has not freed big buffers before: measured
    # on the first (large-record) model only.
    dt_list, growth = (None, None) if small else _list_then_save(tmp, model, x, n)
    r, h, v, vt = (statistics.median(a) for a in (raw, hl, naive, tuned))
    ratio_raw = statistics.median(a / b for a, b in zip(raw, hl))
    ratio_naive = statistics.median(b / a for a, b in zip(hl, naive))
    ratio_tuned = statistics.median(b / a for a, b in zip(hl, tuned))
    mbs = lambda dt: total / dt / 2**20  # noqa: E731
    print(f"[throughput] {label}, {per_step / 2**20:.0f} MB per step, {total / 2**30:.2f} GiB per measurement, "
          f"median of {reps}")
    print(f"  model alone, no capture      {mbs(compute_only):8.0f} MB/s of activations")
    print(f"  numpy tofile + fsync         {mbs(r):8.0f} MB/s")
    met = lambda ok: "met" if ok else "NOT met"  # noqa: E731
    print(f"  hookline Recorder (+close)   {mbs(h):8.0f} MB/s  ratio {ratio_raw:.2f}x of raw "
          f"(target >= 0.7x: {met(ratio_raw >= 0.7)})")
    print(f"  naive per-record h5py        {mbs(v):8.0f} MB/s  hookline is {ratio_naive:.2f}x as fast "
          f"(target >= 3x: {met(ratio_naive >= 3)})")
    print(f"  same, one record per chunk   {mbs(vt):8.0f} MB/s  hookline is {ratio_tuned:.2f}x as fast (a hand-tuned "
          f"hook, no target)")
    if dt_list is not None:
        print(f"  list of .cpu().clone() + torch.save {mbs(dt_list):6.0f} MB/s, RSS grew {growth:.0f} MB "
              f"for {total / 2**20:.0f} MB captured (grows with the run; hookline stays within max_buffer_mb)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--section", choices=("all", "overhead", "throughput"), default="all")
    ap.add_argument("--decompose", action="store_true",
                    help="overhead: also time the recorder without writer / without staging")
    ap.add_argument("--rounds", type=int, default=60, help="rounds per overhead measurement (5 steps per variant each)")
    ap.add_argument("--widths", type=lambda v: [int(w) for w in v.split(",") if w], default=[1024, 2048],
                    help="MLP widths of the overhead runs (default 1024,2048: 110 and 55 MB/s of capture)")
    ap.add_argument("--transformer", action="store_true",
                    help="overhead: also (or, with --widths '', only) a 2-layer TransformerEncoder")
    ap.add_argument("--malloc", choices=("default", "tuned"), default="default",
                    help="tuned: run with glibc heap trimming off (see the module docstring)")
    args = ap.parse_args()
    if args.malloc == "tuned" and os.environ.get("MALLOC_TRIM_THRESHOLD_") is None:
        # glibc reads these once at start-up: run this script again with them set.
        env = {**os.environ, **TUNED_MALLOC}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    settings = " ".join(f"{k}={os.environ.get(k, 'unset')}" for k in TUNED_MALLOC)
    print(f"malloc: {args.malloc} ({settings})")
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="hookline-bench-", dir=args.dir))
    try:
        if args.section in ("all", "overhead"):
            for width in args.widths:
                bench_overhead(tmp, 5 if args.quick else args.rounds, width, decompose=args.decompose)
            if args.transformer:
                bench_overhead(tmp, 3 if args.quick else args.rounds, steps=2 if args.quick else 3,
                               decompose=args.decompose, model_x_label=transformer())
        if args.section in ("all", "throughput"):
            bench_throughput(tmp, 30 if args.quick else 120, 1 if args.quick else 3)
            bench_throughput(tmp, 30 if args.quick else 120, 1 if args.quick else 3, small=True)
    finally:
        shutil.rmtree(tmp)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
