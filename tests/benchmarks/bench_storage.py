"""Storage benchmark (a script, not collected by pytest). Prints ratios measured in one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python tests/benchmarks/bench_storage.py [--size-gb 2] [--dir DIR]

1. Writer throughput: the same bytes (1 MiB float32 records) written by numpy ``tofile`` (+fsync),
   by :class:`RunWriter` (write + close, fsync included; with its default xxh3 chunk hashes,
   with ``checksums=False``, and with HDF5's fletcher32) and by a naive per-record h5py
   ``resize`` + write. Targets: RunWriter >= 0.7x tofile and >= 3x naive; the chunk hashes cost
   <= 10% of the writer's throughput (they are on by default).
2. One-record random read latency on a ``--size-gb`` run (page cache dropped for the file with
   ``posix_fadvise(DONTNEED)`` first: cold reads). Target < 10 ms.
3. Peak RSS over baseline with a slow disk (the writer thread sleeps per MiB written) vs
   ``max_buffer_mb``. Target <= budget + 64 MB.
4. Training-thread stall: a numpy/Python loop that hands one record per iteration to the writer,
   vs the same loop without a writer (records discarded) and vs writing inline with h5py.
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

import h5py
import numpy as np

from hookline.storage import RunWriter, open_run
from hookline.storage._fs import WRITEBACK_BYTES, start_writeback

REC_SHAPE = (16, 1024)  # 64 KiB float32 records for the throughput runs (a typical activation)
SMALL_SHAPE = (64, 64)  # 16 KiB: per-record overhead dominates
STALL_SHAPE = (256, 1024)  # 1 MiB per iteration in the stall loop
HID = "outputs[layer]"


def _fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _records(n_pool: int = 8, shape: tuple[int, ...] = REC_SHAPE) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(n_pool)]


def bench_tofile(d: Path, n: int, pool: list[np.ndarray], kick_bytes: int = 0) -> float:
    """numpy ``tofile`` + fsync; with ``kick_bytes``, also the writer's writeback kicks (a raw
    writer given the same I/O scheduling, to separate format cost from scheduling)."""
    p = d / "raw.bin"
    t0 = time.perf_counter()
    since = 0
    with open(p, "wb") as f:
        for i in range(n):
            pool[i % len(pool)].tofile(f)
            since += pool[0].nbytes
            if kick_bytes and since >= kick_bytes:
                since = 0
                f.flush()
                start_writeback(f.fileno())
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    p.unlink()
    return dt


def bench_writer(d: Path, n: int, pool: list[np.ndarray], flush_every: int | None = None,
                 compression: str | None = None, checksums: bool = True) -> float:
    run = d / "run"
    t0 = time.perf_counter()
    w = RunWriter(run, max_buffer_mb=256, compression=compression, checksums=checksums)
    w.add_handle(HID)
    for i in range(n):
        # The writer takes ownership; a recorder hands over fresh copies, so do we (copy cost
        # is on the caller, like a device->host copy would be).
        w.write(HID, i, 0, {"outputs.0": pool[i % len(pool)].copy()})
        if flush_every and (i + 1) % flush_every == 0:
            w.flush()
    w.close()
    dt = time.perf_counter() - t0
    shutil.rmtree(run)
    return dt


def bench_copy_only(n: int, pool: list[np.ndarray]) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        pool[i % len(pool)].copy()
    return time.perf_counter() - t0


def bench_naive(d: Path, n: int, pool: list[np.ndarray]) -> float:
    p = d / "naive.h5"
    t0 = time.perf_counter()
    with h5py.File(p, "w") as f:
        shape = pool[0].shape
        ds = f.create_dataset("x", shape=(0, *shape), maxshape=(None, *shape), dtype=np.float32,
                              chunks=(1, *shape))
        for i in range(n):
            ds.resize(i + 1, axis=0)
            ds[i] = pool[i % len(pool)]
    _fsync_path(p)
    dt = time.perf_counter() - t0
    p.unlink()
    return dt


def bench_read(d: Path, size_gb: float, pool: list[np.ndarray]) -> dict[str, float]:
    run = d / "readrun"
    rec = np.ones((64, 1024), np.float32)  # 256 KiB records
    n = int(size_gb * (1 << 30) / rec.nbytes)
    w = RunWriter(run, max_buffer_mb=256, fsync=False)
    w.add_handle(HID)
    for i in range(n):
        w.write(HID, i, 0, {"outputs.0": rec * (i % 97)})
    w.close()
    files = list(run.rglob("*.h5"))
    size = sum(p.stat().st_size for p in files)
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    t0 = time.perf_counter()
    f = open_run(run)[HID]["outputs.0"]
    x = f[n // 2]
    first = time.perf_counter() - t0
    assert x[0, 0] == (n // 2) % 97
    rng = np.random.default_rng(1)
    idx = rng.integers(0, n, 200)
    lat = []
    for i in idx:
        t0 = time.perf_counter()
        f[int(i)]
        lat.append(time.perf_counter() - t0)
    shutil.rmtree(run)
    return {"size_gb": size / 2**30, "records": n, "open_plus_first_ms": first * 1e3,
            "median_ms": float(np.median(lat)) * 1e3, "p99_ms": float(np.percentile(lat, 99)) * 1e3}


_RSS_CHILD = r"""
import json, sys, time
import numpy as np
from hookline.storage import RunWriter
from hookline.storage.writer.queue import WriteQueue
budget, delay, n = float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
release = WriteQueue.release  # a slow disk: sleep per MiB written before the bytes return to the budget
WriteQueue.release = lambda q, nbytes: (time.sleep(delay * nbytes / 2**20), release(q, nbytes))[1]
template = np.ones((256, 1024), np.float32)
w0 = RunWriter(sys.argv[1] + "/warm", max_buffer_mb=4); w0.add_handle("a[b]")
w0.write("a[b]", 0, 0, {"x": template.copy()}); w0.close()
import os
base = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")  # current RSS
w = RunWriter(sys.argv[1] + "/run", max_buffer_mb=budget, fsync=False)
w.add_handle("outputs[layer]")
t0 = time.perf_counter()
for i in range(n):
    w.write("outputs[layer]", i, 0, {"outputs.0": template * 1.0})  # fresh 1 MiB each
st = w.close()
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec from the forking parent.
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"budget_mb": budget, "over_baseline_mb": (peak - base) / 2**20,
                  "peak_buffer_mb": st.peak_buffer_bytes / 2**20, "blocked_s": st.blocked_seconds,
                  "seconds": time.perf_counter() - t0}))
"""


def bench_rss(d: Path, budget_mb: float, delay_s_per_mb: float, n: int) -> dict[str, float]:
    sub = d / "rss"
    sub.mkdir()
    r = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(sub), str(budget_mb), str(delay_s_per_mb), str(n)],
                       capture_output=True, text=True, check=True)
    shutil.rmtree(sub)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _train_loop(n: int, sink) -> float:
    a = np.random.default_rng(2).standard_normal((192, 192)).astype(np.float32)
    rec = np.ones(STALL_SHAPE, np.float32)
    t0 = time.perf_counter()
    acc = 0.0
    for i in range(n):
        b = a
        for _ in range(6):
            b = np.tanh(b @ a * 0.01)
        acc += sum(float(v) for v in b[0, :64])  # some pure-Python work too
        sink(i, rec * 1.0)  # the "captured" tensor: a fresh 1 MiB copy
    return time.perf_counter() - t0


def _process_child(shm_name: str, slots: int, nbytes: int, free_q, full_q, path: str) -> None:
    from multiprocessing import shared_memory

    shm = shared_memory.SharedMemory(name=shm_name)
    ring = np.ndarray((slots, nbytes), np.uint8, buffer=shm.buf)
    with open(path, "wb") as fh:
        while (slot := full_q.get()) is not None:
            ring[slot].tofile(fh)
            free_q.put(slot)
    del ring
    shm.close()


def _process_writer_loop(d: Path, n: int, slots: int = 64) -> float:
    """The alternative to a writer thread: a writer *process* fed through a shared-memory ring
    (the caller copies each record into a free slot and passes the slot number)."""
    import multiprocessing as mp
    from multiprocessing import shared_memory

    nbytes = int(np.prod(STALL_SHAPE)) * 4
    shm = shared_memory.SharedMemory(create=True, size=slots * nbytes)
    ctx = mp.get_context("spawn")
    free_q, full_q = ctx.Queue(), ctx.Queue()
    for i in range(slots):
        free_q.put(i)
    child = ctx.Process(target=_process_child, args=(shm.name, slots, nbytes, free_q, full_q, str(d / "proc.bin")))
    child.start()
    ring = np.ndarray((slots, *STALL_SHAPE), np.float32, buffer=shm.buf)

    def send(i, x):
        slot = free_q.get()
        np.copyto(ring[slot], x)
        full_q.put(slot)

    try:
        t = _train_loop(n, send)
    finally:
        full_q.put(None)
        child.join(60)
        del ring
        shm.close()
        shm.unlink()
        (d / "proc.bin").unlink(missing_ok=True)
    return t


def bench_stall(d: Path, n: int) -> dict[str, float]:
    base = min(_train_loop(n, lambda i, x: None) for _ in range(2))
    held: list[np.ndarray] = []

    def hold(i, x):  # keep the last 64 records alive (allocation/page-fault cost, no I/O)
        held.append(x)
        if len(held) > 64:
            held.pop(0)

    hold_t = _train_loop(n, hold)
    held.clear()
    run = d / "stall"
    w = RunWriter(run, max_buffer_mb=256, fsync=False)
    w.add_handle(HID)
    call_t: list[float] = []

    def write(i, x):
        t0 = time.perf_counter()
        w.write(HID, i, 0, {"outputs.0": x})
        call_t.append(time.perf_counter() - t0)

    with_writer = _train_loop(n, write)
    w.close()
    shutil.rmtree(run)
    p = d / "inline.h5"
    with h5py.File(p, "w") as f:
        ds = f.create_dataset("x", shape=(0, *STALL_SHAPE), maxshape=(None, *STALL_SHAPE), dtype=np.float32,
                              chunks=(1, *STALL_SHAPE))

        def inline(i, x):
            ds.resize(i + 1, axis=0)
            ds[i] = x

        inline_t = _train_loop(n, inline)
    p.unlink()
    import queue
    import threading

    q: queue.Queue = queue.Queue(64)
    raw = d / "raw_thread.bin"

    def drain():
        with open(raw, "wb") as fh:
            while (x := q.get()) is not None:
                x.tofile(fh)

    th = threading.Thread(target=drain)
    th.start()
    raw_t = _train_loop(n, lambda i, x: q.put(x))
    q.put(None)
    th.join()
    raw.unlink()
    proc_t = _process_writer_loop(d, n)
    return {"loop_s": base, "hold_x": hold_t / base, "with_writer_x": with_writer / base,
            "raw_thread_x": raw_t / base, "inline_h5py_x": inline_t / base, "process_x": proc_t / base,
            "write_call_us": float(np.median(call_t)) * 1e6, "write_call_p99_us": float(np.percentile(call_t, 99)) * 1e6}


def bench_compression(d: Path, mb: int = 256) -> list[tuple[str, float, float, float]]:
    """ReLU-like activations (half zeros) and random normal float32, per compression setting:
    (setting, GiB/s incl. close, ratio on ReLU data, ratio on random-normal data)."""
    rng = np.random.default_rng(3)
    relu = [np.maximum(rng.standard_normal((64, 1024)), 0).astype(np.float32) for _ in range(8)]
    normal = [rng.standard_normal((64, 1024)).astype(np.float32) for _ in range(8)]
    n = mb * 4  # 256 KiB records
    out = []
    for comp in (None, "lz4", "zstd", "lzf", "gzip-1"):
        sizes = []
        for data in (relu, normal):
            run = d / "comp"
            t0 = time.perf_counter()
            w = RunWriter(run, max_buffer_mb=256, compression=comp, fsync=False)
            w.add_handle(HID)
            for i in range(n):
                w.write(HID, i, 0, {"outputs.0": data[i % 8].copy()})
            w.close()
            dt = time.perf_counter() - t0
            sizes.append((sum(p.stat().st_size for p in run.rglob("*.h5")), dt))
            shutil.rmtree(run)
        raw = n * relu[0].nbytes
        out.append((str(comp), raw / 2**30 / sizes[0][1], raw / sizes[0][0], raw / sizes[1][0]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-gb", type=float, default=2.0, help="size of the read-latency run (default 2)")
    ap.add_argument("--write-gb", type=float, default=1.0, help="bytes per throughput measurement (default 1)")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compression", action="store_true", help="only the compression comparison")
    ap.add_argument("--throughput-only", action="store_true", help="only the throughput tables")
    ap.add_argument("--stall-only", action="store_true", help="only the training-thread stall comparison")
    ap.add_argument("--record-kib", type=int, default=None, help="throughput: only this record size (KiB)")
    args = ap.parse_args()
    d = Path(tempfile.mkdtemp(prefix="hookline-bench-", dir=args.dir))
    try:
        if args.compression:
            print("== compression (256 MiB of 256 KiB float32 records, one writer thread, no fsync)")
            for comp, gbs, r_relu, r_norm in bench_compression(d):
                print(f"  {comp:7s} {gbs:5.2f} GiB/s   ratio ReLU {r_relu:4.2f}x   random-normal {r_norm:4.2f}x")
            return
        if args.stall_only:
            _print_stall(bench_stall(d, n=400))
            return
        shapes = (REC_SHAPE, SMALL_SHAPE) if args.record_kib is None else ((args.record_kib * 256 // 1024, 1024),)
        for shape in shapes:
            pool = _records(shape=shape)
            n = int(args.write_gb * (1 << 30) / pool[0].nbytes)
            if shape == SMALL_SHAPE:
                n //= 2
            keys = ("tofile", "tofile_kick", "writer", "writer_nohash", "writer_checksum", "writer_flush", "naive")
            res: dict[str, list[float]] = {k: [] for k in keys}
            flush_every = (64 << 20) // pool[0].nbytes  # a flush every 64 MiB
            runs = {"tofile": lambda: bench_tofile(d, n, pool),
                    "tofile_kick": lambda: bench_tofile(d, n, pool, WRITEBACK_BYTES), "writer": lambda: bench_writer(d, n, pool),
                    "writer_nohash": lambda: bench_writer(d, n, pool, checksums=False),
                    "writer_checksum": lambda: bench_writer(d, n, pool, compression="none+checksum", checksums=False),
                    "writer_flush": lambda: bench_writer(d, n, pool, flush_every=flush_every),
                    "naive": lambda: bench_naive(d, n, pool)}
            for rep in range(args.repeats):
                # Rotating order: the disk's drift (writeback of the previous variant, other
                # tenants) falls on every variant alike; ratios are taken within one repeat.
                for k in keys[rep % len(keys):] + keys[: rep % len(keys)]:
                    res[k].append(runs[k]())
            med = {k: float(np.median(v)) for k, v in res.items()}
            paired = {k: float(np.median([a / b for a, b in zip(res["tofile"], res[k])])) for k in keys}
            paired_naive = float(np.median([a / b for a, b in zip(res["naive"], res["writer"])]))
            paired_kick = float(np.median([a / b for a, b in zip(res["tofile_kick"], res["writer"])]))
            paired_ck = float(np.median([a / b for a, b in zip(res["writer_nohash"], res["writer_checksum"])]))
            paired_hash = float(np.median([a / b for a, b in zip(res["writer_nohash"], res["writer"])]))
            gb = n * pool[0].nbytes / 2**30
            print(f"== throughput ({gb:.2f} GiB of {pool[0].nbytes >> 10} KiB float32 records, median of "
                  f"{args.repeats}, fsync included)")
            for k in keys:
                print(f"  {k:15s} {gb / med[k]:6.2f} GiB/s  ({med[k]:.2f} s)")
            print("  (ratios: median over repeats of the ratio within one repeat)")
            print(f"  RATIO writer / tofile            = {paired['writer']:.2f}x   (target >= 0.7)")
            print(f"  RATIO writer / (tofile + same writeback kicks) = {paired_kick:.2f}x")
            print(f"  RATIO writer(flush/64MiB) / tofile = {paired['writer_flush']:.2f}x")
            print(f"  RATIO writer (xxh3 chunk hashes, default) / writer(checksums=False) = {paired_hash:.2f}x   "
                  f"(on by default if >= 0.90)")
            print(f"  RATIO writer + fletcher32 ('+checksum') / writer(checksums=False) = {paired_ck:.2f}x")
            print(f"  RATIO writer / naive h5py        = {paired_naive:.2f}x   (target >= 3)")
        if args.throughput_only:
            return

        r = bench_read(d, args.size_gb, pool)
        print(f"== one-record read, {r['size_gb']:.2f} GiB run, {r['records']} records of 256 KiB, cold")
        print(f"  open_run + first record: {r['open_plus_first_ms']:.2f} ms; random record median "
              f"{r['median_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms   (target < 10 ms)")

        rs = bench_rss(d, budget_mb=128, delay_s_per_mb=0.004, n=768)
        print(f"== memory, slow disk (~250 MB/s simulated), max_buffer_mb={rs['budget_mb']:.0f}, 768 MiB written")
        print(f"  peak RSS over baseline {rs['over_baseline_mb']:.1f} MB (target <= {rs['budget_mb'] + 64:.0f}); "
              f"peak buffered {rs['peak_buffer_mb']:.1f} MB; write() blocked {rs['blocked_s']:.2f} s")

        _print_stall(bench_stall(d, n=400))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _print_stall(st: dict[str, float]) -> None:
    print("== training-thread stall (numpy/Python loop + one fresh 1 MiB record per iteration)")
    print(f"  loop alone {st['loop_s']:.2f} s; holding the records only (no I/O) {st['hold_x']:.2f}x; "
          f"with RunWriter {st['with_writer_x']:.2f}x; thread + tofile {st['raw_thread_x']:.2f}x; "
          f"process (shared-memory ring) + tofile {st['process_x']:.2f}x; inline h5py writes {st['inline_h5py_x']:.2f}x")
    print(f"  RunWriter.write() call: median {st['write_call_us']:.1f} us, p99 {st['write_call_p99_us']:.1f} us")


if __name__ == "__main__":
    main()
