"""RunWriter behaviour: API contract, layout, ragged fields, budget/policies, compression."""

from __future__ import annotations

import json
import threading
import time

import h5py
import numpy as np
import pytest

from hookline.storage import (
    InvalidArgumentError,
    RunWriter,
    UnknownNameError,
    WriterClosedError,
    open_run,
)
from hookline.storage.format import FORMAT_VERSION

from _storage_support import GID, HID, add_std_handles, record_value, slow_disk, write_std_run


def test_write_is_fast_and_close_returns_stats(run_dir):
    w = RunWriter(run_dir, max_buffer_mb=256)
    add_std_handles(w)
    arrs = [record_value(i, (64, 256)) for i in range(200)]
    t = []
    for i, a in enumerate(arrs):
        t0 = time.perf_counter()
        assert w.write(HID, i, 0, {"outputs.0": a}) is True
        t.append(time.perf_counter() - t0)
    assert np.median(t) < 200e-6, np.median(t)  # microseconds, no HDF5 on this thread
    stats = w.close()
    assert stats.handles[HID].records == 200 and stats.dropped == 0
    assert stats.bytes == sum(a.nbytes for a in arrs)
    assert w.close() is not None  # idempotent
    with pytest.raises(WriterClosedError):
        w.write(HID, 0, 0, {})
    with pytest.raises(WriterClosedError):
        w.flush()


def test_layout_plain_h5py_and_manifest(run_dir):
    w = write_std_run(run_dir, n=30, flush_every=7, meta={"lr": 0.1})
    w.close()
    files = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*") if p.is_file())
    assert files == ["grads/blocks.0.h5", "manifest.json", "outputs/blocks.0.h5"]
    with h5py.File(run_dir / "outputs/blocks.0.h5", "r") as f:
        assert f.attrs["format_version"] == FORMAT_VERSION
        assert f.attrs["handle_id"] == HID and f.attrs["module_name"] == "blocks.0"
        assert f.attrs["category"] == "forward_hook" and f.attrs["hook_fn_name"] == "outputs"
        assert json.loads(f.attrs["meta"]) == {"kind": "outputs"}
        assert json.loads(f.attrs["run_meta"]) == {"lr": 0.1}
        assert f["step"][:].tolist() == list(range(30))
        assert f["call"][:].tolist() == [0] * 30
        d = f["outputs.0"]
        assert d.shape == (30, 8, 16) and d.maxshape == (None, 8, 16) and d.chunks is not None
        assert d.attrs["dtype"] == "float32" and d.attrs["layout"] == "fixed"
        assert np.array_equal(d[7], record_value(7))
        assert f["_index/outputs.0/record"][:].tolist() == list(range(30))
        assert np.allclose(f["_index/outputs.0/norm"][:], [np.linalg.norm(record_value(i)) for i in range(30)])
        # ragged field: flat data + offsets + shapes, no padding
        r = f["outputs.1"]
        assert r.attrs["layout"] == "ragged" and r.shape == (sum(i % 5 + 1 for i in range(30)),)
        off, shp = f["_index/outputs.1/offset"][:], f["_index/outputs.1/shape"][:]
        assert np.array_equal(r[off[13] : off[13] + shp[13][0]], np.arange(4))
    with h5py.File(run_dir / "grads/blocks.0.h5", "r") as f:
        assert f["grad_out.0"].shape == (15, 8, 16)
        assert f["_index/grad_out.0/record"][:].tolist() == list(range(0, 30, 2))
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["format"] == "hookline-run" and m["status"] == "closed" and m["meta"] == {"lr": 0.1}
    e = m["handles"][HID]
    assert e["file"] == "outputs/blocks.0.h5" and e["key"] == "outputs/blocks.0"
    assert e["records"] == 30 and e["dropped"] == 0 and e["steps"] == [0, 29]
    assert e["fields"] == {"outputs.0": {"dtype": "float32", "shape": [8, 16], "ndim": 2},
                           "outputs.1": {"dtype": "int64", "shape": None, "ndim": 1}}
    assert m["handles"][GID]["fields"]["grad_out.0"]["shape"] == [8, 16]


def test_absent_fields_and_reader_views(run_dir):
    write_std_run(run_dir, n=10).close()
    run = open_run(run_dir)
    g = run[GID]
    assert g.steps.tolist() == list(range(10)) and len(g) == 10
    f = g["grad_out.0"]
    assert len(f) == 5 and f.steps.tolist() == [0, 2, 4, 6, 8]
    assert np.array_equal(f[2], record_value(-4))
    assert f.at_step(3).shape == (0, 8, 16)
    assert np.array_equal(f.at_step(4)[0], record_value(-4))


def test_field_becomes_ragged_later(run_dir):
    w = RunWriter(run_dir)
    w.add_handle(HID)
    shapes = [(4, 3)] * 50 + [(5, 3), (2, 3)] + [(4, 3)] * 20
    for i, s in enumerate(shapes):
        w.write(HID, i, 0, {"outputs.0": np.full(s, i, np.float32)})
        if i == 30:
            w.flush()
    w.flush()
    f = open_run(run_dir)[HID]["outputs.0"]  # segments: fixed then ragged
    assert f.shape is None and len(f) == len(shapes)
    assert all(f[i].shape == s and (f[i] == i).all() for i, s in enumerate(shapes))
    w.close()
    f = open_run(run_dir)[HID]["outputs.0"]
    assert f.shape is None and [a.shape for a in f.read()] == shapes
    with h5py.File(run_dir / "outputs/blocks.0.h5", "r") as h:
        assert h["outputs.0"].attrs["layout"] == "ragged"
        assert h["outputs.0"].shape == (sum(int(np.prod(s)) for s in shapes),)
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["handles"][HID]["fields"]["outputs.0"]["shape"] is None


def test_zero_size_and_scalar_records(run_dir):
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        w.write(HID, 0, 0, {"outputs.0": np.zeros((0, 4), np.float32), "outputs.1": np.float64(3.5) * np.ones(())})
        w.write(HID, 1, 0, {"outputs.0": np.ones((2, 4), np.float32), "outputs.1": np.array(-1.0)})
    h = open_run(run_dir)[HID]
    assert h["outputs.0"][0].shape == (0, 4) and h["outputs.0"][1].shape == (2, 4)
    assert h["outputs.1"].shape == () and h["outputs.1"].read().tolist() == [3.5, -1.0]
    assert h["outputs.0"].norms().tolist() == [0.0, np.sqrt(8)]


def test_argument_errors(run_dir):
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        w.add_handle(HID, module_name="other")  # idempotent
        with pytest.raises(UnknownNameError, match="add_handle"):
            w.write("nope[x]", 0, 0, {})
        w.write(HID, 0, 0, {"outputs.0": np.zeros(3, np.float32)})
        with pytest.raises(InvalidArgumentError, match="changed dtype"):
            w.write(HID, 1, 0, {"outputs.0": np.zeros(3, np.float64)})
        with pytest.raises(InvalidArgumentError, match="ndim"):
            w.write(HID, 1, 0, {"outputs.0": np.zeros((3, 1), np.float32)})
        with pytest.raises(TypeError):
            w.write(HID, 1.5, 0, {})
    with pytest.raises(InvalidArgumentError, match="policy"):
        RunWriter(run_dir, policy="wait")
    with pytest.raises(InvalidArgumentError, match="compression"):
        RunWriter(run_dir, compression="snappy")
    for bad in (-1, "32", True):
        with pytest.raises(InvalidArgumentError, match=f"writeback_mb .*got {bad!r}"):
            RunWriter(run_dir, writeback_mb=bad)
    fresh = run_dir.parent / "never-created"
    for bad in (0, -1, float("nan"), "300", True):  # refused before anything is created
        with pytest.raises(InvalidArgumentError, match=f"autoflush_s .*got {bad!r}.*None to seal only"):
            RunWriter(fresh, autoflush_s=bad)
        assert not fresh.exists()


@pytest.mark.parametrize("writeback_mb", [1, 0])
def test_writeback_kicks_and_small_records_share_chunks(run_dir, monkeypatch, writeback_mb):
    """Every ``writeback_mb`` of data the kernel is asked to start writeback (real fadvise);
    64 KiB records are packed 16 to a 1 MiB chunk (one HDF5 chunk write per 16 records)."""
    import hookline.storage._fs as fs

    kicked: list[int] = []
    real = fs.start_writeback

    def spy(fd: int) -> None:
        kicked.append(fd)
        real(fd)

    monkeypatch.setattr(fs, "start_writeback", spy)
    rec = np.arange(16 * 1024, dtype=np.float32).reshape(16, 1024)  # 64 KiB
    with RunWriter(run_dir, writeback_mb=writeback_mb) as w:
        w.add_handle(HID)
        for i in range(64):  # 4 MiB
            w.write(HID, i, 0, {"outputs.0": rec + i})
    assert len(kicked) == (4 if writeback_mb else 0)  # one per MiB written (segment + merge: one file)
    with h5py.File(run_dir / "outputs" / "blocks.0.h5", "r") as f:
        assert f["outputs.0"].chunks == (16, 16, 1024)
    f = open_run(run_dir)[HID]["outputs.0"]
    assert len(f) == 64 and all(np.array_equal(f[i], rec + i) for i in (0, 15, 16, 63))


def test_writeback_counts_bytes_over_all_open_files(run_dir, monkeypatch):
    """Many handles, each far below ``writeback_mb``: the run's total still triggers kicks, and
    each kick covers every file written to since the last one."""
    import hookline.storage._fs as fs

    kicks: list[int] = []
    monkeypatch.setattr(fs, "start_writeback", lambda fd: kicks.append(fd))
    rec = np.ones((64, 256), np.float32)  # 64 KiB: 16 records fill a chunk
    with RunWriter(run_dir, writeback_mb=2, merge_on_close=False) as w:
        for h in range(8):
            w.add_handle(f"outputs[m{h}]")
        for i in range(16):  # 8 handles x 16 x 64 KiB: one 1 MiB chunk per file, 8 MiB in all
            for h in range(8):
                w.write(f"outputs[m{h}]", i, 0, {"outputs.0": rec})
    # No file reached 2 MiB, yet the run's 8 MiB gave 4 kicks of two open files each.
    assert len(kicks) == 8 and len(set(kicks)) == 8


def test_drop_policy_counts_and_reports(run_dir, monkeypatch):
    slow_disk(monkeypatch, 0.05)  # 20 MB/s
    w = RunWriter(run_dir, max_buffer_mb=2, policy="drop")
    w.add_handle(HID)
    a = np.ones((256, 256), np.float32)  # 256 KiB
    accepted = sum(w.write(HID, i, 0, {"outputs.0": a.copy()}) for i in range(100))
    stats = w.close()
    assert 0 < accepted < 100
    assert stats.handles[HID].dropped == 100 - accepted and stats.dropped == 100 - accepted
    assert stats.peak_buffer_bytes <= 2 << 20
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["handles"][HID]["dropped"] == 100 - accepted and m["dropped"] == 100 - accepted
    assert len(open_run(run_dir)[HID]) == accepted


def test_drop_policy_small_budget_keeps_up_with_a_slow_producer(run_dir):
    """Batched wake-ups must not starve a small budget: at ~13 MB/s into a 0.5 MB budget (the
    disk is far faster) the writer drains in time and nothing is dropped."""
    w = RunWriter(run_dir, max_buffer_mb=0.5, policy="drop")
    w.add_handle(HID)
    a = np.ones((16, 1024), np.float32)  # 64 KiB
    for i in range(64):
        assert w.write(HID, i, 0, {"outputs.0": a * i}), f"record {i} dropped"
        time.sleep(0.005)
    stats = w.close()
    assert stats.dropped == 0 and stats.peak_buffer_bytes <= 1 << 19
    f = open_run(run_dir)[HID]["outputs.0"]
    assert len(f) == 64 and np.array_equal(f[63], a * 63)


def test_block_policy_bounds_memory(run_dir, monkeypatch):
    slow_disk(monkeypatch, 0.02)
    w = RunWriter(run_dir, max_buffer_mb=2, policy="block")
    w.add_handle(HID)
    a = np.ones((128, 256), np.float32)  # 128 KiB
    for i in range(80):
        assert w.write(HID, i, 0, {"outputs.0": a * i})
    stats = w.close()
    assert stats.peak_buffer_bytes <= 2 << 20 and stats.blocked_seconds > 0
    f = open_run(run_dir)[HID]["outputs.0"]
    assert len(f) == 80 and np.array_equal(f[79], a * 79)


def test_many_flushes_compact_and_merge(run_dir):
    w = RunWriter(run_dir, fsync=False)
    add_std_handles(w)
    for i in range(200):
        w.write(HID, i, i % 3, {"outputs.0": record_value(i), "outputs.1": np.arange(i % 4 + 1)})
        w.flush()
        if i == 120:  # mid-run: compaction keeps the number of segments small, reader sees all
            # (the compactor runs on its own thread: on a loaded machine it may lag the flushes,
            # so wait for it, with a deadline far beyond its normal pace)
            deadline = time.monotonic() + 60
            while len(segs := list((run_dir / "outputs").glob("*.h5seg"))) >= 40 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert len(segs) < 40, [s.name for s in segs]
            f = open_run(run_dir)[HID]["outputs.0"]
            assert len(f) == 121 and np.array_equal(f[100], record_value(100))
    w.close()
    assert sorted(p.name for p in (run_dir / "outputs").iterdir()) == ["blocks.0.h5"]
    h = open_run(run_dir)[HID]
    assert h.calls.tolist() == [i % 3 for i in range(200)]
    assert all(np.array_equal(h["outputs.0"][i], record_value(i)) for i in range(0, 200, 17))
    assert [len(x) for x in h["outputs.1"].read()] == [i % 4 + 1 for i in range(200)]


def test_continue_existing_run(run_dir):
    write_std_run(run_dir, n=10).close()
    w = RunWriter(run_dir)
    add_std_handles(w)
    for i in range(10, 15):
        w.write(HID, i, 0, {"outputs.0": record_value(i)})
    w.close()
    h = open_run(run_dir)[HID]
    assert h.steps.tolist() == list(range(15))
    assert len(h["outputs.0"]) == 15 and len(h["outputs.1"]) == 10
    assert np.array_equal(h["outputs.0"][12], record_value(12))
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["handles"][HID]["records"] == 15 and GID in m["handles"]


@pytest.mark.parametrize("comp", ["gzip", "lzf", "zstd", "lz4"])
def test_compression_round_trip(run_dir, comp):
    x = np.maximum(np.random.default_rng(0).standard_normal((64, 128)), 0).astype(np.float32)
    with RunWriter(run_dir, compression={"outputs.*": comp}) as w:
        w.add_handle(HID)
        for i in range(20):
            w.write(HID, i, 0, {"outputs.0": x + i, "grad_in.0": x})
    h = open_run(run_dir)[HID]
    assert np.array_equal(h["outputs.0"][7], x + 7) and np.array_equal(h["grad_in.0"][3], x)
    with h5py.File(run_dir / "outputs/blocks.0.h5", "r") as f:
        assert f["outputs.0"].compression is not None or f["outputs.0"]._filters
        assert not f["grad_in.0"]._filters


def test_ranks_file_naming_and_reader_presents_together(tmp_path):
    run = tmp_path / "run"
    for r in range(2):
        with RunWriter(run, rank=r, world_size=2) as w:
            w.add_handle(HID)
            for i in range(3):
                w.write(HID, i, 0, {"outputs.0": np.full(4, 10 * r + i, np.float32)})
    assert sorted(p.name for p in (run / "outputs").iterdir()) == ["blocks.0.rank0.h5", "blocks.0.rank1.h5"]
    assert (run / "manifest.rank0.json").exists() and (run / "manifest.rank1.json").exists()
    ro = open_run(run)
    assert ro.handles == [HID] and ro.ranks == [0, 1]
    h = ro[HID]
    assert h.ranks.tolist() == [0, 0, 0, 1, 1, 1] and h.steps.tolist() == [0, 1, 2, 0, 1, 2]
    assert h["outputs.0"].at_step(1)[:, 0].tolist() == [1.0, 11.0]
    assert ro.handle(HID, rank=1)["outputs.0"][0][0] == 10.0


def test_concurrent_writers_threads(run_dir):
    w = RunWriter(run_dir, max_buffer_mb=4)
    hids = [f"outputs[m{i}]" for i in range(4)]
    for h in hids:
        w.add_handle(h)

    def work(h):
        for i in range(100):
            w.write(h, i, 0, {"outputs.0": np.full((32, 32), i, np.float32)})

    ts = [threading.Thread(target=work, args=(h,)) for h in hids]
    [t.start() for t in ts]
    [t.join() for t in ts]
    w.close()
    run = open_run(run_dir)
    for h in hids:
        f = run[h]["outputs.0"]
        assert len(f) == 100 and f[99][0, 0] == 99


def test_second_writer_on_same_run_is_refused(run_dir):
    from hookline.storage import StorageError

    w = RunWriter(run_dir)
    with pytest.raises(StorageError, match="another RunWriter"):
        RunWriter(run_dir)
    RunWriter(run_dir, rank=1, world_size=2).close()  # another rank is fine
    w.close()
    RunWriter(run_dir).close()  # released by close


def test_write_block_equals_record_writes_fixed_and_ragged(run_dir, tmp_path):
    """A block of k records stores exactly what k write() calls store, also when the field
    turns ragged between blocks (the segment is sealed and the rest is stored ragged)."""
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal((3, 4, 5)).astype(np.float32),   # fixed (4, 5)
              rng.standard_normal((2, 6, 5)).astype(np.float32),   # shape changes: ragged
              rng.standard_normal((4, 6, 5)).astype(np.float32)]   # a multi-record ragged block
    ref_dir = tmp_path / "ref"
    with RunWriter(run_dir) as w, RunWriter(ref_dir) as ref:
        for x in (w, ref):
            x.add_handle(HID)
        step = 0
        for b in blocks:
            steps = list(range(step, step + len(b)))
            assert w.write_block(HID, steps, [0] * len(b), {"outputs.0": b, "ids": np.arange(len(b))})
            for j, s in enumerate(steps):
                ref.write(HID, s, 0, {"outputs.0": b[j], "ids": np.int64(j)})
            step += len(b)
    got, want = open_run(run_dir)[HID], open_run(ref_dir)[HID]
    assert list(got.steps) == list(want.steps) == list(range(9))
    f, g = got["outputs.0"], want["outputs.0"]
    assert f.ragged and g.ragged
    for i in range(9):
        np.testing.assert_array_equal(f[i], g[i])
    np.testing.assert_allclose(f.norms(), g.norms(), rtol=1e-6)
    np.testing.assert_array_equal(got["ids"].read(), [0, 1, 2, 0, 1, 0, 1, 2, 3])


def test_write_block_takes_a_copy_of_the_step_and_call_lists(run_dir):
    steps, calls = [5, 6], [0, 0]
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        w.write_block(HID, steps, calls, {"f": np.ones((2, 3))})
        steps[0], calls[1] = 99, 7  # the caller reuses its lists before the writer ran
    got = open_run(run_dir)[HID]
    assert list(got.steps) == [5, 6] and list(got.calls) == [0, 0]


@pytest.mark.parametrize("steps, calls, fields, match", [
    ([0, 1], [0], {"f": np.ones((2, 3))}, "same length"),
    ([], [], {"f": np.ones((0, 3))}, "empty block"),
    ([0, -1], [0, 0], {"f": np.ones((2, 3))}, "non-negative"),
    ([0, 1], [0, 2**63], {"f": np.ones((2, 3))}, "up to 2\\*\\*63"),
    ([0.5, 1], [0, 0], {"f": np.ones((2, 3))}, "integer"),
    ([0, 1], [0, 0], {"f": np.ones((3, 3))}, r"shape \(2, \.\.\.\), got shape \(3, 3\)"),
    ([0, 1], [0, 0], {"f": np.float32(1.0)}, r"shape \(2, \.\.\.\)"),
])
def test_write_block_rejects_bad_blocks_before_queueing(run_dir, steps, calls, fields, match):
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        with pytest.raises(InvalidArgumentError, match=match):
            w.write_block(HID, steps, calls, fields)
        assert w.stats().records == 0
        with pytest.raises(UnknownNameError, match="nope"):
            w.write_block("nope", [0], [0], {"f": np.ones((1, 2))})
