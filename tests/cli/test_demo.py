"""`hookline demo` end to end, in a subprocess, exactly as the README runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HOOKLINE = Path(sys.executable).with_name("hookline")


def _run_demo(cwd: Path, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)  # as on a fresh machine: MLflow's default store
    env["MPLBACKEND"] = "Agg"
    return subprocess.run([str(HOOKLINE), "demo", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_demo_end_to_end(tmp_path):
    out = _run_demo(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    assert "Traceback" not in out.stderr
    # where the data is
    dirs = sorted(p for p in (tmp_path / "runs" / "demo").iterdir() if p.is_dir())
    assert len(dirs) == 1
    session = dirs[0]
    assert (session / "lr0.01" / "manifest.json").is_file() and (session / "lr0.1" / "manifest.json").is_file()
    assert str(Path("runs") / "demo" / session.name / "lr0.01") in text
    # the comparison table and the plot
    assert "grads[fc1]" in text and "grads[head]" in text and "cosine" in text
    png = session / "compare.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert str(png.relative_to(tmp_path)) in text
    # MLflow's default store in the working directory, and the printed search filter finds both runs
    assert (tmp_path / "mlflow.db").is_file()
    m = re.search(r"(tags\.\S+ = '[^']+')", text)
    assert m, text
    filt = m.group(1)
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("hookline-demo")
    found = client.search_runs([exp.experiment_id], filter_string=filt)
    assert len(found) == 2
    for r in found:
        assert r.data.tags.get("hookline.version")
        assert int(r.data.tags["hookline.handles"]) == 6
        assert r.data.params["lr"] in ("0.01", "0.1")
        assert r.info.status == "FINISHED"
        arts = {a.path for a in client.list_artifacts(r.info.run_id, "hookline")}
        assert "hookline/manifest.json" in arts
    # re-running works: new directories and runs, nothing overwritten
    again = _run_demo(tmp_path, "--steps", "20", "--quiet")
    assert again.returncode == 0, again.stdout + again.stderr
    dirs2 = sorted(p for p in (tmp_path / "runs" / "demo").iterdir() if p.is_dir())
    assert len(dirs2) == 2 and png.read_bytes() == data
    assert len(client.search_runs([exp.experiment_id])) == 4


def test_demo_without_mlflow(tmp_path, cli_runner):
    from hookline.cli.main import cli

    res = cli_runner.invoke(cli, ["demo", "--no-mlflow", "--steps", "12", "--every", "4", "--out", str(tmp_path / "d")],
                            catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    assert "MLflow" not in res.stdout.split("Gradient comparison")[0].split("Data")[1]
    assert not (tmp_path / "mlflow.db").exists()
    (session,) = (tmp_path / "d").iterdir()
    assert (session / "compare.png").stat().st_size > 5000


def test_demo_with_unreachable_mlflow_degrades(tmp_path, cli_runner, monkeypatch):
    from hookline.cli.main import cli

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    res = cli_runner.invoke(cli, ["demo", "--tracking-uri", "http://127.0.0.1:9", "--steps", "6", "--every", "3",
                                  "--out", str(tmp_path / "d"), "-q"], catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    assert "warning: MLflow unavailable" in res.stderr and "recording locally only" in res.stderr
    assert "Gradient comparison" in res.stdout
