"""What a new user hit in the CLI in the first hour: ``sync`` without ``--run-id``, ``verify
runs:/ID``, ``export`` without FIELD, the files ``export`` writes, a very wide csv, and sizes that
read the same in the Recorder's summary, ``show`` and ``runs``."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

from hookline.cli.main import cli
from hookline.storage import open_run

from test_commands import fails, ok  # (tests/cli is on sys.path: pytest's rootdir-less "prepend" import mode)


@pytest.fixture
def mlflow_recorded(sqlite_tracking_uri, tmp_path, recorder_run) -> tuple[Path, str, str]:
    """A run recorded into an MLflow run: ``(run_dir, run_id, tracking_uri)``."""
    from mlflow import MlflowClient

    rid = MlflowClient(sqlite_tracking_uri).create_run("0").info.run_id
    run_dir = recorder_run(tmp_path / "recorded", mlflow_run_id=rid, tracking_uri=sqlite_tracking_uri)
    return run_dir, rid, sqlite_tracking_uri


# ----------------------------------------------------------------------------------------- sync
def test_sync_takes_the_run_id_from_the_manifest(cli_runner, mlflow_recorded):
    run_dir, rid, uri = mlflow_recorded
    d = json.loads(ok(cli_runner, "sync", run_dir, "--tracking-uri", uri, "--json").stdout)
    assert d["ok"] and d["run_id"] == rid
    assert not d["uploaded"] and len(d["skipped"]) == 5  # (4 handle files + the manifest, uploaded at close)
    assert rid in ok(cli_runner, "sync", run_dir, "--tracking-uri", uri).stdout


def test_sync_of_a_run_recorded_without_mlflow_names_run_id(cli_runner, runs, sqlite_tracking_uri):
    res = fails(cli_runner, "sync", runs["a"], "--tracking-uri", sqlite_tracking_uri, quoted=repr(str(runs["a"])))
    assert "--run-id" in res.stderr and "without an MLflow run" in res.stderr


# --------------------------------------------------------------------------------------- verify
def test_verify_an_mlflow_run(cli_runner, mlflow_recorded):
    run_dir, rid, uri = mlflow_recorded
    res = ok(cli_runner, "verify", f"runs:/{rid}", "--tracking-uri", uri)
    assert res.stdout.startswith(f"runs:/{rid}: OK (4 handles, 16 records)"), res.stdout
    d = json.loads(ok(cli_runner, "verify", rid, "--tracking-uri", uri, "--json").stdout)
    assert d["ok"] and {h["handle_id"] for h in d["handles"]} == set(open_run(run_dir).handles)
    fails(cli_runner, "verify", f"runs:/{rid}", "--tracking-uri", uri, "--repair", quoted=rid)

    # a file MLflow lost: the handle's records are missing, and the advice is to upload again
    art = next(Path(uri.removeprefix("sqlite:///")).parent.joinpath("mlartifacts").rglob("outputs/fc1.h5"))
    art.unlink()
    res = fails(cli_runner, "verify", f"runs:/{rid}", "--tracking-uri", uri, quoted=rid)
    assert "hookline sync" in res.stderr and "--repair`" not in res.stderr
    assert re.search(r"outputs\[fc1\]: 0 records.*PROBLEMS", res.stdout), res.stdout


# --------------------------------------------------------------------------------------- export
def test_export_without_field_when_the_handle_has_one(cli_runner, runs, tmp_path):
    res = ok(cli_runner, "export", runs["a"], "outputs[fc1]", "--format", "npy", "--out", tmp_path / "o.npy")
    f = open_run(runs["a"])["outputs[fc1]"]["outputs.0"]
    np.testing.assert_array_equal(np.load(tmp_path / "o.npy"), f.read())
    assert "outputs.0" in res.stdout
    # two fields: the error names both and how to pick one
    res = fails(cli_runner, "export", runs["a"], "grads[head]", "--format", "npy", "--out", tmp_path / "g.npy",
                quoted="'grads[head]'")
    assert "grad_in.0" in res.stderr and "grad_out.0" in res.stderr
    assert not (tmp_path / "g.npy").exists()


def test_export_names_every_file_it_writes(cli_runner, runs, tmp_path):
    out = tmp_path / "g.npy"
    res = ok(cli_runner, "export", runs["a"], "grads[fc1]", "grad_out.0", "--format", "npy", "--out", out)
    side = Path(f"{out}.steps.csv")
    written = {p for p in tmp_path.iterdir()}
    assert written == {out, side}
    for p in written:
        assert str(p) in res.stdout, res.stdout
    # the side file is the user's too: not overwritten without --force
    out.unlink()
    fails(cli_runner, "export", runs["a"], "grads[fc1]", "grad_out.0", "--format", "npy", "--out", out,
          quoted=str(side))


def test_export_warns_on_a_csv_too_wide_for_spreadsheets(cli_runner, tmp_path):
    import torch

    from hookline.tracker import HookManager, Recorder, select

    model = torch.nn.Sequential(OrderedDict(wide=torch.nn.Linear(2, 16_400), narrow=torch.nn.Linear(16_400, 3)))
    with Recorder(tmp_path / "run") as rec:
        HookManager().register_forward_hook(rec.outputs, **select(model, "*", types=torch.nn.Linear))
        with rec.step(0), torch.no_grad():
            model(torch.ones(1, 2))
    res = ok(cli_runner, "export", tmp_path / "run", "outputs[wide]", "--format", "csv", "--out", tmp_path / "w.csv")
    assert "16,402 columns" in res.stderr and "--format npy" in res.stderr, res.stderr
    with open(tmp_path / "w.csv") as fh:
        assert len(fh.readline().split(",")) == 16_402
    res = ok(cli_runner, "export", tmp_path / "run", "outputs[narrow]", "--format", "csv", "--out", tmp_path / "n.csv")
    assert "warning" not in res.stderr


# ---------------------------------------------------------------------------------------- sizes
def test_sizes_read_the_same_in_the_summary_show_and_runs(cli_runner, sqlite_tracking_uri, tmp_path):
    """One convention: binary units, named as such (the summary printed powers of 1000 as "MB",
    show and runs powers of 1024 as "MB")."""
    import torch
    from mlflow import MlflowClient

    from hookline.storage.words import human_bytes
    from hookline.tracker import HookManager, Recorder, select

    rid = MlflowClient(sqlite_tracking_uri).create_run("0").info.run_id
    model = torch.nn.Sequential(OrderedDict(fc=torch.nn.Linear(4, 3000)))
    with Recorder(tmp_path / "run", mlflow_run_id=rid) as rec:
        HookManager().register_forward_hook(rec.outputs, **select(model, "fc"))
        for step in range(4):
            with rec.step(step), torch.no_grad():
                model(torch.ones(25, 4))
    summary = str(rec.close())
    assert rec.close().bytes == 4 * 25 * 3000 * 4
    assert f"{human_bytes(4 * 25 * 3000 * 4)}" == "1.1 MiB" and "1.1 MiB" in summary, summary

    file_bytes = sum(p.stat().st_size for p in (tmp_path / "run").rglob("*.h5"))
    shown = ok(cli_runner, "show", tmp_path / "run").stdout
    listed = ok(cli_runner, "runs").stdout
    assert human_bytes(file_bytes) in shown and human_bytes(file_bytes) in listed, (shown, listed)
    for text in (summary, shown, listed):
        assert not re.search(r"\d (KB|MB|GB)\b", text), text
    assert human_bytes(1023) == "1023 B" and human_bytes(1024) == "1.0 KiB" and human_bytes(3 << 30) == "3.0 GiB"
