"""Tensor -> storage field conversion and the device copier (tracker/convert.py)."""

import numpy as np
import pytest
import torch

from hookline.tracker.convert import BITS_DTYPES, DeviceCopier, to_field

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


class FakeEvent:
    """Stands in for torch.cuda.Event: completes after `ready_after` queries."""

    def __init__(self, ready_after):
        self.ready_after, self.queries, self.synced, self.recorded = ready_after, 0, False, False

    def record(self):
        self.recorded = True

    def query(self):
        self.queries += 1
        return self.synced or self.queries > self.ready_after

    def synchronize(self):
        self.synced = True


def test_cpu_copies_are_private_and_delivered_at_once():
    got = []
    copier = DeviceCopier(lambda payload, host: got.append((payload, host)))
    t = torch.ones(4)
    copier.submit("p", [t])
    t.mul_(3)  # the model modifies its tensor in place after the hook returned
    assert got[0][0] == "p" and torch.equal(got[0][1][0], torch.ones(4))
    assert copier.pending == 0


def test_pending_device_copies_are_delivered_in_order_when_events_complete():
    """The CUDA branch's bookkeeping, exercised with a fake device tensor's event on CPU."""
    got, events = [], []

    def factory():
        events.append(FakeEvent(ready_after=1))
        return events[-1]

    copier = DeviceCopier(lambda payload, host: got.append(payload), event_factory=factory)
    # Drive the pending queue directly: device tensors do not exist on this machine.
    for i in range(3):
        ev = factory()
        ev.record()
        copier._pending.append((ev, i, [torch.zeros(1)]))
    copier._poll()  # first query of event 0 is not ready yet
    assert got == [] and copier.pending == 3
    copier._poll()
    assert got == [0]  # event 0 completed, event 1 not yet: order is kept
    copier.drain()
    assert got == [0, 1, 2] and copier.pending == 0
    assert events[1].synced and events[2].synced  # drain waited on the events it needed


def test_buffer_pool_reuses_only_buffers_nobody_reads():
    import gc
    import weakref

    from hookline.tracker.convert import BufferPool, fresh_copy

    pool = BufferPool(max_bytes=1 << 20)
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
    from hookline.tracker.convert import BufferPool

    pool = BufferPool(max_bytes=64)
    pool.give(torch.empty(8, dtype=torch.float64))  # 64 bytes: kept
    pool.give(torch.empty(8, dtype=torch.float64))  # over the bound: dropped
    assert pool.take(torch.Size([8]), torch.float64) is not None and pool.reused == 1
    pool.take(torch.Size([8]), torch.float64)
    assert pool.reused == 1


def test_fresh_contiguous_results_are_not_copied_again():
    got = []
    copier = DeviceCopier(lambda payload, host: got.extend(host))
    cast = torch.ones(4, 4).to(torch.bfloat16)
    view = torch.ones(4, 4)[:, :2]  # not contiguous: always copied
    shared = torch.ones(3)
    copier.submit("p", [cast, view, shared], [True, True, False])
    assert got[0] is cast
    assert got[1] is not view and got[1].is_contiguous() and torch.equal(got[1], view)
    assert got[2] is not shared and got[2].data_ptr() != shared.data_ptr()
