"""Logical dtypes of hookline fields and their bit-exact on-disk representation.

Every torch dtype maps to one *logical dtype name* (``"float32"``, ``"bfloat16"``,
``"float8_e4m3fn"`` ...). numpy-native dtypes are stored as themselves. dtypes numpy lacks are
stored as raw bits in an unsigned integer array of the same width, with the logical name in the
dataset's ``dtype`` attribute:

=====================  ==============  ======================================================
logical name           stored as       numpy reads return
=====================  ==============  ======================================================
``bfloat16``           ``uint16``      ``float32`` (bits shifted left by 16: exact)
``float8_*`` variants  ``uint8``       ``float32`` via a 256-entry lookup table (exact)
``complex32``          ``uint32``      ``complex64`` (two float16 halves, real in the low bits)
=====================  ==============  ======================================================

This module needs only numpy; torch is imported lazily by :func:`to_torch`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import HookTypeError, InvalidArgumentError

__all__ = [
    "DtypeInfo",
    "NATIVE_NAMES",
    "BITS_NAMES",
    "info",
    "lookup",
    "native_name",
    "decode",
    "to_torch",
    "float8_table",
    "to_float",
]


@dataclass(frozen=True)
class DtypeInfo:
    """How one logical dtype is stored and read.

    Attributes:
        name: logical dtype name (torch's name without ``torch.``).
        storage: numpy dtype of the stored array (the raw bits for non-native dtypes).
        read: numpy dtype numpy reads return.
        is_bits: True when ``storage`` holds raw bits of a dtype numpy lacks.
        has_norm: True for floating and complex dtypes (the writer stores per-record L2 norms).
    """

    name: str
    storage: np.dtype
    read: np.dtype
    is_bits: bool
    has_norm: bool


_NATIVE = {
    "bool": np.bool_,
    "int8": np.int8,
    "int16": np.int16,
    "int32": np.int32,
    "int64": np.int64,
    "uint8": np.uint8,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "complex64": np.complex64,
    "complex128": np.complex128,
}

#: float8 formats: name -> (exponent bits, mantissa bits, bias, kind). kind: "ieee" (inf+nan like
#: IEEE), "fn" (no inf, NaN = all ones), "fnuz" (no inf, no -0, NaN = 0x80), "e8m0" (exponent only).
_FLOAT8 = {
    "float8_e4m3fn": (4, 3, 7, "fn"),
    "float8_e5m2": (5, 2, 15, "ieee"),
    "float8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "float8_e5m2fnuz": (5, 2, 16, "fnuz"),
    "float8_e8m0fnu": (8, 0, 127, "e8m0"),
}

_INFO: dict[str, DtypeInfo] = {}
for _n, _t in _NATIVE.items():
    _d = np.dtype(_t)
    _INFO[_n] = DtypeInfo(_n, _d, _d, False, _d.kind in "fc")
_INFO["bfloat16"] = DtypeInfo("bfloat16", np.dtype(np.uint16), np.dtype(np.float32), True, True)
for _n in _FLOAT8:
    _INFO[_n] = DtypeInfo(_n, np.dtype(np.uint8), np.dtype(np.float32), True, True)
_INFO["complex32"] = DtypeInfo("complex32", np.dtype(np.uint32), np.dtype(np.complex64), True, True)

#: Logical names stored as themselves.
NATIVE_NAMES: tuple[str, ...] = tuple(_NATIVE)
#: Logical names stored as raw bits (writer input ``(bits, name)``).
BITS_NAMES: tuple[str, ...] = tuple(n for n, i in _INFO.items() if i.is_bits)

# numpy dtype (native byte order) -> logical name; keyed by dtype for O(1) lookup on the hot path.
_BY_NUMPY: dict[np.dtype, str] = {np.dtype(t): n for n, t in _NATIVE.items()}


def info(name: str) -> DtypeInfo:
    """Return the :class:`DtypeInfo` of a logical dtype name.

    Raises:
        InvalidArgumentError: for an unknown name (the message lists the known ones).
    """
    try:
        return _INFO[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown dtype name {name!r}; known: {', '.join(sorted(_INFO))}"
        ) from None


def lookup(name: object) -> DtypeInfo | None:
    """The :class:`DtypeInfo` of a logical dtype name, or None when ``name`` is not one (for
    validating input without an exception; :func:`info` raises)."""
    return _INFO.get(name) if isinstance(name, str) else None


def native_name(dtype: np.dtype) -> str:
    """Logical name of a numpy array dtype (either byte order).

    Raises:
        HookTypeError: for dtypes hookline cannot store (object, strings, structured, ``|V2``...).
    """
    name = _BY_NUMPY.get(dtype)
    if name is None:
        if dtype.byteorder in "<>" and dtype.isnative is False:
            name = _BY_NUMPY.get(dtype.newbyteorder("="))
        if name is None:
            raise HookTypeError(
                f"cannot store numpy dtype {dtype!r}; use one of {', '.join(NATIVE_NAMES)} or pass "
                f"(raw_bits, name) with name in {', '.join(BITS_NAMES)}"
            )
    return name


def float8_table(name: str) -> np.ndarray:
    """The exact float32 value of every one of the 256 bit patterns of a float8 format."""
    table = _TABLES.get(name)
    if table is None:
        ebits, mbits, bias, kind = _FLOAT8[name]
        vals = np.empty(256, dtype=np.float64)
        for b in range(256):
            if kind == "e8m0":
                vals[b] = np.nan if b == 0xFF else 2.0 ** (b - bias)
                continue
            s = (b >> 7) & 1
            e = (b >> mbits) & ((1 << ebits) - 1)
            m = b & ((1 << mbits) - 1)
            if e == 0:
                v = (m / (1 << mbits)) * 2.0 ** (1 - bias)
            else:
                v = (1 + m / (1 << mbits)) * 2.0 ** (e - bias)
            emax = (1 << ebits) - 1
            if kind == "ieee" and e == emax:
                v = np.inf if m == 0 else np.nan
            elif kind == "fn" and e == emax and m == (1 << mbits) - 1:
                v = np.nan
            elif kind == "fnuz" and b == 0x80:
                v = np.nan
            vals[b] = -v if s else v
        table = vals.astype(np.float32)  # every value is exactly representable in float32
        table.setflags(write=False)
        _TABLES[name] = table
    return table


_TABLES: dict[str, np.ndarray] = {}


def decode(stored: np.ndarray, name: str) -> np.ndarray:
    """Convert a stored array to what numpy reads return (exact).

    Args:
        stored: the array as read from HDF5 (``info(name).storage`` dtype).
        name: logical dtype name.

    Returns:
        ``stored`` itself for native dtypes; an exact float32 / complex64 array otherwise.
    """
    if name == "bfloat16":
        return (stored.astype(np.uint32) << 16).view(np.float32)
    if name in _FLOAT8:
        return float8_table(name)[stored]
    if name == "complex32":
        s = stored.astype(np.uint32)
        halves = np.empty(s.shape + (2,), dtype=np.uint16)
        halves[..., 0] = s & 0xFFFF
        halves[..., 1] = s >> 16
        return halves.view(np.float16).astype(np.float32).view(np.complex64).reshape(s.shape)
    return stored


def to_float(stored: np.ndarray, name: str) -> np.ndarray:
    """A float32/float64/complex view of float-like data for norm computations (not exact for ints)."""
    if name == "float16":
        return stored.astype(np.float32)
    return decode(stored, name)


def to_torch(stored: np.ndarray, name: str, copy: bool = True) -> Any:
    """Return a torch tensor of the exact logical dtype (imports torch lazily).

    Args:
        stored: the array as read from HDF5.
        name: logical dtype name.
        copy: False when ``stored`` is a fresh array nobody else holds: the tensor then shares
            its memory (no second copy of a large read).
    """
    import torch

    arr = np.ascontiguousarray(stored).reshape(np.shape(stored))  # ascontiguousarray makes 0-d 1-d
    if copy:
        arr = arr.copy()
    if name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    if name in _FLOAT8:
        tdt = getattr(torch, name, None)
        if tdt is None:
            raise InvalidArgumentError(f"this torch ({torch.__version__}) has no dtype {name!r}")
        return torch.from_numpy(arr).view(tdt)
    if name == "complex32":
        return torch.from_numpy(arr.view(np.int32)).view(torch.complex32)
    return torch.from_numpy(arr)
