"""Closing a run of many handles, beside the per-file floor measured in the same process (issue 35).

Run:  python tests/benchmarks/bench_close.py [--handles N] [--steps N] [--record-floats N]

Each case runs in its own process: ``N`` hooked ``Linear(d, d)`` modules (``d`` from
``--record-floats``, 1 by default: 64-byte records of a ``(16, 1)`` output) for ``--steps`` steps
under ``torch.no_grad()``, torch on one thread; then ``Recorder.close()`` is timed (wall and the
process's CPU). The cases differ in how many sealed parts each handle has when ``close()`` starts:

- ``one part``: nothing sealed before ``close()`` (the default budget): close seals each
  handle's open part and renames it to its ``<key>.h5``;
- ``N flushes``: ``rec.flush()`` every ``steps / N`` steps, as ``autoflush_s`` does in a long run:
  close merges ``N + 1`` parts per handle;
- ``index seals``: a 16 MB budget, whose index share (2 MB) 64-byte records fill: the writer
  seals every open part when their index entries reach it.

The floor, measured in the same process right after ``close()`` and in the same directory's file
system: creating ``N`` minimal HDF5 files (``h5py.File(path, "w")`` with one dataset holding that
handle's recorded bytes), then one ``numpy.tofile`` of all the bytes and an ``fsync``. The
target (issue 35): ``close()`` <= 1.5x that floor.

Beside it, the format's own floor (``layout``): the same ``N`` files written as hookline parts
(one field's records, the step/call/record/norm indexes, chunk hashes and ~25 attributes,
through the writer's ``HandleFileWriter``), no fsync and nothing to merge.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import h5py
    import numpy as np
    import torch
    from hookline.tracker import HookManager, Recorder

    where, n, steps, d, flushes, budget = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                           int(sys.argv[5]), int(sys.argv[6]))
    torch.set_num_threads(1)
    mods = [torch.nn.Linear(d, d) for _ in range(n)]
    x = torch.randn(16, d)
    rec = Recorder(os.path.join(where, "run"), max_buffer_mb=budget, autoflush_s=None)
    mgr = HookManager()
    mgr.register_forward_hook(rec.outputs, **{str(i): m for i, m in enumerate(mods)})
    every = steps // (flushes + 1) if flushes else 0
    with torch.no_grad():
        for s in range(steps):
            with rec.step(s):
                for m in mods:
                    m(x)
            if every and (s + 1) % every == 0 and s + 1 < steps:
                rec.flush()
    t, c = time.perf_counter(), time.process_time()
    summary = rec.close()
    close_s, close_cpu = time.perf_counter() - t, time.process_time() - c
    per = summary.storage.bytes // n
    floor_dir = os.path.join(where, "floor")
    os.mkdir(floor_dir)
    data = np.ones(max(1, per // 4), np.float32)
    t, c = time.perf_counter(), time.process_time()
    for i in range(n):
        with h5py.File(os.path.join(floor_dir, f"{i}.h5"), "w") as f:
            f.create_dataset("x", data=data)
    files_s = time.perf_counter() - t
    t = time.perf_counter()
    raw = os.path.join(where, "raw.bin")
    np.ones(max(1, summary.storage.bytes // 4), np.float32).tofile(raw)
    fd = os.open(raw, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    bytes_s = time.perf_counter() - t
    floor_cpu = time.process_time() - c
    # The format's own floor: each handle's records as one hookline file (its datasets, index
    # and ~25 attributes through the writer's HandleFileWriter), no fsync, no merge.
    from hookline.storage._h5write import FieldSpec, HandleFileWriter
    lay = os.path.join(where, "layout")
    os.mkdir(lay)
    k = summary.records // n
    recs = np.ones((k, 16, d), np.float32)
    attrs = {"handle_id": "outputs[0]", "key": "outputs/0", "module_name": "0", "module_type": "Linear",
             "category": "forward_hook", "hook_fn_name": "outputs", "rank": np.int64(-1),
             "world_size": np.int64(-1), "hookline_version": "0", "meta": "{}", "run_meta": "{}",
             "created": "2026-01-01T00:00:00+00:00", "run_uuid": "0" * 32, "run_created": "2026-01-01T00:00:00+00:00"}
    t = time.perf_counter()
    for i in range(n):
        w = HandleFileWriter(os.path.join(lay, f"{i}.h5"), attrs, 0, None)
        out = w.field(FieldSpec("outputs.0", "float32", False, (16, d), None), k)
        out.append(recs)
        out.records.append(np.arange(k))
        out.norms.append(np.ones(k))
        w.add_index(np.arange(k), np.zeros(k, np.int64))
        w.finish()
    layout_s = time.perf_counter() - t
    print(json.dumps({"n": n, "close_s": close_s, "close_cpu": close_cpu, "files_s": files_s,
                      "bytes_s": bytes_s, "floor_cpu": floor_cpu, "layout_s": layout_s, "records": summary.records,
                      "bytes": summary.storage.bytes, "index_seals": summary.storage.index_seals}))
""")


def run_case(n: int, steps: int, d: int, flushes: int, budget: int) -> dict:
    with tempfile.TemporaryDirectory(dir=os.environ.get("HOOKLINE_BENCH_DIR")) as tmp:
        out = subprocess.run([sys.executable, "-c", CHILD, tmp, str(n), str(steps), str(d), str(flushes),
                              str(budget)], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"case failed:\n{out.stdout}{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handles", type=int, default=1000, help="hooked modules (default 1,000)")
    ap.add_argument("--steps", type=int, default=120, help="steps per case (default 120)")
    ap.add_argument("--record-floats", type=int, default=1, metavar="D",
                    help="Linear(D, D) on a (16, D) input: records of 64 * D bytes (default 1)")
    ap.add_argument("--flushes", type=int, nargs="+", default=[3], metavar="K",
                    help="the flush cases: K flushes during the run (default 3)")
    ap.add_argument("--skip-index-seals", action="store_true", help="leave out the 16 MB budget case")
    args = ap.parse_args()
    cases = [("one part", 0, 512)] + [(f"{k} flushes", k, 512) for k in args.flushes]
    if not args.skip_index_seals:
        cases.append(("index seals (16 MB)", 0, 16))
    print(f"hookline close benchmark: {args.handles} handles x {args.steps} steps of {64 * args.record_floats}-byte "
          f"records; {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at start\n")
    print(f"  {'case':<20} {'index seals':>11} {'close s':>8} {'close CPU s':>11} | {'floor s':>8} "
          f"({'files':>6} + {'bytes':>6}) | {'close / floor':>13} {'ms per handle':>14} | "
          f"{'layout s':>8} {'layout / floor':>14}")
    for name, flushes, budget in cases:
        r = run_case(args.handles, args.steps, args.record_floats, flushes, budget)
        floor = r["files_s"] + r["bytes_s"]
        print(f"  {name:<20} {r['index_seals']:>11} {r['close_s']:>8.2f} {r['close_cpu']:>11.2f} | {floor:>8.2f} "
              f"({r['files_s']:>6.2f} + {r['bytes_s']:>6.2f}) | {r['close_s'] / floor:>12.2f}x "
              f"{r['close_s'] / r['n'] * 1e3:>8.2f} vs {floor / r['n'] * 1e3:.2f} | "
              f"{r['layout_s']:>8.2f} {r['layout_s'] / floor:>13.2f}x", flush=True)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end; target: close / floor <= 1.5x")


if __name__ == "__main__":
    main()
