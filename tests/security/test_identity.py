"""A handle file must prove it belongs to its run before it is read, verified or uploaded as the
run's; a file that cannot be opened for a reason that is not damage is never quarantined; repair
converges (issue 34, cases 1-4).

Every run is written by the real RunWriter; the hostile changes are made with h5py, ``os`` and
raw bytes, as a user (or an attacker) would. The seeded cases pick which handle (and field) is
altered; CI runs a few seeds, a larger run sets ``HOOKLINE_IDENTITY_SEEDS``::

    HOOKLINE_IDENTITY_SEEDS=50 .venv/bin/python -m pytest -q tests/security/test_identity.py
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
from click.testing import CliRunner

from hookline.cli.main import cli
from hookline.storage import RunWriter, open_run, verify

HIDS = ("outputs[fc]", "outputs[proj]")
N = 6
#: Seeds per case (each case adds its own offset, so the cases see different choices).
SEEDS = list(range(int(os.environ.get("HOOKLINE_IDENTITY_SEEDS", "2"))))


def _write_run(run: Path, scale: float = 1.0) -> Path:
    with RunWriter(run) as w:
        for hid in HIDS:
            w.add_handle(hid, module_name=hid[8:-1])
        for i in range(N):
            for hid in HIDS:
                w.write(hid, i, 0, {"outputs.0": np.full(4, i * scale, np.float32),
                                    "outputs.1": np.arange(i % 3 + 1, dtype=np.int64)})
    return run


def _file(run: Path, hid: str) -> Path:
    return run / json.loads((run / "manifest.json").read_text())["handles"][hid]["file"]


def _verify_cli(run: Path, *args: str):
    return CliRunner().invoke(cli, ["verify", str(run), *args])


def _seeded_handle(seed: int) -> str:
    return random.Random(seed).choice(HIDS)


# --- 1. a handle file copied in from another run --------------------------------------------------
@pytest.mark.parametrize("seed", [100 + s for s in SEEDS])
def test_file_from_another_run_is_refused_by_verify_reader_and_repair(tmp_path, seed):
    run, other = _write_run(tmp_path / "run"), _write_run(tmp_path / "other", scale=100.0)
    hid = _seeded_handle(seed)
    shutil.copyfile(_file(other, hid), _file(run, hid))  # same handle id, same key, other run

    rep = verify(run)
    assert not rep.ok
    (hr,) = [h for h in rep.handles if h.handle_id == hid]
    text = "\n".join(hr.problems)
    assert "another run" in text and json.loads((other / "manifest.json").read_text())["run_uuid"] in text, text
    res = _verify_cli(run)
    assert res.exit_code == 1 and "another run" in res.output, res.output

    with open_run(run) as r, pytest.warns(UserWarning, match="another run"):
        assert len(r[hid]) == 0  # nothing of the foreign file reads as this run's
    with open_run(run) as r:
        other_hid = next(h for h in HIDS if h != hid)
        np.testing.assert_array_equal(r[other_hid]["outputs.0"][5], np.full(4, 5, np.float32))

    first = verify(run, repair=True)
    assert first.ok and not first.clean and any(hid in m or "fc" in m or "proj" in m for m in first.moved)
    again = verify(run, repair=True)  # converges: a second repair changes nothing
    assert again.clean and not again.moved and not again.repaired[1:], str(again)


def test_sync_does_not_upload_a_file_of_another_run(tmp_path, sqlite_tracking_uri):
    import mlflow

    from hookline.storage import sync

    run, other = _write_run(tmp_path / "run"), _write_run(tmp_path / "other", scale=100.0)
    shutil.copyfile(_file(other, HIDS[0]), _file(run, HIDS[0]))
    rid = mlflow.MlflowClient().create_run("0").info.run_id
    report = sync(run, rid, tracking_uri=sqlite_tracking_uri)
    assert not report.ok
    assert not any("fc" in u for u in report.uploaded), report.uploaded
    assert any("another run" in e for e in report.errors), report.errors
    assert any("proj" in u for u in report.uploaded), report.uploaded


# --- 2. permission denied is not damage -----------------------------------------------------------
def _as_unprivileged(run: Path, fn):
    """Run ``fn(run)`` where file permissions apply: as this user when it is not root, else in a
    forked child that became ``nobody``, on a copy of the run in a folder ``nobody`` can reach
    (the test's temporary folders are private to root; the copy is moved back after, modes
    kept). Returns what ``fn`` returned (through JSON), or raises with the child's error."""
    if os.geteuid() != 0:
        return fn(run)
    public = Path(tempfile.mkdtemp(prefix="hookline-perm-"))
    try:
        public.chmod(0o755)
        moved = public / "run"
        shutil.move(str(run), moved)
        for p in [moved, *moved.rglob("*")]:
            os.lchown(p, 65534, 65534)
        got = _in_child_as_nobody(lambda: fn(moved))
        shutil.move(str(moved), run)
    finally:
        shutil.rmtree(public, ignore_errors=True)
    if "error" in got:
        raise AssertionError(got["error"])
    return got["ok"]


def _in_child_as_nobody(fn) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            os.setgid(65534)
            os.setuid(65534)
            out = json.dumps({"ok": fn()})
        except BaseException as e:  # noqa: BLE001 - handed to the parent
            out = json.dumps({"error": f"{type(e).__name__}: {e}"})
        os.write(w, out.encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = json.loads(f.read() or '{"error": "child died"}')
    os.waitpid(pid, 0)
    return got


@pytest.mark.parametrize("seed", [300 + s for s in SEEDS[:max(1, len(SEEDS) // 2)]])
def test_permission_denied_is_reported_and_never_quarantined(tmp_path, seed):
    run = _write_run(tmp_path / "run")
    hid = _seeded_handle(seed)
    f = _file(run, hid)
    before = f.read_bytes()
    manifest_before = (run / "manifest.json").read_bytes()
    f.chmod(0)

    def check_and_repair(where: Path):
        plain, rep = verify(where), verify(where, repair=True)
        return {"plain_ok": plain.ok, "plain": str(plain), "ok": rep.ok, "moved": rep.moved, "text": str(rep),
                "lost": [h.lost for h in rep.handles]}

    got = _as_unprivileged(run, check_and_repair)
    assert not got["plain_ok"] and "permission" in got["plain"].lower(), got["plain"]
    assert not got["ok"] and got["moved"] == [] and got["lost"] == [[], []], got
    assert "not damage" in got["text"], got["text"]
    f.chmod(0o644)
    assert f.read_bytes() == before  # the intact file stayed where it was, unchanged
    assert not (run / ".quarantine").exists()
    m = json.loads((run / "manifest.json").read_text())
    assert "lost" not in m["handles"][hid]
    assert m["handles"] == json.loads(manifest_before)["handles"]
    assert verify(run).clean
    with open_run(run) as r:
        assert len(r[hid]) == N


# --- 3. a field removed from a handle file --------------------------------------------------------
@pytest.mark.parametrize("seed", [400 + s for s in SEEDS])
def test_field_removed_from_file_is_a_problem(tmp_path, seed):
    run = _write_run(tmp_path / "run")
    hid = _seeded_handle(seed)
    field = random.Random(seed).choice(["outputs.0", "outputs.1"])
    with h5py.File(_file(run, hid), "r+") as f:
        del f[field]
        del f["_index"][field]
        f.attrs["fields"] = json.dumps([n for n in json.loads(f.attrs["fields"]) if n != field])

    rep = verify(run)
    assert not rep.ok
    (hr,) = [h for h in rep.handles if h.handle_id == hid]
    assert any(field in p and "manifest" in p for p in hr.problems), hr.problems
    assert _verify_cli(run).exit_code == 1
    with open_run(run) as r, pytest.warns(UserWarning, match=field.replace(".", r"\.")):
        assert field not in r[hid].fields or r[hid].problems

    first = verify(run, repair=True)
    assert first.ok and not first.clean, str(first)
    (hr,) = [h for h in first.handles if h.handle_id == hid]
    assert any(field in x for x in hr.lost), hr.lost
    second = verify(run, repair=True)
    assert second.ok and second.clean, str(second)
    m = json.loads((run / "manifest.json").read_text())
    assert field not in m["handles"][hid]["fields"] and any(field in x for x in m["handles"][hid]["lost"])


# --- 4. a handle id that is not UTF-8 -------------------------------------------------------------
@pytest.mark.parametrize("seed", [600 + s for s in SEEDS[:max(1, len(SEEDS) // 2)]])
def test_non_utf8_handle_id_is_a_clear_problem_and_repair_converges(tmp_path, seed):
    run = _write_run(tmp_path / "run")
    hid = _seeded_handle(seed)
    path = _file(run, hid)
    with h5py.File(path, "r+") as f:  # a fixed-length byte string: h5py hands back raw bytes
        f.attrs["handle_id"] = np.bytes_(b"\xff\xfe")

    rep = verify(run)
    assert not rep.ok and "UTF-8" in str(rep), str(rep)
    assert sorted(h.handle_id for h in rep.handles) == sorted(HIDS)  # no ghost handle
    assert _verify_cli(run).exit_code == 1

    outcomes = [verify(run, repair=True) for _ in range(3)]
    for rep in outcomes:
        assert sorted(h.handle_id for h in rep.handles) == sorted(HIDS), str(rep)
        assert all("\udcff" not in h.handle_id for h in rep.handles)
    assert outcomes[0].ok and len(outcomes[0].moved) == 1, str(outcomes[0])
    assert outcomes[1].clean and outcomes[2].clean, str(outcomes[1])
    quarantined = list((run / ".quarantine").rglob("*.h5"))
    assert len(quarantined) == 1  # the damaged file, kept; nothing else moved
    m = json.loads((run / "manifest.json").read_text())
    assert sorted(m["handles"]) == sorted(HIDS)
    res = _verify_cli(run)
    assert res.exit_code == 0, res.output
