"""Compression specs: Blosc2 names, the existing names unchanged, clear errors for bad ones, and
files that plain h5py (+ hdf5plugin) reads."""

from __future__ import annotations

import h5py
import hdf5plugin
import numpy as np
import pytest

from hookline.storage import InvalidArgumentError, RunWriter, open_run
from hookline.storage._filters import BLOSC2_DEFAULT, compression_kwargs

HID = "outputs[fc]"


def _relu(i: int) -> np.ndarray:
    return np.maximum(np.random.default_rng(i).standard_normal((64, 256)), 0).astype(np.float32)


@pytest.mark.parametrize("spec", ["blosc2", "blosc2-lz4", "blosc2-zstd-1-shuffle", "blosc2-lz4hc-9-bitshuffle",
                                  "blosc2-blosclz-0-noshuffle", "blosc2-zlib-3", "blosc2+checksum"])
def test_blosc2_round_trip_and_plain_h5py_reads_it(run_dir, spec):
    bf16 = (np.arange(64 * 128, dtype=np.uint32) % 300).astype(np.uint16).reshape(64, 128)
    with RunWriter(run_dir, compression={"outputs.*": spec}) as w:
        w.add_handle(HID)
        for i in range(12):
            w.write(HID, i, 0, {"outputs.0": _relu(i), "outputs.1": (bf16, "bfloat16"), "grad_in.0": _relu(100 + i)})
    with open_run(run_dir) as run:
        h = run[HID]
        np.testing.assert_array_equal(h["outputs.0"][11], _relu(11))
        np.testing.assert_array_equal(h["outputs.1"][3], (bf16.astype(np.uint32) << 16).view(np.float32))
    with h5py.File(run_dir / "outputs" / "fc.h5", "r") as f:  # (hdf5plugin imported: its filters registered)
        assert str(hdf5plugin.BLOSC2_ID) in f["outputs.0"]._filters
        assert not f["grad_in.0"]._filters
        np.testing.assert_array_equal(f["outputs.0"][5], _relu(5))


def test_blosc2_saves_space_on_bf16_relu(run_dir):
    x = np.maximum(np.random.default_rng(0).standard_normal((256, 512)), 0).astype(np.float32)
    bits = (x.view(np.uint32) >> 16).astype(np.uint16)
    with RunWriter(run_dir, compression="blosc2") as w:
        w.add_handle(HID)
        for i in range(16):
            w.write(HID, i, 0, {"outputs.0": (bits, "bfloat16")})
    size = (run_dir / "outputs" / "fc.h5").stat().st_size
    assert 16 * bits.nbytes / size > 2.0


@pytest.mark.parametrize("spec", [None, "none", "gzip", "gzip-0", "gzip-9", "lzf", "zstd", "zstd-22", "lz4"])
def test_existing_specs_keep_working(run_dir, spec):
    assert compression_kwargs(spec) == compression_kwargs(spec)  # (accepted, deterministic)
    with RunWriter(run_dir, compression=spec) as w:
        w.add_handle(HID)
        w.write(HID, 0, 0, {"outputs.0": _relu(0)})
    with open_run(run_dir) as run:
        np.testing.assert_array_equal(run[HID]["outputs.0"][0], _relu(0))


def test_existing_spec_arguments_unchanged():
    assert compression_kwargs("gzip") == {"compression": "gzip", "compression_opts": 4, "shuffle": False}
    assert compression_kwargs("lzf") == {"compression": "lzf"}
    assert compression_kwargs("zstd-3") == dict(hdf5plugin.Zstd(clevel=3))
    assert compression_kwargs(None) == compression_kwargs("none") == {}


@pytest.mark.parametrize("spec, says", [
    ("blosc2-snappy", "unknown Blosc2 codec 'snappy'"),
    ("blosc2-lz4-10", "from 0 to 9"),
    ("blosc2-zstd-1-byteshuffle", "unexpected 'byteshuffle'"),
    ("blosc2-zstd-shuffle-1", "unexpected '1'"),
    ("blosc", "unknown compression 'blosc'"),
    ("zstd-0", "from 1 to 22"),
    ("lz4-3", "lz4 has no level"),
    ("gzip+zstd", "the only suffix is '+checksum'"),
])
def test_bad_specs_are_refused_quoting_them(run_dir, spec, says):
    with pytest.raises(InvalidArgumentError, match="compression") as e:
        RunWriter(run_dir, compression={"outputs.*": spec})
    assert repr(spec) in str(e.value) and says in str(e.value), str(e.value)
    assert not run_dir.exists()


def test_blosc2_default_is_the_documented_one():
    assert BLOSC2_DEFAULT == "blosc2-lz4-5-bitshuffle"
    assert compression_kwargs("blosc2") == compression_kwargs(BLOSC2_DEFAULT)
