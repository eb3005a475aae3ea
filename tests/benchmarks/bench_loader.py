"""Training-data throughput of RecordDataset (SPEC §14), as ratios from one run.

One field of ``--gb`` GB (records (8, 64, 512) float32, 1 MiB each; rows of 512 floats) is read
for one epoch as batches of ``--batch`` rows, and beside it the same bytes and rows as:

* raw: ``readinto`` of the same bytes from a flat file, 16 MiB at a time into one reused buffer
  (the limit); and the same reads into batches of ``--batch`` rows rotating through 4 buffers
  (RecordDataset's rotation: a batch stays valid while the loop may use it);
* memmap: an ``np.memmap`` of the same rows, batches in order / of random rows (one gather);
* arrow: a Hugging Face ``datasets`` table of the same rows (``save_to_disk`` +
  ``load_from_disk``, the format SAE trainers cache activations in) read through its torch
  format, in order / after ``Dataset.shuffle`` (the library's shuffle).

Every reader hands over torch tensors of each batch. Files are written first, so all reads
come from the page cache (the machine has far more memory than the data). Each reader runs
``--repeat`` epochs, interleaved with the others, and its best is kept (the cores are shared);
one RecordDataset per mode serves all its epochs (``set_epoch``), as in training ("new
dataset": a fresh one per epoch, which maps the file's pages again, like a ``DataLoader``
worker that is not persistent). Slow readers
stop after ``--budget`` seconds; their rate is over the rows read by then. Last, the stages of a
shuffled epoch are timed one at a time (where the time goes).

    .venv/bin/python tests/benchmarks/bench_loader.py --gb 1
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from hookline.storage import RecordDataset, RunWriter

SHAPE = (8, 64, 512)
REF = "outputs[layer]/outputs.0"


def write(root: Path, gb: float) -> tuple[Path, Path, int]:
    """The run, a flat copy of its rows (for raw and memmap), and the number of records."""
    n = max(1, int(gb * 1e9) // (4 * int(np.prod(SHAPE))))
    run, flat = root / "run", root / "rows.f32"
    rng = np.random.default_rng(0)
    base = rng.standard_normal(SHAPE, dtype=np.float32)
    with RunWriter(run, max_buffer_mb=256) as w, open(flat, "wb") as fh:
        w.add_handle("outputs[layer]", module_name="layer", module_type="torch.nn.Linear", category="forward_hook",
                     hook_fn_name="outputs")
        for i in range(n):
            x = base + np.float32(i)
            w.write("outputs[layer]", i, 0, {"outputs.0": x})
            x.tofile(fh)
    return run, flat, n


def arrow(root: Path, flat: Path, rows: int) -> Path:
    """The same rows as a ``datasets`` directory (one fixed-size-list column)."""
    import datasets
    import pyarrow as pa

    d = SHAPE[-1]
    mm = np.memmap(flat, np.float32, "r", shape=(rows, d))
    stream = root / "rows.arrow"
    with pa.OSFile(str(stream), "wb") as sink:
        schema = pa.schema([("x", pa.list_(pa.float32(), d))])
        with pa.ipc.new_stream(sink, schema) as wr:
            for a in range(0, rows, 65536):
                block = np.ascontiguousarray(mm[a : a + 65536])
                wr.write_batch(pa.record_batch([pa.FixedSizeListArray.from_arrays(pa.array(block.reshape(-1)), d)],
                                               schema=schema))
    datasets.disable_progress_bars()
    datasets.Dataset.from_file(str(stream)).save_to_disk(str(root / "arrow"))
    return root / "arrow"


def timed(batches: Iterable[torch.Tensor], row_bytes: int, budget: float) -> tuple[float, float, int]:
    """(rows/s, GB/s, rows) of consuming ``batches`` (stops after ``budget`` seconds)."""
    rows = 0
    t0 = time.perf_counter()
    for b in batches:
        rows += len(b)
        if time.perf_counter() - t0 > budget:
            break
    dt = time.perf_counter() - t0
    return rows / dt, rows * row_bytes / dt / 1e9, rows


def raw_read(flat: Path, row_bytes: int) -> Iterable[torch.Tensor]:
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(flat, "rb", buffering=0) as fh:
        while (k := fh.readinto(view)) > 0:
            yield torch.frombuffer(buf, dtype=torch.uint8)[: k - k % row_bytes].view(-1, row_bytes)


def raw_batches(flat: Path, row_bytes: int, batch: int, buffers: int) -> Iterable[torch.Tensor]:
    """The raw read into batches of ``batch`` rows, in turn through ``buffers`` buffers: the
    buffer rotation of RecordDataset (batches in its queue, the one being filled, the one the loop
    holds), so each batch stays valid while the loop may still use it."""
    bufs = [bytearray(batch * row_bytes) for _ in range(buffers)]
    i = 0
    with open(flat, "rb", buffering=0) as fh:
        while (k := fh.readinto(bufs[i % buffers])) > 0:
            yield torch.frombuffer(bufs[i % buffers], dtype=torch.uint8)[: k - k % row_bytes].view(-1, row_bytes)
            i += 1


def memmap_batches(flat: Path, rows: int, batch: int, shuffle: bool) -> Iterable[torch.Tensor]:
    mm = np.memmap(flat, np.float32, "r", shape=(rows, SHAPE[-1]))
    order = np.random.default_rng(0).permutation(rows) if shuffle else None
    for a in range(0, rows, batch):
        yield torch.from_numpy(mm[np.sort(order[a : a + batch])] if order is not None else np.array(mm[a : a + batch]))


def arrow_batches(path: Path, batch: int, shuffle: bool) -> Iterable[torch.Tensor]:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if shuffle:
        ds = ds.shuffle(seed=0)
    for b in ds.with_format("torch").iter(batch_size=batch):
        yield b["x"]


def dataset_batches(ds: RecordDataset) -> Iterable[torch.Tensor]:
    """One epoch of ``ds`` (the next epoch number: one dataset serves every epoch, as in training)."""
    ds.set_epoch(ds.epoch + 1)
    for b in ds:
        yield b[REF]


def where(run: Path, flat: Path, row_bytes: int, batch: int) -> None:
    """Where a shuffled epoch's time goes, stage by stage on one thread, each beside a raw read
    of the same bytes into a reused 16 MiB buffer (interleaved window by window, so load falls
    on both): row references of each window (and its ``MADV_WILLNEED``), then gathering its rows
    from the mapped file into reused batch buffers, shuffled and in order."""
    from hookline.storage import open_run
    from hookline.storage.analysis.dataset_map import MapCache, map_fields
    from hookline.storage.analysis.dataset_read import Batcher, MappedWindow, window_spans

    ds = RecordDataset(run, REF, shuffle=True, batch_rows=batch)
    plan = ds.plan
    r = open_run(run)
    mapped = map_fields([r["outputs[layer]"]["outputs.0"]], plan.row_shapes, MapCache())
    assert mapped is not None, "the field is not stored as plain chunks"
    bufs = [{REF: np.empty((batch, SHAPE[-1]), np.float32)} for _ in range(2)]
    turn = iter(range(1 << 62))
    cum = np.concatenate([[0], np.cumsum(plan.counts)])
    unit_rows = cum[plan.units[1:]] - cum[plan.units[:-1]]
    t = {"raw": 0.0, "refs": 0.0, "shuffled": 0.0, "in order": 0.0}
    buf = bytearray(16 << 20)
    units = np.random.default_rng(0).permutation(plan.num_units)
    for _ in range(2):  # (the first pass maps the file's pages: timed is the second)
        t = dict.fromkeys(t, 0.0)
        with open(flat, "rb", buffering=0) as fh:
            for spans, n in window_spans(plan, units, unit_rows, ds.buffer_rows):
                t0 = time.perf_counter()
                for a, b in spans:
                    fh.seek(int(cum[a]) * row_bytes)
                    left = int(cum[b] - cum[a]) * row_bytes
                    while left > 0:
                        left -= fh.readinto(memoryview(buf)[: min(left, len(buf))])
                t1 = time.perf_counter()
                src = MappedWindow(mapped, plan, spans, False)
                t2 = time.perf_counter()
                for key, rng in (("shuffled", np.random.default_rng(0)), ("in order", None)):
                    t3 = time.perf_counter()
                    bat = Batcher(batch, rng, lambda: bufs[next(turn) % 2], sort=True)
                    for _ in bat.feed(src, n):
                        pass
                    t[key] += time.perf_counter() - t3
                t["raw"] += t1 - t0
                t["refs"] += t2 - t1
    r.close()
    gb = plan.num_rows * row_bytes / 1e9
    rate = {k: gb / max(v, 1e-9) for k, v in t.items()}
    print(f"where the time goes (one thread, stage by stage, second pass over the mapped file, raw read of the "
          f"same bytes interleaved): raw reads {rate['raw']:.2f} GB/s; window row references + MADV_WILLNEED "
          f"{rate['refs']:.1f} GB/s ({rate['refs'] / rate['raw']:.1f}x raw); gathering shuffled batches "
          f"{rate['shuffled']:.2f} GB/s ({rate['shuffled'] / rate['raw']:.2f}x raw); gathering the same rows in "
          f"order {rate['in order']:.2f} GB/s ({rate['in order'] / rate['raw']:.2f}x raw)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="size of the field in GB (default 1)")
    p.add_argument("--batch", type=int, default=4096, help="rows per batch (default 4096)")
    p.add_argument("--budget", type=float, default=30.0, help="seconds at most per reader (default 30)")
    p.add_argument("--repeat", type=int, default=2, help="epochs per reader, best kept (default 2)")
    p.add_argument("--dir", default=None, help="where to write the data (default: a temp dir, removed after)")
    a = p.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="bench-loader-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        t0 = time.perf_counter()
        run, flat, n = write(root, a.gb)
        rows, row_bytes = n * SHAPE[0] * SHAPE[1], SHAPE[-1] * 4
        apath = arrow(root, flat, rows)
        print(f"field: {n} records of {SHAPE} float32 = {rows} rows of {row_bytes} B, {rows * row_bytes / 1e9:.2f} GB "
              f"(written in {time.perf_counter() - t0:.0f} s); batch {a.batch} rows; loadavg "
              f"{open('/proc/loadavg').read().split()[:3]}")
        seq = RecordDataset(run, REF, batch_rows=a.batch)
        shuf = RecordDataset(run, REF, shuffle=True, batch_rows=a.batch)
        cases: list[tuple[str, Callable[[], Iterable[torch.Tensor]]]] = [
            ("raw sequential read (limit)", lambda: raw_read(flat, row_bytes)),
            ("raw read into batches kept while used", lambda: raw_batches(flat, row_bytes, a.batch, 4)),
            ("RecordDataset sequential", lambda: dataset_batches(seq)),
            ("RecordDataset shuffled", lambda: dataset_batches(shuf)),
            ("RecordDataset shuffled, new dataset", lambda: dataset_batches(
                RecordDataset(run, REF, shuffle=True, batch_rows=a.batch))),
            ("np.memmap sequential", lambda: memmap_batches(flat, rows, a.batch, False)),
            ("np.memmap shuffled rows", lambda: memmap_batches(flat, rows, a.batch, True)),
            ("datasets Arrow, torch format, sequential", lambda: arrow_batches(apath, a.batch, False)),
            ("datasets Arrow, torch format, shuffled", lambda: arrow_batches(apath, a.batch, True)),
        ]
        results: dict[str, tuple[float, float, int]] = {}
        for _ in range(a.repeat):  # (interleaved repeats, best kept: the cores are shared)
            for name, make in cases:
                got = timed(make(), row_bytes, a.budget)
                if name not in results or got[1] > results[name][1]:
                    results[name] = got
        raw = results["raw sequential read (limit)"][1]
        print(f"{'reader':42s} {'rows/s':>12s} {'GB/s':>7s} {'x raw':>6s} {'rows read':>10s}")
        for name, (rps, gbs, got) in results.items():
            print(f"{name:42s} {rps:12,.0f} {gbs:7.2f} {gbs / raw:6.2f} {got:10d}")
        best = results["RecordDataset shuffled"][1]
        arr = results["datasets Arrow, torch format, shuffled"][1]
        kept = results["raw read into batches kept while used"][1]
        print(f"shuffled RecordDataset / raw read into kept batches: {best / kept:.2f}")
        print(f"shuffled RecordDataset / raw sequential: {best / raw:.2f} (target >= 0.8); "
              f"/ shuffled Arrow: {best / arr:.1f}x; / sequential Arrow: "
              f"{best / results['datasets Arrow, torch format, sequential'][1]:.1f}x")
        where(run, flat, row_bytes, a.batch)
        print(f"loadavg after: {open('/proc/loadavg').read().split()[:3]}")
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    main()
