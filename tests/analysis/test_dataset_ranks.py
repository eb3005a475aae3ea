"""RecordDataset under torch.distributed: two gloo ranks, each with two DataLoader workers,
read every row of an epoch exactly once between them (SPEC §14)."""

from __future__ import annotations

from _dataset_support import A, B, expected_keys, rank_worker, write_run
from _launch import spawn
from hookline.storage import RecordDataset


def test_two_ranks_split_an_epoch_exactly_once(tmp_path):
    run = write_run(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    results = spawn(rank_worker, 2, out, 2, str(tmp_path / "init"), str(run), str(out), timeout=150)
    for r, res in enumerate(results):
        assert res["aligned"] and res["shard"] == (2 * r, 4)  # rank r's workers: shards 2r, 2r+1 of 4
    k0, k1 = results[0]["keys"], results[1]["keys"]
    assert k0 and k1 and not set(k0) & set(k1)
    assert sorted(k0 + k1) == expected_keys()
    # each rank got exactly its shards of that epoch's order (the same on both ranks)
    ds = RecordDataset(run, [A, B], shuffle=True, seed=3, unit_bytes=96)
    ds.set_epoch(1)
    for r, keys in ((0, k0), (1, k1)):
        mine = [tuple(int(v) for v in row[:3]) for s in (2 * r, 2 * r + 1) for b in ds.blocks(s, 4) for row in b[A]]
        assert sorted(keys) == sorted(mine)
