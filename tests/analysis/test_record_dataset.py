"""RecordDataset (SPEC §14): aligned rows of recorded fields as a torch IterableDataset, in one
process. Workers, ranks and the Arrow export have their own files."""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from _dataset_support import A, B, BF16_SPECIAL, bf16_bits, expected_keys, keys_of, record, write_run
from hookline.storage import HooklineError, InvalidArgumentError, RecordDataset, RunWriter, StorageError, open_run
from hookline.storage.analysis.dataset import records_per_batch
from hookline.storage.analysis.dataset_map import MapCache, MappedRows, map_fields
from hookline.storage.reader import Field

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    return write_run(tmp_path_factory.mktemp("ds") / "run")


def _rows(ds) -> tuple[torch.Tensor, torch.Tensor]:
    items = list(ds)
    if ds.batch_rows is None:
        return torch.stack([i[A] for i in items]), torch.stack([i[B] for i in items])
    return torch.cat([i[A] for i in items]), torch.cat([i[B] for i in items])


def test_every_row_once_in_record_order_and_aligned(run_dir):
    ds = RecordDataset(run_dir, [A, B], index=True)
    assert isinstance(ds, IterableDataset)
    items = list(ds)
    assert ds.num_rows == len(items) == 12 * 2 * 6 and ds.num_records == 24
    a = torch.stack([i[A] for i in items])
    b = torch.stack([i[B] for i in items])
    assert keys_of(a) == expected_keys()
    assert torch.equal(a[:, :3], b[:, :3]) and set(a[:, 3].tolist()) == {1.0} and set(b[:, 3].tolist()) == {2.0}
    # the index keys say the same as the self-identifying values
    idx = torch.stack([torch.stack([i["step"], i["call"], i["sample"]]) for i in items])
    assert idx.tolist() == [list(k) for k in expected_keys()]
    assert {int(i["rank"]) for i in items} == {-1} and items[0][A].dtype == torch.float32


def test_shuffle_is_a_seeded_permutation_that_changes_with_the_epoch(run_dir):
    def order(seed, epoch, **kw):
        ds = RecordDataset(run_dir, [A, B], shuffle=True, seed=seed, unit_bytes=96, buffer_rows=20, **kw)
        ds.set_epoch(epoch)
        a, b = _rows(ds)
        assert torch.equal(a[:, :3], b[:, :3])  # aligned after shuffling
        return keys_of(a)

    first = order(7, 0)
    assert sorted(first) == expected_keys() and first != expected_keys()
    assert order(7, 0) == first  # same seed and epoch: same order
    assert order(7, 1) != first and sorted(order(7, 1)) == expected_keys()
    assert order(8, 0) != first
    # batching does not change which rows come together: batch i holds rows 5i..5i+4 of the order
    # without batches (in the order they lie in the window: the same rows, read in a cheaper order)
    batched = order(7, 0, batch_rows=5)
    runs = range(0, 144, 5)
    assert [sorted(batched[i : i + 5]) for i in runs] == [sorted(first[i : i + 5]) for i in runs]
    assert batched != first


def test_batches_hold_batch_rows_rows(run_dir):
    ds = RecordDataset(run_dir, [A, B], batch_rows=10, shuffle=True, unit_bytes=96)
    batches = list(ds)
    assert [len(b[A]) for b in batches] == [10] * 14 + [4]
    assert sorted(keys_of(torch.cat([b[A] for b in batches]))) == expected_keys()
    loader = DataLoader(ds, batch_size=None)  # the fast path: the dataset batches
    assert sum(len(b[B]) for b in loader) == 144


def test_whole_records_and_steps(run_dir):
    ds = RecordDataset(run_dir, A, rows="record", steps=range(3, 6), index=True)
    items = list(ds)
    assert [(int(i["step"]), int(i["call"])) for i in items] == [(s, c) for s in (3, 4, 5) for c in (0, 1)]
    for i in items:
        np.testing.assert_array_equal(i[A].numpy(), record(int(i["step"]), int(i["call"]), 1, 2, 3, 4))
    with pytest.raises(InvalidArgumentError, match=r"steps \[100, 101\] select no aligned record; .* 0\.\.11"):
        RecordDataset(run_dir, A, steps=[100, 101])


def test_bfloat16_rows_are_bit_exact(tmp_path):
    run = write_run(tmp_path / "bf", steps=3, bf16=True)
    for rows in ("sample", "record"):
        ds = RecordDataset(run, [A, B], rows=rows, batch_rows=4 if rows == "sample" else None, shuffle=True)
        items = list(ds)
        for it in items:
            t = it[A]
            assert t.dtype == torch.bfloat16
            bits = t.view(torch.int16).numpy().view(np.uint16).reshape(-1, 7)
            assert (bits[:, 4:7] == BF16_SPECIAL).all()  # -0.0, NaN payload, denormal kept
            for row in bits:  # every row's bits are what was written for its (step, call, sample)
                s, c, k = (int(v) for v in (row[:3].astype(np.uint32) << 16).view(np.float32))
                want = bf16_bits(record(s, c, 1, 2, 3, 7)).reshape(-1, 7)[k]
                np.testing.assert_array_equal(row, want)


def test_fields_align_on_common_records_and_labels_by_sample_dims(tmp_path):
    run = write_run(tmp_path / "lab", steps=6, skip_b=(1, 4), labels=True)
    ds = RecordDataset(run, [A, B, "inputs[emb]/inputs.0"], sample_dims={"inputs[emb]/inputs.0": 2},
                       batch_rows=7, shuffle=True)
    a, b, lab = (torch.cat(x) for x in zip(*[(i[A], i[B], i["inputs[emb]/inputs.0"]) for i in ds]))
    assert sorted(keys_of(a)) == expected_keys(steps=6, skip=(1, 4))
    assert torch.equal(a[:, :3], b[:, :3])
    assert torch.equal(lab, (a[:, 0] * 100 + a[:, 2]).long())  # the label of each token row
    with pytest.raises(InvalidArgumentError, match=r"rows of 'inputs\[emb\]/inputs.0' \(2 per record\) do not "
                                                   r"line up with 'outputs\[a\]/outputs.0' \(6\)"):
        RecordDataset(run, [A, "inputs[emb]/inputs.0"])


def test_ragged_records(tmp_path):
    run = write_run(tmp_path / "rag", steps=6, ragged=True)
    assert open_run(run)["outputs[a]"]["outputs.0"].shape is None
    a, b = _rows(RecordDataset(run, [A, B], shuffle=True, batch_rows=8))
    assert sorted(keys_of(a)) == expected_keys(steps=6, ragged=True) and torch.equal(a[:, :3], b[:, :3])
    recs = list(RecordDataset(run, A, rows="record"))
    assert [tuple(r[A].shape) for r in recs] == [(2, 3 + s % 3, 4) for s in range(6) for _ in range(2)]
    with pytest.raises(InvalidArgumentError, match="batch_rows needs fixed-shape rows"):
        RecordDataset(run, A, rows="record", batch_rows=2)


@pytest.mark.parametrize("kwargs, error, pattern", [
    ({"fields": "outputs[a]"}, InvalidArgumentError, r"field reference 'outputs\[a\]' is not 'handle/field'"),
    ({"fields": "outputs[z]/outputs.0"}, KeyError, r"unknown handle 'outputs\[z\]' .*available: .*outputs\[a\]"),
    ({"fields": "outputs[a]/grad.0"}, KeyError, r"unknown field 'grad.0' .*fields of 'outputs\[a\]': \['outputs.0'\]"),
    ({"fields": [A, A]}, InvalidArgumentError, r"given twice"),
    ({"fields": []}, InvalidArgumentError, r"fields is empty"),
    ({"fields": [A, 3]}, TypeError, r"fields must be 'handle/field' strings"),
    ({"rows": "token"}, InvalidArgumentError, r"rows must be one of \('sample', 'record'\), got 'token'"),
    ({"buffer_rows": 0}, InvalidArgumentError, r"buffer_rows must be an int >= 1 or None, got 0"),
    ({"seed": -1}, InvalidArgumentError, r"seed must be an int >= 0, got -1"),
    ({"sample_dims": 4}, InvalidArgumentError, r"sample_dims 4 for 'outputs\[a\]/outputs.0' must be an int in 0..3"),
    ({"steps": ["1"]}, TypeError, r"steps must be ints, got \['1'\]"),
    ({"rank": 2, "world_size": 2}, InvalidArgumentError, r"rank 2 must be below world_size 2"),
])
def test_bad_arguments_raise_one_clear_error(run_dir, kwargs, error, pattern):
    kw = {"fields": A, **kwargs}
    with pytest.raises(error, match=pattern) as e:
        RecordDataset(run_dir, **kw)
    assert isinstance(e.value, HooklineError)
    ds = RecordDataset(run_dir, A)
    with pytest.raises(InvalidArgumentError, match="epoch must be an int >= 0, got -2"):
        ds.set_epoch(-2)


def test_pickles_before_iteration_and_opens_no_file_until_then(run_dir):
    ds = RecordDataset(run_dir, [A, B], shuffle=True, batch_rows=6, seed=5)
    clone = pickle.loads(pickle.dumps(ds))
    assert type(clone) is type(ds)
    assert [keys_of(b[A]) for b in clone] == [keys_of(b[A]) for b in ds]
    # an opened run passed in stays the caller's (usable afterwards); the dataset reopens by path
    with open_run(run_dir) as r:
        ds2 = RecordDataset(r, A, rows="record")
        assert len(list(pickle.loads(pickle.dumps(ds2)))) == 24
        assert r["outputs[a]"]["outputs.0"][0].shape == (2, 3, 4)


@pytest.fixture(scope="module")
def gzip_dir(tmp_path_factory):
    """The rows of ``run_dir`` stored compressed: read through HDF5, not from mapped files."""
    return write_run(tmp_path_factory.mktemp("dsz") / "run", compression="gzip")


def test_reads_whole_units_never_a_read_per_row(run_dir, gzip_dir, monkeypatch):
    calls, gathers = [], []
    real_read, real_gather = Field.read_stored, MappedRows.gather

    def counting(self, start, stop, out=None):
        calls.append(stop - start)
        return real_read(self, start, stop, out=out)

    def gathering(self, refs, out):
        gathers.append(len(refs))
        return real_gather(self, refs, out)

    monkeypatch.setattr(Field, "read_stored", counting)
    monkeypatch.setattr(MappedRows, "gather", gathering)
    ds = RecordDataset(gzip_dir, [A, B], shuffle=True, unit_bytes=4 * 96)
    assert len(list(ds)) == 144
    assert len(calls) == 2 * ds.plan.num_units == 2 * 6 and set(calls) == {4}  # 4 records per read
    assert gathers == []
    # plain chunks: no HDF5 read; rows are gathered from the mapped files, one gather per batch and field
    ds = RecordDataset(run_dir, [A, B], shuffle=True, unit_bytes=4 * 96, batch_rows=50)
    assert len(list(ds)) == 3 and len(calls) == 12 and gathers == [50, 50, 50, 50, 44, 44]


def test_mapped_and_hdf5_reads_give_the_same_batches(run_dir, gzip_dir, tmp_path):
    segments = write_run(tmp_path / "seg", merge=False)  # (a field over several files)
    assert len(open_run(segments)["outputs[a]"]["outputs.0"].pieces) == 3

    def batches(run):
        ds = RecordDataset(run, [A, B], shuffle=True, seed=3, batch_rows=7, buffer_rows=40, unit_bytes=96,
                           index=True)
        ds.set_epoch(1)
        return list(ds)

    plain, packed, split = batches(run_dir), batches(gzip_dir), batches(segments)
    assert len(plain) == len(packed) == len(split) == 21
    for x, y, z in zip(plain, packed, split):
        assert x.keys() == y.keys() == z.keys()
        assert all(torch.equal(x[k], y[k]) and torch.equal(x[k], z[k]) for k in x)
    a = torch.cat([b[A] for b in plain])
    assert sorted(keys_of(a)) == expected_keys() and keys_of(a) != expected_keys()
    # in order: runs of consecutive rows, read with os.preadv
    ordered = [torch.cat([b[A] for b in RecordDataset(run, A, batch_rows=64)]) for run in (run_dir, gzip_dir, segments)]
    assert keys_of(ordered[0]) == expected_keys() and torch.equal(ordered[0], ordered[1])
    assert torch.equal(ordered[0], ordered[2])
    # single rows: a block's rows in shuffled order jump between files (one gather per file)
    rows = [_rows(RecordDataset(run, [A, B], shuffle=True, seed=3, unit_bytes=96)) for run in (gzip_dir, segments)]
    assert torch.equal(rows[0][0], rows[1][0]) and torch.equal(rows[0][1], rows[1][1])
    assert sorted(keys_of(rows[1][0])) == expected_keys()


def test_mapped_rows_keep_their_files_whatever_the_cache_drops(tmp_path):
    import gc

    run = write_run(tmp_path / "seg", merge=False)
    with open_run(run) as r:
        fld = r["outputs[a]"]["outputs.0"]
        rows = map_fields([fld], [(4,)], MapCache(capacity=1))[0]  # 3 files through a cache of 1, then dropped
        stored = fld.read_stored(0, len(fld)).reshape(-1, 4)
    gc.collect()
    others = [open(tmp_path / f"other{i}", "wb+") for i in range(6)]  # (would take a closed descriptor's number)
    refs = rows.refs(np.arange(24), np.full(24, 6))
    in_order, shuffled = np.empty((144, 4), np.float32), np.empty((144, 4), np.float32)
    rows.gather(refs, in_order)  # (runs of consecutive rows: os.preadv)
    perm = np.random.default_rng(0).permutation(144)
    rows.gather(refs[perm], shuffled)  # (single rows: from the mappings)
    assert keys_of(in_order) == expected_keys() and np.array_equal(in_order, stored)
    assert np.array_equal(shuffled, stored[perm])
    for f in others:
        f.close()


def test_batch_buffers_are_reused_only_once_nothing_holds_them(run_dir):
    ds = RecordDataset(run_dir, [A, B], shuffle=True, batch_rows=4, unit_bytes=96)
    kept = list(ds)  # every batch held: none may be overwritten by a later one
    a = torch.cat([b[A] for b in kept])
    assert sorted(keys_of(a)) == expected_keys() and torch.equal(a[:, :3], torch.cat([b[B] for b in kept])[:, :3])
    view = kept[0][A][1:]  # a view keeps its batch's buffer too
    first = view.clone()
    del kept, a
    made = ds._reuse.buffers.made
    for epoch in range(1, 4):  # consumed and dropped: the pooled buffers serve every later epoch
        ds.set_epoch(epoch)
        rows = sorted(k for b in ds for k in keys_of(b[A]))
        assert rows == expected_keys()
    assert ds._reuse.buffers.made == made and torch.equal(view, first)


def test_shard_rows_say_what_each_shard_gets(run_dir):
    ds = RecordDataset(run_dir, [A, B], shuffle=True, unit_bytes=96, batch_rows=5)
    ds.set_epoch(2)
    got = [sum(len(b[A]) for b in ds.blocks(s, 3)) for s in range(3)]
    assert [ds.shard_rows(s, 3) for s in range(3)] == got and sum(got) == ds.num_rows
    with pytest.raises(InvalidArgumentError, match="shard 3 must be below num_shards 3"):
        ds.shard_rows(3, 3)


def test_mixing_meets_the_documented_bound(tmp_path):
    run = write_run(tmp_path / "mix", steps=64, calls=1, batch=4, seq=8)  # 64 records of 32 rows
    batch = 32
    seen = {}
    for buffer_rows in (64, 512):
        ds = RecordDataset(run, A, shuffle=True, batch_rows=batch, buffer_rows=buffer_rows, index=True,
                           unit_bytes=32 * 4 * 4)
        full = [b for b in ds if len(b["step"]) == batch]
        seen[buffer_rows] = np.mean([len(set(b["step"].tolist())) for b in full])
        assert seen[buffer_rows] >= 0.9 * records_per_batch(batch, buffer_rows, 32)
    assert records_per_batch(batch, 64, 32) < records_per_batch(batch, 512, 32) <= batch
    assert seen[512] > seen[64] > 1
    # without shuffling a batch spans the records its consecutive rows come from
    plain = [b for b in RecordDataset(run, A, batch_rows=batch, index=True)]
    assert {len(set(b["step"].tolist())) for b in plain} == {1}


def test_stopping_early_stops_the_reader_thread(gzip_dir):
    before = threading.active_count()
    ds = RecordDataset(gzip_dir, [A, B], unit_bytes=96, prefetch=1, shuffle=True, buffer_rows=30)
    it = iter(ds)
    next(it)
    it.close()
    assert threading.active_count() == before
    # the next epoch reuses the window the stopped one gave back, and still gives every row once
    assert len(ds._reuse.windows) == 1
    a, b = _rows(ds)
    assert sorted(keys_of(a)) == expected_keys() and torch.equal(a[:, :3], b[:, :3]) and len(ds._reuse.windows) == 1


def test_a_read_error_reaches_the_training_loop(tmp_path):
    run = write_run(tmp_path / "gone", steps=2)
    ds = RecordDataset(run, A)
    (run / "outputs" / "a.h5").unlink()
    with pytest.warns(UserWarning, match="skipping 1 unreadable file"), \
            pytest.raises(StorageError, match=r"changed since the dataset was made: 'outputs\[a\]/outputs.0' is gone, "
                                              r"the dataset reads 4; make the dataset again"):
        list(ds)


def test_storage_and_the_dataset_plumbing_import_no_torch():
    # (the class itself, built on first access, is an IterableDataset: the tests above)
    code = ("import sys, hookline.storage as s\n"
            "from hookline.storage.analysis import dataset, dataset_plan, dataset_read, dataset_arrow\n"
            "assert 'RecordDataset' in s.__all__ and 'torch' not in sys.modules, sorted(sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    # pickle finds the lazily made class by this name in spawned workers
    assert (RecordDataset.__module__, RecordDataset.__qualname__) == ("hookline.storage.analysis.dataset",
                                                                      "RecordDataset")


def test_the_linear_probe_example_in_docs_runs_as_written(tmp_path):
    text = (ROOT / "docs" / "analysis.md").read_text()
    section = text.split("## Training on recorded activations", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "docs/analysis.md has no python example under 'Training on recorded activations'"
    script = tmp_path / "probe.py"
    script.write_text(blocks[0])
    # (one torch thread: on the shared 2-core CI machine two intra-op threads wait on each other)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert re.search(r"probe accuracy: (0\.9\d*|1\.0)", r.stdout), r.stdout


def test_an_mlflow_run_reads_like_a_local_one(tmp_path, mlflow_server):
    from mlflow import MlflowClient

    from hookline.storage import sync

    run = write_run(tmp_path / "run", steps=3)
    client = MlflowClient(mlflow_server)
    run_id = client.create_run(client.create_experiment("record-dataset")).info.run_id
    assert sync(run, run_id, tracking_uri=mlflow_server).ok
    ds = RecordDataset(f"runs:/{run_id}", [A, B], shuffle=True, batch_rows=5, tracking_uri=mlflow_server,
                       cache_dir=tmp_path / "cache")
    local = RecordDataset(run, [A, B], shuffle=True, batch_rows=5)
    want = [keys_of(b[A]) for b in local]
    assert [keys_of(b[A]) for b in ds] == want
    # a copy (a worker) reopens the URI and reads the same download cache
    assert [keys_of(b[B]) for b in pickle.loads(pickle.dumps(ds))] == want


def test_read_stored_fills_a_given_buffer_or_says_what_fits(tmp_path):
    run = write_run(tmp_path / "bf", steps=2, bf16=True)
    fld = open_run(run)["outputs[a]"]["outputs.0"]
    out = np.empty((3, 2, 3, 7), np.uint16)
    assert fld.read_stored(1, 4, out=out) is out
    np.testing.assert_array_equal(out, fld.read_stored(1, 4))  # the stored bits, as read without out
    np.testing.assert_array_equal((out.astype(np.uint32) << 16).view(np.float32), fld[1:4])
    with pytest.raises(InvalidArgumentError, match=r"out must be a C-contiguous uint16 array of shape "
                                                   r"\(3, 2, 3, 7\) .*got float32 \(3, 2, 3, 7\)"):
        fld.read_stored(1, 4, out=np.empty((3, 2, 3, 7), np.float32))


def test_float8_complex32_and_unsigned_fields_arrive_as_their_own_dtype(tmp_path):
    f8 = torch.randn(2, 4).to(torch.float8_e4m3fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch, once per process: ComplexHalf is experimental)
        c32 = torch.randn(2, 4, dtype=torch.complex64).to(torch.complex32)
    with RunWriter(tmp_path / "dt") as w:
        w.add_handle("outputs[m]", module_name="m", module_type="M", category="forward_hook", hook_fn_name="outputs")
        w.write("outputs[m]", 0, 0, {"outputs.0": (f8.view(torch.uint8).numpy(), "float8_e4m3fn"),
                                     "outputs.1": (c32.view(torch.int32).numpy().view(np.uint32), "complex32"),
                                     "outputs.2": np.array([7, 65535], np.uint16)})
    refs = [f"outputs[m]/outputs.{i}" for i in range(3)]
    ds = RecordDataset(tmp_path / "dt", refs, sample_dims={refs[2]: 1}, batch_rows=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        (b,) = list(ds)
    assert torch.equal(b[refs[0]].view(torch.uint8), f8.view(torch.uint8)) and b[refs[0]].dtype == f8.dtype
    assert torch.equal(b[refs[1]].view(torch.int32), c32.view(torch.int32)) and b[refs[1]].dtype == c32.dtype
    assert b[refs[2]].dtype == torch.uint16 and b[refs[2]].tolist() == [7, 65535]
