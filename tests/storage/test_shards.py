"""The reader's logical view of DTensor fields (storage/shards.py) on runs written rank by rank
with the layouts a recorder writes: uneven and empty shards, two mesh dimensions, partial
reductions, replicated fields stored once, and layouts it must refuse. Expected values come from
numpy on the full tensor, split the way DTensor splits it (``torch.chunk``: ceil-sized chunks,
empty trailing shards)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

from hookline.storage import FormatError, LogicalField, RunWriter, open_run


def _chunks(x: np.ndarray, n: int, dim: int) -> list[np.ndarray]:
    size = math.ceil(x.shape[dim] / n)
    return [np.take(x, range(min(i * size, x.shape[dim]), min((i + 1) * size, x.shape[dim])), axis=dim)
            for i in range(n)]


def _layout(placements, mesh_shape, coord, stored=True, mesh_ranks=None):
    ranks = mesh_ranks or list(range(int(np.prod(mesh_shape))))
    return {"placements": placements, "mesh_shape": list(mesh_shape), "mesh_dim_names": None,
            "mesh_ranks": ranks, "coordinate": list(coord), "stored": stored}


def _write(run_dir, world: int, per_rank) -> None:
    """``per_rank(rank) -> (layouts, [(step, {field: array})])`` for the handle ``outputs[m]``."""
    for r in range(world):
        layouts, records = per_rank(r)
        w = RunWriter(run_dir, rank=r, world_size=world, fsync=False)
        w.add_handle("outputs[m]", module_name="m", category="forward_hook", meta={"dtensor": layouts})
        for step, fields in records:
            w.write("outputs[m]", step, 0, fields)
        w.close()


def test_uneven_shards_2d_mesh_and_replicate(tmp_path):
    """A (2, 2) mesh: tensor dim 0 sharded over mesh dim 0 (5 rows: 3 + 2), tensor dim 1 sharded
    over mesh dim 1 (1 column: 1 + 0, an empty shard); a second field replicated over mesh dim 1."""
    rng = np.random.default_rng(0)
    full = [rng.standard_normal((5, 1)).astype(np.float32) for _ in range(3)]
    rep = [rng.standard_normal((4,)).astype(np.float32) for _ in range(3)]

    def per_rank(r):
        c = (r // 2, r % 2)
        lays = {"outputs.0": _layout(["shard:0", "shard:1"], (2, 2), c),
                "outputs.1": _layout(["shard:0", "replicate"], (2, 2), c, stored=c[1] == 0)}
        recs = []
        for s in range(3):
            fields = {"outputs.0": _chunks(_chunks(full[s], 2, 0)[c[0]], 2, 1)[c[1]]}
            if c[1] == 0:
                fields["outputs.1"] = _chunks(rep[s], 2, 0)[c[0]]
            recs.append((s, fields))
        return lays, recs

    _write(tmp_path, 4, per_rank)
    run = open_run(tmp_path)
    f = run["outputs[m]"]["outputs.0"]
    assert isinstance(f, LogicalField) and len(f) == 3 and f.shape == (5, 1) and f.ranks.tolist() == [-1] * 3
    assert run.handle("outputs[m]", rank=3)["outputs.0"].record_shape(0) == (2, 0)  # an empty shard is a record
    np.testing.assert_array_equal(f.read(), np.stack(full))
    np.testing.assert_array_equal(f.at_step(2)[0], full[2])
    assert f.to_torch(1).numpy().tolist() == full[1].tolist()
    g = run["outputs[m]"]["outputs.1"]
    assert sorted(g.shards(0)) == [0, 2]  # replicated over mesh dim 1: ranks 1 and 3 store nothing
    np.testing.assert_array_equal(g[:], np.stack(rep))
    assert g.record_shape(0) == (4,)


@pytest.mark.parametrize("op, reduce", [("sum", np.sum), ("avg", np.mean), ("max", np.max)])
def test_partial_placements_are_reduced(tmp_path, op, reduce):
    rng = np.random.default_rng(1)
    parts = rng.standard_normal((2, 3, 4)).astype(np.float32)
    _write(tmp_path, 2, lambda r: ({"outputs.0": _layout([f"partial:{op}"], (2,), (r,))},
                                   [(0, {"outputs.0": parts[r]})]))
    f = open_run(tmp_path)["outputs[m]"]["outputs.0"]
    np.testing.assert_array_equal(f[0], reduce(parts, axis=0).astype(np.float32))
    assert f[0].dtype == np.float32


def test_two_meshes_give_one_logical_record_each(tmp_path):
    """Ranks {0, 1} and {2, 3} are two tensor-parallel groups (a 2-D run's data-parallel groups)."""
    rng = np.random.default_rng(2)
    full = {0: rng.standard_normal((2, 6)).astype(np.float32), 2: rng.standard_normal((2, 6)).astype(np.float32)}

    def per_rank(r):
        lead, c = r - r % 2, r % 2
        return ({"outputs.0": _layout(["shard:1"], (2,), (c,), mesh_ranks=[lead, lead + 1])},
                [(0, {"outputs.0": _chunks(full[lead], 2, 1)[c]})])

    _write(tmp_path, 4, per_rank)
    f = open_run(tmp_path)["outputs[m]"]["outputs.0"]
    assert f.meshes == [[0, 1], [2, 3]] and f.ranks.tolist() == [0, 2]
    np.testing.assert_array_equal(f[:], np.stack([full[0], full[2]]))
    assert f.records.tolist() == [0, 2]  # the lead ranks' records in the handle (rank-major)


def test_fields_that_cannot_be_reassembled_read_per_rank(tmp_path):
    """A field whose layout changed between records, or an unknown placement, reads as the plain
    rank-major field; a malformed layout or a missing rank is an error naming the field."""
    x = np.ones((2, 2), np.float32)
    _write(tmp_path / "varies", 2, lambda r: ({"outputs.0": {**_layout(["shard:0"], (2,), (r,)), "varies": True}},
                                              [(0, {"outputs.0": x})]))
    f = open_run(tmp_path / "varies")["outputs[m]"]["outputs.0"]
    assert not isinstance(f, LogicalField) and len(f) == 2
    _write(tmp_path / "strided", 2, lambda r: ({"outputs.0": _layout(["_StridedShard(dim=0, sf=2)"], (2,), (r,))},
                                               [(0, {"outputs.0": x})]))
    assert not isinstance(open_run(tmp_path / "strided")["outputs[m]"]["outputs.0"], LogicalField)
    _write(tmp_path / "bad", 2, lambda r: ({"outputs.0": {**_layout(["shard:0"], (2,), (r,)), "coordinate": "0"}},
                                           [(0, {"outputs.0": x})]))
    with pytest.raises(FormatError, match=r"outputs.0.*malformed"):
        open_run(tmp_path / "bad")["outputs[m]"]["outputs.0"]
    _write(tmp_path / "gap", 2, lambda r: ({"outputs.0": _layout(["shard:0"], (3,), (r,))},
                                           [(0, {"outputs.0": x})]))
    with pytest.raises(FormatError, match=r"rank\(s\) \[2\] have no data"):
        open_run(tmp_path / "gap")["outputs[m]"]["outputs.0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert open_run(tmp_path / "gap").handle("outputs[m]", rank=1)["outputs.0"].shape == (2, 2)
