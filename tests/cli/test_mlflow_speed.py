"""MLflow-facing commands do only what they need: no store is created by looking for one, and
``show runs:/ID`` downloads the manifest(s) only (a handle file only when a command reads it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import InvalidArgumentError, mlflow_source, sync


def _run(runner: CliRunner, *args: object):
    return runner.invoke(cli, [str(a) for a in args])


@pytest.fixture
def empty_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory without an MLflow store, and no tracking URI set anywhere."""
    import mlflow

    folder = tmp_path / "elsewhere"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(None)
    return folder


def test_runs_from_a_folder_without_a_store_creates_nothing(empty_folder, cli_runner, recorder_run, tmp_path):
    """`hookline runs` (and show/sync) with MLflow's implicit default store refuse a store that
    does not exist, with the fix in the message, instead of creating an empty mlflow.db."""
    run_id = "0123456789abcdef0123456789abcdef"
    local = recorder_run(tmp_path / "run")
    for args in (["runs"], ["runs", "--json"], ["show", f"runs:/{run_id}"], ["sync", local, "--run-id", run_id]):
        res = _run(cli_runner, *args)
        assert res.exit_code == 1, (args, res.output)
        msg = res.stderr
        assert "no MLflow store here" in msg and repr(str(empty_folder / "mlflow.db")) in msg, msg
        assert "--tracking-uri" in msg and "MLFLOW_TRACKING_URI" in msg
        assert list(empty_folder.iterdir()) == [], f"{args} created {list(empty_folder.iterdir())}"
    with pytest.raises(InvalidArgumentError, match="no MLflow store here"):
        sync(local, run_id)
    with pytest.raises(InvalidArgumentError, match="no MLflow store here"):
        mlflow_source(f"runs:/{run_id}")
    assert list(empty_folder.iterdir()) == []
    # an explicit sqlite URI or directory store that does not exist is refused the same way
    for uri in ("sqlite:///nowhere.db", str(empty_folder / "mlruns"), (empty_folder / "mlruns").as_uri()):
        res = _run(cli_runner, "runs", "--tracking-uri", uri)
        assert res.exit_code == 1 and "no MLflow store at tracking URI" in res.stderr, (uri, res.output)
    assert list(empty_folder.iterdir()) == []


def test_runs_still_reads_an_existing_default_store(sqlite_tracking_uri, cli_runner, monkeypatch):
    """The working directory's mlflow.db is used when it exists (MLflow's default)."""
    import mlflow

    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(None)
    assert Path("mlflow.db").is_file()  # (the fixture's store, in the working directory)
    res = _run(cli_runner, "runs", "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["runs"] == []


def _cached(cache: Path, run_id: str) -> list[str]:
    root = cache / run_id
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_show_of_an_mlflow_run_downloads_the_manifest_only(mlflow_server, cli_runner, recorder_run, tmp_path,
                                                           monkeypatch):
    """Listing a remote run's handles fetches its manifest(s); a handle file is downloaded only
    when a command reads it (show HANDLE), and nothing else."""
    from mlflow import MlflowClient

    cache = tmp_path / "cache"
    monkeypatch.setenv("HOOKLINE_CACHE_DIR", str(cache))
    client = MlflowClient(mlflow_server)
    rid = client.create_run(client.create_experiment(f"show-{tmp_path.name}")).info.run_id
    local = recorder_run(tmp_path / "run", mlflow_run_id=rid, tracking_uri=mlflow_server)

    res = _run(cli_runner, "show", f"runs:/{rid}", "--tracking-uri", mlflow_server, "--json")
    assert res.exit_code == 0, res.output
    assert _cached(cache, rid) == ["hookline/manifest.json"]
    assert "Downloading artifacts" not in res.stderr  # (no MLflow progress bars in the output)
    remote = json.loads(res.stdout)
    here = json.loads(_run(cli_runner, "show", local, "--json").stdout)
    assert [h["handle"] for h in remote["handles"]] == [h["handle"] for h in here["handles"]]
    for r, h in zip(remote["handles"], here["handles"]):
        assert (r["records"], r["steps"], r["bytes"], r["module_type"]) == (h["records"], h["steps"], h["bytes"],
                                                                             h["module_type"])
        assert [(f["name"], f["dtype"], f["shape"]) for f in r["fields"]] == \
            [(f["name"], f["dtype"], f["shape"]) for f in h["fields"]]
        assert r["n_steps"] is None and all(f["records"] is None for f in r["fields"])  # (in the files only)
    table = _run(cli_runner, "show", f"runs:/{rid}", "--tracking-uri", mlflow_server)
    assert table.exit_code == 0 and "grads[fc1]" in table.stdout
    assert _cached(cache, rid) == ["hookline/manifest.json"]

    res = _run(cli_runner, "show", f"runs:/{rid}", "grads[fc1]", "--tracking-uri", mlflow_server, "--json")
    assert res.exit_code == 0, res.output
    assert _cached(cache, rid) == ["hookline/grads/fc1.h5", "hookline/manifest.json"]
    assert json.loads(res.stdout)["fields"][0]["norm_max"] is not None
    src = mlflow_source(f"runs:/{rid}", tracking_uri=mlflow_server, cache_dir=cache)
    src.manifests()
    assert src.downloads == ["hookline/manifest.json"]  # the cached handle file is not fetched again either
