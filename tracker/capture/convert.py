"""Tensor -> storage field conversion, and the host buffers captures are copied into.

``storage`` takes numpy arrays, or ``(raw_bits, dtype_name)`` pairs for dtypes numpy lacks
(bfloat16, float8 variants, complex32). Everything here is zero-copy on the numpy side: the tensor
handed in must already be a private copy (see :mod:`hookline.tracker.capture.packer`).
"""

from __future__ import annotations

import functools
import threading
from collections import deque
from typing import Union

import numpy as np
import torch

from hookline.storage import dtypes
from hookline.storage.errors import HookTypeError

__all__ = ["FieldValue", "to_field", "storage_dtype", "BufferPool", "BITS_DTYPES"]

FieldValue = Union[np.ndarray, "tuple[np.ndarray, str]"]

#: torch dtypes numpy cannot represent -> (integer view dtype, numpy bits dtype, storage name).
BITS_DTYPES: dict[torch.dtype, tuple[torch.dtype, np.dtype, str]] = {
    torch.bfloat16: (torch.int16, np.dtype(np.uint16), "bfloat16"),
}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu"):
    _dt = getattr(torch, _name, None)
    if _dt is not None:
        BITS_DTYPES[_dt] = (torch.uint8, np.dtype(np.uint8), _name)
if hasattr(torch, "complex32"):
    BITS_DTYPES[torch.complex32] = (torch.int32, np.dtype(np.uint32), "complex32")


def to_field(t: torch.Tensor) -> FieldValue:
    """Return the storage value of a CPU tensor without copying.

    Args:
        t: a dense CPU tensor the caller owns (a private copy).

    Returns:
        A numpy array sharing memory with ``t``, or ``(bits, dtype_name)`` for bfloat16, float8
        variants and complex32, whose bits are reinterpreted bit-exactly.

    Raises:
        TypeError: for tensor layouts numpy cannot view (sparse, quantized).
    """
    bits = BITS_DTYPES.get(t.dtype)
    if bits is not None:
        view_dtype, np_bits, name = bits
        return t.view(view_dtype).numpy().view(np_bits), name
    return t.numpy()


@functools.lru_cache(maxsize=None)
def storage_dtype(dtype: torch.dtype) -> str:
    """The storage dtype name a CPU tensor of ``dtype`` is stored under (see :func:`to_field`).

    Raises:
        HookTypeError: for dtypes hookline cannot store.
    """
    bits = BITS_DTYPES.get(dtype)
    if bits is not None:
        return bits[2]
    try:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise HookTypeError(f"cannot record tensors of dtype {dtype}; cast them in the module") from None
    return dtypes.native_name(np_dtype)


class BufferPool:
    """Host buffers reused across captures, so copies land in warm pages.

    A fresh allocation per capture costs page faults on first touch (``clone()`` into fresh pages
    runs at a fraction of the speed of a copy into warm memory). The recorder returns a buffer
    with :meth:`give` once the writer has dropped the array that views it (a ``weakref.finalize``
    on that array, which may run on the writer thread: hence the lock, which keeps the byte count
    exact over a long run).

    Args:
        max_bytes: at most this many bytes are kept for reuse; beyond it buffers are freed. A
            :class:`~.packer.BlockPacker` lowers it while its open blocks grow (:meth:`shrink`),
            so free and open buffers together stay within one share of the budget.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple, deque[torch.Tensor]] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self._pinned_ever = False  # is_pinned() costs ~5 us: only ask once pinned buffers exist
        self.reused = 0  # statistics (tests, benchmarks)

    def take(self, shape: torch.Size, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """A contiguous buffer of this shape and dtype: reused when one is free, else new."""
        with self._lock:
            q = self._free.get((tuple(shape), dtype, pin))
            if q:
                buf = q.pop()
                self._bytes -= buf.nbytes
                self.reused += 1
                return buf
        if pin:
            self._pinned_ever = True
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer nobody reads any more (any thread)."""
        pinned = self._pinned_ever and buf.device.type == "cpu" and buf.is_pinned()
        key = (tuple(buf.shape), buf.dtype, pinned)
        with self._lock:
            if self._bytes + buf.nbytes > self.max_bytes:
                return
            self._free.setdefault(key, deque()).append(buf)
            self._bytes += buf.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes of the free buffers kept now."""
        return self._bytes

    def shrink(self, max_bytes: int) -> None:
        """Keep at most ``max_bytes`` of free buffers from now on, freeing the longest unused
        ones first (the head of each shape's queue: :meth:`take` reuses the tail)."""
        with self._lock:
            self.max_bytes = max(0, max_bytes)
            while self._bytes > self.max_bytes and self._free:
                for key in list(self._free):
                    q = self._free[key]
                    self._bytes -= q.popleft().nbytes
                    if not q:
                        del self._free[key]
                    if self._bytes <= self.max_bytes:
                        break
