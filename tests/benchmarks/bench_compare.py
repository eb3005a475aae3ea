"""CKA across runs: hookline's streaming comparison against reading the same bytes (the limit) and
against the old example's approach; ``similarity()`` on a 2-process LocalCluster against one
process (a script, not collected by pytest). Prints ratios measured in one run.

    .venv/bin/python tests/benchmarks/bench_compare.py [--steps 100] [--rounds 3] [--runs 8] [--dir DIR]

* **one layer, two runs**: ``--steps`` records of a ``(8, 128, 64)`` float32 output (a
  sequence model's ``(batch, seq, d)``; 256 KiB each) per run, written by ``RunWriter``.
  ``read``: every record of both runs read through the reader in 16 MB blocks (the bytes any
  comparison must read: the limit). ``cka``: ``compare_runs(metrics=["cka"])`` (per-token CKA
  per step and over all steps). ``cka+procrustes``: both metrics in one pass. Per round the
  variants run back to back; the ratio is the median of per-round ratios.
* **old example**: ``docs/examples/cka_two_runs.py`` before this change flattened a record to
  ``(8, 8192)`` and formed ``8192 x 8192`` matrices; timed on ``--old-records`` records and
  scaled to ``--steps`` (it would take minutes to run them all).
* **similarity()**: ``--runs`` runs of ``--sim-steps`` records; all ``runs*(runs-1)/2`` pairs
  in this process against a ``LocalCluster(n_workers=2, threads_per_worker=1)`` (started
  before the clock; each pair one task that opens its runs in the worker). The workers'
  statistical profiler is off (``distributed.worker.profile.enabled``; ``--worker-profile``
  keeps it): on oversubscribed cores its 10 ms stack sampling makes a task wait for the GIL most
  of its wall time (here 0.07 s of CPU in 0.6-1 s of wall time per pair; 0.2 s without it).

Matrix products run on BLAS threads: on busy cores set ``OPENBLAS_NUM_THREADS=1`` (dask's
workers set it for themselves); docs/performance.md gives both.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

from hookline.storage import RunWriter, compare_runs, open_run, similarity

HID = "outputs[layer]"
FIELD = "outputs.0"
SHAPE = (8, 128, 64)


def _write(path: Path, steps: int, seed: int, base: list[np.ndarray] | None = None) -> Path:
    rng = np.random.default_rng(seed)
    mix = rng.standard_normal((SHAPE[-1], SHAPE[-1])).astype(np.float32)
    with RunWriter(path) as w:
        w.add_handle(HID, module_name="layer", hook_fn_name="outputs")
        for s in range(steps):
            x = base[s % len(base)] if base else rng.standard_normal(SHAPE).astype(np.float32)
            w.write(HID, s, 0, {FIELD: (x @ mix + rng.standard_normal(SHAPE).astype(np.float32)).astype(np.float32)})
    return path


def _read_all(a: Path, b: Path) -> None:
    for run in (a, b):
        with open_run(run) as r:
            fld = r[HID][FIELD]
            per = max(1, (16 << 20) // (8 * int(np.prod(SHAPE))))
            for i in range(0, len(fld), per):
                np.asarray(fld[i:i + per], np.float64)


def _old_cka(x: np.ndarray, y: np.ndarray) -> float:
    """The old example's CKA: a record flattened to (batch, seq*d), features x features matrices."""
    x = np.asarray(x, np.float64).reshape(len(x), -1)
    y = np.asarray(y, np.float64).reshape(len(y), -1)
    x, y = x - x.mean(axis=0), y - y.mean(axis=0)
    return float(np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y)))


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_layer(d: Path, steps: int, rounds: int, old_records: int) -> None:
    a, b = _write(d / "a", steps, 0), _write(d / "b", steps, 1)
    mb = 2 * steps * int(np.prod(SHAPE)) * 4 / 1e6
    variants: dict[str, Callable[[], object]] = {
        "read": lambda: _read_all(a, b),
        "cka": lambda: compare_runs(a, b, metrics=["cka"]),
        "cka+procrustes": lambda: compare_runs(a, b, metrics=["cka", "procrustes"]),
    }
    variants["read"]()  # page cache warm for all
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(rounds):
        for k, fn in variants.items():
            times[k].append(_timed(fn))
    print(f"one layer, {steps} steps of {SHAPE} float32 in each of two runs ({mb:.0f} MB read per variant)")
    for k, ts in times.items():
        ratio = statistics.median(t / r for t, r in zip(ts, times["read"]))
        print(f"  {k:<16} {statistics.median(ts):7.3f} s  {ratio:5.2f}x read  ({mb / statistics.median(ts):6.0f} MB/s)")
    with open_run(a) as ra, open_run(b) as rb:
        fa, fb = ra[HID][FIELD], rb[HID][FIELD]
        per = [_timed(lambda i=i: _old_cka(fa[i], fb[i])) for i in range(old_records)]
        old_value = _old_cka(fa[0], fb[0])
    new_value = compare_runs(a, b, metrics=["cka"]).get(HID, FIELD).values["cka"][0]
    old = statistics.median(per) * steps
    print(f"  old example      {statistics.median(per):7.3f} s per record x {steps} = {old:.1f} s "
          f"({old / statistics.median(times['cka']):.0f}x cka; {old_records} records timed)")
    print(f"  step 0: old example's CKA {old_value:.3f} (8 samples of {SHAPE[1] * SHAPE[2]} features), "
          f"per-token CKA {new_value:.3f} ({SHAPE[0] * SHAPE[1]} samples of {SHAPE[2]})")


def bench_similarity(d: Path, n_runs: int, steps: int, worker_profile: bool) -> None:
    import dask
    from dask.distributed import Client, LocalCluster

    dask.config.set({"distributed.worker.profile.enabled": worker_profile})
    base = [np.random.default_rng(99).standard_normal(SHAPE).astype(np.float32) for _ in range(steps)]
    runs = [str(_write(d / f"sim{i}", steps, 10 + i, base)) for i in range(n_runs)]
    pairs = n_runs * (n_runs - 1) // 2
    local_t = _timed(lambda: similarity(runs, metric="cka"))
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        similarity(runs[:2], metric="cka", client=client)  # workers import hookline once
        remote: dict = {}
        cluster_t = _timed(lambda: remote.update(similarity(runs, metric="cka", client=client)))
    local = similarity(runs, metric="cka")
    same = all(np.allclose(remote[h].values, local[h].values, rtol=0, atol=1e-12, equal_nan=True) for h in local)
    print(f"similarity(): {n_runs} runs x {steps} steps, {pairs} pairs (each one task; worker profiler "
          f"{'on' if worker_profile else 'off'})")
    print(f"  one process      {local_t:7.3f} s")
    print(f"  LocalCluster x2  {cluster_t:7.3f} s  {local_t / cluster_t:5.2f}x faster  (equal to local: {same})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--old-records", type=int, default=2)
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--sim-steps", type=int, default=20)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--worker-profile", action="store_true", help="keep the dask workers' statistical profiler")
    args = p.parse_args()
    d = Path(tempfile.mkdtemp(prefix="bench-compare-", dir=args.dir))
    try:
        bench_layer(d, args.steps, args.rounds, args.old_records)
        bench_similarity(d, args.runs, args.sim_steps, args.worker_profile)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
