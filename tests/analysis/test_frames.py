"""Tables of the record index (SPEC §12): Field/Handle/Run.frame() and hookline.storage.frame()
checked against the reader's own steps, calls, ranks and norms."""

from __future__ import annotations

import shutil
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest

from _analysis_runs import GID, HID, SID, STATS, write_run
from hookline.storage import (FormatError, InvalidArgumentError, MissingDependencyError, UnknownNameError, frame,
                              open_run)
from hookline.storage._h5read import PartField


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("frames")
    write_run(root / "a", n=12, seed=0)
    write_run(root / "b", n=8, seed=1)
    for r in (0, 1):  # one run of two ranks in one directory
        write_run(root / "ddp", n=6, seed=10 + r, rank=r, world_size=2)
    return root


def _expected_field(f) -> dict[str, np.ndarray]:
    norms = f.norms() if f.dtype.kind in "fc" else np.full(len(f), np.nan)
    return {"step": f.steps, "call": f.calls, "rank": f.handle.ranks[f.records], "norm": norms}


def _check(df: pd.DataFrame, expected: dict[str, np.ndarray]) -> None:
    for col, values in expected.items():
        np.testing.assert_array_equal(df[col].to_numpy(), values, err_msg=col)


def test_field_frame_is_the_index(runs):
    with open_run(runs / "a") as run:
        f = run[HID]["outputs.0"]
        df = f.frame()
        assert list(df.columns) == ["step", "call", "rank", "norm"]
        assert [str(t) for t in df.dtypes] == ["int64", "int64", "int64", "float64"]
        assert len(df) == 12 and df["rank"].eq(-1).all()
        _check(df, _expected_field(f))
        np.testing.assert_allclose(df["norm"], np.linalg.norm(f.read().reshape(12, -1), axis=1), rtol=1e-6)
        g = run[GID]["grad_out.0"]  # a field on every other record only
        _check(g.frame(), _expected_field(g))
        assert g.frame()["step"].tolist() == [0, 1, 2, 3, 4, 5]
        ints = run[HID]["outputs.1"].frame()  # no stored norm for int fields: NaN, never data read
        assert ints["norm"].isna().all() and len(ints) == 12


def test_frames_read_no_tensor_data(runs, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a frame read tensor data")

    monkeypatch.setattr(PartField, "read_block", refuse)
    monkeypatch.setattr(PartField, "read_stored", refuse)
    with open_run(runs / "a") as run:
        df = run.frame(handles=[HID, GID])
        assert len(df) == 12 * 3 + 6
        with pytest.raises(AssertionError):
            run[HID]["outputs.0"].read()  # (the spy works)


def test_handle_frame_has_every_field(runs):
    with open_run(runs / "a") as run:
        h = run[HID]
        df = h.frame()
        assert list(df.columns) == ["field", "step", "call", "rank", "norm"]
        assert isinstance(df["field"].dtype, pd.CategoricalDtype)
        assert df["field"].unique().tolist() == h.fields
        for name in h.fields:
            _check(df[df["field"] == name], _expected_field(h[name]))
        only = h.frame(fields="outputs.2")
        assert only["field"].unique().tolist() == ["outputs.2"] and len(only) == 12
        _check(only, _expected_field(h["outputs.2"]))  # bfloat16: the stored norms
        with pytest.raises(UnknownNameError, match="'nope'.*outputs.0"):
            h.frame(fields=["outputs.0", "nope"])
        with pytest.raises(InvalidArgumentError, match="fields= must be"):
            h.frame(fields=3)


def test_stats_handle_frame_has_a_column_per_statistic(runs):
    with open_run(runs / "a") as run:
        h = run[SID]
        df = h.frame()
        assert list(df.columns) == ["field", "step", "call", "rank", *STATS]
        assert df["field"].unique().tolist() == ["outputs.0"]
        for s in STATS:
            np.testing.assert_array_equal(df[s].to_numpy(), h[f"outputs.0.{s}"].read())
        x = run[HID]["outputs.0"].read()  # the same values fc1 recorded in tensor mode
        np.testing.assert_allclose(df["mean"], x.reshape(12, -1).mean(axis=1), rtol=1e-6)
        np.testing.assert_allclose(df["absmax"], np.abs(x).reshape(12, -1).max(axis=1))


def test_run_frame_columns_and_filters(runs):
    with open_run(runs / "a") as run:
        df = run.frame()
        assert list(df.columns) == ["handle", "module", "field", "step", "call", "rank", "norm", *STATS[1:]]
        assert df["handle"].unique().tolist() == run.handles
        assert df.groupby("handle", observed=True)["module"].first().to_dict() == {HID: "fc1", GID: "fc1",
                                                                                    SID: "fc2"}
        for hid in run.handles:  # every handle's rows are its own frame
            own = run[hid].frame()
            part = df[df["handle"] == hid].reset_index(drop=True)
            pd.testing.assert_frame_equal(part[own.columns].astype({"field": str}), own.astype({"field": str}),
                                          check_dtype=False)
        assert df.loc[df["handle"] != SID, "mean"].isna().all()
        sel = run.frame(handles=[GID], fields=["grad_out.0"])
        assert len(sel) == 6 and set(sel["field"]) == {"grad_out.0"}
        outs = run.frame(fields="outputs.0")  # a field of two handles (fc2's summarised one)
        assert set(outs["handle"]) == {HID, SID} and len(outs) == 24
        with pytest.raises(UnknownNameError, match=r"no handle 'outputs\[nope\]'.*grads\[fc1\]"):
            run.frame(handles=["outputs[nope]"])
        with pytest.raises(UnknownNameError, match="no field 'grad_out.0'"):
            run.frame(handles=[HID], fields="grad_out.0")


def test_frame_over_runs(runs):
    b = open_run(runs / "b")
    df = frame([runs / "a", b], fields="outputs.0")
    assert df["run"].unique().tolist() == [str(runs / "a"), str(runs / "b")]
    assert list(df.columns[:4]) == ["run", "handle", "module", "field"]
    for label, path, n in [(str(runs / "a"), runs / "a", 12), (str(runs / "b"), runs / "b", 8)]:
        with open_run(path) as run:
            mine = df[(df["run"] == label) & (df["handle"] == HID)]
            assert len(mine) == n
            _check(mine, _expected_field(run[HID]["outputs.0"]))
    assert b[HID]["outputs.0"][0].shape == (4, 8)  # an opened run stays open (the caller's)
    b.close()
    named = frame({"base": runs / "a", "ft": str(runs / "b")}, handles=HID)
    assert named["run"].unique().tolist() == ["base", "ft"]
    assert named.groupby("run", observed=True).size().to_dict() == {"base": 36, "ft": 24}
    with pytest.raises(InvalidArgumentError, match="labelled"):
        frame([runs / "a", str(runs / "a")])
    with pytest.raises(InvalidArgumentError, match="got 3"):
        frame([runs / "a", 3])
    with pytest.raises(UnknownNameError, match="no field 'grad_in.9'"):
        frame([runs / "a", runs / "b"], fields=["grad_in.9"])


def test_rank_column_distinguishes_ranks(runs):
    with open_run(runs / "ddp") as run:
        df = run.frame(handles=HID, fields="outputs.0")
        assert df["rank"].tolist() == [0] * 6 + [1] * 6
        _check(df, _expected_field(run[HID]["outputs.0"]))
        assert frame(run, fields="outputs.0").groupby("rank")["norm"].size().to_dict() == {0: 12, 1: 12}


def test_a_live_run_frames_over_its_sealed_segments(tmp_path):
    w = write_run(tmp_path / "live", n=20, close=False, flush_every=4)  # writer open: one file per flush
    try:
        with open_run(tmp_path / "live") as run:
            df = run.frame()
            for hid in run.handles:
                h = run[hid]
                assert len(h[h.fields[0]].pieces) > 1
                for name in h.fields:
                    if hid != SID:
                        _check(df[(df["handle"] == hid) & (df["field"] == name)], _expected_field(h[name]))
            assert df.loc[df["handle"] == HID, "step"].tolist() == [i // 2 for i in range(20)] * 3
    finally:
        w.close()


def test_a_damaged_or_foreign_file_is_refused_by_the_table(tmp_path):
    write_run(tmp_path / "bad", n=12)
    with h5py.File(tmp_path / "bad/outputs/fc1.h5", "r+") as f:
        f["_index/outputs.0/record"][3] = 1  # record numbers must increase
    with open_run(tmp_path / "bad") as run:
        with pytest.raises(FormatError, match=r"fc1\.h5.*'outputs\.0'.*not increasing"):
            run.frame(handles=HID)
        assert len(run.frame(handles=GID)) == 6  # the other files still read
    write_run(tmp_path / "moved", n=12)
    shutil.copy(tmp_path / "moved/grads/fc1.h5", tmp_path / "moved/outputs/fc1.h5")  # another handle's file
    with open_run(tmp_path / "moved") as run, pytest.warns(UserWarning, match=r"holds handle 'grads\[fc1\]', not 'outputs\[fc1\]'"):
        df = run.frame()
    assert HID not in set(df["handle"]) and len(df[df["handle"] == GID]) == 6


def test_a_run_in_mlflow(runs, sqlite_tracking_uri, tmp_path):
    from mlflow import MlflowClient

    from hookline.storage import sync

    client = MlflowClient(tracking_uri=sqlite_tracking_uri)
    rid = client.create_run(client.create_experiment("frames")).info.run_id
    assert sync(runs / "a", rid, tracking_uri=sqlite_tracking_uri).ok
    cache = tmp_path / "cache"
    df = frame({"mlflow": f"runs:/{rid}", "local": runs / "a"}, handles=GID, tracking_uri=sqlite_tracking_uri,
               cache_dir=cache)
    a, b = (df[df["run"] == k].drop(columns="run").reset_index(drop=True) for k in ("mlflow", "local"))
    pd.testing.assert_frame_equal(a, b)
    # only the file of the handle asked for was downloaded
    assert sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*.h5")) == [f"{rid}/hookline/grads/fc1.h5"]
    # the lazy arrays of an MLflow run read its downloaded copy
    with open_run(f"runs:/{rid}", tracking_uri=sqlite_tracking_uri, cache_dir=cache) as remote, \
            open_run(runs / "a") as local:
        x = remote[HID]["outputs.2"].to_dask()
        assert np.array_equal(x.compute(), local[HID]["outputs.2"].read())
    assert len(list(cache.rglob("*.h5"))) == 2


@pytest.mark.parametrize("hidden, call", [
    ("pandas", "run['outputs[fc1]']['outputs.0'].frame()"),
    ("dask", "run['outputs[fc1]']['outputs.0'].to_dask()"),
    ("xarray", "run['outputs[fc1]'].to_xarray()"),
])
def test_missing_extra_is_one_clear_line(runs, hidden, call):
    code = (f"import sys; sys.modules[{hidden!r}] = None\n"
            "from hookline.storage import open_run, MissingDependencyError\n"
            f"run = open_run({str(runs / 'a')!r})\n"
            f"try:\n    {call}\nexcept MissingDependencyError as e:\n    print(repr(str(e)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    msg = out.stdout.strip()
    assert "\\n" not in msg and f"needs {hidden}" in msg and 'pip install "hookline[analysis]"' in msg
    assert issubclass(MissingDependencyError, ImportError)
