"""Bit-exact round trip of every dtype through RunWriter -> open_run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hookline.storage import RunWriter, open_run
from hookline.storage import dtypes

HID = "outputs[m]"

_SPECIAL_F = [0.0, -0.0, 1.0, -1.5, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-40, 3.4e38, 1e-310, 5e-324]


def _special(dt: np.dtype) -> np.ndarray:
    if dt.kind == "b":
        return np.array([True, False, True, True], dtype=dt)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return np.array([info.min, info.max, 0, 1, info.max // 3], dtype=dt)
    if dt.kind == "f":
        with np.errstate(over="ignore"):
            vals = np.array(_SPECIAL_F, dtype=np.float64).astype(dt)
        # NaN payloads and signalling NaNs: set bit patterns directly.
        bits = vals.view(f"u{dt.itemsize}").copy()
        nb = {2: [0x7E01, 0xFE55, 0x7C01], 4: [0x7FC00123, 0xFFA00001, 0x7F800001],
              8: [0x7FF8000000000123, 0xFFF0000000000001, 0x7FF4000000000000]}[dt.itemsize]
        return np.concatenate([bits, np.array(nb, dtype=bits.dtype)]).view(dt)
    if dt.kind == "c":
        f = _special(np.dtype(f"f{dt.itemsize // 2}"))
        return (f[: len(f) // 2 * 2]).view(dt)
    raise AssertionError(dt)


@pytest.mark.parametrize("name", dtypes.NATIVE_NAMES)
def test_native_dtypes_bit_exact(tmp_path, name):
    dt = np.dtype(name)
    x = _special(dt)
    with RunWriter(tmp_path / "r") as w:
        w.add_handle(HID)
        w.write(HID, 0, 0, {"outputs.0": x, "outputs.1": x.reshape(1, -1)})
        w.write(HID, 1, 0, {"outputs.0": x[::-1].copy()})
    run = open_run(tmp_path / "r")
    f = run[HID]["outputs.0"]
    assert f.dtype == dt and f.torch_dtype_name == name
    got = f[0]
    assert got.dtype == dt
    assert got.tobytes() == x.tobytes()
    assert f[1].tobytes() == x[::-1].tobytes()
    assert f.read().tobytes() == np.stack([x, x[::-1]]).tobytes()
    t = f.to_torch(0)
    assert t.numpy().tobytes() == x.tobytes()
    assert run[HID]["outputs.1"][0].tobytes() == x.tobytes()


def _torch_bits_dtypes():
    out = ["bfloat16"]
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
        if hasattr(torch, n):
            out.append(n)
    return out


@pytest.mark.parametrize("name", _torch_bits_dtypes())
def test_bits_dtypes_all_patterns_exact(tmp_path, name):
    """Every bit pattern round-trips; numpy reads equal torch's own float32 conversion."""
    nbits = 16 if name == "bfloat16" else 8
    bits = np.arange(1 << nbits, dtype=np.uint16 if nbits == 16 else np.uint8)
    tdt = getattr(torch, name)
    with RunWriter(tmp_path / "r") as w:
        w.add_handle(HID)
        w.write(HID, 0, 0, {"outputs.0": (bits, name)})
    f = open_run(tmp_path / "r")[HID]["outputs.0"]
    assert f.dtype == np.float32 and f.torch_dtype_name == name
    t = f.to_torch(0)
    assert t.dtype == tdt
    assert t.view(torch.int16 if nbits == 16 else torch.uint8).numpy().view(bits.dtype).tobytes() == bits.tobytes()
    got = f[0]
    ref = torch.from_numpy(bits.view(np.int16) if nbits == 16 else bits).view(tdt).float().numpy()
    nan = np.isnan(ref)
    assert np.array_equal(np.isnan(got), nan)
    assert got[~nan].view(np.uint32).tobytes() == ref[~nan].view(np.uint32).tobytes()  # -0.0, denormals
    if name == "bfloat16":  # bf16 -> f32 is a shift: NaN payloads survive too
        assert got.view(np.uint32).tobytes() == (bits.astype(np.uint32) << 16).tobytes()


def test_bfloat16_from_torch_tensor(tmp_path):
    t = torch.tensor([1.0, -0.0, float("inf"), float("nan"), 1e-40, 3.0e38], dtype=torch.bfloat16).reshape(2, 3)
    bits = t.view(torch.int16).numpy().view(np.uint16)
    with RunWriter(tmp_path / "r") as w:
        w.add_handle(HID)
        w.write(HID, 5, 0, {"outputs.0": (bits, "bfloat16")})
    f = open_run(tmp_path / "r")[HID]["outputs.0"]
    back = f.to_torch(0)
    assert back.dtype == torch.bfloat16 and torch.equal(back.view(torch.int16), t.view(torch.int16))
    assert f.shape == (2, 3)
    assert np.array_equal(f[0], t.float().numpy(), equal_nan=True)


def test_complex32_bits(tmp_path):
    t = torch.tensor([1 + 2j, -0.0 - 1j, float("inf") + 0j], dtype=torch.complex64).to(torch.complex32)
    bits = t.view(torch.int32).numpy().view(np.uint32)
    with RunWriter(tmp_path / "r") as w:
        w.add_handle(HID)
        w.write(HID, 0, 0, {"grad_in.0": (bits, "complex32")})
    f = open_run(tmp_path / "r")[HID]["grad_in.0"]
    assert f.dtype == np.complex64
    assert np.array_equal(f[0], t.to(torch.complex64).numpy())
    back = f.to_torch(0)
    assert back.dtype == torch.complex32 and torch.equal(back.view(torch.int32), t.view(torch.int32))


def test_big_endian_input_is_stored_by_value(tmp_path):
    x = np.array([1.5, -2.25, np.inf], dtype=">f4")
    with RunWriter(tmp_path / "r") as w:
        w.add_handle(HID)
        w.write(HID, 0, 0, {"outputs.0": x})
    got = open_run(tmp_path / "r")[HID]["outputs.0"][0]
    assert got.dtype == np.float32 and np.array_equal(got, x.astype("<f4"))


def test_rejects_unstorable_values(tmp_path):
    from hookline.storage import HookTypeError, InvalidArgumentError

    with RunWriter(tmp_path / "r") as w:
        w.add_handle(HID)
        with pytest.raises(HookTypeError, match="cannot store numpy dtype"):
            w.write(HID, 0, 0, {"outputs.0": np.array([object()])})
        with pytest.raises(HookTypeError, match="bfloat16 bits must be"):
            w.write(HID, 0, 0, {"outputs.0": (np.zeros(3, np.float32), "bfloat16")})
        with pytest.raises(InvalidArgumentError, match="float32"):
            w.write(HID, 0, 0, {"outputs.0": (np.zeros(3, np.uint32), "float32")})
        with pytest.raises(HookTypeError, match="list"):
            w.write(HID, 0, 0, {"outputs.0": [1, 2]})
        with pytest.raises(InvalidArgumentError, match="invalid field name"):
            w.write(HID, 0, 0, {"step": np.zeros(1)})
