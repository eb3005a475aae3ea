"""Tensor -> storage field conversion and the host buffer pool (tracker/capture/convert.py)."""

import numpy as np
import pytest
import torch

from hookline.tracker.capture.convert import BITS_DTYPES, BufferPool, to_field

SPECIALS = [0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), 1e-40, 3.0e38]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.int8, torch.int16,
                                   torch.int32, torch.int64, torch.uint8, torch.bool,
                                   torch.complex64, torch.complex128])
def test_numpy_native_dtypes_are_zero_copy_views(dtype):
    t = (torch.arange(12) - 5).reshape(3, 4).to(dtype)
    v = to_field(t)
    assert isinstance(v, np.ndarray) and v.shape == (3, 4)
    assert np.shares_memory(v, t.numpy())
    assert torch.equal(torch.from_numpy(v), t)


@pytest.mark.parametrize("dtype", sorted(BITS_DTYPES, key=str))
def test_bits_dtypes_round_trip_bit_exactly(dtype):
    base = torch.tensor(SPECIALS * 2, dtype=torch.float32)
    t = base.to(dtype) if dtype != getattr(torch, "complex32", None) else torch.complex(base, -base).to(dtype)
    bits, name = to_field(t)
    view_dtype, np_bits, expect_name = BITS_DTYPES[dtype]
    assert name == expect_name and bits.dtype == np_bits
    back = torch.from_numpy(bits.view(np.dtype(str(view_dtype).removeprefix("torch.")))).view(dtype)
    assert torch.equal(back.view(view_dtype), t.view(view_dtype))  # bit-exact, NaN payloads included


def test_buffer_pool_reuses_only_buffers_nobody_reads():
    import gc
    import weakref

    pool = BufferPool(max_bytes=1 << 20)

    def fresh_copy(t, pool):
        return pool.take(t.shape, t.dtype).copy_(t)

    a = fresh_copy(torch.ones(8), pool)
    arr = a.numpy()
    view = arr.reshape(2, 4)[1:]  # a view the "writer" still holds
    del arr
    owner = view
    while isinstance(owner.base, np.ndarray):
        owner = owner.base
    weakref.finalize(owner, pool.give, a)
    gc.collect()
    b = fresh_copy(torch.zeros(8), pool)
    assert pool.reused == 0 and b.data_ptr() != a.data_ptr()  # the view keeps the buffer busy
    assert view.sum() == 4  # untouched
    del view, owner
    gc.collect()
    c = fresh_copy(torch.full((8,), 2.0), pool)
    assert pool.reused == 1 and c.data_ptr() == a.data_ptr() and torch.equal(c, torch.full((8,), 2.0))


def test_buffer_pool_is_bounded():
    pool = BufferPool(max_bytes=64)
    pool.give(torch.empty(8, dtype=torch.float64))  # 64 bytes: kept
    pool.give(torch.empty(8, dtype=torch.float64))  # over the bound: dropped
    assert pool.take(torch.Size([8]), torch.float64) is not None and pool.reused == 1
    pool.take(torch.Size([8]), torch.float64)
    assert pool.reused == 1


def test_buffer_pool_byte_count_stays_exact_under_concurrent_give_and_take():
    """give() runs on the writer thread (finalizers) while take() runs on the training thread."""
    import threading

    pool = BufferPool(max_bytes=1 << 30)
    bufs = [torch.empty(16) for _ in range(64)]

    def giver():
        for _ in range(200):
            for b in bufs:
                pool.give(b)

    t = threading.Thread(target=giver)
    t.start()
    for _ in range(20000):
        pool.take(torch.Size([16]), torch.float32)
    t.join()
    held = sum(b.nbytes for q in pool._free.values() for b in q)
    assert pool._bytes == held
