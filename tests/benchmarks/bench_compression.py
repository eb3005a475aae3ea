"""Compression codecs through :class:`RunWriter` on activations, gradients and random data (a
script, not collected by pytest). Prints the ratio and the write speed of every codec beside
uncompressed, measured in one run, codecs interleaved.

    .venv/bin/python tests/benchmarks/bench_compression.py [--mb 64] [--repeats 2] [--dir DIR]

Data (256 KiB records; the values of a 2-layer MLP's hidden layer are not needed: the codecs
see bytes): ``relu`` (ReLU of standard normal: half zeros), ``gelu`` (GELU of standard normal),
``relu-bf16`` / ``gelu-bf16`` (the same as bfloat16 bits), ``grad`` (normal * 1e-3, the scale of
gradients), ``normal`` (standard normal float32: next to nothing to find). Speed: records written with
``write()`` + ``close()`` (fsync included), as GiB/s of payload, and as a ratio to the
uncompressed writer within the same repeat; CPU: process CPU seconds per GiB of payload (the
writer's threads included). Blosc2 runs ``BLOSC_NTHREADS`` threads (the writer sets up to 4 when
unset). Issue 25's target: >= 0.9x the uncompressed speed while saving >= 1.5x on ReLU/GELU
activations and on bf16.
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

HID = "outputs[layer]"
CODECS = (None, "none+checksum", "lz4", "zstd", "blosc2-lz4-1-shuffle", "blosc2-lz4-5-bitshuffle",
          "blosc2-zstd-1-shuffle", "blosc2-zstd-1-bitshuffle")


def _data() -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((64, 1024), dtype=np.float32) for _ in range(4)]
    relu = [np.maximum(a, 0) for a in x]
    gelu = [(a * 0.5 * (1 + np.tanh(0.7978845608 * (a + 0.044715 * a**3)))).astype(np.float32) for a in x]

    def bf16(pool: list[np.ndarray]) -> list[np.ndarray]:  # (two f32 records per 256 KiB; round to nearest even)
        out = []
        for i in range(len(pool)):
            u = np.concatenate([pool[i], pool[(i + 1) % len(pool)]]).view(np.uint32).astype(np.uint64)
            out.append(((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))
        return out

    return {"relu": relu, "gelu": gelu, "relu-bf16": bf16(relu), "gelu-bf16": bf16(gelu),
            "grad": [a * np.float32(1e-3) for a in x],
            "normal": x}


def _write(d: Path, codec: str | None, pool: list[np.ndarray], n: int) -> tuple[float, float, int]:
    """(seconds, CPU seconds, bytes on disk) for ``n`` records."""
    run = d / "run"
    field = {"outputs.0": None}
    t0, c0 = time.perf_counter(), time.process_time()
    w = RunWriter(run, max_buffer_mb=256, compression=codec)
    w.add_handle(HID)
    for i in range(n):
        a = pool[i % len(pool)]
        field["outputs.0"] = (a.copy(), "bfloat16") if a.dtype == np.uint16 else a.copy()
        w.write(HID, i, 0, dict(field))
    w.close()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    size = sum(p.stat().st_size for p in run.rglob("*.h5"))
    shutil.rmtree(run)
    return dt, cpu, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=64, help="MiB of payload per measurement (default 64)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--codecs", default=None, help="comma-separated specs (default: the built-in list)")
    args = ap.parse_args()
    codecs = CODECS if args.codecs is None else tuple(None if c == "none" else c for c in args.codecs.split(","))
    if None not in codecs:
        codecs = (None, *codecs)
    data = _data()
    n = args.mb * 4  # 256 KiB records
    gib = n * (256 << 10) / 2**30
    d = Path(tempfile.mkdtemp(prefix="hookline-bench-comp-", dir=args.dir))
    # res[kind][codec] = list of (speed ratio to uncompressed, GiB/s, CPU s per GiB, ratio)
    res: dict[str, dict[str, list[tuple[float, float, float, float]]]] = {k: {} for k in data}
    t_start = time.perf_counter()
    try:
        for rep in range(args.repeats):
            for kind, pool in data.items():
                order = codecs[rep % len(codecs):] + codecs[: rep % len(codecs)]  # rotating order
                got = {c: _write(d, c, pool, n) for c in order}
                base = got[None][0]
                for c, (dt, cpu, size) in got.items():
                    res[kind].setdefault(str(c), []).append((base / dt, gib / dt, cpu / gib, n * (256 << 10) / size))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"== compression through RunWriter: {args.mb} MiB of 256 KiB records per cell, write + close with "
          f"fsync, median of {args.repeats} repeats (BLOSC_NTHREADS={os.environ.get('BLOSC_NTHREADS', 'unset')} "
          f"before the first Blosc2 writer; {time.perf_counter() - t_start:.0f} s in all)")
    print("  cell: size ratio (raw / file) | speed vs uncompressed in the same repeat | GiB/s | CPU s per GiB")
    kinds = list(data)
    print("  " + f"{'codec':28s}" + "".join(f"{k:>32s}" for k in kinds))
    for c in codecs:
        cells = []
        for k in kinds:
            rows = res[k][str(c)]
            sp, gbs, cpu, ratio = (float(np.median([r[i] for r in rows])) for i in range(4))
            cells.append(f"{ratio:5.2f}x | {sp:4.2f}x | {gbs:4.2f} | {cpu:4.2f}")
        print("  " + f"{str(c or 'none'):28s}" + "".join(f"{x:>32s}" for x in cells))
    print("  target (issue 25): >= 1.5x size on relu, gelu and bf16 at >= 0.90x the uncompressed speed")
    for c in codecs[1:]:
        ok_ratio = all(float(np.median([r[3] for r in res[k][str(c)]])) >= 1.5
                       for k in ("relu", "gelu", "relu-bf16", "gelu-bf16"))
        ok_speed = all(float(np.median([r[0] for r in res[k][str(c)]])) >= 0.9 for k in kinds)
        print(f"  {str(c):28s} ratio >= 1.5x on all activations: {'yes' if ok_ratio else 'no'}; "
              f"speed >= 0.9x everywhere: {'yes' if ok_speed else 'no'}")


if __name__ == "__main__":
    main()
