"""One-record reads through hookline against plain h5py on the same file (a script, not collected
by pytest). Prints ratios measured in one run, variants interleaved.

    .venv/bin/python tests/benchmarks/bench_read.py [--rounds 40] [--dir DIR]

For each record size (8 MiB, 256 KiB, 4 KiB float32; a closed run written by ``RunWriter``):

* **open + one record**: ``open_run(run)[handle][field][i]`` against
  ``h5py.File(path, "r")[field][i]`` (both open the file, read one record, close), **warm**
  (file in the page cache) and **cold** (the file's pages dropped first: as root
  ``echo 1 > /proc/sys/vm/drop_caches`` when ``--drop-caches`` is given and allowed, else
  ``posix_fadvise(POSIX_FADV_DONTNEED)`` on the file).
  A cold round reads a record from each of two chunks nothing read before, one per variant (a
  VM's host keeps what the guest read: dropping the guest's pages does not make a chunk read
  before cold again; plain h5py reads whole chunks).
* **first open in a process**: the same, timed inside a fresh process per try (hookline walks a
  file's structure once per process; the rows above reuse that walk after their first round).
* **one record, file open**: ``field[i]`` of an open run against ``ds[i]`` of an open h5py dataset.
* **warm stages** (4 KiB): what each step of a warm open + one record costs, hookline
  (``open_run``, ``run[h]``, ``h[f]``, ``f[i]``, ``close``) and h5py (``File``, ``f[name]``,
  ``ds[i]``, ``close``).

Target (issue 25): hookline <= 1.5x plain h5py, warm and cold. Each ratio is the median over
rounds of the per-round ratio (random record, both variants read the same record, order
alternating).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import h5py
import numpy as np

from hookline.storage import RunWriter, open_run

HID = "outputs[layer]"
FIELD = "outputs.0"
SIZES = {"8 MiB": (2048, 1024), "256 KiB": (64, 1024), "4 KiB": (1024,)}


def _write_run(d: Path, shape: tuple[int, ...], n: int) -> Path:
    run = d / f"run-{'x'.join(map(str, shape))}"
    rng = np.random.default_rng(0)
    pool = [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]
    with RunWriter(run) as w:  # (fsynced: the pages are clean, so dropping them works)
        w.add_handle(HID)
        for i in range(n):
            w.write(HID, i, 0, {FIELD: pool[i % 4].copy()})
    return run


def _drop(path: Path, use_proc: bool) -> None:
    if use_proc:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return
        except OSError:
            pass
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _hookline_open_read(run: Path, i: int) -> float:
    t = time.perf_counter()
    with open_run(run) as r:
        r[HID][FIELD][i]
    return time.perf_counter() - t


def _h5py_open_read(path: Path, i: int) -> float:
    t = time.perf_counter()
    with h5py.File(path, "r") as f:
        f[FIELD][i]
    return time.perf_counter() - t


def _best(fn: Callable[[], float], tries: int) -> float:
    return min(fn() for _ in range(tries))


def bench_size(run: Path, n: int, rounds: int, use_proc: bool, tries: int = 3, seed: int = 0) -> dict[str, float]:
    """Per round: a random record; each variant's best of ``tries`` (alternating), warm, cold and
    with the file open; the ratio of the two bests. Returns the medians over rounds."""
    path = run / "outputs" / "layer.h5"
    rng = np.random.default_rng(seed)
    ratios: dict[str, list[float]] = {"warm": [], "cold": [], "open": []}
    times: dict[str, list[float]] = {k: [] for k in ("h_warm", "p_warm", "h_cold", "p_cold", "h_open", "p_open")}
    _hookline_open_read(run, 0), _h5py_open_read(path, 0)  # (imports, first touch)
    with open_run(run) as r, h5py.File(path, "r") as f:
        fld, ds = r[HID][FIELD], f[FIELD]
        fld[0], ds[0]

        def cold(fn: Callable[[], float]) -> Callable[[], float]:
            def go() -> float:
                _drop(path, use_proc)
                return fn()
            return go

        def timed(fn: Callable[[], Any]) -> Callable[[], float]:
            def go() -> float:
                t = time.perf_counter()
                fn()
                return time.perf_counter() - t
            return go

        # Cold reads take records of chunks nothing read before (on a VM the host's cache keeps what
        # the guest read: a chunk read once reads fast again even after the guest dropped it; plain
        # h5py reads whole chunks). Warm reads stay in the first 4 chunks.
        c0 = int(ds.chunks[0])
        fresh = [int(x) for x in rng.permutation(np.arange(4, n // c0))]
        for k in range(rounds):
            i = int(rng.integers(min(n, 4 * c0)))
            if len(fresh) >= 2:
                ci, cj = (fresh.pop() * c0 + int(rng.integers(c0)) for _ in range(2))
            else:
                ci = cj = i
            variants = {
                "warm": (lambda: _hookline_open_read(run, i), lambda: _h5py_open_read(path, i)),
                "cold": (cold(lambda: _hookline_open_read(run, ci)), cold(lambda: _h5py_open_read(path, cj))),
                "open": (timed(lambda: fld[i]), timed(lambda: ds[i])),
            }
            for name, (hk, pl) in variants.items():
                pair = (hk, pl) if k % 2 == 0 else (pl, hk)
                # (cold: one try each; a second drop right after a read left pages behind)
                best = [_best(fn, 1 if name == "cold" else tries) for fn in pair]
                th, tp = (best[0], best[1]) if k % 2 == 0 else (best[1], best[0])
                ratios[name].append(th / tp)
                times["h_" + name].append(th), times["p_" + name].append(tp)
    out = {k: float(np.median(v)) for k, v in ratios.items()}
    out.update({k: float(np.median(v)) * 1e3 for k, v in times.items()})
    return out


_CHILD = """
import sys, time
from pathlib import Path
import h5py
from hookline.storage import open_run
run, i, which = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t = time.perf_counter()
if which == "hookline":
    with open_run(run) as r:
        r["%s"]["%s"][i]
else:
    with h5py.File(run / "outputs" / "layer.h5", "r") as f:
        f["%s"][i]
print(time.perf_counter() - t)
""" % (HID, FIELD, FIELD)


def bench_first_open(run: Path, n: int, children: int) -> tuple[float, float]:
    """Median seconds of open + one record in a fresh process (the first open of a file in a
    process walks its structure: later opens reuse the walk), hookline and h5py."""
    import subprocess
    import sys

    got: dict[str, list[float]] = {"hookline": [], "h5py": []}
    for k in range(children):
        for which in (("hookline", "h5py") if k % 2 == 0 else ("h5py", "hookline")):
            out = subprocess.run([sys.executable, "-c", _CHILD, str(run), str(k % n), which], check=True,
                                 capture_output=True, text=True).stdout
            got[which].append(float(out))
    return float(np.median(got["hookline"])), float(np.median(got["h5py"]))


def bench_stages(run: Path, n: int, rounds: int) -> dict[str, float]:
    """Median microseconds of each stage of a warm open + one record, hookline and h5py
    alternating (after a first round: imports, the structure walk)."""
    path = run / "outputs" / "layer.h5"
    got: dict[str, list[float]] = {}

    def note(names: tuple[str, ...], stamps: list[float]) -> None:
        for name, a, b in zip(names, stamps, stamps[1:]):
            got.setdefault(name, []).append((b - a) * 1e6)
        got.setdefault(names[0].split(" ")[0] + " total", []).append((stamps[-1] - stamps[0]) * 1e6)

    def stamped(steps: list[Callable[[dict], Any]]) -> list[float]:
        """Run the steps on one shared dict; the clock before the first and after each."""
        state: dict[str, Any] = {}
        t = [time.perf_counter()]
        for step in steps:
            step(state)
            t.append(time.perf_counter())
        return t

    for k in range(rounds + 1):
        i = k % n
        t = stamped([lambda s: s.update(r=open_run(run)), lambda s: s.update(h=s["r"][HID]),
                     lambda s: s.update(f=s["h"][FIELD]), lambda s: s["f"][i], lambda s: s["r"].close()])
        u = stamped([lambda s: s.update(f=h5py.File(path, "r")), lambda s: s.update(ds=s["f"][FIELD]),
                     lambda s: s["ds"][i], lambda s: s["f"].close()])
        if k:
            note(("hookline open_run", "hookline run[h]", "hookline h[f]", "hookline f[i]", "hookline close"), t)
            note(("h5py File", "h5py f[name]", "h5py ds[i]", "h5py close"), u)
    return {k: float(np.median(v)) for k, v in got.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--children", type=int, default=6, help="fresh processes per variant for the first-open row")
    ap.add_argument("--drop-caches", action="store_true",
                    help="cold reads drop the whole page cache (needs root) instead of the file's pages")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hookline-bench-read-", dir=args.dir))
    try:
        print(f"== one record: open_run(run)[h][f][i] vs h5py.File(path)[f][i], median of {args.rounds} rounds "
              f"(ms; ratio = median of per-round ratios; target <= 1.5x)")
        for label, shape in SIZES.items():
            nbytes = 4 * int(np.prod(shape))
            c0 = max(1, min(4096, (1 << 20) // nbytes))  # (records per chunk: 256 KiB -> 4, 4 KiB -> 256)
            n = c0 * (2 * args.rounds + 6)  # (a fresh chunk for every cold read)
            run = _write_run(d, shape, n)
            r = bench_size(run, n, args.rounds, args.drop_caches)
            fh, fp = bench_first_open(run, n, args.children)
            print(f"  {label:8s} ({n} records)  warm: hookline {r['h_warm']:.3f} ms, h5py {r['p_warm']:.3f} ms, "
                  f"RATIO {r['warm']:.2f}x | cold: {r['h_cold']:.3f} / {r['p_cold']:.3f} ms, RATIO {r['cold']:.2f}x "
                  f"| file open: {r['h_open']:.3f} / {r['p_open']:.3f} ms, RATIO {r['open']:.2f}x")
            print(f"  {'':8s} first open in a fresh process (warm page cache): hookline {fh * 1e3:.3f} ms, "
                  f"h5py {fp * 1e3:.3f} ms, RATIO {fh / fp:.2f}x")
            if label == "4 KiB":
                st = bench_stages(run, n, 300)
                print(f"  {'':8s} warm stages (us, medians of 300): " + ", ".join(f"{k} {v:.0f}" for k, v in st.items()))
            shutil.rmtree(run)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
