"""MLflow adapter against both stores: the embedded sqlite default and a real ``mlflow server``."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _mlflow_support import LINEAR, RELU, HandleSpec, append_records, build_run, sha256

from hookline.storage import InvalidArgumentError, TrackingError, TrackingUnreachableError, UnknownNameError
from hookline.storage import MlflowAdapter, mlflow_source, sync
from hookline.storage.mlflow.client import check_reachable
from hookline.storage.mlflow.keys import metric_key, tag_key
from hookline.storage.mlflow.uri import parse_run_uri

REPO = Path(__file__).resolve().parents[2]

# The three filter strings documented in docs/mlflow.md (checked verbatim below).
F_CAPTURED = "tags.`hookline.outputs/blocks.0/id` = 'outputs[blocks.0]'"
F_LINEAR = "tags.`hookline.has.Linear` = 'true'"
F_GRAD = "metrics.`hookline.grads/blocks.0/grad_out.0.norm_max` > 5"

SPECS = [
    HandleSpec("outputs[blocks.0]", LINEAR, "outputs.0"),
    HandleSpec("grads[blocks.0]", LINEAR, "grad_out.0", category="backward_hook"),
]


def _search(new_run, flt: str) -> set[str]:
    import mlflow

    runs = mlflow.search_runs(experiment_ids=[new_run.experiment_id], filter_string=flt, output_format="list")
    return {r.info.run_id for r in runs}


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _sync_record(client, run_id: str, dst: Path) -> dict[str, str]:
    """The files the run's sync record (artifact ``hookline/sync.json``) lists, with their digests."""
    dst.mkdir(parents=True, exist_ok=True)
    got = client.download_artifacts(run_id, "hookline/sync.json", dst_path=str(dst))
    return json.loads(Path(got).read_text())["files"]


# --------------------------------------------------------------------------------------------
# naming (no store)
# --------------------------------------------------------------------------------------------


def test_keys_follow_documented_scheme():
    assert tag_key("outputs[blocks.0]", "id") == "hookline.outputs/blocks.0/id"
    assert tag_key("outputs[blocks.0]", "id", rank=1) == "hookline.outputs/blocks.0-rank1/id"
    assert metric_key("grads[blocks.0]", "grad_out.0", "norm_max") == "hookline.grads/blocks.0/grad_out.0.norm_max"
    assert metric_key("grads[blocks.0]", "grad_out.0") == "hookline.grads/blocks.0/grad_out.0.norm"


def test_keys_are_valid_and_collision_free_for_awkward_ids():
    ids = ["outputs[a.b]", "outputs[a]", "outputs[a-rank1]", "outputs", "outputs[]", "out puts[x:y]",
           "grads[" + "very.long.module.name." * 30 + "]", "grads[" + "very.long.module.name." * 30 + "x]",
           "weird/id[a[b]]", "ünïcode[模块]"]
    keys = set()
    for hid in ids:
        for rank in (None, 0, 1):
            for f in ("outputs.0", "grad_out.0", "x" * 200):
                for stat in ("norm", "norm_max"):
                    k = metric_key(hid, f, stat, rank=rank)
                    assert re.fullmatch(r"[/\w.\- ]*", k) and len(k) <= 250, k
                    keys.add(k)
            for name in ("id", "records"):
                k = tag_key(hid, name, rank=rank)
                assert re.fullmatch(r"[/\w.\- ]*", k) and len(k) <= 250, k
                keys.add(k)
    assert len(keys) == len(ids) * 3 * (6 + 2)


def test_parse_run_uri_forms_and_errors():
    rid = "0123456789abcdef0123456789abcdef"
    assert parse_run_uri(f"runs:/{rid}") == (rid, "hookline", None)
    assert parse_run_uri(f"runs:/{rid}/hookline/", "http://x") == (rid, "hookline", "http://x")
    assert parse_run_uri(f"mlflow-artifacts:/3/{rid}/artifacts/hookline") == (rid, "hookline", None)
    assert parse_run_uri(f"mlflow-artifacts://127.0.0.1:5000/3/{rid}/artifacts") == (
        rid, "hookline", "http://127.0.0.1:5000")
    assert parse_run_uri(rid, "sqlite:///x.db") == (rid, "hookline", "sqlite:///x.db")
    with pytest.raises(InvalidArgumentError, match="not-a-run"):
        parse_run_uri("not-a-run")


def _python(code: str) -> str:
    """Run ``code`` in a fresh interpreter; its stdout (it must exit 0)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_import_storage_does_not_import_mlflow():
    code = ("import sys, hookline.storage as s; a = s.MlflowAdapter('0123456789abcdef0123456789abcdef'); "
            "a.close(); print('mlflow' in sys.modules)")
    assert _python(code).strip() == "False"


def test_one_run_id_rule():
    from hookline.storage.keys import is_mlflow_run_id

    assert is_mlflow_run_id("0123456789abcdef0123456789abcdef")
    for text in ("0123456789ABCDEF0123456789ABCDEF", "0123456789abcdef0123456789abcde", "runs/baseline",
                 "0123456789abcdef0123456789abcdef\n", "", None, 123):
        assert not is_mlflow_run_id(text), text


def test_the_reader_opens_mlflow_runs_through_the_source_registry():
    """The reader imports no MLflow code; ``hookline.storage`` registers the MLflow source."""
    code = ("import sys; from hookline.storage.reader import open_run\n"
            "print('hookline.storage.mlflow.source' in sys.modules, 'mlflow' in sys.modules)\n"
            "from hookline.storage.sources import find_source\n"
            "print(find_source('runs:/abc', None).__module__, find_source('runs/abc', None))\n"
            "print(find_source('0123456789abcdef0123456789abcdef', None), "
            "find_source('0123456789abcdef0123456789abcdef', 'sqlite:///x.db').__name__)")
    assert _python(code).split("\n")[:3] == ["False False", "hookline.storage.mlflow.source None", "None mlflow_source"]


def test_exit_callbacks_run_after_main_last_registered_first_before_atexit():
    code = ("import atexit, threading\n"
            "from hookline.storage.mlflow.shutdown import at_main_exit\n"
            "atexit.register(lambda: print('atexit'))\n"
            "at_main_exit(lambda: print('first', threading.current_thread().name))\n"
            "at_main_exit(lambda: print('second'))\n"
            "print('main done')\n")
    assert _python(code).splitlines() == ["main done", "second", "first hookline-exit", "atexit"]


def test_bad_arguments_quote_the_value():
    with pytest.raises(InvalidArgumentError, match="'bad/id'"):
        MlflowAdapter("bad/id")
    with pytest.raises(InvalidArgumentError, match="-1"):
        MlflowAdapter("abc", rank=-1)


def test_docs_show_the_tested_filters():
    text = (REPO / "docs" / "mlflow.md").read_text()
    for flt in (F_CAPTURED, F_LINEAR, F_GRAD):
        assert flt in text, flt


# --------------------------------------------------------------------------------------------
# both stores
# --------------------------------------------------------------------------------------------


def test_sync_uploads_files_tags_and_metrics(store, new_run, tmp_path):
    client = new_run.client
    rid = new_run()
    built = build_run(tmp_path / "run", SPECS, records=6)
    report = sync(built.path, rid, tracking_uri=store)
    assert report.ok and report.metrics > 0
    assert sorted(report.uploaded) == ["hookline/grads/blocks.0.h5", "hookline/manifest.json",
                                       "hookline/outputs/blocks.0.h5"]
    # artifacts hold the same bytes as the local files
    dl = tmp_path / "dl"
    for rel in ("outputs/blocks.0.h5", "grads/blocks.0.h5", "manifest.json"):
        got = client.download_artifacts(rid, f"hookline/{rel}", dst_path=str(dl))
        assert sha256(Path(got)) == sha256(built.path / rel)
    run = client.get_run(rid)
    tags = run.data.tags
    # per handle: its id and its record count; nothing else (the rest is in the manifest)
    assert {k: v for k, v in tags.items() if k.startswith("hookline.grads/")} == {
        tag_key("grads[blocks.0]", "id"): "grads[blocks.0]",
        tag_key("grads[blocks.0]", "records"): "6",
    }
    assert tags[tag_key("outputs[blocks.0]", "id")] == "outputs[blocks.0]"
    assert tags["hookline.has.Linear"] == "true" and tags["hookline.handles"] == "2"
    assert tags["hookline.format_version"] == "1"
    # bookkeeping: the digests in the sync record, the total size in one run tag, the origin a param
    files = ("outputs/blocks.0.h5", "grads/blocks.0.h5", "manifest.json")
    digests = {f"hookline/{rel}": f"{(built.path / rel).stat().st_size}:{sha256(built.path / rel)}" for rel in files}
    record = _sync_record(client, rid, tmp_path / "state")
    assert record.pop("hookline/summary.html").split(":")[0].isdigit()  # the summary page, made from the run
    assert record == digests
    assert tags["hookline.bytes"] == str(sum((built.path / rel).stat().st_size for rel in files[:2]))
    assert not any(":" in v and len(v) > 64 for v in tags.values()), tags  # no digest is a tag
    assert run.data.params["hookline.origin"] == json.loads((built.path / "manifest.json").read_text())["run_uuid"]
    # per-step norm series (one chart per field) and for gradients their running maximum: a line
    # each, no single-point metric
    assert set(run.data.metrics) == ({metric_key(h, built.fields[h]) for h in built.data}
                                     | {metric_key("grads[blocks.0]", built.fields["grads[blocks.0]"], "norm_max")})
    for hid in ("outputs[blocks.0]", "grads[blocks.0]"):
        f = built.fields[hid]
        hist = _history(client, rid, metric_key(hid, f))
        assert [s for s, _ in hist] == list(built.steps[hid])
        np.testing.assert_allclose([v for _, v in hist], built.norms(hid), rtol=1e-5)
        if not hid.startswith("grads"):
            continue
        mx = _history(client, rid, metric_key(hid, f, "norm_max"))
        assert [s for s, _ in mx] == list(built.steps[hid])
        np.testing.assert_allclose([v for _, v in mx], np.maximum.accumulate(built.norms(hid)), rtol=1e-5)
        assert run.data.metrics[metric_key(hid, f, "norm_max")] == pytest.approx(built.norms(hid).max(), rel=1e-5)


def test_sync_is_idempotent(store, new_run, tmp_path):
    client = new_run.client
    rid = new_run()
    built = build_run(tmp_path / "run", SPECS, records=4)
    sync(built.path, rid, tracking_uri=store)
    again = sync(built.path, rid, tracking_uri=store)
    assert again.ok and again.uploaded == [] and again.metrics == 0 and again.tags == 0
    assert len(again.skipped) == 3
    # lose the bookkeeping (as if a pass died between logging metrics and tags, and between
    # uploading a file and recording it): still no duplicates
    client.delete_tag(rid, tag_key("grads[blocks.0]", "records"))
    record = _sync_record(client, rid, tmp_path / "state")
    del record["hookline/grads/blocks.0.h5"]
    client.log_text(rid, json.dumps({"format": "hookline-sync", "files": record}), "hookline/sync.json")
    third = sync(built.path, rid, tracking_uri=store)
    assert third.ok and third.uploaded == ["hookline/grads/blocks.0.h5"] and third.metrics > 0
    for hid, stat in (("outputs[blocks.0]", "norm"), ("grads[blocks.0]", "norm"), ("grads[blocks.0]", "norm_max")):
        hist = client.get_metric_history(rid, metric_key(hid, built.fields[hid], stat))
        assert len(hist) == 4, (hid, stat, hist)
    assert len(client.list_artifacts(rid, "hookline/grads")) == 1


def test_documented_filters_find_exactly_the_right_runs(store, new_run, tmp_path):
    runs = {
        "A": [HandleSpec("outputs[blocks.0]", LINEAR, "outputs.0"),
              HandleSpec("grads[blocks.0]", LINEAR, "grad_out.0", scale=10.0, category="backward_hook")],
        "B": [HandleSpec("outputs[act]", RELU, "outputs.0"),
              HandleSpec("grads[act]", RELU, "grad_out.0", scale=10.0, category="backward_hook")],
        "C": [HandleSpec("outputs[blocks.0]", LINEAR, "outputs.0"),
              HandleSpec("grads[blocks.0]", LINEAR, "grad_out.0", scale=0.1, category="backward_hook")],
        "D": [HandleSpec("outputs[head]", LINEAR, "outputs.0")],
        "E": [HandleSpec("outputs[blocks.1]", RELU, "outputs.0")],
    }
    ids = {}
    for i, (name, specs) in enumerate(runs.items()):
        ids[name] = new_run(name)
        sync(build_run(tmp_path / name, specs, records=3, seed=i).path, ids[name], tracking_uri=store)
    new_run("empty")  # a run without hookline data
    import mlflow

    mlflow.set_tracking_uri(store)
    try:
        assert _search(new_run, F_CAPTURED) == {ids["A"], ids["C"]}
        assert _search(new_run, F_LINEAR) == {ids["A"], ids["C"], ids["D"]}
        assert _search(new_run, F_GRAD) == {ids["A"]}
    finally:
        mlflow.set_tracking_uri(None)


def test_open_run_from_mlflow_downloads_only_what_is_read(store, new_run, tmp_path):
    rid = new_run()
    specs = SPECS + [HandleSpec("outputs[blocks.1]", LINEAR, "outputs.0", shape=(2, 5))]
    built = build_run(tmp_path / "run", specs, records=5)
    sync(built.path, rid, tracking_uri=store)
    cache = tmp_path / "cache"
    src = mlflow_source(f"runs:/{rid}", tracking_uri=store, cache_dir=cache)
    assert {h for m in src.manifests() for h in m["handles"]} == set(built.data)
    files = lambda: sorted(p.relative_to(cache / rid).as_posix() for p in (cache / rid).rglob("*.h5"))  # noqa: E731
    assert files() == []
    from hookline.storage import open_run

    with open_run(f"runs:/{rid}", tracking_uri=store, cache_dir=cache) as run:
        assert sorted(run.handles) == sorted(built.data)
        assert files() == []
        h = run["grads[blocks.0]"]
        np.testing.assert_array_equal(h.steps, built.steps["grads[blocks.0]"])
        np.testing.assert_array_equal(h["grad_out.0"].read(), built.data["grads[blocks.0]"])
        np.testing.assert_array_equal(h["grad_out.0"][2], built.data["grads[blocks.0]"][2])
    assert files() == ["hookline/grads/blocks.0.h5"]
    assert not list((cache / rid).glob(".partial/*"))  # no stray temp dirs
    # second access reuses the cache
    p = src.path("grads/blocks.0.h5")
    mtime = p.stat().st_mtime_ns
    assert src.path("grads/blocks.0.h5").stat().st_mtime_ns == mtime
    # the mlflow-artifacts:/ and bare-id forms reach the same run
    art_uri = new_run.client.get_run(rid).info.artifact_uri
    if art_uri.startswith("mlflow-artifacts:"):
        assert mlflow_source(f"{art_uri}/hookline", tracking_uri=store, cache_dir=cache).run_id == rid
    assert mlflow_source(rid, tracking_uri=store, cache_dir=cache).path("outputs/blocks.1.h5").is_file()


def test_adapter_submit_never_blocks_and_close_uploads(store, new_run, tmp_path):
    client = new_run.client
    rid = new_run()
    built = build_run(tmp_path / "run", SPECS, records=3)
    adapter = MlflowAdapter(rid, tracking_uri=store)
    t0 = time.perf_counter()
    adapter.submit(built.path)  # metrics and tags only, mid-run
    assert time.perf_counter() - t0 < 0.05
    rep = adapter.wait(timeout=60)
    assert rep.ok and rep.uploaded == [] and rep.metrics > 0
    final = adapter.close(timeout=60)
    assert final.ok and len(final.uploaded) == 3
    assert adapter.close() is final  # idempotent
    assert len(client.get_metric_history(rid, metric_key("grads[blocks.0]", "grad_out.0"))) == 3
    assert "hookline/outputs/blocks.0.h5" in _sync_record(client, rid, tmp_path / "state")


def test_ranked_runs_keep_ranks_apart(store, new_run, tmp_path):
    client = new_run.client
    rid = new_run()
    spec = [HandleSpec("outputs[blocks.0]", LINEAR, "outputs.0")]
    r0 = build_run(tmp_path / "run", spec, records=3, rank=0, world_size=2, seed=0)
    r1 = build_run(tmp_path / "run", spec, records=3, rank=1, world_size=2, seed=1)
    MlflowAdapter(rid, tracking_uri=store, rank=1).log_run_dir(r1.path)
    names = {a.path for a in client.list_artifacts(rid, "hookline/outputs")}
    assert names == {"hookline/outputs/blocks.0.rank1.h5"}
    sync(r0.path, rid, tracking_uri=store)  # every rank's manifest in the directory
    names = {a.path for a in client.list_artifacts(rid, "hookline/outputs")}
    assert names == {"hookline/outputs/blocks.0.rank0.h5", "hookline/outputs/blocks.0.rank1.h5"}
    tags = client.get_run(rid).data.tags
    assert tags[tag_key("outputs[blocks.0]", "id", rank=0)] == "outputs[blocks.0]"
    assert tags[tag_key("outputs[blocks.0]", "id", rank=1)] == "outputs[blocks.0]"
    for rank, built in ((0, r0), (1, r1)):
        hist = _history(client, rid, metric_key("outputs[blocks.0]", "outputs.0", rank=rank))
        np.testing.assert_allclose([v for _, v in hist], built.norms("outputs[blocks.0]"), rtol=1e-5)


def test_unknown_run_and_missing_dir_errors(store, tmp_path):
    bad = "0123456789abcdef0123456789abcdef"
    built = build_run(tmp_path / "run", SPECS[:1], records=1)
    with pytest.raises(UnknownNameError, match=bad):
        sync(built.path, bad, tracking_uri=store)
    with pytest.raises(UnknownNameError, match=bad):
        mlflow_source(f"runs:/{bad}", tracking_uri=store)
    with pytest.raises(UnknownNameError, match="nowhere"):
        MlflowAdapter(bad, tracking_uri=store).log_run_dir(tmp_path / "nowhere")
    # In the background (a Recorder's adapter): the repair hint names another run, not this one
    adapter = MlflowAdapter(bad, tracking_uri=store)
    adapter.submit(built.path)
    with pytest.raises(TrackingError, match="--run-id <an existing run id>") as ei:
        adapter.close(timeout=60)
    assert f"--run-id {bad}" not in str(ei.value)
    if store.startswith("sqlite:///"):  # a typo in a sqlite path is not a new, empty store
        typo = store.replace("mlflow.db", "mlflw.db")
        with pytest.raises(InvalidArgumentError, match="no MLflow store"):
            sync(built.path, bad, tracking_uri=typo)
        assert not Path(typo[len("sqlite:///"):]).exists()


def test_source_of_unsynced_run_says_how_to_fix(store, new_run):
    from hookline.storage import FormatError

    rid = new_run()
    with pytest.raises(FormatError, match="hookline sync"):
        mlflow_source(f"runs:/{rid}", tracking_uri=store).manifests()


def test_default_tracking_uri_is_mlflows_resolution(sqlite_tracking_uri, tmp_path):
    from mlflow import MlflowClient

    repo_db = REPO / "mlflow.db"  # may exist from running the demo in the checkout
    before = repo_db.stat().st_mtime_ns if repo_db.exists() else None
    rid = MlflowClient().create_run("0").info.run_id  # MLFLOW_TRACKING_URI set by the fixture
    built = build_run(tmp_path / "run", SPECS[:1], records=2)
    assert sync(built.path, rid).ok
    assert MlflowClient(sqlite_tracking_uri).get_run(rid).data.tags["hookline.handles"] == "1"
    after = repo_db.stat().st_mtime_ns if repo_db.exists() else None
    assert after == before, "the test wrote to the repository's mlflow.db"


# --------------------------------------------------------------------------------------------
# failure: the server dies mid-run, then comes back
# --------------------------------------------------------------------------------------------


def test_server_killed_mid_run_then_sync_completes_without_duplicates(mlflow_server_factory, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    # (MLflow's default retries: the reachability check, not a setting, makes the failure quick)
    server = mlflow_server_factory()
    client = MlflowClient(server.uri)
    rid = client.create_run(client.create_experiment("kill")).info.run_id
    built = build_run(tmp_path / "run", SPECS, records=8, upto=4, close=False)  # training: 4 steps flushed
    adapter = MlflowAdapter(rid, tracking_uri=server.uri)
    adapter.submit(built.path)  # mid-run pass (the writer is open): metrics + tags of 4 records
    rep = adapter.wait(timeout=60)
    assert rep.ok and rep.metrics > 0 and rep.uploaded == []
    assert len(client.get_metric_history(rid, metric_key("grads[blocks.0]", "grad_out.0"))) == 4

    server.kill()
    append_records(built, built.writer, 4, 8)  # training goes on while the server is down
    built.writer.flush()
    t0 = time.perf_counter()
    adapter.submit(built.path)  # the training thread never sees the failure
    assert time.perf_counter() - t0 < 0.05
    built.writer.close()
    before = {p: sha256(p) for p in built.path.rglob("*") if p.is_file()}
    with pytest.raises(TrackingUnreachableError, match=f"hookline sync .* --run-id {rid}") as ei:
        adapter.close(timeout=120)
    assert isinstance(ei.value, ConnectionError) and ei.value.report.errors
    assert f"cannot reach the MLflow tracking server at {server.uri!r}" in str(ei.value)
    assert adapter.close(raise_on_error=False) is ei.value.report  # reported once, then returned
    assert {p: sha256(p) for p in built.path.rglob("*") if p.is_file()} == before  # local files untouched

    server.restart()  # same backend store and artifact dir
    report = sync(built.path, rid, tracking_uri=server.uri)
    assert report.ok and len(report.uploaded) == 3
    assert sync(built.path, rid, tracking_uri=server.uri).uploaded == []
    dl = tmp_path / "dl"
    for rel in ("outputs/blocks.0.h5", "grads/blocks.0.h5", "manifest.json"):
        got = client.download_artifacts(rid, f"hookline/{rel}", dst_path=str(dl))
        assert sha256(Path(got)) == sha256(built.path / rel)
    for hid in built.data:
        hist = _history(client, rid, metric_key(hid, built.fields[hid]))
        assert [s for s, _ in hist] == list(built.steps[hid])  # every step exactly once
        if not hid.startswith("grads"):
            continue
        # the running max has a point per record, none twice, across the passes
        mx = _history(client, rid, metric_key(hid, built.fields[hid], "norm_max"))
        assert [s for s, _ in mx] == list(built.steps[hid])
        assert mx[-1][1] == pytest.approx(built.norms(hid).max(), rel=1e-6)
    tags = client.get_run(rid).data.tags
    assert tags[tag_key("grads[blocks.0]", "records")] == "8"
    assert "hookline/grads/blocks.0.h5" in _sync_record(client, rid, tmp_path / "state")


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_unreachable_server_and_bad_uris_are_clear_errors(sqlite_tracking_uri, tmp_path):
    """A dead server is a ConnectionError that quotes the URI (MLflow alone retried for about
    four minutes per request); a URI MLflow cannot use is an InvalidArgumentError."""
    from mlflow import MlflowClient

    built = build_run(tmp_path / "run", SPECS, records=3)
    rid = MlflowClient(sqlite_tracking_uri).create_run("0").info.run_id
    dead = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(TrackingUnreachableError, match=re.escape(repr(dead))) as ei:
        sync(built.path, rid, tracking_uri=dead)
    assert isinstance(ei.value, OSError) and "hookline sync" in str(ei.value)
    with pytest.raises(TrackingUnreachableError):
        mlflow_source(f"runs:/{rid}", tracking_uri=dead)
    for bad in ("htp://127.0.0.1:5000",):
        with pytest.raises(InvalidArgumentError, match=re.escape(repr(bad))):
            sync(built.path, rid, tracking_uri=bad)
    with pytest.raises(TypeError, match="got 5000"):
        check_reachable(5000)
    # credentials stay out of the message; a bad timeout setting is named
    with pytest.raises(TrackingUnreachableError) as ei:
        check_reachable(dead.replace("http://", "http://user:secret@"))
    assert "secret" not in str(ei.value) and repr(dead) in str(ei.value)
    for raw in ("ten", "0"):
        os.environ["HOOKLINE_MLFLOW_TIMEOUT"] = raw
        try:
            with pytest.raises(InvalidArgumentError, match=f"HOOKLINE_MLFLOW_TIMEOUT .* got {raw!r}"):
                check_reachable(dead)
        finally:
            del os.environ["HOOKLINE_MLFLOW_TIMEOUT"]


def test_reachability_counts_any_answer(tmp_path):
    """Any HTTP status, a path prefix, credentials in the URI, and a TLS handshake error (MLflow
    has its own certificate settings) all mean the server is there."""
    import http.server
    import threading

    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(401 if "secret" in self.path else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_port
        for uri in (f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/mlflow/", f"http://u:pw@127.0.0.1:{port}",
                    f"https://127.0.0.1:{port}"):
            check_reachable(uri)
    finally:
        srv.shutdown()


def test_a_second_run_directory_is_refused_by_a_synced_run(sqlite_tracking_uri, tmp_path):
    """Its files would replace the first one's (same artifact paths) and its records would lose
    their metric points (the first one's watermark): that happened silently before."""
    from mlflow import MlflowClient

    from hookline.storage import DuplicateNameError

    client = MlflowClient(sqlite_tracking_uri)
    rid = client.create_run("0").info.run_id
    first = build_run(tmp_path / "first", SPECS, records=3)
    second = build_run(tmp_path / "second", SPECS, records=5)
    assert sync(first.path, rid, tracking_uri=sqlite_tracking_uri).ok
    before = client.get_run(rid).data.tags
    with pytest.raises(DuplicateNameError, match="already holds the hookline data of another run directory"):
        sync(second.path, rid, tracking_uri=sqlite_tracking_uri)
    assert client.get_run(rid).data.tags == before
    dl = client.download_artifacts(rid, "hookline/outputs/blocks.0.h5", str(tmp_path / "dl"))
    assert sha256(Path(dl)) == sha256(first.path / "outputs/blocks.0.h5")
    assert sync(first.path, rid, tracking_uri=sqlite_tracking_uri).ok  # the same directory: fine


def _run_and_writer(uri: str, tmp_path: Path, hid: str):
    """A new MLflow run and a RunWriter on ``tmp_path/run`` with one Linear handle ``hid``."""
    from mlflow import MlflowClient

    from hookline.storage import RunWriter

    client = MlflowClient(uri)
    kind, _, name = hid.partition("[")
    w = RunWriter(tmp_path / "run", fsync=False)
    w.add_handle(hid, module_name=name[:-1], module_type=LINEAR,
                 category="backward_hook" if kind == "grads" else "forward_hook", hook_fn_name=kind)
    return client, client.create_run("0").info.run_id, w


def test_the_same_directory_resyncs_after_repair_and_after_continuing_an_old_run(sqlite_tracking_uri, tmp_path):
    """A manifest rebuilt by verify --repair keeps the run's identity (from the files), and a
    run written before run_uuid existed, continued later, is still the same run."""
    from hookline.storage import RunWriter, verify

    client, rid, w = _run_and_writer(sqlite_tracking_uri, tmp_path, "outputs[m]")
    for step in range(3):
        w.write("outputs[m]", step, 0, {"outputs.0": np.full(4, step, np.float32)})
    w.close()
    run = tmp_path / "run"
    assert sync(run, rid, tracking_uri=sqlite_tracking_uri).ok
    (run / "manifest.json").unlink()
    assert verify(run, repair=True).ok
    assert sync(run, rid, tracking_uri=sqlite_tracking_uri).ok  # (was refused as another directory)

    # an old-format run: no run_uuid anywhere; synced, then continued by a writer
    man = json.loads((run / "manifest.json").read_text())
    man.pop("run_uuid", None)
    (run / "manifest.json").write_text(json.dumps(man))
    rid2 = client.create_run("0").info.run_id
    assert sync(run, rid2, tracking_uri=sqlite_tracking_uri).ok
    w = RunWriter(run, fsync=False)
    w.add_handle("outputs[m]", module_name="m", module_type=LINEAR, category="forward_hook", hook_fn_name="outputs")
    w.write("outputs[m]", 3, 0, {"outputs.0": np.full(4, 3, np.float32)})
    w.close()
    assert sync(run, rid2, tracking_uri=sqlite_tracking_uri).ok
    # recorded by rank 0 of 1, continued by rank 0 of 2 (new per-rank manifests): the same run
    ddp = tmp_path / "ddp"
    rid3 = client.create_run("0").info.run_id
    for step, ws in ((0, 1), (1, 2)):
        w = RunWriter(ddp, fsync=False, rank=0, world_size=ws)
        w.add_handle("outputs[m]", module_name="m", module_type=LINEAR, category="forward_hook",
                     hook_fn_name="outputs")
        w.write("outputs[m]", step, 0, {"outputs.0": np.full(4, step, np.float32)})
        w.close()
        assert sync(ddp, rid3, tracking_uri=sqlite_tracking_uri).ok


def test_summaries_stay_current_when_steps_restart(sqlite_tracking_uri, tmp_path):
    """Steps that restart per epoch: the summaries of the second pass were logged at a lower step
    than the first pass's, so MLflow kept showing the first (norm_max 2.6 for a true 250)."""
    client, rid, w = _run_and_writer(sqlite_tracking_uri, tmp_path, "grads[fc]")
    rng = np.random.default_rng(0)
    norms = []
    for epoch, (steps, scale) in enumerate(((range(10), 1.0), (range(5), 100.0))):
        for step in steps:
            g = (rng.standard_normal(8) * scale).astype(np.float32)
            norms.append(float(np.linalg.norm(g)))
            w.write("grads[fc]", step, 0, {"grad_out.0": g})
        if epoch == 0:  # a mid-run pass (metrics only)
            w.flush()
            adapter = MlflowAdapter(rid, tracking_uri=sqlite_tracking_uri)
            adapter.submit(tmp_path / "run")
            assert adapter.wait(timeout=60).metrics > 0
    w.close()
    assert adapter.close(timeout=60).ok  # the final pass
    got = client.get_run(rid).data.metrics
    assert got[metric_key("grads[fc]", "grad_out.0", "norm_max")] == pytest.approx(max(norms), rel=1e-5)
    key = metric_key("grads[fc]", "grad_out.0", "norm_max")
    mx = [m.value for m in sorted(client.get_metric_history(rid, key), key=lambda m: m.timestamp)]
    np.testing.assert_allclose(mx, np.maximum.accumulate(norms), rtol=1e-5)  # a line: every record's running max
    assert client.search_runs(["0"], filter_string=f"metrics.`{key}` > 50")


def test_a_tensor_field_named_norm_gets_its_own_l2_norm(sqlite_tracking_uri, tmp_path):
    """A module returning {"norm": tensor}: its field outputs.norm was taken for a stats-mode norm
    and logged as |first element|."""
    client, rid, w = _run_and_writer(sqlite_tracking_uri, tmp_path, "outputs[m]")
    rng = np.random.default_rng(1)
    values = []
    for step in range(3):
        y = rng.standard_normal((2, 8)).astype(np.float32)
        values.append(y)
        w.write("outputs[m]", step, 0, {"outputs.norm": y, "outputs.feat": y * 2})
    w.close()
    assert sync(tmp_path / "run", rid, tracking_uri=sqlite_tracking_uri).ok
    for field, scale in (("outputs.norm", 1), ("outputs.feat", 2)):
        hist = _history(client, rid, metric_key("outputs[m]", field))
        np.testing.assert_allclose([v for _, v in hist], [np.linalg.norm(y * scale) for y in values], rtol=1e-5)


def test_a_deleted_run_is_refused_before_anything_is_uploaded(sqlite_tracking_uri, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_tracking_uri)
    rid = client.create_run("0").info.run_id
    client.delete_run(rid)
    built = build_run(tmp_path / "run", SPECS, records=2)
    with pytest.raises(UnknownNameError, match="is deleted"):
        sync(built.path, rid, tracking_uri=sqlite_tracking_uri)
    client.restore_run(rid)
    assert client.list_artifacts(rid) == []  # nothing went into the deleted run
    assert sync(built.path, rid, tracking_uri=sqlite_tracking_uri).ok


def test_pending_uploads_are_flushed_at_interpreter_exit(sqlite_tracking_uri, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_tracking_uri)
    rid = client.create_run("0").info.run_id
    built = build_run(tmp_path / "run", SPECS, records=3)
    code = (f"from hookline.storage import MlflowAdapter\n"
            f"a = MlflowAdapter({rid!r}, tracking_uri={sqlite_tracking_uri!r})\n"
            f"a.submit({str(built.path)!r})\n")  # no wait(), no close(): the exit hook must finish
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert {a.path for a in client.list_artifacts(rid, "hookline")} >= {"hookline/manifest.json"}
    assert len(client.get_metric_history(rid, metric_key("grads[blocks.0]", "grad_out.0"))) == 3


def test_partial_fields_and_stats_mode_fields(sqlite_tracking_uri, tmp_path):
    from mlflow import MlflowClient

    from hookline.storage import RunWriter

    client = MlflowClient(sqlite_tracking_uri)
    rid = client.create_run("0").info.run_id
    rng = np.random.default_rng(3)
    w = RunWriter(tmp_path / "run", fsync=False)
    w.add_handle("grads[fc]", module_name="fc", module_type=LINEAR, category="backward_hook", hook_fn_name="grads")
    w.add_handle("stats[fc]", module_name="fc", module_type=LINEAR, category="forward_hook", hook_fn_name="stats")
    gin, gout, norms = {}, {}, []
    for step in range(6):
        rec = {"grad_out.0": rng.standard_normal((3, 2)).astype(np.float32)}
        gout[step] = rec["grad_out.0"]
        if step % 2 == 0:  # grad_in.0 is None on odd steps: absent from those records
            rec["grad_in.0"] = gin[step] = rng.standard_normal((5,)).astype(np.float32)
        w.write("grads[fc]", step, 0, rec)
        n = float(rng.uniform(1, 2))
        norms.append(n)
        w.write("stats[fc]", step, 0, {"outputs.0.norm": np.array(n, np.float32),
                                       "outputs.0.mean": np.array(0.5, np.float32)})
    w.close()
    assert sync(tmp_path / "run", rid, tracking_uri=sqlite_tracking_uri).ok
    hin = _history(client, rid, metric_key("grads[fc]", "grad_in.0"))
    assert [s for s, _ in hin] == [0, 2, 4]
    np.testing.assert_allclose([v for _, v in hin], [np.linalg.norm(gin[s]) for s in (0, 2, 4)], rtol=1e-5)
    assert len(_history(client, rid, metric_key("grads[fc]", "grad_out.0"))) == 6
    hs = _history(client, rid, metric_key("stats[fc]", "outputs.0"))  # the stored norm is the series
    np.testing.assert_allclose([v for _, v in hs], norms, rtol=1e-6)
    keys = set(client.get_run(rid).data.metrics)
    assert not any("mean" in k for k in keys), keys
    assert {metric_key("grads[fc]", f) for f in ("grad_in.0", "grad_out.0")} <= keys


def test_one_failed_upload_is_reported_and_retried_alone(sqlite_tracking_uri, tmp_path, monkeypatch):
    from mlflow import MlflowClient
    from mlflow.store.artifact.local_artifact_repo import LocalArtifactRepository

    client = MlflowClient(sqlite_tracking_uri)
    rid = client.create_run("0").info.run_id
    built = build_run(tmp_path / "run", SPECS, records=3)
    adapter = MlflowAdapter(rid, tracking_uri=sqlite_tracking_uri)
    real = LocalArtifactRepository.log_artifact

    def flaky(repo, local_file, artifact_path=None):  # (the artifact store refuses one file)
        if str(local_file).endswith("grads/blocks.0.h5"):
            raise OSError("disk quota exceeded on the artifact store")
        return real(repo, local_file, artifact_path)

    monkeypatch.setattr(LocalArtifactRepository, "log_artifact", flaky)
    with pytest.raises(TrackingError, match="grads/blocks.0.h5.*disk quota") as ei:
        adapter.log_run_dir(built.path)
    rep = ei.value.report
    assert rep.uploaded == ["hookline/outputs/blocks.0.h5"] and rep.metrics > 0
    assert "hookline/manifest.json" not in rep.uploaded  # the manifest waits for every file
    assert set(_sync_record(client, rid, tmp_path / "state")) == {"hookline/outputs/blocks.0.h5"}
    # the size tag says what the run holds: the uploaded file only (sent ahead, then corrected)
    size = (built.path / "outputs" / "blocks.0.h5").stat().st_size
    assert client.get_run(rid).data.tags["hookline.bytes"] == str(size)
    monkeypatch.undo()
    again = sync(built.path, rid, tracking_uri=sqlite_tracking_uri)
    assert again.ok and sorted(again.uploaded) == ["hookline/grads/blocks.0.h5", "hookline/manifest.json"]
    assert again.metrics == 0
    assert len(client.get_metric_history(rid, metric_key("grads[blocks.0]", "grad_out.0"))) == 3


def test_failed_mid_run_pass_made_good_by_the_final_one_is_not_an_error(sqlite_tracking_uri, tmp_path):
    from mlflow import MlflowClient

    client = MlflowClient(sqlite_tracking_uri)
    rid = client.create_run("0").info.run_id
    built = build_run(tmp_path / "run", SPECS, records=3)
    adapter = MlflowAdapter(rid, tracking_uri=sqlite_tracking_uri)
    real = adapter.client.log_batch
    calls = []

    def once_down(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("tracking server unreachable")
        return real(*a, **k)

    adapter.client.log_batch = once_down
    adapter.submit(built.path)
    while not calls:
        time.sleep(0.01)
    final = adapter.close(timeout=60)  # the final pass succeeds: nothing is missing
    assert final.ok and len(final.uploaded) == 3
    assert len(client.get_metric_history(rid, metric_key("grads[blocks.0]", "grad_out.0"))) == 3


def _settled_lines(log: Path) -> int:
    """The access log's line count once it has stopped growing for a second (the server writes
    a request's line after its answer, later still on a loaded machine)."""
    last, since = -1, time.monotonic()
    deadline = since + 30
    while time.monotonic() < deadline:
        n = len(log.read_text(errors="replace").splitlines())
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= 1.0:
            break
        time.sleep(0.05)
    return last


def _requests(log: Path, since: int) -> list[str]:
    """The HTTP requests (method and path) in a server's access log after line ``since``."""
    _settled_lines(log)
    lines = log.read_text(errors="replace").splitlines()[since:]
    return [ln.split('"', 2)[1].split("?", 1)[0].replace(" HTTP/1.1", "") for ln in lines
            if re.search(r'"(GET|POST|PUT) /', ln)]


def test_a_repeat_sync_reads_the_sync_record_in_one_request_without_a_progress_bar(
        shared_mlflow_server, tmp_path, capfd):
    """The sync record is read straight from the run's artifact repository: one GET, no
    progress bar on stderr (MLflow's download_artifacts looks the run up again, lists the path,
    searches the run's logged models and draws a bar)."""
    from mlflow import MlflowClient

    server = shared_mlflow_server
    client = MlflowClient(server.uri)
    rid = client.create_run("0").info.run_id
    built = build_run(tmp_path / "run", SPECS, records=3)
    assert sync(built.path, rid, tracking_uri=server.uri).ok
    log = server.root / "server.log"
    n = _settled_lines(log)
    capfd.readouterr()
    again = sync(built.path, rid, tracking_uri=server.uri)
    err = capfd.readouterr().err
    assert again.ok and again.uploaded == [] and "hookline/manifest.json" in again.skipped, again
    assert "Downloading" not in err and "%|" not in err, err  # (tqdm's bar)
    got = _requests(log, n)
    record_reads = [r for r in got if "sync.json" in r]
    assert len(record_reads) == 1 and record_reads[0].startswith("GET "), got
    assert len([r for r in got if "/runs/get" in r]) == 1 and not [r for r in got if "logged-models" in r], got
    assert len(got) <= 4, got  # probe, get_run, MLflow's capability check of its repository, the record


FIVE = [HandleSpec(f"outputs[blocks.{i}]", LINEAR, "outputs.0") for i in range(3)] + \
    [HandleSpec(f"grads[blocks.{i}]", LINEAR, "grad_out.0", category="backward_hook") for i in range(2)]


def test_a_final_pass_fetches_its_run_once_and_sends_no_separate_probe(shared_mlflow_server, tmp_path):
    """The pass's get_run is its reachability probe, and the uploads go straight to the run's
    artifact repository (MLflow's log_artifact would fetch the run again): one runs/get, one PUT
    per file, summary page, manifest and sync record, one log-batch for a small pass. The handle
    files upload side by side; the summary page and then the manifest are sent once every one of
    them is stored, the sync record once the manifest is (the access log has a request's line once
    it is answered)."""
    from mlflow import MlflowClient

    server = shared_mlflow_server
    rid = MlflowClient(server.uri).create_run("0").info.run_id
    built = build_run(tmp_path / "run", FIVE, records=3)
    log = server.root / "server.log"
    n = _settled_lines(log)
    rep = MlflowAdapter(rid, tracking_uri=server.uri).log_run_dir(built.path)
    assert rep.ok and len(rep.uploaded) == len(FIVE) + 1, rep
    got = _requests(log, n)
    assert [r for r in got if r.startswith("GET ")] == ["GET /api/2.0/mlflow/runs/get"], got
    assert [r for r in got if r.startswith("POST ")] == ["POST /api/2.0/mlflow/runs/log-batch"], got
    assert got[0] == "GET /api/2.0/mlflow/runs/get", got  # (nothing is sent before the run is checked)
    puts = [r for r in got if r.startswith("PUT ")]
    data = [i for i, r in enumerate(puts) if r.endswith(".h5")]
    assert len(data) == len(FIVE) and len(puts) == len(FIVE) + 3, got
    assert puts[-3].endswith("/hookline/summary.html") and max(data) < len(puts) - 3, got
    assert puts[-2].endswith("/hookline/manifest.json"), got
    assert puts[-1].endswith("/hookline/sync.json"), got


def test_opening_a_run_from_mlflow_probes_with_its_get_run(shared_mlflow_server, tmp_path):
    """``mlflow_source`` (``show runs:/ID``) fetches its run with the reachability probe itself:
    one runs/get, no separate experiments/get before it."""
    from mlflow import MlflowClient

    server = shared_mlflow_server
    rid = MlflowClient(server.uri).create_run("0").info.run_id
    built = build_run(tmp_path / "run", SPECS, records=3)
    assert sync(built.path, rid, tracking_uri=server.uri).ok
    log = server.root / "server.log"
    n = _settled_lines(log)
    src = mlflow_source(f"runs:/{rid}", tracking_uri=server.uri, cache_dir=tmp_path / "cache")
    assert _requests(log, n) == ["GET /api/2.0/mlflow/runs/get"]
    assert [m["run_uuid"] for m in src.manifests()] == [json.loads((built.path / "manifest.json").read_text())["run_uuid"]]


@pytest.mark.parametrize("fresh", [True, False])
def test_a_prefetched_run_is_the_passs_only_get_run_while_fresh(shared_mlflow_server, tmp_path, monkeypatch, fresh):
    """``prefetch()`` (Recorder.close() calls it before closing its files) sends the pass's
    ``get_run`` ahead: the pass then sends none of its own. A prefetch older than
    ``PREFETCH_FRESH_S`` is not used: the pass fetches the run again."""
    from mlflow import MlflowClient

    import hookline.storage.mlflow.upload as upload

    if not fresh:
        monkeypatch.setattr(upload, "PREFETCH_FRESH_S", 0.0)
    server = shared_mlflow_server
    rid = MlflowClient(server.uri).create_run("0").info.run_id
    built = build_run(tmp_path / "run", SPECS, records=3)
    log = server.root / "server.log"
    adapter = MlflowAdapter(rid, tracking_uri=server.uri)
    n = _settled_lines(log)
    adapter.prefetch()
    assert _settled_lines(log) > n and _requests(log, n) == ["GET /api/2.0/mlflow/runs/get"]  # sent at once
    rep = adapter.log_run_dir(built.path)
    assert rep.ok and len(rep.uploaded) == len(SPECS) + 1, rep
    gets = [r for r in _requests(log, n) if r.startswith("GET ")]
    assert gets == ["GET /api/2.0/mlflow/runs/get"] * (1 if fresh else 2), gets
    adapter.close()


def test_recorder_close_fetches_its_run_once_before_its_files_are_closed(shared_mlflow_server, tmp_path,
                                                                           monkeypatch):
    """Recorder.close() starts the final pass's get_run before it closes its files (the server
    answers it meanwhile); the pass uses that one."""
    import torch
    from mlflow import MlflowClient

    from hookline.storage.writer import RunWriter
    from hookline.tracker import HookManager, Recorder, select

    server = shared_mlflow_server
    rid = MlflowClient(server.uri).create_run("0").info.run_id
    log = server.root / "server.log"
    seen: list[list[str]] = []
    real_close = RunWriter.close

    def close_and_look(self, *a, **k):  # (the requests sent by the time the files are closed:
        try:                               # the final pass starts only after this returns)
            return real_close(self, *a, **k)
        finally:
            seen.append(_requests(log, n))

    monkeypatch.setattr(RunWriter, "close", close_and_look)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))
    rec = Recorder(tmp_path / "rec", mlflow_run_id=rid, tracking_uri=server.uri)
    HookManager().register_forward_hook(rec.outputs, **select(model, "*", types=torch.nn.Linear))
    for step in range(3):
        with rec.step(step):
            model(torch.randn(2, 4))
    n = _settled_lines(log)
    rec.close()
    got = _requests(log, n)
    assert [r for r in got if r.startswith("GET ")] == ["GET /api/2.0/mlflow/runs/get"], got
    assert sum("manifest.json" in r for r in got) == 1, got
    assert seen == [["GET /api/2.0/mlflow/runs/get"]], seen  # fetched while the files closed
