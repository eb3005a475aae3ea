"""Chunk hashes on by default (issue 34): every field of every file carries an xxh3-64 hash per
block of entries (docs/format.md, "Chunk hashes"); ``verify`` finds a flipped bit and names the
handle, field and records; ``open_run(verify_checksums=True)`` refuses the damaged records and
reads the rest; files without hashes (older runs, ``checksums=False``) read and verify as before."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import xxhash
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import FormatError, RunWriter, open_run, verify

HID = "outputs[fc]"
N = 300


def _rec(i: int) -> np.ndarray:
    return np.full((16, 64), i, np.float32) + np.arange(64, dtype=np.float32) / 64


def _run(run_dir, n=N, flush_every=None, **kw):
    with RunWriter(run_dir, fsync=False, **kw) as w:
        w.add_handle(HID)
        for i in range(n):
            w.write(HID, i, 0, {"outputs.0": _rec(i), "outputs.1": np.arange(i % 7 + 1, dtype=np.float64),
                                "big": np.full((3, 1024, 1024), i % 5, np.float32)} if i % 150 == 0 else
                    {"outputs.0": _rec(i), "outputs.1": np.arange(i % 7 + 1, dtype=np.float64)})
            if flush_every and (i + 1) % flush_every == 0:
                w.flush()
    return run_dir / "outputs" / "fc.h5"


def _flip(path, field: str, chunk: int, byte: int = 100) -> int:
    """Flip one bit of data chunk ``chunk`` of ``field``; returns the chunk's first row."""
    with h5py.File(path, "r") as f:
        info = f[field].id.get_chunk_info(chunk)
    with open(path, "r+b") as fh:
        fh.seek(info.byte_offset + byte)
        b = fh.read(1)[0]
        fh.seek(info.byte_offset + byte)
        fh.write(bytes([b ^ 8]))
    return info.chunk_offset[0]


def test_every_field_has_hashes_as_docs_define_them(run_dir):
    path = _run(run_dir, flush_every=120)  # segments merged at close: the final file's hashes
    with h5py.File(path, "r") as f:
        for name in ("outputs.0", "outputs.1", "big"):
            ds, hs = f[name], f[f"_index/{name}/xxh3"]
            rows = int(hs.attrs["rows"])
            extent = ds.shape[0] if name != "outputs.1" else int(f["_index/outputs.1/offset"][-1]
                                                                    + np.prod(f["_index/outputs.1/shape"][-1]))
            want = [xxhash.xxh3_64_intdigest(np.ascontiguousarray(ds[a : min(extent, a + rows)]).tobytes())
                    for a in range(0, extent, rows)]
            assert hs.dtype == np.uint64 and hs[()].tolist() == want, name
        assert int(f["_index/big/xxh3"].attrs["rows"]) == 1  # (a 12 MiB record over several chunks)


def test_flipped_bit_is_found_by_verify_and_by_checked_reads(run_dir):
    path = _run(run_dir)
    first = _flip(path, "outputs.0", chunk=0, byte=40)
    rep = verify(run_dir)
    assert not rep.ok
    text = "\n".join(rep.handles[0].problems)
    assert "xxh3" in text and "'outputs.0'" in text and f"records {first}-" in text and HID in text, text
    res = CliRunner().invoke(cli, ["verify", str(run_dir)])
    assert res.exit_code == 1 and "xxh3" in res.output

    with open_run(run_dir, verify_checksums=True) as run:
        f = run[HID]["outputs.0"]
        np.testing.assert_array_equal(f[N - 1], _rec(N - 1))  # (another block: reads)
        with pytest.raises(FormatError, match="xxh3"):
            f[first]
        with pytest.raises(FormatError, match="fc.h5"):
            f[:]
        np.testing.assert_array_equal(run[HID]["outputs.1"][5], np.arange(6, dtype=np.float64))
    with open_run(run_dir) as run:  # (unchecked reads stay as fast as before: no hash read)
        assert run[HID]["outputs.0"][first].shape == (16, 64)


def test_flipped_bit_in_a_ragged_field_is_found(run_dir):
    path = _run(run_dir)
    _flip(path, "outputs.1", chunk=0, byte=8)
    rep = verify(run_dir)
    assert not rep.ok and "'outputs.1'" in str(rep) and "xxh3" in str(rep), str(rep)
    with open_run(run_dir, verify_checksums=True) as run, pytest.raises(FormatError, match="xxh3"):
        run[HID]["outputs.1"][1]


def test_runs_without_hashes_read_and_verify(run_dir, tmp_path):
    path = _run(run_dir, n=40, checksums=False, merge_on_close=False, flush_every=20)
    segs = sorted(run_dir.glob("outputs/fc.r*.h5seg"))
    assert segs
    for seg in segs:
        with h5py.File(seg, "r") as f:
            assert "xxh3" not in f["_index/outputs.0"]
    old = tmp_path / "old"
    path = _run(old, n=40)
    with h5py.File(path, "r+") as f:  # as a file written before hookline had hashes
        for name in ("outputs.0", "outputs.1", "big"):
            del f[f"_index/{name}/xxh3"]
    rep = verify(run_dir)
    assert all(p.startswith("not merged") for h in rep.handles for p in h.problems), str(rep)
    for d in (run_dir, old):
        with open_run(d, verify_checksums=True) as run:
            np.testing.assert_array_equal(run[HID]["outputs.0"][39], _rec(39))
    assert verify(old).clean
