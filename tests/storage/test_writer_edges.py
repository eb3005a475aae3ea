"""RunWriter edge cases found in review: races with close()/add_handle(), values HDF5 cannot
store, and the fsync of a segment sealed by a shape change."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import hookline.storage._fs as fs
from hookline.storage import InvalidArgumentError, RunWriter, WriterClosedError, open_run
from _storage_support import open_files_under

HID = "outputs[fc]"


def test_write_racing_close_is_either_stored_or_refused(tmp_path):
    """Every write() that returned True while close() ran is on disk (before the fix, a record
    queued behind the close item was acknowledged and silently lost in most trials)."""
    for trial in range(8):
        d = tmp_path / f"r{trial}"
        w = RunWriter(d, fsync=False)
        w.add_handle(HID)
        accepted = [0]
        fields = {f"f{j}": np.ones(2, np.float32) for j in range(20)}  # a wide validation window

        def produce() -> None:
            i = 0
            while True:
                try:
                    if w.write(HID, i, 0, fields):
                        accepted[0] += 1
                except WriterClosedError:
                    return
                i += 1

        t = threading.Thread(target=produce)
        t.start()
        time.sleep(0.01)
        stats = w.close()
        t.join()
        with open_run(d) as run:
            on_disk = len(run[HID])
        assert on_disk == accepted[0] == stats.handles[HID].records, trial


def test_add_handle_while_the_writer_works(tmp_path):
    """add_handle() from the caller while the writer thread walks its handles (the writer
    thread died of 'dictionary changed size during iteration' before)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # many thread switches: makes the race show within a second
    try:
        w = RunWriter(tmp_path / "r", fsync=False, max_buffer_mb=1)
        for i in range(100):
            w.add_handle(f"outputs[m{i}]")
        stop = threading.Event()
        added = [0]

        def add() -> None:
            while not stop.is_set():
                w.add_handle(f"grads[n{added[0]}]")
                added[0] += 1
                time.sleep(0.0005)

        t = threading.Thread(target=add)
        t.start()
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 1.5:
                for i in range(100):
                    w.write(f"outputs[m{i}]", 0, 0, {"x": np.ones(1024, np.float32)})
                w.raise_if_failed()
        finally:
            stop.set()
            t.join()
        stats = w.close()
    finally:
        sys.setswitchinterval(old)
    assert added[0] > 10
    assert stats.handles["outputs[m0]"].records > 0 and stats.dropped == 0


@pytest.mark.parametrize("step, call", [(2**63, 0), (0, 2**63), (2**64, 0)])
def test_steps_beyond_int64_are_refused_and_lose_nothing(tmp_path, step, call):
    w = RunWriter(tmp_path / "r", fsync=False)
    w.add_handle(HID)
    w.write(HID, 0, 0, {"x": np.ones(3, np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"2\*\*63 - 1"):
        w.write(HID, step, call, {"x": np.ones(3, np.float32)})
    big = np.array([step], dtype=np.uint64) if step < 2**64 else [step]
    with pytest.raises(InvalidArgumentError):
        w.write_block(HID, big, np.array([call], dtype=np.uint64) if call < 2**64 else [call],
                      {"x": np.ones((1, 3), np.float32)})
    w.close()
    with open_run(tmp_path / "r") as run:
        assert len(run[HID]) == 1  # the good record survived


@pytest.mark.parametrize("name", [".", "..", "a\x00b"])
def test_field_names_hdf5_cannot_store_are_refused(tmp_path, name):
    w = RunWriter(tmp_path / "r", fsync=False)
    w.add_handle(HID)
    w.write(HID, 0, 0, {"x": np.ones(3, np.float32)})
    with pytest.raises(InvalidArgumentError, match="invalid field name"):
        w.write(HID, 1, 0, {name: np.ones(3, np.float32)})
    w.close()
    with open_run(tmp_path / "r") as run:
        assert len(run[HID]) == 1


def test_segment_sealed_by_a_shape_change_is_fsynced(tmp_path, monkeypatch):
    """flush() promises fsynced data: that includes the segment a shape change sealed earlier."""
    synced: list[str] = []
    real = fs.fsync_file
    monkeypatch.setattr(fs, "fsync_file", lambda p: (synced.append(os.path.basename(p)), real(p))[1])
    d = tmp_path / "r"
    w = RunWriter(d)  # fsync=True (the default)
    w.add_handle(HID)
    w.write(HID, 0, 0, {"x": np.ones(4, np.float32)})
    w.write(HID, 1, 0, {"x": np.ones(5, np.float32)})  # shape change: seals the first segment
    w.flush()
    segs = sorted(p.name for p in (d / "outputs").iterdir() if p.name.endswith(".h5seg"))
    assert len(segs) == 2
    starts = {s.split(".r")[1][:12] for s in synced}
    assert all(s.split(".r")[1][:12] in starts for s in segs), (segs, synced)
    w.close()


def test_continued_run_keeps_each_fields_dtype_and_ndim(tmp_path):
    """A second writer on the same run refuses a field's new dtype/ndim up front (before, the
    write was accepted and close() failed merging, leaving a .partial)."""
    d = tmp_path / "r"
    with RunWriter(d, fsync=False) as w:
        w.add_handle(HID)
        for i in range(3):
            w.write(HID, i, 0, {"outputs.0": np.ones(4, np.float32)})
    with RunWriter(d, fsync=False) as w:
        w.add_handle(HID)
        with pytest.raises(InvalidArgumentError, match="changed dtype from float32 to float64"):
            w.write(HID, 3, 0, {"outputs.0": np.ones(4, np.float64)})
        with pytest.raises(InvalidArgumentError, match="changed ndim from 1 to 2"):
            w.write(HID, 3, 0, {"outputs.0": np.ones((2, 2), np.float32)})
        w.write(HID, 3, 0, {"outputs.0": np.ones(5, np.float32)})  # same dtype/ndim: fine (ragged)
    with open_run(d) as run:
        assert list(run[HID].steps) == [0, 1, 2, 3]
    assert not any(p.name.endswith(".partial") for p in (d / "outputs").iterdir())


def test_continuing_after_a_crash_inside_a_merge_removes_superseded_segments(tmp_path):
    """A crash after close()'s merged file was renamed into place but before its inputs were
    deleted leaves both; the next writer on the run removes the covered segments."""
    import subprocess
    import textwrap

    d = tmp_path / "r"
    child = textwrap.dedent(f"""
        import os
        import numpy as np
        from hookline.storage import RunWriter
        w = RunWriter({str(d)!r})
        w.add_handle({HID!r})
        for i in range(3):
            w.write({HID!r}, i, 0, {{"x": np.full(4, i, np.float32)}})
            w.flush()
        real = os.unlink
        def unlink(p, *a, **k):
            if str(p).endswith(".h5seg"):
                os._exit(9)  # the merged file is in place, its inputs are not deleted yet
            return real(p, *a, **k)
        os.unlink = unlink
        os.remove = unlink
        w.close()
    """)
    assert subprocess.run([sys.executable, "-c", child]).returncode == 9
    names = sorted(p.name for p in (d / "outputs").iterdir())
    assert "fc.h5" in names and any(n.endswith(".h5seg") for n in names), names
    with RunWriter(d) as w:
        w.add_handle(HID)
        w.write(HID, 3, 0, {"x": np.full(4, 3, np.float32)})
    names = sorted(p.name for p in (d / "outputs").iterdir())
    assert names == ["fc.h5"], names
    with open_run(d) as run:
        assert [float(run[HID]["x"][j][0]) for j in range(4)] == [0.0, 1.0, 2.0, 3.0]


def test_too_many_open_files_says_what_to_do(tmp_path):
    """The writer keeps one file per handle open between flushes: past the open-file limit the
    error names it and the fix, and what was flushed before stays readable."""
    import subprocess
    import textwrap

    d = tmp_path / "r"
    child = textwrap.dedent(f"""
        import resource
        import numpy as np
        from hookline.storage import RunWriter, StorageError
        w = RunWriter({str(d)!r}, fsync=False)
        w.add_handle("outputs[h0]")
        w.write("outputs[h0]", 0, 0, {{"x": np.ones(3, np.float32)}})
        w.flush()
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        for i in range(1, 100):
            w.add_handle(f"outputs[h{{i}}]")
            w.write(f"outputs[h{{i}}]", 0, 0, {{"x": np.ones(3, np.float32)}})
        try:
            w.flush()
        except StorageError as e:
            print("ERRNO", e.errno, str(e))
        try:
            w.close()
        except StorageError:
            pass
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert "ERRNO 24" in out.stdout, out.stdout + out.stderr
    assert "ulimit -n" in out.stdout
    with open_run(d) as run:
        assert len(run["outputs[h0]"]) == 1


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_more_handles_than_max_open_files_park_files_and_lose_nothing(tmp_path):
    """20 handles through 4 open files: files are parked and reopened, never sealed early, so
    each flush leaves exactly one segment per handle (no segment per rotation)."""
    d = tmp_path / "r"
    rng = np.random.default_rng(0)
    want: dict[str, list[np.ndarray]] = {}
    with RunWriter(d, max_open_files=4, fsync=True, merge_on_close=False) as w:
        handles = [f"outputs[m{i}]" for i in range(20)]
        for h in handles:
            w.add_handle(h)
        peak = 0
        for step in range(6):
            for h in handles:  # every handle writes every step: 20 handles through 4 open files
                x = rng.standard_normal((256, 1024)).astype(np.float32)  # 1 MiB: written at once
                want.setdefault(h, []).append(x)
                w.write(h, step, 0, {"x": x})
                peak = max(peak, open_files_under(d, ".partial"))
            if step == 2:
                w.flush()
                with open_run(d) as mid:  # readable mid-run, like any flushed segment
                    assert all(len(mid[h]) == 3 for h in handles)
        w.flush()
        peak = max(peak, open_files_under(d, ".partial"))
        assert w.stats().parked_files > 0
    assert peak <= 4
    assert len(list(d.rglob("*.h5seg"))) == 2 * 20  # two flushes, one segment per handle each
    with open_run(d) as run:
        for h in handles:
            assert list(run[h].steps) == list(range(6))
            for j, x in enumerate(want[h]):
                np.testing.assert_array_equal(run[h]["x"][j], x)


def test_default_max_open_files_follows_ulimit(tmp_path):
    """With a low open-file limit set before the writer starts, 100 handles still get written
    (the writer parks files instead of failing with EMFILE)."""
    import subprocess
    import textwrap

    d = tmp_path / "r"
    child = textwrap.dedent(f"""
        import resource
        import numpy as np
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from hookline.storage import RunWriter
        w = RunWriter({str(d)!r}, fsync=False, max_buffer_mb=4096)
        print("MAX", w.max_open_files)
        for i in range(100):
            w.add_handle(f"outputs[h{{i}}]")
        for step in range(3):
            for i in range(100):
                w.write(f"outputs[h{{i}}]", step, 0, {{"x": np.full(3, i + step, np.float32)}})
        stats = w.close()
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "MAX 16" in out.stdout  # (96 - 64) // 2
    assert sorted(p.name for p in d.rglob("*") if p.is_file() and p.suffix == ".h5") == [
        f"h{i}.h5" for i in sorted(range(100), key=str)]
    with open_run(d) as run:
        for i in (0, 57, 99):
            assert [float(run[f"outputs[h{i}]"]["x"][j][0]) for j in range(3)] == [i, i + 1, i + 2]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_bad_max_open_files_is_refused(tmp_path, bad):
    with pytest.raises(InvalidArgumentError, match="max_open_files"):
        RunWriter(tmp_path / "r", max_open_files=bad)


def test_merges_of_many_segments_open_a_bounded_number_of_files(tmp_path, monkeypatch):
    """close() merges every segment of a handle; with more segments than MERGE_MAX_FILES it goes
    through intermediate files, never holding more inputs open at once, and loses nothing."""
    import hookline.storage._merge as merge_mod

    monkeypatch.setattr(merge_mod, "MERGE_MAX_FILES", 3)
    open_now, peak = [0], [0]
    real_open = merge_mod.open_part

    def counting_open(path):
        part = real_open(path)
        open_now[0] += 1
        peak[0] = max(peak[0], open_now[0])
        real_close = part.close

        def close():
            open_now[0] -= 1
            real_close()
        part.close = close
        return part

    monkeypatch.setattr(merge_mod, "open_part", counting_open)
    d = tmp_path / "r"
    want = []
    with RunWriter(d, fsync=False) as w:
        w.add_handle(HID)
        for seg in range(10):  # 10 segments; the 4th and 7th have another shape (ragged field)
            for j in range(2):
                x = np.full((3 if seg in (3, 6) else 2, 4), seg * 10 + j, np.float32)
                want.append(x)
                w.write(HID, seg, j, {"x": x})
            w.flush()
    assert peak[0] <= 3
    assert sorted(p.name for p in d.rglob("*") if p.is_file() and "partial" in p.name) == []
    with open_run(d) as run:
        assert len(run[HID]) == 20
        for i, x in enumerate(want):
            np.testing.assert_array_equal(run[HID]["x"][i], x)


def test_outputs_of_a_merge_killed_midway_are_removed_by_the_next_writer(tmp_path):
    """SIGKILL during close()'s grouped merge leaves intermediate `.rA-B.h5seg.partial` copies:
    verify calls them merge leftovers (not lost records), and the next writer removes them."""
    import subprocess
    import textwrap

    from hookline.storage import verify

    d = tmp_path / "r"
    child = textwrap.dedent(f"""
        import os, signal
        import numpy as np
        import hookline.storage._merge as H
        from hookline.storage import RunWriter
        H.MERGE_MAX_FILES = 4
        real, calls = H.merge_parts, [0]
        def killing(*a, **k):
            calls[0] += 1
            if calls[0] == 3:  # during the third group merge of close()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        H.merge_parts = killing
        w = RunWriter({str(d)!r}, autoflush_s=None, fsync=False)
        w.add_handle("a")
        for s in range(20):
            w.write("a", s, 0, {{"x": np.full(3, s, np.float32)}})
            w.flush()
        w.close()
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == -9, out.stdout + out.stderr
    leftovers = sorted(p.name for p in d.glob("*.partial"))
    assert leftovers and all("-" in n for n in leftovers)  # ranged names: merge outputs
    report = verify(d)
    problems = [p for h in report.handles for p in h.problems]
    assert any("interrupted merge output" in p for p in problems)
    assert not any("never flushed" in p for p in problems)
    with RunWriter(d, fsync=False) as w:
        w.add_handle("a")
        w.write("a", 20, 0, {"x": np.full(3, 20, np.float32)})
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == ["a.h5", "manifest.json"]
    assert verify(d).ok
    with open_run(d) as run:
        assert run["a"]["x"].read()[:, 0].tolist() == list(range(21))


def test_add_handle_with_the_same_meta_holding_nan_is_a_no_op(tmp_path):
    """nan != nan: identical meta with a NaN used to be refused as a conflict (also on resume)."""
    meta = {"clip": float("nan"), "note": "x"}
    for _ in range(2):  # a new run, then the same run continued
        w = RunWriter(tmp_path / "r")
        w.add_handle("h", meta=meta)
        w.add_handle("h", meta=meta)
        w.write("h", 0, 0, {"x": np.zeros(2)})
        w.close()
    w = RunWriter(tmp_path / "r")
    with pytest.raises(InvalidArgumentError, match="already records with clip=nan"):
        w.add_handle("h", meta={"clip": 1.0})
    w.close()


def test_a_refused_record_registers_none_of_its_fields(tmp_path):
    w = RunWriter(tmp_path / "r")
    w.add_handle("h")
    with pytest.raises(InvalidArgumentError, match="invalid field name"):
        w.write("h", 0, 0, {"a": np.zeros(2, np.float32), "b/c": np.zeros(2)})
    w.write("h", 1, 0, {"a": np.zeros(2, np.float16)})  # 'a' was never written as float32
    with pytest.raises(InvalidArgumentError, match="changed dtype from float16 to float32"):
        w.reserve_fields("h", {"a": ("float32", (2,)), "z": ("float32", (2,))})
    w.write("h", 2, 0, {"a": np.zeros(2, np.float16), "z": np.zeros(3, np.int8)})  # 'z' not registered
    w.close()
    with open_run(tmp_path / "r") as run:
        assert run["h"].steps.tolist() == [1, 2] and run["h"]["z"].dtype == np.int8


def test_bad_argument_types_create_nothing(tmp_path):
    from hookline.storage import HookTypeError

    for kwargs in ({"meta": {"x": {1, 2}}}, {"compression": 5}, {"max_buffer_mb": "64"}):
        with pytest.raises(HookTypeError):
            RunWriter(tmp_path / "r", **kwargs)
        assert not (tmp_path / "r").exists()
    RunWriter(tmp_path / "r", max_buffer_mb=np.float32(8)).close()
