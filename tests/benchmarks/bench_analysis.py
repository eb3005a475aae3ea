"""Offline analysis against plain h5py (a script, not collected by pytest). Prints ratios
measured in one run.

    .venv/bin/python tests/benchmarks/bench_analysis.py [--handles 1000] [--records 1000]
        [--record-kib 1] [--field-gb 2] [--budget-mb 768] [--skip frame|reduce] [--dir DIR]

* **frame**: ``open_run(run).frame()`` of a closed run of ``--handles`` handles x ``--records``
  records (one field each, ``--record-kib`` per record) against reading the same index with plain
  h5py (for every file: ``step``, ``call``, ``_index/<field>/record`` and ``norm``; no
  DataFrame). Page cache warm; the first round of each in a fresh process, then (in another
  process, after one round of each) alternating rounds, medians; never in the writing process.
  Wall and CPU time (``time.process_time``: what the other jobs on a shared machine change least).
  ``--handles 10 --record-kib 1024``: a 10 GB run of few handles with big records.
* **reduce**: the float64 mean of a float32 field of ``--field-gb`` GB (1 MiB records) three
  ways, each in a fresh process, the file's pages dropped before each
  (``posix_fadvise(POSIX_FADV_DONTNEED)``): ``field.to_dask().mean(dtype=float64)`` on a
  ``LocalCluster(n_workers=2, processes=True, threads_per_worker=1)`` whose workers get
  ``--budget-mb`` each (together less than the field); a hand-written h5py loop over 64 MiB
  blocks in one process; and the raw sequential read of the file's bytes (``readinto`` of 64 MiB
  blocks: the limit). Imports and the cluster's start are outside the timing. Peak memory is each process's ``VmHWM`` (for the cluster: the driver and
  the largest worker).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hookline.storage import RunWriter

FIELD = "outputs.0"
BLOCK = 64 << 20

PEAK = ("def peak():\n    with open('/proc/self/status') as f:\n"
        "        return next(int(l.split()[1]) * 1024 for l in f if l.startswith('VmHWM:'))\n")


def write_many(run: Path, handles: int, records: int, record_kib: float) -> None:
    """A closed run of ``handles`` handles of ``records`` records each (written in blocks of at
    most 64 MiB, so big records do not need the whole field in memory)."""
    rec = np.random.default_rng(0).standard_normal(max(1, int(record_kib * 256))).astype(np.float32)
    per = max(1, min(records, BLOCK // rec.nbytes))
    block = np.tile(rec, (per, 1))
    with RunWriter(run, fsync=False) as w:
        for h in range(handles):
            w.add_handle(f"outputs[layers.{h}]", module_name=f"layers.{h}")
            for a in range(0, records, per):
                b = min(records, a + per)
                w.write_block(f"outputs[layers.{h}]", np.arange(a, b, dtype=np.int64), np.zeros(b - a, np.int64),
                              {FIELD: block[: b - a]})


FRAME_CODE = PEAK + """
import sys, time, json, statistics
run_dir, which, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
import glob, h5py, pandas  # (imports outside the timing: pandas alone takes ~1-3 s here)
from hookline.storage import open_run
def hookline():
    with open_run(run_dir) as run:
        return len(run.frame())
def plain():
    n = 0
    for p in sorted(glob.glob(run_dir + "/outputs/*.h5")):
        with h5py.File(p, "r") as f:
            cols = [f["step"][:], f["call"][:], f["_index/outputs.0/record"][:], f["_index/outputs.0/norm"][:]]
            n += len(cols[2])
    return n
def timed(fn):
    t0, c0 = time.perf_counter(), time.process_time()
    n = fn()
    return {"s": time.perf_counter() - t0, "cpu": time.process_time() - c0, "rows": n}
if which != "warm":  # this process's first read of the run
    print(json.dumps({**timed(hookline if which == "hookline" else plain), "peak": peak()}))
else:  # one round of each first, then alternating rounds; medians
    hookline(), plain()
    runs = {"hookline": [], "h5py": []}
    for r in range(rounds):
        for w in (("hookline", "h5py") if r % 2 == 0 else ("h5py", "hookline")):
            runs[w].append(timed(hookline if w == "hookline" else plain))
    print(json.dumps({w: {k: statistics.median(x[k] for x in v) for k in ("s", "cpu")} for w, v in runs.items()}))
"""


def _child(code: str, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=3600)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_frame(d: Path, handles: int, records: int, record_kib: float, rounds: int = 5) -> None:
    run = d / "many"
    t0 = time.perf_counter()
    write_many(run, handles, records, record_kib)
    size = sum(p.stat().st_size for p in run.rglob("*.h5"))
    print(f"frame: {handles} handles x {records} records, {size / 1e9:.2f} GB on disk (written in "
          f"{time.perf_counter() - t0:.0f} s)")
    # (every round in a process that did not write the run: writing 1,000 files leaves a process's
    # later HDF5 opens ~1.6x slower, for plain h5py too)
    first = {w: _child(FRAME_CODE, str(run), w, "0") for w in ("h5py", "hookline")}  # fresh processes
    assert first["hookline"]["rows"] == first["h5py"]["rows"] == handles * records
    warm = _child(FRAME_CODE, str(run), "warm", str(rounds))
    hl, hp = warm["hookline"]["s"], warm["h5py"]["s"]
    cl, cp = warm["hookline"]["cpu"], warm["h5py"]["cpu"]
    fh, fp = first["hookline"], first["h5py"]
    print(f"  fresh process: hookline Run.frame() {fh['s']:.3f} s wall, {fh['cpu']:.3f} s CPU "
          f"(peak {fh['peak'] / 2**20:.0f} MiB); plain h5py index reads {fp['s']:.3f} s wall, {fp['cpu']:.3f} s CPU "
          f"(peak {fp['peak'] / 2**20:.0f} MiB): {fh['s'] / fp['s']:.2f}x wall, {fh['cpu'] / fp['cpu']:.2f}x CPU")
    print(f"  warm process (median of {rounds}): hookline {hl:.3f} s wall, {cl:.3f} s CPU; h5py {hp:.3f} s wall, "
          f"{cp:.3f} s CPU: {hl / hp:.2f}x wall, {cl / cp:.2f}x CPU; per file: hookline "
          f"{hl / handles * 1e3:.2f} ms, h5py {hp / handles * 1e3:.2f} ms (wall)")
    shutil.rmtree(run)


def write_field(run: Path, gb: float) -> Path:
    """One handle whose field holds ``gb`` GB of 1 MiB float32 records; returns its file."""
    rec = np.random.default_rng(0).standard_normal((256, 1024)).astype(np.float32)
    with RunWriter(run, fsync=True) as w:  # (fsynced: clean pages can be dropped)
        w.add_handle("outputs[big]", module_name="big")
        for i in range(int(gb * 1e9) // rec.nbytes + 1):
            w.write("outputs[big]", i, 0, {FIELD: rec * (1 + (i % 7))})
    return run / "outputs" / "big.h5"


REDUCE_CODE = PEAK + """
import sys, time, json, os
run_dir, path, which, budget_mb = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
BLOCK = 64 << 20
def main():
    t0 = time.perf_counter()
    extra = {}
    if which == "raw":
        buf = bytearray(BLOCK)
        n = 0
        with open(path, "rb", buffering=0) as f:
            while (k := f.readinto(buf)):
                n += k
        value = float(n)
    elif which == "h5py":
        import h5py, numpy as np
        with h5py.File(path, "r") as f:
            ds = f["outputs.0"]
            step = max(1, BLOCK // (ds.dtype.itemsize * int(np.prod(ds.shape[1:]))))
            total = 0.0
            for a in range(0, ds.shape[0], step):
                total += ds[a:a + step].sum(dtype=np.float64)
            value = total / ds.size
    else:
        import dask, numpy as np
        from dask.distributed import Client, LocalCluster
        from hookline.storage import open_run
        with LocalCluster(n_workers=2, processes=True, threads_per_worker=1, dashboard_address=None,
                          memory_limit=f"{budget_mb}MiB") as cluster, Client(cluster) as client:
            warm = lambda: [__import__(m) for m in ("dask.array", "h5py", "hookline.storage.analysis.lazy")]
            warm()
            client.run(warm)  # (imports outside the timing)
            t0 = time.perf_counter()
            with dask.config.set({"array.chunk-size": "64MiB"}), open_run(run_dir) as run:
                x = run["outputs[big]"]["outputs.0"].to_dask()
                extra["chunks"] = x.numblocks[0]
                value = float(x.mean(dtype=np.float64).compute())
            extra["worker_peak"] = max(client.run(peak).values())
    print(json.dumps({"s": time.perf_counter() - t0, "value": value, "peak": peak(), **extra}))
if __name__ == "__main__":
    main()
"""


def _drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_reduce(d: Path, gb: float, budget_mb: int) -> None:
    run = d / "big"
    t0 = time.perf_counter()
    path = write_field(run, gb)
    size = path.stat().st_size
    print(f"reduce: float64 mean of a {size / 1e9:.2f} GB float32 field (written in {time.perf_counter() - t0:.0f} s); "
          f"cluster budget 2 x {budget_mb} MiB = {2 * budget_mb / 1024:.2f} GiB")
    res = {}
    for which in ("raw", "h5py", "dask"):
        _drop(path)
        res[which] = _child(REDUCE_CODE, str(run), str(path), which, str(budget_mb))
    assert abs(res["dask"]["value"] - res["h5py"]["value"]) <= 1e-9 * max(1.0, abs(res["h5py"]["value"]))
    for which, what in (("raw", "raw sequential read (readinto, 64 MiB)"), ("h5py", "h5py block loop, 1 process"),
                        ("dask", f"to_dask() on 2 workers ({res['dask']['chunks']} chunks)")):
        r = res[which]
        mem = f"peak {r['peak'] / 2**20:.0f} MiB" + (
            f" driver, {r['worker_peak'] / 2**20:.0f} MiB largest worker" if "worker_peak" in r else "")
        print(f"  {what:45s} {r['s']:7.2f} s  {size / r['s'] / 1e9:5.2f} GB/s  {mem}")
    print(f"  ratios (time): dask / h5py loop {res['dask']['s'] / res['h5py']['s']:.2f}x, "
          f"dask / raw read {res['dask']['s'] / res['raw']['s']:.2f}x, h5py loop / raw {res['h5py']['s'] / res['raw']['s']:.2f}x")
    shutil.rmtree(run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--handles", type=int, default=1000)
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--record-kib", type=float, default=1.0)
    ap.add_argument("--field-gb", type=float, default=2.0)
    ap.add_argument("--budget-mb", type=int, default=768)
    ap.add_argument("--skip", choices=["frame", "reduce"])
    ap.add_argument("--dir", type=Path, default=None)
    a = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hookline-bench-analysis-", dir=a.dir))
    print(f"load: {Path('/proc/loadavg').read_text().strip()}")
    try:
        if a.skip != "frame":
            bench_frame(d, a.handles, a.records, a.record_kib)
        if a.skip != "reduce":
            bench_reduce(d, a.field_gb, a.budget_mb)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"load: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
