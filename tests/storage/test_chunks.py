"""Chunks sized to the data: a small field gets a small file; large records keep their chunks."""

from __future__ import annotations

import os

import h5py
import numpy as np
import pytest

from hookline.storage import RunWriter, open_run
from hookline.storage.format import TARGET_CHUNK_BYTES, flat_chunk, record_chunk

HID = "outputs[fc]"
#: A closed run's file for a 5 KB field stays below this (28-32 KB measured: HDF5's own metadata,
#: mostly the chunk B-tree nodes of the field and its four index datasets; it was ~89 KB with the
#: 64 KiB chunk floor of live segments).
SMALL_FILE_BOUND = 40_000


def _write(run_dir, n, shape, dtype=np.float32, flush_every=None):
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        for i in range(n):
            w.write(HID, i, 0, {"outputs.0": np.full(shape, i, dtype)})
            if flush_every and (i + 1) % flush_every == 0:
                w.flush()
    return run_dir / "outputs" / "fc.h5"


@pytest.mark.parametrize("n, shape", [(10, (128,)), (40, (32,)), (1, (1280,)), (5, (16, 16))])
def test_a_5kb_field_takes_a_small_file(run_dir, n, shape):
    path = _write(run_dir, n, shape)
    assert n * 4 * int(np.prod(shape)) == 5120
    size = os.path.getsize(path)
    assert size < SMALL_FILE_BOUND, f"{size} bytes for a 5 KB field"
    with h5py.File(path, "r") as f:
        ds = f["outputs.0"]  # (a chunk holds at most the next power of two of its records)
        assert ds.chunks[0] * ds.dtype.itemsize * int(np.prod(shape)) <= 2 * 5120
    with open_run(run_dir) as run:
        np.testing.assert_array_equal(run[HID]["outputs.0"][n - 1], np.full(shape, n - 1, np.float32))


def test_small_ragged_field_takes_a_small_file(run_dir):
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        for i in range(20):
            w.write(HID, i, 0, {"outputs.0": np.arange(i % 5 + 60, dtype=np.float32)})
    path = run_dir / "outputs" / "fc.h5"
    assert os.path.getsize(path) < SMALL_FILE_BOUND
    with h5py.File(path, "r") as f:
        assert f["outputs.0"].attrs["layout"] == "ragged" and f["outputs.0"].chunks[0] <= 2048


def test_large_records_keep_their_chunks(run_dir):
    """Records of 256 KiB: 4 per ~1 MiB chunk, as before (the rule for segments with data)."""
    path = _write(run_dir, 12, (64, 1024))
    with h5py.File(path, "r") as f:
        assert f["outputs.0"].chunks == (4, 64, 1024)
    assert record_chunk((64, 1024), 4) == (4, 64, 1024)
    assert record_chunk((256, 1024), 4, 3) == (1, 256, 1024)  # 1 MiB: one chunk each


def test_many_small_records_still_get_full_chunks(run_dir):
    """A field that fills chunks while the segment is open keeps ~1 MiB chunks (throughput)."""
    path = _write(run_dir, 4096, (64,))  # 256 B records, 1 MiB in all
    with h5py.File(path, "r") as f:
        c0 = f["outputs.0"].chunks[0]
    assert c0 * 256 >= 64 << 10, c0


def test_small_field_in_a_multi_segment_run_reads_back(run_dir):
    path = _write(run_dir, 9, (8,), flush_every=3)
    with open_run(run_dir) as run:
        f = run[HID]["outputs.0"]
        assert len(f) == 9 and f[8][0] == 8
    assert os.path.getsize(path) < SMALL_FILE_BOUND


def test_flat_chunk_is_sized_to_small_data():
    assert flat_chunk(4, 100) == (128,)
    assert flat_chunk(4) == (TARGET_CHUNK_BYTES // 4,)
