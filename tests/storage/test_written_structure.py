"""The writer's account of the files it wrote (storage/_h5check.py, ``remember``): its own parts
are not walked again when it merges them or a reader of the same process opens them, and the
account is exactly what the walk finds."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from hookline.storage import RunWriter, open_run
from hookline.storage import _h5check
from hookline.storage._h5check import Structure, check_structure, known, remember, same_structure
from hookline.storage._h5write import FieldSpec, HandleFileWriter

ATTRS = {"handle_id": "h", "key": "h", "module_name": "m", "module_type": "Linear", "category": "c",
         "hook_fn_name": "outputs", "rank": np.int64(-1), "world_size": np.int64(-1)}


def _walk(path) -> Structure:
    import h5py

    with h5py.File(path, "r") as f:
        return check_structure(f, str(path))


def _write(path, attrs=ATTRS) -> HandleFileWriter:
    w = HandleFileWriter(path, attrs, 0, None)
    out = w.field(FieldSpec("x", "float32", False, (3,), None), 4)
    out.append(np.ones((4, 3), np.float32))
    out.records.append(np.arange(4))
    out.norms.append(np.ones(4))
    w.add_index(np.arange(4), np.zeros(4, np.int64))
    w.finish()
    return w


def _flushed_run(run, steps: int, flushes: int, fields) -> None:
    """Handles ``a`` and ``b`` record ``fields(step)`` each step; the first ``flushes`` steps
    end with a flush (a segment per handle each); then close()."""
    w = RunWriter(run, autoflush_s=None, fsync=False)
    for h in ("a", "b"):
        w.add_handle(h)
    for s in range(steps):
        for h in ("a", "b"):
            w.write(h, s, 0, fields(s))
        if s < flushes:
            w.flush()
    w.close()


@pytest.fixture
def walks(monkeypatch):
    """Counts the structure walks (the real walk runs)."""
    n = [0]
    real = _h5check.check_structure

    def counted(f, where):
        n[0] += 1
        return real(f, where)

    monkeypatch.setattr(_h5check, "check_structure", counted)
    monkeypatch.delenv(_h5check.CHECK_WRITTEN_ENV)  # (the suite's own cross-check walks too)
    return n


def test_a_written_file_is_described_as_the_walk_finds_it(tmp_path):
    w = _write(tmp_path / "a.h5")
    assert w.structure is not None
    assert same_structure(_walk(tmp_path / "a.h5"), w.structure) is None


def test_an_attribute_the_writer_cannot_foresee_leaves_no_account(tmp_path):
    w = _write(tmp_path / "a.h5", {**ATTRS, "scale": 0.5})  # a float: written through h5py
    assert w.structure is None
    remember(tmp_path / "a.h5", w.structure)
    assert known(tmp_path / "a.h5") is None


def test_same_structure_names_the_first_difference(tmp_path):
    w = _write(tmp_path / "a.h5")
    walked = _walk(tmp_path / "a.h5")
    walked.attrs[""]["records"] = np.int64(5)
    assert "attribute 'records' of ''" in same_structure(walked, w.structure)
    walked = _walk(tmp_path / "a.h5")
    walked.attrs[""]["rank"] = -1  # the same value as a Python int: another type
    assert "int" in same_structure(walked, w.structure)
    walked = _walk(tmp_path / "a.h5")
    walked.shapes["x"] = (5, 3)
    assert same_structure(walked, w.structure) == "shapes['x']: (5, 3) != (4, 3)"


def test_a_remembered_file_changed_since_is_walked_again(tmp_path, walks):
    path = tmp_path / "a.h5"
    remember(path, _write(path).structure)
    assert known(path) is not None
    with open(path, "ab") as f:  # (any change: size, mtime and ctime move)
        f.write(b"\0")
    assert known(path) is None
    os.truncate(path, path.stat().st_size - 1)
    assert known(path) is None  # (same size again, another ctime)


def test_a_cross_check_refuses_a_wrong_account(tmp_path, monkeypatch):
    monkeypatch.setenv(_h5check.CHECK_WRITTEN_ENV, "1")
    path = tmp_path / "a.h5"
    st = _write(path).structure
    st.attrs[""]["records"] = np.int64(7)
    with pytest.raises(AssertionError, match="records"):
        remember(path, st)
    assert known(path) is None


def test_close_merges_and_reads_the_writers_own_parts_without_a_walk(tmp_path, walks):
    """Three flushes make three segments per handle; close() merges them into each handle's
    ``.h5``, and a reader in the same process opens those: no file is walked."""
    run = tmp_path / "run"
    _flushed_run(run, 3, 3, lambda s: {"x": np.full(3, s, np.float32), "r": np.arange(s + 1, dtype=np.int16)})
    assert walks[0] == 0
    with open_run(run) as r:
        assert np.array_equal(r["a"]["x"].read()[:, 0], [0, 1, 2])
        assert [len(v) for v in r["b"]["r"].read()] == [1, 2, 3]
    assert walks[0] == 0


def test_a_file_from_elsewhere_is_still_walked(tmp_path, walks):
    """What another process wrote has no account here: opening it walks it."""
    import subprocess
    import sys

    run = tmp_path / "run"
    code = ("import numpy as np\nfrom hookline.storage import RunWriter\n"
            f"w = RunWriter({str(run)!r}, fsync=False)\nw.add_handle('a')\n"
            "w.write('a', 0, 0, {'x': np.zeros(2, np.float32)})\nw.close()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    with open_run(run) as r:
        r["a"]["x"].read()
    assert walks[0] == 1


def test_a_finished_writer_leaves_no_cycle():
    """A finished writer and its fields are freed by reference counting: left as a cycle,
    thousands of them waited for a collection with their dataset ids in h5py's registry."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        gc.disable()
        try:
            w = _write(Path(d) / "a.h5")
            out = next(iter(w.fields.values()))
            assert out.ds is None and out.owner is None
            gone = weakref.ref(w)
            del w, out
            assert gone() is None
        finally:
            gc.enable()


def test_merged_inputs_make_room_for_the_parts_still_to_merge(tmp_path, walks, monkeypatch):
    """The entries of merged (removed) parts are dropped: with room for exactly the run's ten
    parts, close() merges both handles without walking one (before, the first handle's final
    pushed out a part of the second)."""
    monkeypatch.setattr(_h5check, "_CHECKED_MAX", 10)
    monkeypatch.setattr(_h5check, "_CHECKED", type(_h5check._CHECKED)())
    _flushed_run(tmp_path / "run", 5, 4, lambda s: {"x": np.full(2, s, np.float32)})
    assert walks[0] == 0
    assert len(_h5check._CHECKED) == 2  # (the two handles' files)
