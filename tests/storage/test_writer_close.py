"""What RunWriter.close() does on disk: the work it skips and what a crash in the middle leaves."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import hookline.storage.writer.manifest as manifest_mod
import hookline.storage.writer.thread as thread_mod
from hookline.storage import RunWriter, StorageError, open_run, verify


def _writer(run_dir, n: int, **kw) -> RunWriter:
    w = RunWriter(run_dir, fsync=False, **kw)
    for k in range(n):
        w.add_handle(f"outputs[m{k}]", module_name=f"m{k}", category="forward_hook", hook_fn_name="outputs")
    return w


def _write_steps(w: RunWriter, n: int, steps: range) -> None:
    for s in steps:
        for k in range(n):
            w.write(f"outputs[m{k}]", s, 0, {"outputs.0": np.full(3, s * 100 + k, np.float32)})


def test_close_writes_the_manifest_once(tmp_path, monkeypatch):
    """The final manifest only: no 'open' one after sealing the last parts (a 1,000-handle
    manifest is ~50 ms of JSON and an fsync)."""
    w = _writer(tmp_path / "run", 5)
    _write_steps(w, 5, range(3))
    w.flush()
    _write_steps(w, 5, range(3, 6))
    statuses: list[str] = []
    real = manifest_mod.atomic_write_json

    def counting(path, obj, **kw):
        statuses.append(obj["status"])
        return real(path, obj, **kw)

    monkeypatch.setattr(manifest_mod, "atomic_write_json", counting)
    w.close()
    assert statuses == ["closed"]
    run = open_run(tmp_path / "run")
    assert [run[f"outputs[m{k}]"]["outputs.0"].read()[:, 0].tolist() for k in range(5)] == \
        [[s * 100 + k for s in range(6)] for k in range(5)]


def test_close_lists_a_handle_added_since_the_last_manifest_before_finishing(tmp_path, monkeypatch):
    """A handle the manifest does not list yet is listed ('open') before the final files are
    made, so a crash in between leaves every handle in the manifest."""
    w = _writer(tmp_path / "run", 2)
    _write_steps(w, 2, range(2))
    w.flush()
    seen: list[tuple[str, list[str]]] = []
    real = manifest_mod.atomic_write_json

    def recording(path, obj, **kw):
        seen.append((obj["status"], sorted(obj["handles"])))
        return real(path, obj, **kw)

    monkeypatch.setattr(manifest_mod, "atomic_write_json", recording)
    w.add_handle("outputs[late]")
    w.write("outputs[late]", 0, 0, {"outputs.0": np.zeros(3, np.float32)})
    w.close()
    assert seen[-1][0] == "closed"
    assert all("outputs[late]" in handles for _, handles in seen)


def test_single_segment_handle_becomes_its_final_file_without_a_copy(tmp_path, monkeypatch):
    """A handle written in one part: close() renames the sealed segment into ``<key>.h5`` (the
    same inode; no merge opens it)."""
    inodes: dict[str, int] = {}
    real_finalize = thread_mod.finalize

    def noting(ctx, h, dirs=None):
        for s in h.sealed:
            inodes[h.key] = os.stat(ctx.run_dir / s.name).st_ino
        return real_finalize(ctx, h, dirs)

    monkeypatch.setattr(thread_mod, "finalize", noting)
    w = _writer(tmp_path / "run", 3)
    _write_steps(w, 3, range(4))
    w.close()
    for k in range(3):
        assert os.stat(tmp_path / "run" / "outputs" / f"m{k}.h5").st_ino == inodes[f"outputs/m{k}"]


def test_crash_while_finishing_leaves_every_sealed_record_readable(tmp_path, monkeypatch):
    """close() failing after some handles got their final file and before the final manifest:
    every record reads back (final files and sealed segments side by side) and
    verify(repair=True) finishes the run."""
    w = _writer(tmp_path / "run", 4)
    _write_steps(w, 4, range(2))
    w.flush()
    _write_steps(w, 4, range(2, 5))
    calls = [0]
    real_finalize = thread_mod.finalize

    def failing(ctx, h, dirs=None):
        calls[0] += 1
        if calls[0] == 3:
            raise OSError(5, "simulated I/O error")
        return real_finalize(ctx, h, dirs)

    monkeypatch.setattr(thread_mod, "finalize", failing)
    with pytest.raises(StorageError):
        w.close()
    m = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert m["status"] == "failed"
    assert m["handles"]["outputs[m3]"]["records"] == 5  # (sealed before the failure: durable)
    assert (tmp_path / "run" / "outputs" / "m0.h5").exists()
    assert not (tmp_path / "run" / "outputs" / "m3.h5").exists()
    run = open_run(tmp_path / "run")
    for k in range(4):
        assert run[f"outputs[m{k}]"]["outputs.0"].read()[:, 0].tolist() == [s * 100 + k for s in range(5)]
    run.close()
    rep = verify(tmp_path / "run", repair=True)
    assert rep.ok, str(rep)
    assert sorted(p.name for p in (tmp_path / "run" / "outputs").iterdir()) == [f"m{k}.h5" for k in range(4)]
