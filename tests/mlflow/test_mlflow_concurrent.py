"""A final pass uploads its handle files side by side: one that the server fails to store is
reported, left out of the sync record (and the manifest waits), and the next sync uploads it.

Against a real ``mlflow server``: the failure is the server's own (its artifact store cannot write
the file where a folder of that name stands), no MLflow class is replaced.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from _mlflow_support import LINEAR, HandleSpec, build_run

from hookline.storage import sync
from hookline.storage.mlflow.upload import PassMode, Uploader

FIVE = [HandleSpec(f"outputs[blocks.{i}]", LINEAR, "outputs.0") for i in range(3)] + \
    [HandleSpec(f"grads[blocks.{i}]", LINEAR, "grad_out.0", category="backward_hook") for i in range(2)]


def _server_path(server, run, artifact: str) -> Path:
    """Where the server's artifact store keeps ``artifact`` of ``run`` (proxied artifacts)."""
    prefix = "mlflow-artifacts:/"
    assert run.info.artifact_uri.startswith(prefix), run.info.artifact_uri
    return server.artifacts / run.info.artifact_uri[len(prefix):].lstrip("/") / artifact


def _record(client, run_id: str, dst: Path) -> dict[str, str]:
    dst.mkdir(parents=True, exist_ok=True)
    got = client.download_artifacts(run_id, "hookline/sync.json", dst_path=str(dst))
    return json.loads(Path(got).read_text())["files"]


def test_a_file_the_server_fails_to_store_mid_pass_is_reported_and_uploaded_by_the_next_sync(
        shared_mlflow_server, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    # MLflow would retry the 500 for minutes: one quick retry instead. Not none: after the 500 the
    # server closes a connection that the client's pool may hand to the next request, which
    # MLflow's retry covers (with none, that request fails with "connection reset").
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0")
    server = shared_mlflow_server
    client = MlflowClient(server.uri)
    run = client.create_run("0")
    rid = run.info.run_id
    built = build_run(tmp_path / "run", FIVE, records=3)
    bad = "hookline/outputs/blocks.1.h5"  # (the middle one of the files uploaded side by side)
    blocker = _server_path(server, run, bad)
    blocker.mkdir(parents=True)  # the server cannot write the file: a folder has its name

    # (the pass fetches its run while it checks the files, as Recorder.close()'s pass does)
    rep = Uploader(rid, tracking_uri=server.uri).run(built.path, PassMode.FINAL)
    assert not rep.ok and not rep.unreachable, rep  # (one file failed, not the server)
    others = sorted(f"hookline/{p.relative_to(built.path).as_posix()}" for p in built.path.rglob("*.h5")
                    if p.name != "blocks.1.h5" or p.parent.name != "outputs")
    assert len(others) == len(FIVE) - 1
    assert sorted(rep.uploaded) == others, rep  # the others landed; the manifest waits for every file
    assert [e for e in rep.errors if bad in e] == rep.errors and len(rep.errors) == 1, rep.errors
    # (what the server answered, quoted: its 500, or the connection it closed after one)
    assert "500" in rep.errors[0] or "Connection reset" in rep.errors[0], rep.errors
    assert sorted(_record(client, rid, tmp_path / "rec1")) == others  # neither the failed file nor the manifest
    listed = {f.path for f in client.list_artifacts(rid, "hookline")}
    assert "hookline/manifest.json" not in listed, listed

    shutil.rmtree(blocker)
    again = sync(built.path, rid, tracking_uri=server.uri)
    assert again.ok, again.errors
    assert sorted(again.uploaded) == sorted([bad, "hookline/manifest.json"]), again  # only what was missing
    assert sorted(again.skipped) == others, again
    assert again.summary == "hookline/summary.html"  # (the page, made once every file is there)
    assert sorted(_record(client, rid, tmp_path / "rec2")) == sorted([*others, bad, "hookline/manifest.json",
                                                                      "hookline/summary.html"])
    stored = _server_path(server, run, bad)
    assert stored.is_file() and stored.read_bytes() == (built.path / "outputs" / "blocks.1.h5").read_bytes()


def test_norms_read_ahead_from_record_0_equal_those_read_from_the_watermark(tmp_path):
    """A pass checks files before its run (and so the run's watermark) is in, reading the norms
    from record 0; brought up to the watermark they are what reading from it gives."""
    import numpy as np

    from hookline.storage.mlflow.rundir import file_damage, norm_fields, series_since

    built = build_run(tmp_path / "run", FIVE, records=5)
    man = json.loads((built.path / "manifest.json").read_text())
    entry = man["handles"]["grads[blocks.1]"]
    fields = norm_fields(entry["fields"])
    path = built.path / entry["file"]

    def read(start: int) -> list:
        out: dict = {}
        assert file_damage(path, "grads[blocks.1]", entry, exact=True, norms=(fields, start, out)) is None
        return out["series"]

    ahead = read(0)
    for start in (0, 2, 4):
        want, got = read(start), series_since(ahead, start)
        assert [s.base for s in got] == [s.base for s in want] and len(got) == len(fields)
        for g, w in zip(got, want):
            assert len(g.records) == 5 - start
            for name in ("records", "steps", "norms", "all_norms", "all_steps", "all_records"):
                np.testing.assert_array_equal(getattr(g, name), getattr(w, name))
