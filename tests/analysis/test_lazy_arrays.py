"""Whole fields as torch tensors, dask arrays and xarray objects (SPEC §12): bit for bit equal to
``read()``, chunked along the storage chunks, labelled; ragged fields refused clearly."""

from __future__ import annotations

import pickle

import dask
import numpy as np
import pytest
import torch

from _analysis_runs import GID, HID, SID, bf16_bits, write_big, write_run
from hookline.storage import InvalidArgumentError, open_run
from hookline.storage.analysis.lazy import MAX_OPEN, FieldSource


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


@pytest.fixture(scope="module")
def run_a(tmp_path_factory):
    path = tmp_path_factory.mktemp("lazy") / "a"
    write_run(path, n=12)
    with open_run(path) as run:
        yield run


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    path = tmp_path_factory.mktemp("big") / "run"
    data = write_big(path, records=100)  # 64 KiB records, 16 per storage chunk
    with open_run(path) as run:
        yield run["outputs[big]"]["outputs.0"], data


def test_to_torch_whole_fields(run_a):
    f = run_a[HID]["outputs.0"]
    t = f.to_torch()
    assert t.dtype == torch.float32 and t.shape == (12, 4, 8)
    assert _bits(t.numpy()) == _bits(f.read())
    assert torch.equal(f.to_torch(slice(2, 9, 3)), torch.from_numpy(f.read()[2:9:3]))
    assert torch.equal(f.to_torch(slice(9, 2, -3)), torch.from_numpy(f.read()[9:2:-3].copy()))
    assert f.to_torch(slice(5, 5)).shape == (0, 4, 8)
    assert torch.equal(f.to_torch(3), f.to_torch(slice(3, 4))[0])
    b = run_a[HID]["outputs.2"]
    tb = b.to_torch()
    assert tb.dtype == torch.bfloat16 and tb.shape == (12, 3)
    assert _bits(tb.view(torch.int16).numpy().view(np.uint16)) == _bits(bf16_bits(b.read()))
    assert torch.equal(tb[4], b.to_torch(4))
    ragged = run_a[HID]["outputs.1"].to_torch()
    assert isinstance(ragged, list) and [len(x) for x in ragged] == [i % 3 + 1 for i in range(12)]
    assert all(torch.equal(x, torch.from_numpy(y)) for x, y in zip(ragged, run_a[HID]["outputs.1"].read()))
    with pytest.raises(InvalidArgumentError, match=r"to_torch\(\) takes"):
        f.to_torch("all")


def test_to_dask_equals_read_bit_for_bit(run_a):
    for name in ("outputs.0", "outputs.2"):
        f = run_a[HID][name]
        x = f.to_dask()
        assert x.shape == (len(f), *f.shape) and x.dtype == f.dtype
        assert _bits(x.compute()) == _bits(f.read())
        assert _bits(x[3:7, 1].compute()) == _bits(f.read()[3:7, 1])
        assert _bits(x[[1, 5, 2]].compute()) == _bits(f.read()[[1, 5, 2]])
    stats = run_a[SID]["outputs.0.mean"].to_dask()  # 0-d records
    assert stats.shape == (12,) and _bits(stats.compute()) == _bits(run_a[SID]["outputs.0.mean"].read())


def test_many_records_many_chunks_on_storage_chunk_borders(big):
    f, data = big
    rows = f.pieces[0].ds.chunks[0]
    assert rows == 16
    x = f.to_dask(chunks=40)  # rounded down to whole storage chunks
    assert x.chunks[0] == (32, 32, 32, 4) and x.chunks[1:] == ((128,), (128,))
    assert all(c % rows == 0 for c in x.chunks[0][:-1])
    assert _bits(x.compute()) == _bits(data)
    # the graph grows with the chunks, not the records: one task per chunk plus the source
    assert len(dict(x.__dask_graph__())) == len(x.chunks[0]) + 1
    assert f.to_dask(chunks=1).chunks[0][:2] == (16, 16)  # never less than a storage chunk
    with dask.config.set({"array.chunk-size": "1MiB"}):
        assert f.to_dask().chunks[0] == (16,) * 6 + (4,)
    assert f.to_dask().chunks[0] == (100,)  # 6.5 MB: one chunk at dask's default 128 MiB
    assert float(x.astype(np.float64).sum().compute()) == pytest.approx(data.astype(np.float64).sum(), rel=1e-12)
    with pytest.raises(InvalidArgumentError, match="chunks must be"):
        f.to_dask(chunks=0)


def test_a_field_over_several_files(tmp_path):
    w = write_run(tmp_path / "live", n=40, close=False, flush_every=2)  # sealed segments, writer open
    try:
        with open_run(tmp_path / "live") as run:
            f = run[HID]["outputs.0"]
            counts = tuple(pf.count for pf in f.pieces)
            assert len(counts) > MAX_OPEN and sum(counts) == 40
            x = f.to_dask(chunks=1)
            assert x.chunks[0] == counts  # a chunk never spans two files
            assert _bits(x[2:30].compute(scheduler="threads")) == _bits(f.read()[2:30])  # (more files than it keeps open)
            assert _bits(f.to_torch(slice(1, 39)).numpy()) == _bits(f.read()[1:39])
    finally:
        w.close()


def test_source_pickles_without_open_files(big):
    f, data = big
    src = FieldSource.of(f)
    assert _bits(src[5:9]) == _bits(data[5:9])  # opens its file here
    again = pickle.loads(pickle.dumps(src))  # an open h5py file would not pickle
    assert again._pieces == [None] and _bits(again[-3:, 2]) == _bits(data[-3:, 2])
    assert _bits(again[np.array([True] * 50 + [False] * 50)]) == _bits(data[:50])


def test_to_xarray_labels(run_a):
    f = run_a[HID]["outputs.0"]
    xa = f.to_xarray()
    assert xa.dims == ("record", "dim_0", "dim_1") and xa.name == "outputs.0"
    assert xa.attrs == {"handle": HID, "module": "fc1", "field": "outputs.0", "dtype": "float32"}
    np.testing.assert_array_equal(xa["step"], f.steps)
    np.testing.assert_array_equal(xa["call"], f.calls)
    np.testing.assert_array_equal(xa["rank"], -1)
    assert _bits(xa.values) == _bits(f.read())
    at3 = xa.sel(step=3)  # the records of step 3 (both calls)
    assert _bits(at3.values) == _bits(f.at_step(3))
    np.testing.assert_allclose(at3.mean("dim_0").values, f.at_step(3).mean(axis=1), rtol=1e-6)
    named = f.to_xarray(dims=("batch", "feature"))
    assert named.dims == ("record", "batch", "feature")
    with pytest.raises(InvalidArgumentError, match="one distinct name per axis"):
        f.to_xarray(dims=("batch",))
    bf = run_a[HID]["outputs.2"].to_xarray()
    assert bf.attrs["dtype"] == "bfloat16" and bf.dtype == np.float32
    g = run_a[GID]["grad_out.0"].to_xarray()  # even records only
    assert g["step"].values.tolist() == [0, 1, 2, 3, 4, 5] and g["call"].values.tolist() == [0] * 6


def test_handle_to_xarray(run_a):
    ds = run_a[HID].to_xarray()
    assert list(ds.data_vars) == ["outputs.0", "outputs.2"] and ds.attrs["skipped"] == ["outputs.1"]
    assert ds["outputs.0"].dims == ("record", "outputs.0.dim_0", "outputs.0.dim_1")
    assert ds.attrs["handle"] == HID and ds["outputs.2"].attrs["dtype"] == "bfloat16"
    np.testing.assert_array_equal(ds["step"], run_a[HID].steps)
    assert _bits(ds["outputs.2"].sel(step=5).values) == _bits(run_a[HID]["outputs.2"].at_step(5))
    stats = run_a[SID].to_xarray()
    assert stats["outputs.0.hist"].shape == (12, 4) and stats["outputs.0.norm"].dims == ("record",)
    with pytest.raises(InvalidArgumentError, match="ragged"):
        run_a[HID].to_xarray(fields=["outputs.1"])


def test_ragged_and_partial_fields_are_refused_clearly(run_a, tmp_path):
    ragged = run_a[HID]["outputs.1"]
    for call in (ragged.to_dask, ragged.to_xarray):
        with pytest.raises(InvalidArgumentError, match=r"'outputs.1' .* is ragged.*field.read\(\)"):
            call()
    grads = tmp_path / "g"
    w = write_run(grads, n=4, close=False)
    w.write(GID, 9, 0, {"grad_out.0": np.zeros((4, 8), np.float32), "grad_in.0": np.ones(3, np.float32)})
    w.close()
    with open_run(grads) as run:
        with pytest.raises(InvalidArgumentError, match=r"1 entries for the handle's 5 records.*handle\['grad_in.0'\]"):
            run[GID].to_xarray(fields="grad_in.0")
        assert run[GID].to_xarray().attrs["skipped"] == ["grad_out.0", "grad_in.0"]


def test_ranks_are_a_coordinate(tmp_path):
    for r in (0, 1):
        write_run(tmp_path / "ddp", n=4, seed=r, rank=r, world_size=2)
    with open_run(tmp_path / "ddp") as run:
        f = run[HID]["outputs.0"]
        xa = f.to_xarray()
        assert xa["rank"].values.tolist() == [0] * 4 + [1] * 4
        assert _bits(xa.sel(rank=1).values) == _bits(run.handle(HID, rank=1)["outputs.0"].read())
        assert xa.sel(step=1, rank=0).shape == (2, 4, 8)
