"""What a shorter ``autoflush_s`` costs (a script, not collected by pytest). Prints one run's numbers.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python tests/benchmarks/bench_autoflush.py [--dir DIR]

A seal (``flush()``, or the writer's automatic one every ``autoflush_s``) closes, fsyncs and
renames every segment with new data, fsyncs the directory and rewrites the manifest; the next
record of each handle opens a new segment. So shorter intervals cost:

1. **Seals while training runs**: the wall time of one seal of N handles that each got one new
   small record (per-file costs only), as a share of the interval (60 s vs 300 s).
2. **The merge at close**: a run sealed more than once merges each handle's segments into its
   final ``.h5`` (a copy of its bytes); a run sealed only at close renames its single segment.
   Runs between 60 s and 300 s long pay that copy with ``autoflush_s=60`` and not with 300.
   Measured: ``close()`` of the same bytes written as 5 segments per handle vs 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from hookline.storage import RunWriter

SMALL = np.zeros(256, np.float32)  # 1 KiB: a seal's fixed costs dominate


def _writer(d: Path, handles: int) -> RunWriter:
    w = RunWriter(d, autoflush_s=None, max_buffer_mb=512)
    for h in range(handles):
        w.add_handle(f"outputs[layer.{h}]", module_name=f"layer.{h}")
    return w


def seal_ms(root: Path, handles: int, rounds: int = 5) -> float:
    """Median wall time (ms) of a seal of ``handles`` handles with one new small record each."""
    d = root / f"seal{handles}"
    w = _writer(d, handles)
    times = []
    for r in range(rounds + 1):
        for h in range(handles):
            w.write(f"outputs[layer.{h}]", r, 0, {"outputs.0": SMALL})
        t = time.perf_counter()
        w.flush()
        times.append(time.perf_counter() - t)
    w.close()
    shutil.rmtree(d)
    return float(np.median(times[1:]) * 1e3)  # (the first seal also creates the files)


def close_s(root: Path, segments: int, handles: int = 64, mib_per_handle: int = 4) -> float:
    """Wall time (s) of ``close()`` of a run whose handles hold ``mib_per_handle`` MiB each, sealed
    into ``segments`` segments before the close (1: only the close seals)."""
    d = root / f"close{segments}"
    w = _writer(d, handles)
    rec = np.random.default_rng(0).standard_normal((16, 1024), dtype=np.float32)  # 64 KiB
    per = mib_per_handle * 16
    for s in range(segments):
        for i in range(per // segments):
            for h in range(handles):
                w.write(f"outputs[layer.{h}]", s * per + i, 0, {"outputs.0": rec})
        if s < segments - 1:
            w.flush()
    t = time.perf_counter()
    w.close()
    took = time.perf_counter() - t
    assert len(list(d.rglob("*.h5"))) == handles
    shutil.rmtree(d)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="hookline-autoflush-", dir=args.dir))
    try:
        print(f"load: {open('/proc/loadavg').read().strip()}  cpus: {os.cpu_count()}")
        print("1. one seal (one new 1 KiB record per handle), median of 5")
        for n in (8, 64, 512):
            ms = seal_ms(root, n)
            print(f"   {n:4d} handles: {ms:8.1f} ms = {ms / n:.2f} ms/handle; share of the interval: "
                  f"{ms / 600:.3f}% at 60 s, {ms / 3000:.3f}% at 300 s")
        one, five = close_s(root, 1), close_s(root, 5)
        print(f"2. close() of 64 handles x 4 MiB: 1 segment {one:.2f} s (rename), 5 segments {five:.2f} s "
              f"(merge): {five / one:.1f}x, +{(five - one) / 256 * 1024:.1f} ms per MiB")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
