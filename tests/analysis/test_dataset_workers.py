"""RecordDataset under DataLoader workers (fork and spawn): every row exactly once per epoch,
files opened inside the workers (SPEC §14)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from _dataset_support import A, B, expected_keys, keys_of, write_run
from hookline.storage import RecordDataset, open_run


def _loader_order(ds, workers: int, batch: int) -> list[tuple[int, int, int]]:
    """The order a DataLoader with ``workers`` workers gives: their batches in turn, each worker
    reading its own shard (what the dataset's :meth:`blocks` of that shard holds)."""
    streams = []
    for w in range(workers):
        keys = [k for b in ds.blocks(w, workers) for k in keys_of(b[A])]
        streams.append([keys[i : i + batch] for i in range(0, len(keys), batch)])
    out = []
    for i in range(max(map(len, streams))):
        for s in streams:
            if i < len(s):
                out += s[i]
    return out


@pytest.mark.parametrize("context, epochs", [("fork", (0, 1)), ("spawn", (1,))])
def test_two_workers_deliver_every_row_once(tmp_path, context, epochs):
    run = write_run(tmp_path / "run")
    # the parent holds the run open while the workers start: h5py files opened before a fork
    # must not be what the workers read through
    held = open_run(run)
    assert held["outputs[a]"]["outputs.0"][0].shape == (2, 3, 4)
    ds = RecordDataset(held, [A, B], shuffle=True, seed=1, unit_bytes=96, buffer_rows=16)
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context=context)
    orders = []
    for epoch in epochs:
        ds.set_epoch(epoch)
        keys = []
        for batch in loader:
            assert torch.equal(batch[A][:, :3], batch[B][:, :3])
            keys += keys_of(batch[A])
        assert sorted(keys) == expected_keys()  # 144 rows, each once
        assert keys == _loader_order(ds, 2, 4)  # each worker read its shard of this epoch
        orders.append(keys)
    assert len(orders) == 1 or orders[0] != orders[1]
    held.close()
