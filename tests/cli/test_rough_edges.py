"""The rough edges a new user hit in the first hour (issue 21, points 5-9), one test each."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hookline.cli.main import cli

REPO = Path(__file__).resolve().parents[2]


def _invoke(runner, *args):
    return runner.invoke(cli, [str(a) for a in args])


def _one_error_line(res) -> str:
    assert "Traceback" not in res.stderr + res.stdout
    err = res.stderr.strip()
    assert err.startswith("Error:") and len(err.splitlines()) == 1, err
    return err


# ------------------------------------------------------------------ 5: one rule for written paths


def test_every_written_path_needs_its_folder(cli_runner, runs, tmp_path):
    """export --out created missing folders (even at the filesystem root) while compare --plot
    refused them: now every path hookline writes is refused the same way, with the fix."""
    missing = tmp_path / "no" / "such"
    cases = [
        ("export", runs["a"], "grads[fc1]", "grad_out.0", "--format", "npy", "--out", missing / "g.npy"),
        ("compare", runs["a"], runs["b"], "--plot", missing / "cmp.png"),
        ("demo", "--no-mlflow", "--steps", "4", "--out", missing / "demo"),
    ]
    for args in cases:
        res = _invoke(cli_runner, *args)
        err = _one_error_line(res)
        assert res.exit_code == 2, (args[0], res.exit_code, err)
        assert f"folder {str(missing)!r} does not exist" in err and f"mkdir -p {missing}" in err, err
        assert f"'cli {args[0]} --help'" in err, err
        assert not (tmp_path / "no").exists(), args[0]  # nothing created
    # a folder that exists works, and the demo still creates its default runs/demo
    res = _invoke(cli_runner, "export", runs["a"], "grads[fc1]", "grad_out.0", "--format", "npy",
                  "--out", tmp_path / "g.npy")
    assert res.exit_code == 0 and (tmp_path / "g.npy").is_file(), res.stderr


# ------------------------------------------------------------------ 6: nothing in common


def test_compare_with_no_handle_in_common_says_so_and_fails(cli_runner, runs):
    """(It exited 0 with a "missing" row and a note per handle, never saying nothing was compared.)"""
    for extra in ([], ["--json"]):
        res = _invoke(cli_runner, "compare", runs["a"], runs["twice_a"], *extra)
        err = _one_error_line(res)
        assert res.exit_code == 1, err
        assert "nothing compared: the runs have no handle in common" in err, err
        assert "A has 4 handles (" in err and "B has 1 handle (outputs[lin])" in err, err
        assert res.stdout == "", res.stdout  # no table of missing rows, no JSON
    # runs with something in common still compare, with exit 0
    assert _invoke(cli_runner, "compare", runs["a"], runs["b"]).exit_code == 0


# ------------------------------------------------------------------ 7: the demo's run time


def test_demo_run_time_is_described_one_way(cli_runner):
    """(--help said "a few seconds", the quickstart 10-30 s, --no-mlflow "a few seconds".)"""
    from hookline.cli.demo import RUN_TIME, RUN_TIME_NO_MLFLOW

    help_text = " ".join(_invoke(cli_runner, "demo", "--help").stdout.split())
    quick = " ".join((REPO / "docs" / "quickstart.md").read_text().split())
    cli_md = " ".join((REPO / "docs" / "cli.md").read_text().split())
    for text in (help_text, quick, cli_md):
        assert f"Takes {RUN_TIME}" in text or f"takes {RUN_TIME}" in text, text[:200]
        assert f"{RUN_TIME_NO_MLFLOW} with --no-mlflow" in text or f"{RUN_TIME_NO_MLFLOW} with `--no-mlflow`" in text
        assert "a few seconds" not in text and "10-30" not in text
    assert f"takes {RUN_TIME_NO_MLFLOW}" in help_text  # the --no-mlflow option's own help


# ------------------------------------------------------------------ 8: the demo's server-down warning


def test_demo_server_down_warning_promises_nothing_impossible(tmp_path, cli_runner, monkeypatch):
    """(It said `hookline sync` would upload later, but no MLflow run existed to sync into.)"""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    res = _invoke(cli_runner, "demo", "--tracking-uri", "http://127.0.0.1:9", "--steps", "4", "--every", "2",
                  "--out", tmp_path, "-q")
    assert res.exit_code == 0, res.stderr
    warning = " ".join(res.stderr.split())
    assert "warning: MLflow unavailable" in warning and "no MLflow run is created" in warning, warning
    assert "uploads them later" not in warning, warning
    assert "run the demo again" in warning and "`hookline sync RUN_DIR --run-id ID`" in warning, warning
    assert "run id" not in res.stdout  # no MLflow section


# ------------------------------------------------------------------ 9: smaller ones


def test_unknown_run_hint_works_on_mlflow_3(cli_runner, runs, sqlite_tracking_uri):
    """(`mlflow runs list` without --experiment-id fails on MLflow 3.)"""
    res = _invoke(cli_runner, "sync", runs["a"], "--run-id", "0" * 32, "--tracking-uri", sqlite_tracking_uri)
    err = _one_error_line(res)
    assert "`mlflow runs list --experiment-id <id>`" in err, err


def test_usage_errors_of_a_command_point_to_its_help(cli_runner, runs):
    """(`compare a b --plot` pointed to `hookline --help`.)"""
    res = _invoke(cli_runner, "compare", runs["a"], runs["b"], "--plot")
    err = _one_error_line(res)
    assert res.exit_code == 2 and err.endswith("(see 'cli compare --help')"), err
    err = _one_error_line(_invoke(cli_runner, "export", runs["a"], "--format"))
    assert err.endswith("(see 'cli export --help')"), err


def test_counts_are_plural_only_when_not_one(cli_runner, runs, tmp_path):
    """(`verify` printed "1 fields".)"""
    from hookline.storage.words import plural

    assert [plural(n, "field") for n in (0, 1, 2)] == ["0 fields", "1 field", "2 fields"]
    assert plural(1, "loss") == "1 loss" and plural(3, "loss") == "3 losses"
    out = _invoke(cli_runner, "verify", runs["a"]).stdout
    assert "outputs[fc1]: 4 records, 1 field\n" in out, out
    assert not re.search(r"\b1 (fields|records|handles|files)\b", out), out
    res = _invoke(cli_runner, "export", runs["offset"], "grads[fc1]", "grad_out.0", "--format", "npy",
                  "--steps", "4", "--out", tmp_path / "one.npy")
    assert "exported 1 record of grads[fc1]" in res.stdout, (res.stdout, res.stderr)


def test_repair_that_moved_files_names_them_and_exits_3(cli_runner, recorder_run, tmp_path):
    run = recorder_run(tmp_path / "run")
    victim = run / "grads" / "fc1.h5"
    victim.write_bytes(victim.read_bytes()[:4000])
    res = _invoke(cli_runner, "verify", run, "--repair")
    assert res.exit_code == 3, (res.stdout, res.stderr)
    err = _one_error_line(res)
    assert "1 file moved to .quarantine/ (grads/fc1.h5)" in err, err
    assert "REPAIRED, DAMAGE FOUND (1 file moved to .quarantine/ (grads/fc1.h5)" in res.stdout, res.stdout
    summary = res.stdout.splitlines()[0] + err
    assert "file(s)" not in summary and "loss(es)" not in summary and "1 loss recorded" in summary, summary
    assert (run / ".quarantine" / "grads" / "fc1.h5").is_file()
    assert _invoke(cli_runner, "verify", run).exit_code == 0


def test_run_names_do_not_break_at_80_columns(cli_runner, recorder_run, tmp_path, sqlite_tracking_uri, monkeypatch):
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_tracking_uri)
    exp = client.create_experiment("rough-edges")
    names = ["demo-A-lr0.01", "demo-B-lr0.1-with-a-longer-name"]
    for k, name in enumerate(names):
        rid = client.create_run(exp, run_name=name).info.run_id
        recorder_run(tmp_path / f"r{k}", steps=4, mlflow_run_id=rid, tracking_uri=sqlite_tracking_uri)
    for columns in ("80", "160"):
        monkeypatch.setenv("COLUMNS", columns)
        res = _invoke(cli_runner, "runs", "--experiment", "rough-edges", "--tracking-uri", sqlite_tracking_uri)
        assert res.exit_code == 0, res.stderr
        lines = res.stdout.splitlines()
        assert all(len(line.rstrip()) <= int(columns) for line in lines), res.stdout
        for name in names:  # each name whole on one line
            assert any(name in line for line in lines), (name, res.stdout)
        assert re.search(r"\d+\.\d KiB", res.stdout), res.stdout  # the size column whole too


def test_example_trajectory_plot_labels_its_y_axis(runs):
    sys.path.insert(0, str(REPO / "docs" / "examples"))
    try:
        import grad_norm_trajectories as g
    finally:
        sys.path.remove(str(REPO / "docs" / "examples"))
    fig = g.figure(g.trajectories([str(runs["a"]), str(runs["b"])]), "grad_out.0")
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert shown and all(ax.get_ylabel() == "L2 norm of grad_out.0 (log scale)" for ax in shown)


@pytest.mark.slow
def test_demo_output_has_no_mlflow_view_run_lines(cli_runner, tmp_path, mlflow_server):
    """(MLflow printed "🏃 View run ... at: URL" lines into the middle of the demo's output.)"""
    res = _invoke(cli_runner, "demo", "--tracking-uri", mlflow_server, "--steps", "4", "--every", "2",
                  "--out", tmp_path, "-q")
    assert res.exit_code == 0, res.stderr
    assert "View run" not in res.stdout + res.stderr and "View experiment" not in res.stdout
    links = re.findall(rf"run [AB]: run id (\w+)  {re.escape(mlflow_server)}/#/experiments/\d+/runs/(\w+)", res.stdout)
    assert len(links) == 2 and all(a == b for a, b in links), res.stdout
