"""Untrusted run directories: nothing outside the run is read, written, moved or uploaded, and
nothing hangs (issue 23, cases 2, 4, 10, 11; the rule lives in storage/confine.py).

Every test builds a real run with the RunWriter, damages or poisons it the way a shared or
downloaded run directory could be, and runs the real commands (the CLI, the MLflow server
fixture). A *sentinel* directory next to the run holds hookline-looking files; it must come out
with the same names, bytes and mtimes. Commands that could block on a FIFO run in a subprocess
with a timeout, so a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import FormatError, RunWriter, open_run, sync, verify
from hookline.storage.confine import RunRoot, run_path

HOOKLINE = Path(sys.executable).with_name("hookline")
HANDLES = ("outputs[a]", "outputs[b]")
RECORDS = 4
#: Seconds a command may take on a tiny run before it counts as hung (a FIFO blocks forever).
HANG_S = 90


# --- helpers -------------------------------------------------------------------------------------

def make_run(path: Path, *, segments: bool = False, scale: float = 1.0) -> Path:
    """A closed run of HANDLES with RECORDS records each (``segments``: left as one sealed
    segment per record, as a killed writer leaves them; these are what repair merges)."""
    w = RunWriter(path, fsync=False, merge_on_close=not segments)
    for hid in HANDLES:
        w.add_handle(hid, module_name=hid[8:-1], module_type="torch.nn.Linear", category="forward_hook",
                     hook_fn_name="outputs")
    for step in range(RECORDS):
        for i, hid in enumerate(HANDLES):
            w.write(hid, step, 0, {"outputs.0": np.full(3, scale * (10 * i + step), np.float32)})
        if segments:
            w.flush()
    w.close()
    return path


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under ``root`` (links not followed): kind, bytes and mtime."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = os.lstat(p)
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            out[str(p.relative_to(root))] = (stat.S_IFMT(st.st_mode), data, st.st_mtime_ns)
    return out


def edit_manifest(run: Path, hid: str, **changes) -> None:
    m = json.loads((run / "manifest.json").read_text())
    m["handles"][hid].update(changes)
    (run / "manifest.json").write_text(json.dumps(m))


def cli_run(*args: str) -> tuple[int, str]:
    """``hookline ARGS`` in-process: exit code and stdout+stderr."""
    res = CliRunner().invoke(cli, list(args))
    return res.exit_code, res.output + (res.stderr if res.stderr_bytes is not None else "")


def cli_subprocess(*args: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """``hookline ARGS`` in a subprocess; a command still running after ``timeout`` s hangs."""
    try:
        return subprocess.run([str(HOOKLINE), *args], capture_output=True, text=True, timeout=timeout,
                              env=dict(os.environ, HOOKLINE_DEBUG=""))
    except subprocess.TimeoutExpired:
        pytest.fail(f"`hookline {' '.join(args)}` hangs (still running after {timeout} s)")


def python_subprocess(code: str, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"hangs (still running after {timeout} s): {code}")


def new_mlflow_run(uri: str) -> tuple[object, str]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment(f"hookline-confine-{uuid.uuid4().hex[:12]}")
    return client, client.create_run(exp).info.run_id


def artifacts(client, rid: str, dst: Path) -> dict[str, bytes]:
    """Every artifact of the run: path -> bytes (downloaded)."""
    got = Path(client.download_artifacts(rid, "", dst_path=str(dst)))
    return {str(p.relative_to(got)): p.read_bytes() for p in got.rglob("*") if p.is_file()}


# --- the rule ------------------------------------------------------------------------------------

def test_run_path_accepts_files_inside_and_refuses_everything_else(tmp_path):
    run = make_run(tmp_path / "run")
    outside = tmp_path / "outside.h5"
    outside.write_bytes(b"secret")
    assert run_path(run, "outputs/a.h5", what="file") == run / "outputs/a.h5"
    assert run_path(run, "outputs/missing.h5", what="file") == run / "outputs/missing.h5"  # (opening says)
    (run / "outputs/inside-link.h5").symlink_to("a.h5")  # a symlink that stays inside is fine
    assert run_path(run, "outputs/inside-link.h5", what="file") == run / "outputs/inside-link.h5"
    (run / "outputs/out-link.h5").symlink_to(outside)
    os.mkfifo(run / "outputs/fifo.h5")
    bad = {str(outside): "absolute path", "../outside.h5": "'..'", "outputs/../../outside.h5": "'..'",
           "outputs/out-link.h5": "leads outside the run directory", "outputs/fifo.h5": "FIFO",
           "outputs": "a directory", "": "not a relative path"}
    for rel, why in bad.items():
        with pytest.raises(FormatError, match=why) as ei:
            run_path(run, rel, what="file of handle 'outputs[a]'")
        msg = str(ei.value)
        assert "outputs[a]" in msg and str(run) in msg and "verify --repair" in msg, msg
    # the run directory itself may be a symlink (resolved once)
    link = tmp_path / "run-link"
    link.symlink_to(run)
    assert RunRoot(link).file("outputs/a.h5", what="file") == link / "outputs/a.h5"


# --- case 2: verify --repair and manifest keys -----------------------------------------------------

@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_verify_repair_never_follows_a_manifest_key_outside_the_run(tmp_path, kind):
    run = make_run(tmp_path / "run")
    sentinel = make_run(tmp_path / "sentinel", segments=True)  # segments: what repair merges and deletes
    created = tmp_path / "created"  # an absolute key used to create files here
    if kind == "absolute":
        keys = {"outputs[a]": str(sentinel / "outputs" / "a"), "outputs[b]": str(created / "outputs" / "b")}
    else:
        keys = {"outputs[a]": "../sentinel/outputs/a", "outputs[b]": "outputs/../../sentinel/outputs/b"}
    for hid, key in keys.items():
        edit_manifest(run, hid, key=key)
    before = snapshot(sentinel)

    code, out = cli_run("verify", str(run))
    assert code != 0 and ("leads out" in out or "absolute path" in out), out
    for key in keys.values():
        assert repr(key) in out, out  # the entry is named
    assert snapshot(sentinel) == before

    code, out = cli_run("verify", "--repair", str(run))
    assert snapshot(sentinel) == before, "verify --repair touched a directory outside the run"
    assert not created.exists(), "verify --repair created files at an absolute manifest key"
    assert code == 3, out  # repaired, but damage was found: not a clean exit
    assert "reset manifest key" in out, out
    m = json.loads((run / "manifest.json").read_text())
    assert {hid: e["key"] for hid, e in m["handles"].items()} == {"outputs[a]": "outputs/a", "outputs[b]": "outputs/b"}
    with open_run(run) as r:  # the run's own records, not the sentinel's
        assert [float(r["outputs[b]"]["outputs.0"][j][0]) for j in range(RECORDS)] == [10.0, 11.0, 12.0, 13.0]


def test_verify_repair_never_moves_files_into_a_quarantine_link_outside(tmp_path):
    run = make_run(tmp_path / "run", segments=True)
    (run / "outputs" / "a.r000000000009.h5seg.partial").write_bytes(b"unflushed")  # repair quarantines it
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run / ".quarantine").symlink_to(elsewhere)
    before = snapshot(run / "outputs")
    code, out = cli_run("verify", "--repair", str(run))
    assert code != 0 and ".quarantine" in out and "leads outside the run directory" in out, out
    assert list(elsewhere.iterdir()) == []
    assert snapshot(run / "outputs") == before  # nothing merged or removed either


def test_verify_reports_a_symlinked_key_folder_and_repair_moves_the_link_aside(tmp_path):
    run = make_run(tmp_path / "run")
    sentinel = make_run(tmp_path / "sentinel", segments=True)
    os.rename(run / "outputs", run / "outputs.orig")
    (run / "outputs").symlink_to(sentinel / "outputs")
    before = snapshot(sentinel)
    code, out = cli_run("verify", str(run))
    assert code != 0 and "its folder 'outputs'" in out and "leads outside the run directory" in out, out
    code, out = cli_run("verify", "--repair", str(run))
    assert snapshot(sentinel) == before
    assert (run / ".quarantine" / "outputs").is_symlink(), out  # the link moved, not what it points to
    assert not (run / "outputs").is_symlink()


# --- case 4: sync uploads only files inside the run --------------------------------------------------

@pytest.mark.parametrize("kind", ["absolute", "dotdot"])
def test_sync_refuses_a_manifest_file_outside_the_run(mlflow_server, tmp_path, kind):
    run = make_run(tmp_path / "run")
    secret = tmp_path / "secret.h5"
    make_run(tmp_path / "other", scale=-7.0)
    secret.write_bytes((tmp_path / "other" / "outputs" / "a.h5").read_bytes())  # even a sound hookline file
    edit_manifest(run, "outputs[a]", file=str(secret) if kind == "absolute" else "../secret.h5")
    client, rid = new_mlflow_run(mlflow_server)

    code, out = cli_run("sync", str(run), "--run-id", rid, "--tracking-uri", mlflow_server)

    assert code != 0, out
    assert "outputs[a]" in out and ("leads out" in out or "absolute path" in out), out
    got = artifacts(client, rid, tmp_path / "dl")
    assert secret.read_bytes() not in got.values(), sorted(got)
    assert got.get("hookline/outputs/b.h5") == (run / "outputs" / "b.h5").read_bytes(), sorted(got)  # the rest


def test_sync_refuses_a_symlinked_handle_file_leading_outside(mlflow_server, tmp_path):
    run = make_run(tmp_path / "run")
    target = make_run(tmp_path / "other", scale=3.0) / "outputs" / "a.h5"  # same handle id: sound data
    (run / "outputs" / "a.h5").unlink()
    (run / "outputs" / "a.h5").symlink_to(target)
    client, rid = new_mlflow_run(mlflow_server)

    code, out = cli_run("sync", str(run), "--run-id", rid, "--tracking-uri", mlflow_server)

    assert code != 0, out
    assert "'outputs/a.h5'" in out and "leads outside the run directory" in out, out
    got = artifacts(client, rid, tmp_path / "dl")
    assert target.read_bytes() not in got.values(), sorted(got)
    assert "hookline/outputs/b.h5" in got, sorted(got)
    tags = client.get_run(rid).data.tags
    assert not any(k.startswith("hookline.outputs/a/") for k in tags), sorted(tags)


# --- case 10: FIFOs and other non-files never block ------------------------------------------------

_OPEN_RUN = """
import warnings, sys
from hookline.storage import open_run
warnings.simplefilter("ignore")
with open_run(sys.argv[1] if len(sys.argv) > 1 else {run!r}) as r:
    a, b = r["outputs[a]"], r["outputs[b]"]
    print("records", len(a), len(b))
    print("problems", a.problems)
"""


def _plant(path: Path, kind: str) -> None:
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()


@pytest.mark.parametrize("kind", ["fifo", "directory", "socket"])
def test_a_non_file_in_place_of_a_handle_file_is_a_listed_problem_not_a_hang(tmp_path, kind):
    run = make_run(tmp_path / "run")
    _plant(run / "outputs" / "a.h5", kind)
    word = {"fifo": "FIFO", "directory": "a directory", "socket": "a socket"}[kind]

    res = python_subprocess(_OPEN_RUN.format(run=str(run)))
    assert res.returncode == 0, res.stderr
    assert f"records 0 {RECORDS}" in res.stdout and word in res.stdout, res.stdout

    res = cli_subprocess("show", str(run))
    assert res.returncode == 0 and "outputs[b]" in res.stdout, res.stdout + res.stderr
    assert "warning:" in res.stderr and "outputs[a]" in res.stderr, res.stderr

    res = cli_subprocess("verify", str(run))
    assert res.returncode != 0 and word in res.stdout and "outputs/a.h5" in res.stdout, res.stdout + res.stderr

    res = cli_subprocess("verify", "--repair", str(run))
    assert "moved unreadable outputs/a.h5" in res.stdout, res.stdout + res.stderr
    moved = os.lstat(run / ".quarantine" / "outputs" / "a.h5").st_mode
    assert not stat.S_ISREG(moved)  # moved aside as it is, never opened
    with open_run(run) as r:
        assert len(r["outputs[b]"]) == RECORDS


def test_a_fifo_manifest_is_an_error_not_a_hang(tmp_path):
    run = make_run(tmp_path / "run")
    _plant(run / "manifest.json", "fifo")
    res = python_subprocess(_OPEN_RUN.format(run=str(run)))
    assert res.returncode != 0 and "FormatError" in res.stderr and "FIFO" in res.stderr, res.stderr
    res = cli_subprocess("verify", str(run))
    assert res.returncode != 0 and "FIFO" in res.stdout, res.stdout + res.stderr


def test_sync_of_a_run_with_a_fifo_handle_file_finishes_and_uploads_the_rest(mlflow_server, tmp_path):
    run = make_run(tmp_path / "run")
    _plant(run / "outputs" / "a.h5", "fifo")
    client, rid = new_mlflow_run(mlflow_server)
    res = cli_subprocess("sync", str(run), "--run-id", rid, "--tracking-uri", mlflow_server)
    assert res.returncode != 0 and "FIFO" in res.stdout + res.stderr, res.stdout + res.stderr
    assert "hookline/outputs/b.h5" in artifacts(client, rid, tmp_path / "dl")


# --- case 11: sync refuses damaged files ------------------------------------------------------------

@pytest.mark.parametrize("damage", ["truncated", "another handle's file", "more records than the manifest"])
def test_sync_refuses_a_damaged_handle_file_and_uploads_the_rest(mlflow_server, tmp_path, damage):
    run = make_run(tmp_path / "run")
    a = run / "outputs" / "a.h5"
    if damage == "truncated":
        a.write_bytes(a.read_bytes()[: a.stat().st_size // 2])
    elif damage == "another handle's file":
        a.write_bytes((run / "outputs" / "b.h5").read_bytes())
    else:
        edit_manifest(run, "outputs[a]", records=RECORDS - 1)
    client, rid = new_mlflow_run(mlflow_server)

    report = sync(run, rid, tracking_uri=mlflow_server)
    assert not report.ok
    assert any("outputs/a.h5" in e and "damaged" in e for e in report.errors), report.errors
    assert "hookline/outputs/a.h5" not in report.uploaded and "hookline/outputs/b.h5" in report.uploaded

    code, out = cli_run("sync", str(run), "--run-id", rid, "--tracking-uri", mlflow_server)
    assert code != 0 and "outputs/a.h5" in out and "damaged" in out, out
    got = artifacts(client, rid, tmp_path / "dl")
    assert "hookline/outputs/a.h5" not in got and "hookline/outputs/b.h5" in got, sorted(got)
    tags = client.get_run(rid).data.tags
    assert "hookline.outputs/a/records" not in tags, tags  # (was tagged records=0)
    assert tags.get("hookline.outputs/b/records") == str(RECORDS)


# --- the writer continuing a run ---------------------------------------------------------------------

def test_continuing_a_run_never_writes_through_links_planted_in_it(tmp_path):
    run = make_run(tmp_path / "run")
    sentinel = tmp_path / "sentinel"
    sentinel.mkdir()
    victim = sentinel / "victim.txt"
    victim.write_text("keep me")
    (run / "manifest.json.tmp").symlink_to(victim)  # the writer's next manifest write
    (run / "outputs" / f"a.r{RECORDS:012d}.h5seg.partial").symlink_to(sentinel / "created.h5")  # its next segment
    (run / ".writer.lock").symlink_to(sentinel / "created.lock")  # its lock
    before = snapshot(sentinel)
    w = RunWriter(run, fsync=False)
    w.add_handle("outputs[a]")
    w.write("outputs[a]", RECORDS, 0, {"outputs.0": np.zeros(3, np.float32)})
    w.close()
    assert snapshot(sentinel) == before
    with open_run(run) as r:
        assert len(r["outputs[a]"]) == RECORDS + 1
