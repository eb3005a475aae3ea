"""Many hooked handles (issue 24): records of handles that cannot have a chunk-sized block each
share blocks, so a record costs the same whatever the number of handles."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from hookline.storage import open_run
from hookline.tracker import HookManager, Recorder
from hookline.tracker.capture.convert import BufferPool
from hookline.tracker.capture.packer import BLOCK_BYTES, BlockPacker


class Sink:
    """Collects write_block and write_rows calls, and check_fields calls."""

    def __init__(self):
        self.blocks, self.rows, self.checks = [], [], []

    def write_block(self, hid, steps, calls, fields):
        self.blocks.append((hid, list(steps), {k: np.array(v) for k, v in fields.items()}))
        return True

    def write_rows(self, hids, steps, calls, fields):
        self.rows.append((list(hids), list(steps), {k: np.array(v) for k, v in fields.items()}))
        return True

    def check(self, hid, layout):
        self.checks.append(hid)


def test_handles_without_a_chunk_each_share_blocks_in_record_order():
    sink = Sink()
    packer = BlockPacker(sink.write_block, BufferPool(), max_open_bytes=64 << 20, check_fields=sink.check,
                         write_rows=sink.write_rows)
    n = 600  # 600 handles x 1 MiB chunks of 4 KiB records > 64 MiB: not a chunk each
    packer.handles = n
    for step in range(3):
        for h in range(n):
            packer.add(f"h{h}", step, 0, ["outputs.0"], [torch.full((16, 64), float(h * 10 + step))])
    packer.add("odd", 0, 0, ["outputs.0"], [torch.ones(16, 32)])  # another layout: another shared block
    packer.drain()
    assert sink.blocks == []
    full = BLOCK_BYTES // (16 * 64 * 4)  # a shared block holds up to BLOCK_BYTES of records, of every member
    assert [len(r[0]) for r in sink.rows[:1]] == [full] and len(set(sink.rows[0][0])) == n  # a full block
    assert sum(len(r[0]) for r in sink.rows) == 3 * n + 1
    got: dict[str, list[float]] = {}
    for hids, steps, fields in sink.rows:
        for j, hid in enumerate(hids):
            got.setdefault(hid, []).append(float(fields["outputs.0"][j][0, 0]))
    assert got["h7"] == [70.0, 71.0, 72.0] and got["h599"] == [5990.0, 5991.0, 5992.0]
    assert got["odd"] == [1.0]
    assert sorted(sink.checks) == sorted([f"h{h}" for h in range(n)] + ["odd"])  # once per handle layout


def test_a_handle_of_shared_blocks_changes_layout_and_keeps_its_record_order():
    """A handle of shared blocks whose record shape changes leaves its layout's blocks (and
    after two changes gets blocks of its own); the others go on sharing; every handle's records
    reach the writer in step order with their values."""
    handed: list[tuple[list[str], list[int], np.ndarray]] = []  # in the order the writer gets them

    def write_block(hid, steps, calls, fields):
        handed.append(([hid] * len(steps), list(steps), np.array(fields["outputs.0"])))
        return True

    def write_rows(hids, steps, calls, fields):
        handed.append((list(hids), list(steps), np.array(fields["outputs.0"])))
        return True

    packer = BlockPacker(write_block, BufferPool(), max_open_bytes=64 << 20, write_rows=write_rows)
    n = 200
    packer.handles = n
    for step in range(5):
        for h in range(n):
            shape = (16, 32) if (h == 5 and step in (1, 3)) else (16, 64)
            packer.add(f"h{h}", step, 0, ["outputs.0"], [torch.full(shape, float(h * 10 + step))])
    packer.drain()
    got: dict[str, list[tuple[int, tuple, float]]] = {}
    for hids, steps, values in handed:
        for j, hid in enumerate(hids):
            got.setdefault(hid, []).append((steps[j], values[j].shape, float(values[j][0, 0])))
    wide, narrow = (16, 64), (16, 32)
    assert got["h5"] == [(0, wide, 50.0), (1, narrow, 51.0), (2, wide, 52.0), (3, narrow, 53.0), (4, wide, 54.0)]
    assert all(got[f"h{h}"] == [(s, wide, float(h * 10 + s)) for s in range(5)] for h in range(n) if h != 5)
    assert any(len(set(hids)) > 1 for hids, _, _ in handed)  # the others share blocks throughout
    assert [hids for hids, _, _ in handed if "h5" in hids][-1] == ["h5"]  # h5 ended in blocks of its own


def test_a_recorder_with_128_hooked_modules_hands_over_full_shared_blocks(tmp_path):
    """128 Linear(64) modules, 4 KiB records: the open-block budget (64 MB) cannot give 128
    handles a 1 MiB block each. The packer used to hand every record over in a block of its own
    (~1 ms each); now blocks of 256 records of many handles go over, and every record lands in
    its own handle, bit-exactly."""
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(128)])
    mgr = HookManager()
    rec = Recorder(tmp_path / "run")
    rec._packer.max_age_s = float("inf")  # (no hand-over by age on a slow machine)
    mgr.register_forward_hook(rec.outputs, **dict(model.named_children()))
    handed = []
    w = rec._writer
    real_block, real_rows = w.write_block, getattr(w, "write_rows", None)
    rec._packer._write_block = lambda hid, st, *a: (handed.append(len(st)), real_block(hid, st, *a))[1]
    if real_rows is not None:
        rec._packer._write_rows = lambda hids, *a: (handed.append(len(hids)), real_rows(hids, *a))[1]
    x = torch.randn(16, 64)
    want = []
    with torch.no_grad():
        for step in range(8):
            with rec.step(step):  # the model's forward, one hooked call per module
                outs, y = [], x
                for lin in model:
                    y = lin(y)
                    outs.append(y.numpy().copy())
                want.append(outs)
    assert handed == [BLOCK_BYTES // (64 * 16 * 4)]  # 1,024 records: one full shared block, nothing else
    rec.close()
    with open_run(tmp_path / "run") as run:
        for i in (0, 63, 127):
            f = run[f"outputs[{i}]"]["outputs.0"]
            np.testing.assert_array_equal(f.read(), np.stack([want[s][i] for s in range(8)]))
