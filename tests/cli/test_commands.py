"""Every hookline command through click's CliRunner, including the error paths."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from hookline.cli.main import cli
from hookline.storage import open_run



def ok(runner, *args):
    res = runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert res.exit_code == 0, (res.stdout, res.stderr)
    return res


def fails(runner, *args, quoted: str | None = None, code: int | None = None):
    res = runner.invoke(cli, [str(a) for a in args])
    assert res.exit_code != 0, res.stdout
    if code is not None:
        assert res.exit_code == code, (res.exit_code, res.stderr)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    err = res.stderr.strip()
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    assert err.startswith("Error:"), err
    assert len(err.splitlines()) == 1, err  # usage errors too (SPEC §6: one line on stderr)
    if res.exit_code == 2:
        assert re.search(r"\(see '\w+( \w+)? --help'\)$", err), err  # (the runner's prog name is 'cli')
    if quoted is not None:
        assert quoted in err, err
    return res


# ----------------------------------------------------------------------------- show
def test_show_run_table_and_json(cli_runner, runs):
    res = ok(cli_runner, "show", runs["a"])
    for h in ("outputs[fc1]", "grads[head]", "grad_out.0", "float32"):
        assert h in res.stdout
    d = json.loads(ok(cli_runner, "show", runs["a"], "--json").stdout)
    assert d["run"] == str(runs["a"]) and d["status"] == "closed" and "torch_version" in d["meta"]
    by_id = {h["handle"]: h for h in d["handles"]}
    h = by_id["outputs[fc1]"]
    assert h["records"] == 4 and h["steps"] == [0, 9] and h["n_steps"] == 4
    assert h["module_name"] == "fc1" and h["module_type"].endswith("Linear") and h["category"] == "forward_hook"
    assert h["bytes"] and h["bytes"] > 0
    (f,) = h["fields"]
    assert f == {"name": "outputs.0", "dtype": "float32", "shape": [6, 16], "ragged": False, "records": 4}


def test_show_bytes_are_bytes_on_disk(cli_runner, runs):
    """(They were the manifest's field bytes: 6.2 KB shown for a 103 KB file.)"""
    d = json.loads(ok(cli_runner, "show", runs["a"], "--json").stdout)
    run = open_run(runs["a"])
    for h in d["handles"]:
        assert h["bytes"] == (runs["a"] / f"{run[h['handle']].key}.h5").stat().st_size


def test_show_counts_a_damaged_file_on_disk(cli_runner, runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    damaged = run / f"{open_run(run)['grads[fc1]'].key}.h5"
    damaged.write_bytes(damaged.read_bytes()[:5000])
    res = cli_runner.invoke(cli, ["show", str(run), "--json"])
    by_id = {h["handle"]: h for h in json.loads(res.stdout)["handles"]}
    assert by_id["grads[fc1]"]["bytes"] == 5000 and by_id["grads[fc1]"]["records"] == 0


def test_show_ragged_field(cli_runner, runs):
    assert "ragged" in ok(cli_runner, "show", runs["ragged_a"]).stdout
    d = json.loads(ok(cli_runner, "show", runs["ragged_a"], "--json").stdout)
    f = d["handles"][0]["fields"][0]
    assert f["shape"] is None and f["ragged"] is True


def test_show_handle_statistics(cli_runner, runs):
    res = ok(cli_runner, "show", runs["a"], "grads[fc1]")
    assert "grad_out.0" in res.stdout and "norm" in res.stdout
    d = json.loads(ok(cli_runner, "show", runs["a"], "grads[fc1]", "--json").stdout)
    assert d["handle"] == "grads[fc1]"
    (f,) = [f for f in d["fields"] if f["name"] == "grad_out.0"]
    data = open_run(runs["a"])["grads[fc1]"]["grad_out.0"].read().astype(np.float64)
    assert f["min"] == pytest.approx(data.min()) and f["max"] == pytest.approx(data.max())
    assert f["mean"] == pytest.approx(data.mean())
    norms = np.linalg.norm(data.reshape(len(data), -1), axis=1)
    assert f["norm_mean"] == pytest.approx(norms.mean()) and f["norm_last"] == pytest.approx(norms[-1])
    for key in ("norm_min", "norm_max", "nonfinite", "dtype", "shape", "records"):
        assert key in f


def test_show_errors(cli_runner, runs, tmp_path):
    fails(cli_runner, "show", tmp_path / "nope", quoted=repr(str(tmp_path / "nope")))
    fails(cli_runner, "show", runs["a"], "grads[nope]", quoted="grads[nope]")
    fails(cli_runner, "show", "not-a-run-id-and-no-dir", quoted="'not-a-run-id-and-no-dir'")
    empty = tmp_path / "empty"
    empty.mkdir()
    fails(cli_runner, "show", empty)  # not a hookline run directory


def _corrupt_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    victim = sorted(dst.rglob("*.h5"))[0]
    victim.write_bytes(b"this is not an HDF5 file" * 100)
    return victim


def test_corrupt_files_give_one_line_errors(cli_runner, runs, tmp_path):
    run = tmp_path / "corrupt"
    victim = _corrupt_copy(runs["a"], run)
    bad = next(h for h in open_run(run).handles if _fails_to_read(open_run(run), h))
    field = "outputs.0" if bad.startswith("outputs") else "grad_out.0"
    # show RUN: lists the damage as a warning; show RUN HANDLE / export: one-line errors
    res = ok(cli_runner, "show", run)
    assert "warning:" in res.stderr and bad in res.stderr and "hookline verify" in res.stderr
    assert json.loads(ok(cli_runner, "show", run, "--json").stdout)["handles"]
    fails(cli_runner, "show", run, bad, quoted=repr(bad))
    fails(cli_runner, "export", run, bad, field, "--format", "npy", "--out", tmp_path / "x.npy", quoted=repr(field))
    # compare: the damaged handle is reported, the others are compared
    d = json.loads(ok(cli_runner, "compare", run, runs["a"], "--json").stdout)
    st = {r["handle"]: r["status"] for r in d["results"]}
    assert st.pop(bad) == "unreadable" and set(st.values()) == {"ok"}
    assert "unreadable" in ok(cli_runner, "compare", run, runs["a"]).stdout
    # an unreadable manifest
    run2 = tmp_path / "badmanifest"
    shutil.copytree(runs["a"], run2)
    (run2 / "manifest.json").write_text("{ not json")
    fails(cli_runner, "show", run2)
    assert victim.exists()


def _fails_to_read(run, handle) -> bool:
    try:
        h = run[handle]
        if not h.fields:
            return True
        for f in h.fields:
            h[f][0]
    except Exception:
        return True
    return False


# ----------------------------------------------------------------------------- compare
def test_compare_table_json_plot(cli_runner, runs, tmp_path):
    png = tmp_path / "cmp.png"
    res = ok(cli_runner, "compare", runs["a"], runs["b"], "--plot", png)
    assert "grads[fc1]" in res.stdout and "cosine" in res.stdout and str(png) in res.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    d = json.loads(ok(cli_runner, "compare", runs["a"], runs["b"], "--json").stdout)
    assert d["metrics"] == ["cosine", "rel_l2", "norm_ratio"]
    assert d["run_a"] == str(runs["a"]) and d["run_b"] == str(runs["b"])
    for r in d["results"]:
        for key in ("handle", "field", "status", "message", "common_steps", "only_a", "only_b", "mismatched",
                    "shape_a", "shape_b", "dtype_a", "dtype_b", "steps", "calls", "cosine", "rel_l2",
                    "norm_ratio", "summary"):
            assert key in r, key
        assert len(r["cosine"]) == len(r["steps"]) == r["common_steps"] == 4
        assert set(r["summary"]["cosine"]) == {"mean", "min", "max", "first", "last"}


def test_compare_identical_json(cli_runner, runs):
    d = json.loads(ok(cli_runner, "compare", runs["a"], runs["a_same"], "--json", "--metric", "cosine",
                      "--metric", "rel_l2").stdout)
    assert d["metrics"] == ["cosine", "rel_l2"]
    for r in d["results"]:
        assert r["status"] == "ok" and "norm_ratio" not in r
        assert all(abs(c - 1) < 1e-12 for c in r["cosine"]) and all(abs(x) < 1e-12 for x in r["rel_l2"])


def test_compare_filters(cli_runner, runs):
    d = json.loads(ok(cli_runner, "compare", runs["a"], runs["b"], "--handle", "grads[*]", "--field",
                      "grad_out.0", "--json").stdout)
    assert {(r["handle"], r["field"]) for r in d["results"]} == {("grads[fc1]", "grad_out.0"),
                                                                  ("grads[head]", "grad_out.0")}


def test_compare_reports_problems_without_failing(cli_runner, runs, tmp_path):
    res = ok(cli_runner, "compare", runs["a"], runs["wide"], "--handle", "outputs[*]", "--plot", tmp_path / "p.png")
    assert "shape mismatch" in res.stdout and "[16]" not in res.stdout or "16" in res.stdout
    assert "no finite value" not in res.stdout  # skipped for their shapes, not for zeros or NaN
    res = ok(cli_runner, "compare", runs["ragged_a"], runs["ragged_b"])
    assert "ok, 1 skipped" in res.stdout and "no finite value" not in res.stdout
    res = ok(cli_runner, "compare", runs["a"], runs["offset"], "--handle", "grads[*]")
    assert "no common steps" in res.stdout
    # handles of one run only are rows with a status, beside the ones compared (with none in
    # common, nothing is compared: an error, tests/cli/test_rough_edges.py)
    ma = _one_field_run(tmp_path / "ma", [[1.0, 2.0], [2.0, 3.0]], handles=("outputs[m]", "outputs[x]"))
    mb = _one_field_run(tmp_path / "mb", [[1.0, 2.0], [2.0, 1.0]], handles=("outputs[m]", "outputs[y]"))
    res = ok(cli_runner, "compare", ma, mb)
    assert "missing in A" in res.stdout and "missing in B" in res.stdout
    d = json.loads(ok(cli_runner, "compare", ma, mb, "--json").stdout)
    assert {r["status"] for r in d["results"]} == {"ok", "missing_in_a", "missing_in_b"}


def test_compare_errors(cli_runner, runs, tmp_path):
    fails(cli_runner, "compare", runs["a"], tmp_path / "nope", quoted=str(tmp_path / "nope"))
    fails(cli_runner, "compare", runs["a"], runs["b"], "--handle", "nope[*]", quoted="'nope[*]'")
    fails(cli_runner, "compare", runs["a"], runs["b"], "--field", "zzz", quoted="'zzz'")
    fails(cli_runner, "compare", runs["a"], runs["b"], "--metric", "l1", code=2)


def _one_field_run(path, records, handles=("outputs[m]",)):
    from hookline.storage import RunWriter

    with RunWriter(path, fsync=False) as w:
        for hid in handles:
            w.add_handle(hid, module_name="m", module_type="torch.nn.Linear", category="forward_hook",
                         hook_fn_name="outputs")
        for step, rec in enumerate(records):
            w.write(handles[0], step, 0, {"outputs.0": np.asarray(rec, np.float32)})
    return path


def test_compare_says_which_steps_gave_no_finite_value(cli_runner, tmp_path):
    """Zero and NaN records: the table showed cosine 1/1 (identical-looking) and dropped the inf
    rel_l2 and the 0 norm ratio silently."""
    a = _one_field_run(tmp_path / "a", [[0, 0], [1, 2], [3, 4], [np.nan, 1]])
    b = _one_field_run(tmp_path / "b", [[1, 1], [1, 2], [0, 0], [1, 1]])
    res = ok(cli_runner, "compare", a, b)
    assert "inf" in res.stdout  # rel_l2 worst (|a| = 0) and the norm ratio farthest from 1
    assert "of 4 compared steps, these gave no finite value" in res.stdout
    assert "cosine 3" in res.stdout and "rel_l2 2" in res.stdout


def test_compare_lists_handles_without_records_and_refuses_rank_on_plain_runs(cli_runner, runs, tmp_path):
    e = _one_field_run(tmp_path / "e", [], handles=("outputs[m]", "grads[m]"))
    res = ok(cli_runner, "compare", e, e)
    assert res.stdout.count("no records") >= 2  # (the handles vanished from the table before)
    fails(cli_runner, "compare", runs["a"], runs["b"], "--rank", "0", quoted="not a distributed run", code=2)


def test_compare_plot_path_gets_its_extension_and_the_table_comes_first(cli_runner, runs, tmp_path):
    res = ok(cli_runner, "compare", runs["a"], runs["b"], "--plot", tmp_path / "noext")
    assert (tmp_path / "noext.png").read_bytes()[:4] == b"\x89PNG"
    assert f"plot written to {tmp_path / 'noext.png'}" in res.stdout
    fails(cli_runner, "compare", runs["a"], runs["b"], "--plot", tmp_path / "nodir" / "p.png", quoted="does not exist",
          code=2)


def test_sync_errors_are_said_once(cli_runner, runs, tmp_path, sqlite_tracking_uri):
    """(Each error came out three times: its own line, a raw log line, the final message.)"""
    from mlflow import MlflowClient

    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    missing = next(run.rglob("*.h5"))
    missing.unlink()
    rid = MlflowClient(sqlite_tracking_uri).create_run("0").info.run_id
    res = cli_runner.invoke(cli, ["sync", str(run), "--run-id", rid, "--tracking-uri", sqlite_tracking_uri])
    assert res.exit_code == 1
    out = res.stdout + res.stderr
    assert out.count(str(missing)) == 1 and "MLflow sync of" not in out, out
    assert res.stderr.strip().splitlines()[-1].startswith("Error: 1 sync error for ")


@pytest.mark.parametrize("columns", ["60", "40"])
def test_narrow_terminals_cut_no_cell(cli_runner, runs, columns):
    """(At 80 columns "shape mismatch" lost its end; at 60 the norm ratios and bytes were cut.)"""
    d = json.loads(ok(cli_runner, "compare", runs["a"], runs["b"], "--json").stdout)
    res = cli_runner.invoke(cli, ["compare", str(runs["a"]), str(runs["b"])], env={"COLUMNS": columns})
    for r in d["results"]:
        for m in ("cosine", "rel_l2"):
            s = r["summary"][m]
            assert f"{s['mean']:.3g}"[:4] in res.stdout
    res = cli_runner.invoke(cli, ["compare", str(runs["a"]), str(runs["wide"])], env={"COLUMNS": columns})
    assert "shape mismatch" in res.stdout
    res = cli_runner.invoke(cli, ["show", str(runs["a"])], env={"COLUMNS": columns})
    assert res.stdout.count(" KiB") + res.stdout.count(" MiB") >= 1 + len(open_run(runs["a"]).handles)


# ----------------------------------------------------------------------------- export
def test_export_npy_csv_h5(cli_runner, runs, tmp_path):
    f = open_run(runs["a"])["grads[fc1]"]["grad_out.0"]
    data = f.read()
    ok(cli_runner, "export", runs["a"], "grads[fc1]", "grad_out.0", "--format", "npy", "--out", tmp_path / "g.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "g.npy"), data)
    rows = list(csv.reader(open(tmp_path / "g.npy.steps.csv")))
    assert rows[0] == ["row", "step", "call"] and [r[1] for r in rows[1:]] == ["0", "3", "6", "9"]

    ok(cli_runner, "export", runs["a"], "grads[fc1]", "grad_out.0", "--format", "csv", "--out", tmp_path / "g.csv",
       "--steps", "3:7")
    rows = list(csv.reader(open(tmp_path / "g.csv")))
    assert rows[0][:3] == ["step", "call", "0_0"] and len(rows[0]) == 2 + 6 * 16
    assert [r[0] for r in rows[1:]] == ["3", "6"]
    np.testing.assert_allclose(np.array(rows[1][2:], float), data[1].ravel(), rtol=1e-6)

    ok(cli_runner, "export", runs["a"], "grads[fc1]", "grad_out.0", "--format", "h5", "--out", tmp_path / "g.h5",
       "--steps", "0,9")
    with h5py.File(tmp_path / "g.h5", "r") as h:
        assert h["step"][:].tolist() == [0, 9]
        np.testing.assert_array_equal(h["data"][:], data[[0, 3]])
        assert h.attrs["handle"] == "grads[fc1]" and h.attrs["field"] == "grad_out.0"


def test_export_ragged_to_h5(cli_runner, runs, tmp_path):
    f = open_run(runs["ragged_a"])["outputs[proj]"]["outputs.0"]
    fails(cli_runner, "export", runs["ragged_a"], "outputs[proj]", "outputs.0", "--format", "npy", "--out",
          tmp_path / "r.npy", quoted="ragged")
    ok(cli_runner, "export", runs["ragged_a"], "outputs[proj]", "outputs.0", "--format", "h5", "--out", tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5", "r") as h:
        recs = [h["data"][k][:] for k in sorted(h["data"])]
    assert [r.shape[0] for r in recs] == [3, 5, 4, 5]
    np.testing.assert_array_equal(recs[1], f[1])


def test_export_errors(cli_runner, runs, tmp_path):
    a = runs["a"]
    out = tmp_path / "x.npy"
    fails(cli_runner, "export", a, "grads[fc1]", "grad_out.0", "--format", "npy", "--out", out, "--steps", "1:x",
          quoted="'1:x'", code=2)
    fails(cli_runner, "export", a, "grads[fc1]", "grad_out.0", "--format", "npy", "--out", out, "--steps", "-3",
          code=2)
    fails(cli_runner, "export", a, "grads[fc1]", "grad_out.0", "--format", "npy", "--out", out, "--steps", "1,2",
          quoted="'1,2'")  # selects nothing
    fails(cli_runner, "export", a, "grads[nope]", "grad_out.0", "--format", "npy", "--out", out, quoted="grads[nope]")
    fails(cli_runner, "export", a, "grads[fc1]", "grad_zzz", "--format", "npy", "--out", out, quoted="grad_zzz")
    fails(cli_runner, "export", a, "grads[fc1]", "grad_out.0", "--format", "xls", "--out", out, code=2)
    out.write_bytes(b"keep me")
    fails(cli_runner, "export", a, "grads[fc1]", "grad_out.0", "--format", "npy", "--out", out, quoted="--force")
    assert out.read_bytes() == b"keep me"
    ok(cli_runner, "export", a, "grads[fc1]", "grad_out.0", "--format", "npy", "--out", out, "--force")
    # The output file cannot be written: the message names it, not the temporary file.
    res = fails(cli_runner, "export", a, "grads[fc1]", "grad_out.0", "--format", "npy", "--out", "/proc/x.npy",
                quoted="'/proc/x.npy'")
    assert ".partial" not in res.stderr


def test_export_never_writes_into_the_run(cli_runner, runs, tmp_path):
    """--force included: overwriting a handle file or the manifest destroyed recorded data."""
    run = tmp_path / "run"
    shutil.copytree(runs["a"], run)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    handle_file = next(p for p in before if p.suffix == ".h5")
    for target in (handle_file, run / "manifest.json", run / "new.npy"):
        for fmt in ("h5", "npy"):
            fails(cli_runner, "export", run, "grads[fc1]", "grad_out.0", "--format", fmt, "--out", target, "--force",
                  quoted="inside the run directory")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    ok(cli_runner, "show", run, "grads[fc1]")


# ----------------------------------------------------------------------------- verify
def test_verify(cli_runner, runs, tmp_path):
    res = ok(cli_runner, "verify", runs["a"])
    assert res.stdout.strip()
    d = json.loads(ok(cli_runner, "verify", runs["a"], "--json").stdout)
    assert d["ok"] is True
    fails(cli_runner, "verify", tmp_path / "nope", quoted=str(tmp_path / "nope"))
    run = tmp_path / "corrupt"
    _corrupt_copy(runs["a"], run)
    res = cli_runner.invoke(cli, ["verify", str(run), "--json"])
    assert res.exit_code != 0 and "Traceback" not in res.stderr
    assert json.loads(res.stdout)["ok"] is False


# ----------------------------------------------------------------------------- MLflow: runs, sync, runs:/
def test_runs_sync_and_mlflow_uris(cli_runner, sqlite_tracking_uri, tmp_path, recorder_run):
    record_mlp = recorder_run
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_tracking_uri)
    exp = client.create_experiment("cli-test")
    r1 = client.create_run(exp, run_name="recorded").info.run_id
    record_mlp(tmp_path / "r1", mlflow_run_id=r1, tracking_uri=sqlite_tracking_uri)
    client.create_run(exp, run_name="no-hookline-data")

    d = json.loads(ok(cli_runner, "runs", "--json").stdout)
    assert [r["run_id"] for r in d["runs"]] == [r1]
    info = d["runs"][0]
    assert info["handles"] == 4 and info["records"] == 16 and info["bytes"] > 0
    assert info["experiment"] == "cli-test" and info["uri"] == f"runs:/{r1}" and "Linear" in info["module_types"]
    res = ok(cli_runner, "runs", "--experiment", "cli-test")
    assert r1 in res.stdout and "recorded" in res.stdout

    # sync a run recorded without MLflow, twice (idempotent)
    local = record_mlp(tmp_path / "r2", lr=0.5)
    r2 = client.create_run(exp, run_name="synced").info.run_id
    s1 = json.loads(ok(cli_runner, "sync", local, "--run-id", r2, "--json").stdout)
    assert s1["ok"] and s1["uploaded"]
    s2 = json.loads(ok(cli_runner, "sync", local, "--run-id", r2, "--json").stdout)
    assert s2["ok"] and not s2["uploaded"] and s2["skipped"]
    assert "synced" in ok(cli_runner, "sync", local, "--run-id", r2).stdout
    d = json.loads(ok(cli_runner, "runs", "--experiment", "cli-test", "--filter", "attributes.run_name = 'synced'",
                      "--json").stdout)
    assert [r["run_id"] for r in d["runs"]] == [r2]

    # RUN as runs:/ID and as a bare id
    d = json.loads(ok(cli_runner, "show", f"runs:/{r1}", "--json").stdout)
    assert {h["handle"] for h in d["handles"]} >= {"grads[fc1]", "outputs[head]"}
    local_d = json.loads(ok(cli_runner, "show", tmp_path / "r1", "--json").stdout)
    sizes = [{h["handle"]: h["bytes"] for h in x["handles"]} for x in (d, local_d)]
    assert sizes[0] == sizes[1] and min(sizes[0].values()) > 2000  # files' bytes, not the fields' count
    d = json.loads(ok(cli_runner, "compare", r1, f"runs:/{r2}", "--json", "--tracking-uri", sqlite_tracking_uri).stdout)
    assert all(r["status"] == "ok" for r in d["results"])
    ok(cli_runner, "export", r1, "grads[fc1]", "grad_out.0", "--format", "npy", "--out", tmp_path / "m.npy")
    np.testing.assert_array_equal(np.load(tmp_path / "m.npy"), open_run(tmp_path / "r1")["grads[fc1]"]["grad_out.0"].read())

    # errors
    fails(cli_runner, "runs", "--experiment", "no-such-exp", quoted="'no-such-exp'")
    fails(cli_runner, "runs", "--filter", "params.lr === nonsense", quoted="params.lr === nonsense")
    fails(cli_runner, "sync", local, "--run-id", "0" * 32, quoted="0" * 32)
    fails(cli_runner, "sync", tmp_path / "nope", "--run-id", r2, quoted=str(tmp_path / "nope"))
    fails(cli_runner, "show", "f" * 32, quoted="f" * 32)


def test_runs_empty_store(cli_runner, sqlite_tracking_uri):
    res = ok(cli_runner, "runs")
    assert "no runs with hookline data" in res.stdout
    assert json.loads(ok(cli_runner, "runs", "--json").stdout)["runs"] == []


def test_show_and_compare_bfloat16(cli_runner, tmp_path):
    """Logical dtypes are shown as recorded; bfloat16 compares through its exact float32 values."""
    from hookline.storage import RunWriter

    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        w = RunWriter(tmp_path / name)
        w.add_handle("outputs[x]", module_name="x", module_type="torch.nn.Linear", category="forward_hook")
        for step in range(3):
            f32 = rng.standard_normal((4, 8)).astype(np.float32)
            bits = (f32.view(np.uint32) >> 16).astype(np.uint16)
            w.write("outputs[x]", step, 0, {"outputs.0": (bits, "bfloat16")})
        w.close()
    d = json.loads(ok(cli_runner, "show", tmp_path / "a", "--json").stdout)
    assert d["handles"][0]["fields"][0]["dtype"] == "bfloat16"
    d = json.loads(ok(cli_runner, "compare", tmp_path / "a", tmp_path / "b", "--json").stdout)
    (r,) = d["results"]
    assert r["status"] == "ok" and r["dtype_a"] == "bfloat16" and len(r["cosine"]) == 3


def test_warnings_are_one_line(cli_runner, runs, monkeypatch):
    import warnings

    import hookline.cli.show as show_mod

    real = show_mod.handle_info

    def noisy(run, hid):
        warnings.warn("hookline: something odd\nwith a second line", UserWarning)
        return real(run, hid)

    monkeypatch.setattr(show_mod, "handle_info", noisy)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        res = ok(cli_runner, "show", runs["a"])
    assert "warning: something odd with a second line" in res.stderr and "UserWarning" not in res.stderr


def test_unexpected_errors_are_one_line_and_debuggable(cli_runner, runs, monkeypatch):
    import hookline.cli.show as show_mod

    def boom(run, hid):
        raise ZeroDivisionError("division by zero\nsecond line")

    monkeypatch.setattr(show_mod, "handle_info", boom)
    res = fails(cli_runner, "show", runs["a"], quoted="unexpected ZeroDivisionError: division by zero second line")
    assert "HOOKLINE_DEBUG=1" in res.stderr
    monkeypatch.setenv("HOOKLINE_DEBUG", "1")
    res = cli_runner.invoke(cli, ["show", str(runs["a"])])
    assert isinstance(res.exception, ZeroDivisionError)


@pytest.mark.slow
def test_against_a_real_mlflow_server(cli_runner, mlflow_server, tmp_path, recorder_run):
    """runs / show / compare with --tracking-uri pointing at a real `mlflow server`."""
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    exp = client.create_experiment(f"cli-server-{tmp_path.name}")
    ids = []
    for lr in (0.05, 0.5):
        rid = client.create_run(exp, run_name=f"lr{lr}").info.run_id
        recorder_run(tmp_path / f"lr{lr}", lr=lr, mlflow_run_id=rid, tracking_uri=mlflow_server)
        ids.append(rid)
    d = json.loads(ok(cli_runner, "runs", "--tracking-uri", mlflow_server, "--experiment", f"cli-server-{tmp_path.name}",
                      "--json").stdout)
    assert sorted(r["run_id"] for r in d["runs"]) == sorted(ids) and all(r["handles"] == 4 for r in d["runs"])
    d = json.loads(ok(cli_runner, "show", ids[0], "--tracking-uri", mlflow_server, "--json").stdout)
    assert len(d["handles"]) == 4
    d = json.loads(ok(cli_runner, "compare", f"runs:/{ids[0]}", f"runs:/{ids[1]}", "--tracking-uri", mlflow_server,
                      "--handle", "grads[fc1]", "--json").stdout)
    local = json.loads(ok(cli_runner, "compare", tmp_path / "lr0.05", tmp_path / "lr0.5", "--handle", "grads[fc1]",
                          "--json").stdout)
    assert d["results"][0]["cosine"] == local["results"][0]["cosine"]
