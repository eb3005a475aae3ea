"""Per-chunk checksums (``"+checksum"``: HDF5's fletcher32 filter): a flipped data bit in a closed
run is found by ``verify`` (handle and record range named, non-zero exit) and reading the damaged
record raises FormatError naming the file."""

from __future__ import annotations

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import FormatError, InvalidArgumentError, RunWriter, open_run, verify
from hookline.storage._filters import compression_kwargs, parse_spec, spec_of_dataset

HID = "outputs[fc]"
SHAPE = (16, 64)  # 4 KiB float32 records: 256 per ~1 MiB chunk (the 64 KiB live floor: 16 per chunk)


def _record(i: int) -> np.ndarray:
    return np.full(SHAPE, i, np.float32) + np.arange(SHAPE[1], dtype=np.float32) / 64


def _closed_run(run_dir, compression="none+checksum", n=300, ragged=False, **kw):
    with RunWriter(run_dir, compression=compression, **kw) as w:
        w.add_handle(HID)
        for i in range(n):
            fields = {"outputs.0": _record(i)}
            if ragged:
                fields["outputs.1"] = np.arange(i % 7 + 1, dtype=np.float64)
            w.write(HID, i, 0, fields)
    return run_dir / "outputs" / "fc.h5"


def _flip_data_bit(path, field: str, chunk: int, byte: int = 100, bit: int = 3) -> tuple[int, int]:
    """Flip one bit inside data chunk number ``chunk`` of ``field``; returns the chunk's first
    row and its row count (along axis 0)."""
    with h5py.File(path, "r") as f:
        ds = f[field]
        info = ds.id.get_chunk_info(chunk)
        rows = ds.chunks[0]
        first = info.chunk_offset[0]
        assert info.size > byte
        off = info.byte_offset + byte
    with open(path, "r+b") as fh:
        fh.seek(off)
        b = fh.read(1)[0]
        fh.seek(off)
        fh.write(bytes([b ^ (1 << bit)]))
    return first, rows


def test_checksummed_run_round_trips_and_is_readable_by_plain_h5py(run_dir):
    path = _closed_run(run_dir)
    with h5py.File(path, "r") as f:
        assert f["outputs.0"].fletcher32
        np.testing.assert_array_equal(f["outputs.0"][7], _record(7))
    with open_run(run_dir) as run:
        np.testing.assert_array_equal(run[HID]["outputs.0"][299], _record(299))
    assert verify(run_dir).clean


@pytest.mark.parametrize("compression", ["none+checksum", "zstd+checksum", "blosc2+checksum"])
def test_flipped_data_bit_is_found_by_verify_and_read(run_dir, compression):
    path = _closed_run(run_dir, compression)
    first, rows = _flip_data_bit(path, "outputs.0", chunk=0, byte=40)
    last = min(first + rows, 300) - 1

    rep = verify(run_dir)
    assert not rep.ok
    (hr,) = rep.handles
    text = "\n".join(hr.problems)
    assert f"records {first}-{last}" in text and "checksum" in text and "outputs.0" in text, text
    assert HID in str(rep)

    res = CliRunner().invoke(cli, ["verify", str(run_dir)])
    assert res.exit_code == 1
    assert HID in res.output and f"records {first}-{last}" in res.output, res.output

    with open_run(run_dir) as run:
        field = run[HID]["outputs.0"]
        with pytest.raises(FormatError, match="fc.h5") as e:
            field[first]
        assert not isinstance(e.value.__cause__, FormatError)
        np.testing.assert_array_equal(field[last + 1], _record(last + 1))  # other chunks read


def test_flipped_bit_in_a_later_chunk_names_only_its_records(run_dir):
    path = _closed_run(run_dir, n=600)
    first, rows = _flip_data_bit(path, "outputs.0", chunk=1)
    (hr,) = verify(run_dir).handles
    assert any(f"records {first}-{first + rows - 1}" in p for p in hr.problems), hr.problems
    assert first > 0


def test_flipped_bit_in_a_ragged_field(run_dir):
    path = _closed_run(run_dir, n=40, ragged=True)
    with h5py.File(path, "r") as f:
        assert f["outputs.1"].attrs["layout"] == "ragged" and f["outputs.1"].fletcher32
    _flip_data_bit(path, "outputs.1", chunk=0, byte=8)
    (hr,) = verify(run_dir).handles
    assert any("outputs.1" in p and "records 0-" in p for p in hr.problems), hr.problems


def test_without_checksums_the_same_flip_goes_unnoticed(run_dir):
    """What the checksums buy: a file with neither fletcher32 nor hookline's chunk hashes
    (``checksums=False``, a single segment renamed into place) verifies clean with a changed value."""
    path = _closed_run(run_dir, compression=None, checksums=False)
    _flip_data_bit(path, "outputs.0", chunk=0, byte=40)
    assert verify(run_dir).ok
    with open_run(run_dir) as run:
        assert not np.array_equal(run[HID]["outputs.0"][0], _record(0))


def test_checksum_survives_repair_merge(run_dir):
    w = RunWriter(run_dir, compression={"outputs.*": "zstd-3+checksum"})
    w.add_handle(HID)
    for i in range(10):
        w.write(HID, i, 0, {"outputs.0": _record(i)})
        if i % 3 == 2:
            w.flush()
    w.flush()
    w.close()
    with h5py.File(run_dir / "outputs" / "fc.h5", "r") as f:
        ds = f["outputs.0"]
        assert ds.fletcher32 and "32015" in ds._filters


@pytest.mark.parametrize("spec, want", [
    ("none+checksum", {"fletcher32": True}),
    ("gzip-3+checksum", {"compression": "gzip", "compression_opts": 3, "shuffle": False, "fletcher32": True}),
])
def test_checksum_spec(spec, want):
    assert compression_kwargs(spec) == want


@pytest.mark.parametrize("spec", ["none+crc", "zstd+checksum+checksum", "checksum", "+checksum"])
def test_bad_checksum_spec_is_refused_quoting_it(run_dir, spec):
    with pytest.raises(InvalidArgumentError, match="checksum") as e:
        RunWriter(run_dir, compression=spec)
    assert repr(spec) in str(e.value)
    assert not run_dir.exists()


def test_repair_merge_keeps_compression_and_checksums(run_dir):
    """verify(repair=True) merges segments with each field's spec (it kept only gzip/lzf before)."""
    w = RunWriter(run_dir, compression={"outputs.0": "zstd-3+checksum", "outputs.1": "blosc2-lz4-5-shuffle"},
                  merge_on_close=False)
    w.add_handle(HID)
    for i in range(6):
        w.write(HID, i, 0, {"outputs.0": _record(i), "outputs.1": _record(-i)})
        w.flush()
    w.close()
    assert len(list((run_dir / "outputs").glob("*.h5seg"))) == 6
    assert verify(run_dir, repair=True).ok
    with h5py.File(run_dir / "outputs" / "fc.h5", "r") as f:
        assert spec_of_dataset(f["outputs.0"]) == "zstd-3+checksum"
        assert spec_of_dataset(f["outputs.1"]) == "blosc2-lz4-5-shuffle"
        np.testing.assert_array_equal(f["outputs.0"][5], _record(5))


def test_spec_of_dataset_round_trips(tmp_path):
    with h5py.File(tmp_path / "x.h5", "w") as f:
        for spec in ("none+checksum", "gzip-2", "lzf+checksum", "lz4", "zstd-7", "blosc2-zstd-1-bitshuffle+checksum",
                     "blosc2-blosclz-9-noshuffle"):
            ds = f.create_dataset(spec, shape=(4, 8), dtype=np.float32, chunks=(2, 8), **compression_kwargs(spec))
            assert spec_of_dataset(ds) == spec
        assert spec_of_dataset(f.create_dataset("plain", shape=(2,), dtype=np.float32, chunks=(1,))) is None
    assert parse_spec("blosc2+checksum")[1] == {"name": "blosc2", "level": 5, "checksum": True, "cname": "lz4",
                                                "shuffle": "bitshuffle"}
