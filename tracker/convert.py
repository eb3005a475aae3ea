"""Tensor -> storage field conversion, off the training thread's critical path as far as possible.

``storage`` takes numpy arrays, or ``(raw_bits, dtype_name)`` pairs for dtypes numpy lacks
(bfloat16, float8 variants, complex32). Everything here is zero-copy on the numpy side: the tensor
handed in must already be a private copy (see :class:`DeviceCopier`).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Union

import numpy as np
import torch

__all__ = ["FieldValue", "to_field", "DeviceCopier", "BufferPool", "BITS_DTYPES"]

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


class BufferPool:
    """Host buffers reused across captures, so copies land in warm pages.

    A fresh allocation per capture costs page faults on first touch (``clone()`` into fresh pages
    runs at a fraction of the speed of a copy into warm memory). The recorder returns a buffer
    with :meth:`give` once the writer has dropped the array that views it (a ``weakref.finalize``
    on that array, which may run on the writer thread; ``deque`` operations are thread-safe).

    Args:
        max_bytes: at most this many bytes are kept for reuse; beyond it buffers are freed.
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple, deque[torch.Tensor]] = {}
        self._bytes = 0
        self._pinned_ever = False  # is_pinned() costs ~5 us: only ask once pinned buffers exist
        self.reused = 0  # statistics (tests, benchmarks)

    def take(self, shape: torch.Size, dtype: torch.dtype, pin: bool = False) -> torch.Tensor:
        """A contiguous buffer of this shape and dtype: reused when one is free, else new."""
        q = self._free.get((tuple(shape), dtype, pin))
        if q:
            try:
                buf = q.pop()
            except IndexError:  # emptied by another thread meanwhile
                pass
            else:
                self._bytes -= buf.nbytes
                self.reused += 1
                return buf
        if pin:
            self._pinned_ever = True
        return torch.empty(shape, dtype=dtype, pin_memory=pin)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer nobody reads any more."""
        if self._bytes + buf.nbytes > self.max_bytes:
            return
        pinned = self._pinned_ever and buf.device.type == "cpu" and buf.is_pinned()
        key = (tuple(buf.shape), buf.dtype, pinned)
        self._free.setdefault(key, deque()).append(buf)
        self._bytes += buf.nbytes


def fresh_copy(t: torch.Tensor, pool: BufferPool | None = None) -> torch.Tensor:
    """A contiguous private copy of a CPU tensor (the hook's tensor may change in place later)."""
    if pool is None:
        return t.clone(memory_format=torch.contiguous_format)
    buf = pool.take(t.shape, t.dtype)
    return buf.copy_(t)


class DeviceCopier:
    """Moves captured tensors to host memory without synchronising the device inside hooks.

    CPU tensors are cloned synchronously (the caller may modify them in place right after the
    hook returns). CUDA tensors are copied with ``non_blocking=True`` into pinned host buffers and
    an event is recorded on the current stream; the record is handed on (``deliver``) only once
    the event has completed, checked without blocking on every later capture and with a blocking
    wait in :meth:`drain`. This keeps ``torch.cuda.synchronize`` out of the training loop.

    Args:
        deliver: called with ``(payload, host_tensors)`` once the copies of a record are complete.
        event_factory: creates an object with ``record()``, ``query()`` and ``synchronize()``;
            defaults to ``torch.cuda.Event``. Injectable so the pending logic is testable on CPU.
    """

    def __init__(
        self,
        deliver: Callable[[Any, list[torch.Tensor]], None],
        event_factory: Callable[[], Any] | None = None,
        pool: BufferPool | None = None,
    ) -> None:
        self._deliver = deliver
        self._event_factory = event_factory or (lambda: torch.cuda.Event())
        self.pool = pool
        self._pending: deque[tuple[Any, Any, list[torch.Tensor]]] = deque()

    @property
    def pending(self) -> int:
        """Number of records whose device copies have not been delivered yet."""
        return len(self._pending)

    def submit(self, payload: Any, tensors: list[torch.Tensor], fresh: list[bool] | None = None) -> None:
        """Copy ``tensors`` to host memory and deliver them with ``payload`` when ready.

        ``fresh[i]`` marks a CPU tensor that is already a private result (e.g. a dtype cast):
        it is handed on without another copy when contiguous.
        """
        pool = self.pool
        if fresh is None:
            fresh = [False] * len(tensors)
        elif len(fresh) != len(tensors):
            raise ValueError(f"fresh flags ({len(fresh)}) must match the tensors ({len(tensors)})")

        def host_copy(t: torch.Tensor, new: bool) -> torch.Tensor:
            return t if new and t.is_contiguous() else fresh_copy(t, pool)

        if not any(t.device.type != "cpu" for t in tensors):
            self._poll()
            self._deliver(payload, [host_copy(t, new) for t, new in zip(tensors, fresh)])
            return
        host = []
        for t, new in zip(tensors, fresh):
            if t.device.type == "cpu":
                host.append(host_copy(t, new))
            else:
                buf = pool.take(t.shape, t.dtype, pin=True) if pool else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                host.append(buf)
        event = self._event_factory()
        event.record()
        self._pending.append((event, payload, host))
        self._poll()

    def _poll(self) -> None:
        while self._pending and self._pending[0][0].query():
            _, payload, host = self._pending.popleft()
            self._deliver(payload, host)

    def drain(self) -> None:
        """Block until every pending copy is complete and delivered (used by flush/close)."""
        while self._pending:
            event, payload, host = self._pending.popleft()
            event.synchronize()
            self._deliver(payload, host)
