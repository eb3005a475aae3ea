"""Scale benchmark (issue 24): per-call capture cost, close time, bytes on disk and peak memory
against the number of hooked handles, at the default settings (``max_buffer_mb=512``).

Run:  python tests/benchmarks/bench_scale.py [--quick] [--rounds N] [--handles N ...]

Each configuration runs in its own process (its peak RSS is its own): ``n`` ``Linear(d, d)``
modules applied to one ``(16, d)`` input under ``torch.no_grad()``, forward hooks only, so each
hooked call makes one record of ``16 * d * 4`` bytes (d=64: 4 KiB, d=1024: 64 KiB). Interleaved
in random order per round, the same forward pass is timed three ways: no hooks (the recorder
paused: its torch hooks are removed), the Recorder's ``outputs`` hook, and a plain torch forward
hook that appends ``output.detach().clone()`` to a list (what users write by hand). Printed:

1. microseconds per hooked call over the no-hook pass (medians over rounds): wall time, the
   training thread's CPU time and the whole process's CPU time (writer thread included), each
   as a ratio to the recorder's cost at 8 handles of the same record size (target <= 1.5x);
2. ``Recorder.close()`` seconds beside the time ``numpy.tofile`` + fsync takes for the same bytes
   in the same process, and bytes on disk / bytes recorded;
3. peak RSS over the no-capture baseline (the same loop before the recorder existed), against
   the budget + 64 MB and against the bytes recorded.

torch runs with 1 thread so the writer has the second core (see docs/capture.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

#: One configuration, run as ``python -c CHILD n d rounds dir``; prints one JSON line.
CHILD = textwrap.dedent("""
    import json, os, random, resource, statistics, sys, time
    import numpy as np
    import torch
    from hookline.tracker import HookManager, Recorder

    n, d, rounds, where = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    mods = [torch.nn.Linear(d, d) for _ in range(n)]
    x = torch.randn(16, d)
    def forward():
        t, c, p = time.perf_counter(), time.thread_time(), time.process_time()
        with torch.no_grad():
            for m in mods:
                m(x)
        return time.perf_counter() - t, time.thread_time() - c, time.process_time() - p
    for _ in range(2):
        forward()
    base = rss()
    rec = Recorder(os.path.join(where, "run"))
    mgr = HookManager()
    mgr.register_forward_hook(rec.outputs, **{str(i): m for i, m in enumerate(mods)})
    times = {"none": [], "recorder": [], "clone": []}
    step = 0
    def timed(variant):
        global step
        if variant == "recorder":
            with rec.step(step):
                dt = forward()
            step += 1
            return dt
        with rec.paused():
            if variant == "none":
                return forward()
            keep = []
            hs = [m.register_forward_hook(lambda mod, i, o: keep.append(o.detach().clone())) for m in mods]
            try:
                return forward()
            finally:
                for h in hs:
                    h.remove()
    timed("recorder")  # warm: the first record of every handle declares its fields
    for r in range(rounds):
        order = list(times)
        random.Random(r).shuffle(order)
        for v in order:
            times[v].append(timed(v))
    t = time.perf_counter()
    summary = rec.close()
    close_s = time.perf_counter() - t
    with open("/proc/self/status") as f:  # (ru_maxrss would keep the forking parent's)
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    run = os.path.join(where, "run")
    disk = files = 0
    for root, _, names in os.walk(run):
        for name in names:
            disk += os.stat(os.path.join(root, name)).st_blocks * 512
            files += name.endswith(".h5")
    payload = summary.storage.bytes
    raw = os.path.join(where, "raw.bin")
    t = time.perf_counter()
    np.ones(payload // 4, np.float32).tofile(raw)
    fd = os.open(raw, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    raw_s = time.perf_counter() - t
    med = {k: [statistics.median(t[j] for t in v) / n * 1e6 for j in range(3)] for k, v in times.items()}
    print(json.dumps({"n": n, "record": 16 * d * 4, "us": med, "close_s": close_s, "raw_s": raw_s,
                      "payload": payload, "disk": disk, "files": files, "base": base, "peak": peak,
                      "records": summary.records, "budget_mb": 512}))
""")


def _size(nbytes: int) -> str:
    return f"{nbytes // 1024} KiB" if nbytes >= 1024 else f"{nbytes} B"


def run_one(n: int, d: int, rounds: int) -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("HOOKLINE_BENCH_DIR")) as tmp:
        out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(d), str(rounds), tmp],
                             capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"configuration n={n} d={d} failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 5,000-handle and 64 KiB configurations")
    ap.add_argument("--rounds", type=int, default=12, help="timed rounds per configuration (default 12)")
    ap.add_argument("--handles", type=int, nargs="+", metavar="N",
                    help="only these handle counts of 4 KiB records (8 is always run: the reference)")
    ap.add_argument("--tiny", action="store_true",
                    help="only 64-byte records: 8 and 2,000 handles (issue 34, case 9: use --rounds 100)")
    args = ap.parse_args()
    configs = [(8, 64), (100, 64), (128, 64), (1000, 64), (5000, 64), (8, 1024), (128, 1024)]
    if args.quick:
        configs = [c for c in configs if c[0] < 5000 and c[1] == 64]
    if args.handles:
        configs = [(n, 64) for n in sorted({8, *args.handles})]
    if args.tiny:
        configs = [(8, 1), (2000, 1)]  # (Linear(1, 1) on a (16, 1) input: 64-byte records)
    load = os.getloadavg()[0]
    print(f"hookline scale benchmark: {os.cpu_count()} cores, load average {load:.1f} at start\n")
    res = []
    for n, d in configs:
        r = run_one(n, d, args.rounds)
        res.append(r)
        print(f"  ran n={n} record={r['record'] // 1024} KiB", file=sys.stderr)

    print("1. Per hooked call, us over the no-hook pass (medians of", args.rounds, "interleaved rounds):")
    print("   wall time of the step; CPU time of the training thread (the hook path itself, robust to a")
    print("   loaded machine); CPU time of the whole process (adds the writer thread's work per record)")
    print(f"   {'handles':>7} {'record':>7} {'no hooks':>9} | {'recorder: wall':>14} {'vs 8':>6} {'thread':>7} "
          f"{'vs 8':>6} {'process':>8} {'vs 8':>6} | {'clone hook wall':>15}")
    ref: dict = {}
    for r in res:
        u = r["us"]
        over = [u["recorder"][j] - u["none"][j] for j in range(3)]
        base = ref.setdefault(r["record"], over)
        print(f"   {r['n']:>7} {_size(r['record']):>9} {u['none'][0]:>8.1f} | {over[0]:>14.1f} "
              f"{over[0] / base[0]:>5.2f}x {over[1]:>7.1f} {over[1] / base[1]:>5.2f}x {over[2]:>8.1f} "
              f"{over[2] / base[2]:>5.2f}x | {u['clone'][0] - u['none'][0]:>15.1f}")

    print("\n2. close() and bytes on disk (default settings)")
    print(f"   {'handles':>7} {'record':>7} {'recorded':>9} {'close s':>8} {'tofile+fsync s':>15} "
          f"{'close/tofile':>13} {'disk/recorded':>14} {'.h5 files':>10}")
    for r in res:
        print(f"   {r['n']:>7} {_size(r['record']):>9} {r['payload'] / 2**20:>7.1f}MB {r['close_s']:>8.2f} "
              f"{r['raw_s']:>15.2f} {r['close_s'] / max(r['raw_s'], 1e-3):>12.1f}x "
              f"{r['disk'] / r['payload']:>13.2f}x {r['files']:>10}")

    print("\n3. Peak RSS over the no-capture baseline (budget 512 MB + 64 MB = 576 MB allowed)")
    print(f"   {'handles':>7} {'record':>7} {'peak over':>10} {'/ (budget+64)':>14} {'/ recorded':>11}")
    for r in res:
        over = (r["peak"] - r["base"]) / 2**20
        print(f"   {r['n']:>7} {_size(r['record']):>9} {over:>8.0f}MB {over / (r['budget_mb'] + 64):>13.2f}x "
              f"{over * 2**20 / r['payload']:>10.2f}x")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
