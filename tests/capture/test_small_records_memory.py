"""The recorder's blocks hold what the budget counts: a partly filled block pinned its whole
buffer while the writer counted only the filled rows; many handles of tiny records still go over
in blocks of many records. (The whole-process bound for such runs is in
tests/storage/test_memory_return.py.)"""

from __future__ import annotations

import numpy as np
import torch

from hookline.tracker.capture.convert import BufferPool
from hookline.tracker.capture.packer import BlockPacker


class Sink:
    """Keeps what the writer would get (the arrays themselves, not copies)."""

    def __init__(self):
        self.blocks, self.rows = [], []

    def write_block(self, hid, steps, calls, fields):
        self.blocks.append((hid, list(steps), dict(fields)))
        return True

    def write_rows(self, hids, steps, calls, fields):
        self.rows.append((list(hids), list(steps), dict(fields)))
        return True


def test_a_partly_filled_block_goes_over_as_a_copy_and_its_buffer_back_to_the_pool():
    sink = Sink()
    pool = BufferPool()
    packer = BlockPacker(sink.write_block, pool, max_open_bytes=64 << 20)
    packer.add("h", 0, 0, ["f"], [torch.full((16, 64), 3.0)])  # 1 row of a block of many
    packer.hand_over_all()
    (hid, steps, fields), = sink.blocks
    arr = fields["f"]
    assert arr.shape == (1, 16, 64) and (arr == 3.0).all()
    # The block's buffer (256 records of 4 KiB) is free at once although the writer still holds
    # the row: the row is a copy.
    assert pool.nbytes == 1 << 20
    buf = pool.take(torch.Size((256, 16, 64)), torch.float32)
    assert pool.reused == 1 and not np.shares_memory(buf.numpy(), arr)


def test_a_full_block_still_goes_over_without_a_copy():
    sink = Sink()
    packer = BlockPacker(sink.write_block, BufferPool(), max_open_bytes=64 << 20)
    for step in range(256):  # 4 KiB records: a block of 256 (a 1 MiB chunk)
        packer.add("h", step, 0, ["f"], [torch.ones(16, 64)])
    (_, _, fields), = sink.blocks
    assert fields["f"].base is not None  # a view of the block's buffer


def test_a_thousand_handles_of_tiny_records_go_over_in_blocks_not_record_by_record():
    """1,000 handles x 256-byte records: a 256-record block each is almost the whole open-block
    share (64 MiB); every record still goes to the writer in a block of many."""
    sink = Sink()
    packer = BlockPacker(sink.write_block, BufferPool(), max_open_bytes=64 << 20, write_rows=sink.write_rows)
    packer.handles = 1000
    for step in range(20):
        for h in range(1000):
            packer.add(f"h{h}", step, 0, ["f"], [torch.full((16, 4), float(step))])
    packer.drain()
    sizes = [len(s) for _, s, _ in sink.blocks + sink.rows]
    assert sum(sizes) == 20_000 and min(sizes) == 20  # one block per handle, its 20 records
    assert packer._open_bytes == 0 and packer.pool.nbytes <= 64 << 20
