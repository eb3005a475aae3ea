"""What opening a run and reading one record does, and does not do (issue 25: a warm
``open_run(path)[h][f][i]`` within 1.5x of plain h5py): one HDF5 file opened, no directory
listed, the manifest parsed and a file's attributes checked once per process, no h5py
``Dataset`` object built; and the fast path's guards: a closed run's folder that changed after
its manifest was written is listed, damaged files are reported as before, shared manifests stay
unchanged by what callers do with theirs.

The counters wrap the real functions (the real files are opened, listed and parsed).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from hookline.storage import FormatError, RunWriter, open_run
from hookline.storage import dtypes, format as hformat, reader
from _storage_support import GID, HID, open_files_under, record_value, write_std_run


def _settle(run_dir: Path) -> None:
    """Make the manifest younger than every folder of the run (the file system's clock ticks
    every few ms: a run written with fsync=False may write its manifest in the tick of its last
    rename, and then the reader lists the folder, as it must for a continued run's segments)."""
    time.sleep(0.02)
    os.utime(run_dir / "manifest.json")


def _count(monkeypatch, owner, name: str) -> list:
    """Wrap ``owner.name``; the list collects the first argument of every call."""
    real = getattr(owner, name)
    calls: list = []

    def counted(*a, **k):
        calls.append(a[0] if a else None)
        return real(*a, **k)

    monkeypatch.setattr(owner, name, counted)
    return calls


def _h5_opens(monkeypatch) -> list:
    """Every HDF5 file opened, by h5py's high-level File(path) or its low-level h5f.open."""
    opens: list = []
    real_file, real_open = h5py.File, h5py.h5f.open

    class CountingFile(real_file):  # (subclass: isinstance(x, h5py.File) still holds)
        def __init__(self, name, *a, **k):
            if not isinstance(name, h5py.h5f.FileID):
                opens.append(("File", os.fspath(name)))
            super().__init__(name, *a, **k)

    def counting_open(name, *a, **k):
        opens.append(("h5f.open", os.fsdecode(name)))
        return real_open(name, *a, **k)

    monkeypatch.setattr(h5py, "File", CountingFile)
    monkeypatch.setattr(h5py.h5f, "open", counting_open)
    return opens


def test_opening_a_run_and_reading_one_record_opens_exactly_one_hdf5_file(run_dir, monkeypatch):
    """The handle's final file is opened once: not once to count its records (discovery) and
    again to read them. A fresh run, so no file of it was seen by this process before."""
    write_std_run(run_dir, n=6).close()
    _settle(run_dir)
    opens = _h5_opens(monkeypatch)
    with open_run(run_dir) as run:
        x = run[HID]["outputs.0"][4]
        assert open_files_under(run_dir) == 1
    np.testing.assert_array_equal(x, record_value(4))
    assert [Path(p).name for _, p in opens] == ["blocks.0.h5"], opens
    assert Path(opens[0][1]).parent.name == "outputs"
    assert open_files_under(run_dir) == 0  # (closed with the run, though no h5py File was made)


def test_opening_a_closed_run_and_reading_one_record_lists_no_directory(run_dir, monkeypatch):
    """A closed run's manifest names each handle's final file: neither the run directory (for
    manifests) nor the handle's folder (for segments) is listed."""
    write_std_run(run_dir, n=6).close()
    _settle(run_dir)
    listed = _count(monkeypatch, os, "scandir")
    listed_dirs = _count(monkeypatch, os, "listdir")
    with open_run(run_dir) as run:
        np.testing.assert_array_equal(run[HID]["outputs.0"][2], record_value(2))
    assert listed == [] and listed_dirs == []


def test_a_second_open_parses_no_manifest_and_checks_no_attribute_again(run_dir, monkeypatch):
    """The manifest's JSON is parsed and checked, and a file's attributes checked, once per
    process while they are unchanged: a later open_run of the same run reuses both."""
    write_std_run(run_dir, n=6).close()
    _settle(run_dir)
    with open_run(run_dir) as run:
        run[HID]["outputs.0"][0], run[GID]["grad_out.0"][0]
    checks = _count(monkeypatch, hformat, "check_manifest")
    checks_here = _count(monkeypatch, reader, "check_manifest")
    lookups = _count(monkeypatch, dtypes, "lookup")  # (checking a field's attributes looks its dtype up)
    with open_run(run_dir) as run:
        np.testing.assert_array_equal(run[HID]["outputs.0"][5], record_value(5))
        assert run[GID]["grad_out.0"].shape == (8, 16)
    assert checks == [] and checks_here == [] and lookups == []


def test_reading_one_record_builds_no_h5py_dataset_object(run_dir, monkeypatch):
    """The first record read from a part goes through HDF5's low-level calls (h5py's Dataset
    lookup and construction cost more than a small record's read); later reads use h5py's
    Dataset and its compiled reader, and every read returns the same bytes."""
    write_std_run(run_dir, n=6).close()
    built = _count(monkeypatch, h5py.Dataset, "__init__")
    with open_run(run_dir) as run:
        f = run[HID]["outputs.0"]
        first = f[3]
        assert built == []
        assert first.dtype == np.float32 and first.shape == (8, 16)
        np.testing.assert_array_equal(first, record_value(3))
        np.testing.assert_array_equal(f[-1], record_value(5))
        np.testing.assert_array_equal(f[1:3], np.stack([record_value(1), record_value(2)]))
    assert len(built) >= 1


def test_a_closed_run_continued_by_a_killed_writer_still_reads_its_sealed_segments(tmp_path):
    """A continued run's writer seals segments before it rewrites the manifest: killed between
    the two, it leaves the closed run's manifest beside a segment that manifest does not list.
    Its folder changed after the manifest was written, so the reader lists it and reads the
    segment's records (a resumed writer counts on that: `len(handle)` is where it continues)."""
    d = tmp_path / "run"
    with RunWriter(d, fsync=False) as w:
        w.add_handle("h")
        for i in range(5):
            w.write("h", i, 0, {"x": np.full(4, i, np.float32)})
    closed_manifest = (d / "manifest.json").read_bytes()
    written = os.stat(d / "manifest.json")
    shutil.copy(d / "h.h5", tmp_path / "h.h5.first")
    w = RunWriter(d, fsync=False)
    w.add_handle("h")
    for i in range(5, 8):
        w.write("h", i, 0, {"x": np.full(4, i, np.float32)})
    w.flush()
    (segment,) = d.glob("h.r*.h5seg")
    shutil.copy(segment, tmp_path / "segment")
    w.close()
    # The state a SIGKILL right after the seal leaves: the first session's files and manifest,
    # and the second session's sealed segment (created after the manifest was written).
    shutil.copy(tmp_path / "h.h5.first", d / "h.h5")
    shutil.copy(tmp_path / "segment", segment)
    (d / "manifest.json").write_bytes(closed_manifest)
    os.utime(d / "manifest.json", ns=(written.st_atime_ns, written.st_mtime_ns))
    time.sleep(0.02)
    os.utime(d)  # (the folder changed after the manifest, as the seal's rename made it)
    with open_run(d) as run:
        assert run.status == "closed"
        h = run["h"]
        assert len(h) == 8 and h.steps.tolist() == list(range(8))
        assert [float(h["x"][i][0]) for i in range(8)] == list(range(8))
        assert not h.problems


def test_a_closed_run_whose_final_file_is_gone_or_damaged_is_reported_as_before(run_dir):
    """The fast path opens the file the manifest names; when that fails the handle is listed
    and reported as a live run's would be: a damaged file named in .problems and a warning,
    the other handle still readable."""
    write_std_run(run_dir, n=6).close()
    _settle(run_dir)
    (run_dir / "outputs" / "blocks.0.h5").write_bytes(b"not hdf5 at all")
    _settle(run_dir)
    with open_run(run_dir) as run:
        with pytest.warns(UserWarning, match="skipping 1 unreadable file"):
            h = run[HID]
            assert len(h) == 0
        assert any("blocks.0.h5" in p for p in h.problems)
        assert len(run[GID]) == 6
    (run_dir / "outputs" / "blocks.0.h5").unlink()
    _settle(run_dir)
    with open_run(run_dir) as run, pytest.warns(UserWarning, match="manifest lists 6 records"):
        assert len(run[HID]) == 0


def test_a_manifest_naming_a_file_outside_the_run_is_refused_on_the_fast_path(tmp_path):
    """The final file the manifest names is confined like every path from run content: a
    symlink in its place that leads outside the run is never opened."""
    d = tmp_path / "run"
    with RunWriter(d, fsync=False) as w:
        w.add_handle("h")
        w.write("h", 0, 0, {"x": np.ones(4, np.float32)})
    outside = tmp_path / "outside.h5"
    os.replace(d / "h.h5", outside)
    os.symlink(outside, d / "h.h5")
    _settle(d)
    with open_run(d) as run:
        with pytest.warns(UserWarning, match="unreadable"):
            h = run["h"]
            assert len(h) == 0
        assert any("leads outside the run directory" in p for p in h.problems)


def test_what_a_caller_does_to_its_manifests_does_not_reach_the_next_open(run_dir):
    """Manifests are parsed once per process and shared between runs: each run (and handle)
    hands out its own copies, so changing them changes nothing for the next reader."""
    write_std_run(run_dir, n=4, meta={"seed": 3}).close()
    with open_run(run_dir) as run:
        run.manifests[0]["handles"][HID]["key"] = "elsewhere"
        run.manifests[0]["meta"]["seed"] = 99
        run.meta["seed"] = 98
        h = run[HID]
        h.meta["kind"] = "changed"
        h.manifest["file"] = "elsewhere.h5"
    with open_run(run_dir) as run:
        assert run.meta == {"seed": 3} and run.manifests[0]["meta"] == {"seed": 3}
        h = run[HID]
        assert h.key == "outputs/blocks.0" and h.meta == {"kind": "outputs"}
        assert h.manifest["file"] == "outputs/blocks.0.h5"
        np.testing.assert_array_equal(h["outputs.0"][1], record_value(1))


def test_a_rewritten_manifest_is_parsed_again(run_dir):
    """The manifest is reused only while its bytes are the same: a continued run's new one is
    read (its records, its status)."""
    write_std_run(run_dir, n=4).close()
    with open_run(run_dir) as run:
        assert len(run[HID]) == 4
    w = RunWriter(run_dir)
    w.add_handle(HID)
    w.write(HID, 4, 0, {"outputs.0": record_value(4), "outputs.1": np.arange(2, dtype=np.int64)})
    w.flush()
    with open_run(run_dir) as run:
        assert run.status == "open" and run.manifests[0]["handles"][HID]["records"] == 5
        assert len(run[HID]) == 5
    w.close()
    with open_run(run_dir) as run:
        assert run.status == "closed" and len(run[HID]) == 5


def test_a_manifest_that_is_not_json_is_refused_naming_the_file(run_dir):
    write_std_run(run_dir, n=2).close()
    with open_run(run_dir) as run:
        len(run[HID])
    (run_dir / "manifest.json").write_text("{not json")
    with pytest.raises(FormatError, match=r"cannot read manifest .*manifest\.json"):
        open_run(run_dir)


def test_a_closed_run_leaves_no_reference_cycle_of_parts(tmp_path):
    """Closed parts are freed at once, not at Python's next full collection (thousands of them
    waiting slow every later HDF5 call of the process)."""
    import gc

    from hookline.storage import RunWriter, open_run

    with RunWriter(tmp_path / "r") as w:
        for h in range(20):
            w.add_handle(f"outputs[m{h}]", module_name=f"m{h}", category="forward_hook")
            for s in range(3):
                w.write(f"outputs[m{h}]", s, 0, {"outputs.0": np.ones(4, np.float32)})
    gc.collect()
    gc.disable()
    try:
        run = open_run(tmp_path / "r")
        for h in run.handles:
            assert run[h]["outputs.0"].read().shape == (3, 4)
        run.close()
        del run
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if type(o).__name__ in ("Part", "PartField")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
