"""verify(): reports, repairs, never deletes data."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from hookline.storage import open_run, verify
from _storage_support import GID, HID, record_value, wait_for_partial, write_std_run


def _killed_run(run_dir):
    """Simulate a killed writer: flushed segments + an unflushed .partial, no close()."""
    w = write_std_run(run_dir, n=30, flush_every=5, fsync=False)
    for i in range(30, 33):
        w.write(HID, i, 0, {"outputs.0": record_value(i)})
    wait_for_partial(run_dir)
    # Copy the directory as it is now (like a SIGKILL snapshot), then let the writer finish.
    snap = run_dir.parent / "killed"
    shutil.copytree(run_dir, snap)
    w.close()
    return snap


def test_clean_run_is_ok(run_dir):
    write_std_run(run_dir, n=8).close()
    rep = verify(run_dir)
    assert rep.ok and rep.records == 16, str(rep)
    h = next(h for h in rep.handles if h.handle_id == HID)
    assert h.files == ["outputs/blocks.0.h5"] and h.fields == {"outputs.0": 8, "outputs.1": 8}
    d = rep.to_dict()
    assert d["ok"] is True and json.dumps(d)


def test_killed_run_reported_then_repaired(run_dir):
    snap = _killed_run(run_dir)
    rep = verify(snap)
    assert not rep.ok
    text = str(rep)
    assert "partial" in text and "not merged" in text
    before = open_run(snap)[HID]
    n = len(before)
    assert n == 30
    ref = before["outputs.0"].read()
    rep = verify(snap, repair=True)
    assert rep.ok, str(rep)
    assert sorted(p.name for p in (snap / "outputs").iterdir()) == ["blocks.0.h5"]
    assert any(p.name.endswith(".partial") for p in (snap / ".quarantine").rglob("*"))  # moved, not deleted
    after = open_run(snap)
    assert after.status == "closed"
    assert np.array_equal(after[HID]["outputs.0"].read(), ref)
    assert after[GID]["grad_out.0"].steps.tolist() == list(range(0, 30, 2))
    m = json.loads((snap / "manifest.json").read_text())
    assert m["handles"][HID]["records"] == 30
    assert verify(snap).ok


def test_corrupt_file_is_moved_aside(run_dir):
    w = write_std_run(run_dir, n=20, flush_every=5, fsync=False)
    snap = run_dir.parent / "snap"
    shutil.copytree(run_dir, snap)
    w.close()
    segs = sorted((snap / "outputs").glob("*.h5seg"))
    assert segs[-1].name.endswith("r000000000015-000000000020.h5seg")
    segs[-1].write_bytes(b"garbage" * 100)  # last segment destroyed
    rep = verify(snap)
    assert not rep.ok and "unreadable" in str(rep)
    with pytest.warns(UserWarning, match="unreadable"):
        assert len(open_run(snap)[HID]) == 15  # the reader uses what is readable
    rep = verify(snap, repair=True)
    assert rep.ok, str(rep)
    assert (snap / ".quarantine" / "outputs" / segs[-1].name).read_bytes().startswith(b"garbage")
    assert len(open_run(snap)[HID]) == 15
    m = json.loads((snap / "manifest.json").read_text())
    assert m["handles"][HID]["records"] == 15 and m["handles"][HID]["lost"]


def test_a_handle_without_records_is_ok_and_repair_keeps_its_file(run_dir):
    """(verify reported 'not merged ... 1 redundant' and repair quarantined the file.)"""
    write_std_run(run_dir, n=0).close()
    rep = verify(run_dir)
    assert rep.ok, str(rep)
    files = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*.h5"))
    assert len(files) == 2
    rep = verify(run_dir, repair=True)
    assert rep.ok and not rep.to_dict().get("moved"), str(rep)
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*.h5")) == files
    assert not (run_dir / ".quarantine").exists()
    assert verify(run_dir).ok
    assert len(open_run(run_dir)[HID]) == 0


def test_repair_keeps_the_merged_file_when_an_empty_final_file_was_continued(run_dir):
    """A handle closed without records (empty final file), continued by a writer killed before
    close: repair merged the segment into the final file and then moved that merged file to
    quarantine as 'redundant' (the run read empty)."""
    from hookline.storage import RunWriter
    from _storage_support import add_std_handles

    write_std_run(run_dir, n=0).close()
    w = RunWriter(run_dir, fsync=False, merge_on_close=False)
    add_std_handles(w)
    for i in range(3):
        w.write(HID, i, 0, {"outputs.0": record_value(i), "outputs.1": np.arange(2, dtype=np.int64)})
    w.close()  # segments stay next to the empty final file
    rep = verify(run_dir, repair=True)
    assert rep.ok, str(rep)
    run = open_run(run_dir)
    assert len(run[HID]) == 3 and np.array_equal(run[HID]["outputs.0"][2], record_value(2))
    assert verify(run_dir).ok


def test_a_handle_whose_every_file_is_damaged_reads_as_empty(run_dir):
    """The rest of the run stays readable (open_run, len() and show raised for the whole run
    when the only segment of one handle was damaged)."""
    w = write_std_run(run_dir, n=10, flush_every=10, fsync=False)
    snap = run_dir.parent / "snap"
    shutil.copytree(run_dir, snap)
    w.close()
    segs = sorted((snap / "outputs").glob("*.h5seg"))
    assert segs
    for seg in segs:  # every segment of the outputs handle truncated
        seg.write_bytes(seg.read_bytes()[:3000])
    run = open_run(snap)
    with pytest.warns(UserWarning, match="unreadable"):
        assert len(run[HID]) == 0 and run[HID].fields == []
    assert run[HID].problems and "truncated" in run[HID].problems[0]
    assert len(run[GID]) == 10 and len(run[GID]["grad_out.0"]) == 5
    assert not verify(snap).ok


def test_missing_manifest_is_rebuilt(run_dir):
    write_std_run(run_dir, n=4, meta={"lr": 0.1}).close()
    os.unlink(run_dir / "manifest.json")
    run = open_run(run_dir)  # synthesised from file attributes
    assert sorted(run.handles) == sorted([HID, GID])
    rep = verify(run_dir)
    assert not rep.ok and "manifest.json is missing" in str(rep)  # (was reported OK)
    rep = verify(run_dir, repair=True)
    assert rep.ok, str(rep)
    assert (run_dir / "manifest.json").exists()
    run = open_run(run_dir)
    assert len(run[HID]) == 4 and run.meta["lr"] == 0.1  # the run metadata comes back too
    assert verify(run_dir).ok


def test_a_repaired_unreadable_manifest_is_ok(run_dir):
    """(The repair worked, but the report still said PROBLEMS and the CLI exited 1.)"""
    write_std_run(run_dir, n=4).close()
    (run_dir / "manifest.json").write_text('{"format": "hookline-run", "handles": ')
    assert not verify(run_dir).ok
    rep = verify(run_dir, repair=True)
    assert rep.ok and any("manifest unreadable" in r for r in rep.repaired), str(rep)
    assert verify(run_dir).ok and len(open_run(run_dir)[HID]) == 4


def test_repair_refuses_a_live_run(run_dir):
    from hookline.storage import StorageError

    w = write_std_run(run_dir, n=6, flush_every=3)
    rep = verify(run_dir)  # reading a live run is fine: it is open, not damaged
    assert rep.ok and rep.writing and "a RunWriter is writing" in str(rep)
    with pytest.raises(StorageError, match="still writing"):
        verify(run_dir, repair=True)
    w.close()
    assert verify(run_dir).ok


def _rotated_run(d, records=150):
    """One handle in `records` segments (a flush per record, compaction held off;
    merge_on_close=False keeps the segments)."""
    from hookline.storage import RunWriter
    from hookline.storage.writer import merging

    saved, merging.COMPACT_MIN_SEGMENTS = merging.COMPACT_MIN_SEGMENTS, 1 << 30
    try:
        with RunWriter(d, merge_on_close=False, fsync=False) as w:
            w.add_handle("a")
            w.add_handle("b")
            for s in range(records):
                w.write("a", s, 0, {"x": np.full(3, s, np.float32)})
                w.write("b", s, 0, {"x": np.full(3, -s, np.float32)})
                w.flush()
    finally:
        merging.COMPACT_MIN_SEGMENTS = saved


def test_repair_of_a_handle_with_more_segments_than_open_files(tmp_path):
    """verify checks one file at a time and merges in bounded groups: 150 segments under
    `ulimit -n 128` are all kept and merged (none mistaken for unreadable)."""
    import subprocess
    import sys
    import textwrap

    d = tmp_path / "r"
    _rotated_run(d)
    assert len(list(d.glob("a.r*.h5seg"))) == 150
    child = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from hookline.storage import verify
        report = verify({str(d)!r}, repair=True)
        print("OK", report.ok, [h.records for h in report.handles])
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "OK True [150, 150]" in out.stdout
    assert not (d / ".quarantine").exists()
    run = open_run(d)
    assert run["a"]["x"].read()[:, 0].tolist() == list(range(150))


def test_running_out_of_file_handles_is_an_error_not_a_damaged_file(tmp_path):
    """EMFILE while checking a file says so (StorageError, raised before verify moves anything)
    instead of calling the file unreadable, which repair would quarantine."""
    import subprocess
    import sys
    import textwrap

    d = tmp_path / "r"
    _rotated_run(d, records=5)
    seg = sorted(p.name for p in d.glob("a.r*.h5seg"))[0]
    child = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from pathlib import Path
        from hookline.storage import StorageError
        from hookline.storage.verifier import _check_file
        print("FINE", type(_check_file(Path({str(d)!r}), {seg!r}, "a", None)).__name__)
        hog = []
        try:
            while True:
                hog.append(open("/dev/null"))
        except OSError:
            pass
        try:
            print("RESULT", _check_file(Path({str(d)!r}), {seg!r}, "a", None))
        except StorageError as e:
            print("ERROR", e)
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert "FINE _Checked" in out.stdout, out.stdout + out.stderr
    assert "ERROR" in out.stdout and "ulimit -n" in out.stdout and "nothing was moved" in out.stdout, out.stdout
