"""Reader: lazy access, slicing, errors, killed runs, numpy+h5py-only environment."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from hookline.storage import FormatError, RunWriter, StorageError, UnknownNameError, open_run
from _storage_support import GID, HID, open_files_under, record_value, wait_for_partial, write_std_run

REPO = Path(__file__).resolve().parents[2]


def test_run_handle_field_api(run_dir):
    write_std_run(run_dir, n=12, meta={"seed": 3}).close()
    with open_run(run_dir) as run:
        assert run.handles == [HID, GID] and HID in run and len(run) == 2
        assert run.meta == {"seed": 3} and run.status == "closed"
        h = run[HID]
        assert h.id == HID and h.module_name == "blocks.0" and h.category == "forward_hook"
        assert h.module_type.endswith("Linear") and h.meta == {"kind": "outputs"} and h.key == "outputs/blocks.0"
        assert h.fields == ["outputs.0", "outputs.1"]
        f = h["outputs.0"]
        assert len(f) == 12 and f.shape == (8, 16) and f.dtype == np.float32
        assert np.array_equal(f[-1], record_value(11))
        assert f[2:5].shape == (3, 8, 16) and np.array_equal(f[2:5][1], record_value(3))
        assert f[::4].shape == (3, 8, 16) and np.array_equal(f[::4][2], record_value(8))
        assert f.read().shape == (12, 8, 16)
        assert f[5:5].shape == (0, 8, 16)
        assert np.allclose(f.norms(), [np.linalg.norm(record_value(i)) for i in range(12)])
        r = h["outputs.1"]
        assert r.shape is None and r.dtype == np.int64
        assert [a.tolist() for a in r[3:6]] == [list(range(4)), list(range(5)), [0]]
        assert isinstance(r.read(), list) and len(r.read()) == 12
        assert np.allclose(r.norms(), [np.linalg.norm(np.arange(i % 5 + 1)) for i in range(12)])
        assert r.at_step(4)[0].tolist() == list(range(5))
        with pytest.raises(IndexError):
            f[12]
        with pytest.raises(UnknownNameError, match="outputs.0"):
            h["outputs.9"]
        with pytest.raises(KeyError, match=r"grads\[blocks.0\]"):
            run["nope"]
        t = f.to_torch(3)
        import torch

        assert t.dtype == torch.float32 and torch.equal(t, torch.from_numpy(record_value(3)))


def test_open_run_errors(tmp_path):
    with pytest.raises(StorageError, match="no run directory"):
        open_run(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError):
        open_run(tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text('{"format": "hookline-run", "format_version": 99, "handles": {}}')
    with pytest.raises(FormatError, match="upgrade"):
        open_run(tmp_path / "bad")


def test_a_folder_of_runs_is_not_read_as_one_run(tmp_path):
    """(It was: a run of every handle of every run below it, all with 0 records, exit code 0.)"""
    for name in ("lr0.1", "lr0.01"):
        write_std_run(tmp_path / "sweep" / name, n=2).close()
    with pytest.raises(FormatError, match=r"not a run directory .* contains runs: \['lr0.01', 'lr0.1'\]"):
        open_run(tmp_path / "sweep")
    # a handle file away from where its key puts it belongs to no run here
    (tmp_path / "loose").mkdir()
    src = next((tmp_path / "sweep" / "lr0.1").rglob("*.h5"))
    (tmp_path / "loose" / "copied.h5").write_bytes(src.read_bytes())
    with pytest.raises(FormatError, match="not a hookline run directory"):
        open_run(tmp_path / "loose")
    # a run that lost its manifest is read from its files, even with a quarantined manifest or a
    # child run inside it
    run = tmp_path / "sweep" / "lr0.1"
    (run / ".quarantine").mkdir()
    os.replace(run / "manifest.json", run / ".quarantine" / "manifest.json")
    write_std_run(run / "child", n=1).close()
    assert len(open_run(run)[HID]) == 2


def test_reads_live_and_killed_runs_without_repair(run_dir):
    w = write_std_run(run_dir, n=10)
    w.flush()
    for i in range(10, 15):  # written but not flushed: in a .partial segment
        w.write(HID, i, 0, {"outputs.0": record_value(i)})
    wait_for_partial(run_dir)
    run = open_run(run_dir)
    assert run.status == "open"
    assert len(run[HID]) == 10 and np.array_equal(run[HID]["outputs.0"][9], record_value(9))
    w.close()
    assert len(open_run(run_dir)[HID]) == 15


def test_a_handle_listed_before_close_reads_the_merged_file(run_dir, recwarn):
    """close() merges a live run's segments into the final file: a handle that listed the
    segments before reads the merged file after, with no "unreadable file" warning (an MLflow
    pass racing close() used to warn so)."""
    w = write_std_run(run_dir, n=10)
    w.flush()
    for i in range(10, 15):
        w.write(HID, i, 0, {"outputs.0": record_value(i)})
    w.flush()  # two sealed segments
    handle = open_run(run_dir)[HID]  # lists the segments now, opens them on first read
    w.close()
    assert not list((run_dir / "outputs").glob("*.h5seg"))  # merged away
    assert len(handle) == 15 and np.array_equal(handle["outputs.0"][12], record_value(12))
    assert not handle.problems
    assert not [w for w in recwarn if "unreadable" in str(w.message)]


def test_random_access_reads_only_one_record(run_dir):
    """rdcc_nbytes=0 and per-record chunks: one record costs ~ its own bytes, not the file."""
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        x = np.ones((256, 256), np.float32)  # 256 KiB records
        for i in range(200):  # 50 MiB
            w.write(HID, i, 0, {"outputs.0": x})
    run = open_run(run_dir)
    f = run[HID]["outputs.0"]
    f[0]
    t0 = time.perf_counter()
    for i in range(0, 200, 7):
        f[i]
    per = (time.perf_counter() - t0) / len(range(0, 200, 7))
    assert per < 0.01, per


def test_no_pickle_in_storage_sources():
    for p in (REPO / "storage").glob("*.py"):
        text = p.read_text()
        assert "import pickle" not in text and "allow_pickle=True" not in text, p


def test_storage_does_not_import_torch_or_mlflow(run_dir):
    write_std_run(run_dir, n=3).close()
    code = textwrap.dedent(f"""
        import sys
        import hookline.storage as s
        run = s.open_run({str(run_dir)!r})
        x = run[{HID!r}]["outputs.0"][1]
        s.verify({str(run_dir)!r})
        assert "torch" not in sys.modules and "mlflow" not in sys.modules, sorted(m for m in sys.modules if m.startswith(("torch", "mlflow")))
        print("ok", x.shape)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "ok (8, 16)" in r.stdout, r.stderr


@pytest.mark.slow
def test_reader_in_numpy_h5py_only_venv(tmp_path, run_dir):
    """A fresh venv with only numpy + h5py reads a run (hookline.storage from the source tree)."""
    write_std_run(run_dir, n=6).close()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    pip = subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", "numpy", "h5py"],
                         capture_output=True, text=True, timeout=240)
    assert pip.returncode == 0, pip.stderr[-2000:]
    # hookline is a namespace package: expose only the storage folder as hookline.storage
    src = tmp_path / "src" / "hookline"
    src.mkdir(parents=True)
    (src / "storage").symlink_to(REPO / "storage", target_is_directory=True)
    code = textwrap.dedent(f"""
        import sys
        from hookline.storage import open_run
        run = open_run({str(run_dir)!r})
        f = run[{HID!r}]["outputs.0"]
        assert f[5].shape == (8, 16) and float(f[5][0, 0]) == 5.0
        assert "torch" not in sys.modules
        for m in ("torch", "mlflow", "hdf5plugin"):
            try:
                __import__(m)
                raise SystemExit(m + " is installed in the bare venv")
            except ImportError:
                pass
        print("read ok")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONPATH"] = str(tmp_path / "src")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60, env=env, cwd=tmp_path)
    assert r.returncode == 0 and "read ok" in r.stdout, r.stdout + r.stderr


def test_at_step_with_several_calls_and_unsorted_steps(run_dir):
    with RunWriter(run_dir) as w:
        w.add_handle(HID)
        order = [(3, 0), (3, 1), (1, 0), (3, 2), (2, 0), (1, 1)]
        for k, (step, call) in enumerate(order):
            w.write(HID, step, call, {"outputs.0": np.full(2, k, np.float32)})
    f = open_run(run_dir)[HID]["outputs.0"]
    assert f.at_step(3)[:, 0].tolist() == [0.0, 1.0, 3.0]
    assert f.at_step(1)[:, 0].tolist() == [2.0, 5.0]
    with pytest.raises(UnknownNameError, match="step 7"):
        f.at_step(7)  # nothing recorded at step 7: a clear error, not an empty array
    assert f.calls.tolist() == [c for _, c in order]


def _many_handles_run(d, n=30, records=3):
    with RunWriter(d, fsync=False) as w:
        for i in range(n):
            w.add_handle(f"outputs[m{i}]")
            for j in range(records):
                w.write(f"outputs[m{i}]", j, 0, {"x": np.full(4, i * 100 + j, np.float32)})


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_reader_keeps_at_most_max_open_files_open_and_reopens_transparently(tmp_path):
    d = tmp_path / "r"
    _many_handles_run(d)
    with open_run(d, max_open_files=4) as run:
        held = run["outputs[m0]"]["x"]  # a Field kept across evictions of its file
        assert held[1][0] == 1
        peak = 0
        for sweep in range(2):
            for i in range(30):
                f = run[f"outputs[m{i}]"]["x"]
                assert [float(f[j][0]) for j in range(3)] == [i * 100 + j for j in range(3)]
                assert list(run[f"outputs[m{i}]"].steps) == [0, 1, 2]
                peak = max(peak, open_files_under(d))
        assert peak <= 4
        assert run.files.reopened >= 30  # the second sweep reopened what the first closed
        assert float(held[2][0]) == 2  # still readable: its file reopened
        np.testing.assert_array_equal(held.read()[:, 0], [0, 1, 2])
    assert open_files_under(d) == 0
    with pytest.raises(StorageError, match="closed with its run"):
        held[0]


def test_reader_default_file_budget_follows_ulimit(tmp_path):
    d = tmp_path / "r"
    _many_handles_run(d, n=100, records=1)
    child = textwrap.dedent(f"""
        import resource
        resource.setrlimit(resource.RLIMIT_NOFILE, (96, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        from hookline.storage import open_run
        with open_run({str(d)!r}) as run:
            print("BUDGET", run.files.capacity)
            print("SUM", sum(float(run[h]["x"][0][0]) for h in run.handles))
    """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "BUDGET 8" in out.stdout  # max(8, (96 - 64) // 4)
    assert f"SUM {float(sum(i * 100 for i in range(100)))}" in out.stdout


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_reader_max_open_files_is_refused(tmp_path, bad):
    from hookline.storage import InvalidArgumentError

    d = tmp_path / "r"
    _many_handles_run(d, n=1, records=1)
    with pytest.raises(InvalidArgumentError, match="max_open_files"):
        open_run(d, max_open_files=bad)


def test_an_evicted_file_that_changed_is_refused_not_misread(tmp_path, monkeypatch):
    """A file the LRU closed is reopened only if it is still the same file: a continued run that
    rewrote `a.h5` (here with another record shape) makes a kept field raise, never return the
    new file's bytes. A relative run path survives a change of the working directory."""
    d = tmp_path / "run"
    with RunWriter(d, fsync=False) as w:
        for h in ("a", "b"):
            w.add_handle(h)
            w.write(h, 0, 0, {"x": np.array([10, 11, 12], np.float32)})
    monkeypatch.chdir(tmp_path)
    run = open_run("run", max_open_files=1)
    fa = run["a"]["x"]
    np.testing.assert_array_equal(fa[0], [10, 11, 12])
    run["b"]["x"][0]  # evicts a.h5
    monkeypatch.chdir("/")
    np.testing.assert_array_equal(fa[0], [10, 11, 12])  # reopened by its absolute path
    run["b"]["x"][0]
    with RunWriter(d, fsync=False) as w:  # continue the run: a.h5 is merged anew, ragged now
        w.add_handle("a")
        w.write("a", 1, 0, {"x": np.array([1, 2], np.float32)})
    with pytest.raises(StorageError, match="changed since the run was opened"):
        fa[0]
    run.close()
    with open_run(d) as again:
        assert [again["a"]["x"][i].tolist() for i in range(2)] == [[10, 11, 12], [1, 2]]


def _declare_huge_index(h) -> None:
    """'step' and 'call' claim 2**40 records (8 TiB each) in a file of a few KiB: unallocated
    chunks, which HDF5 would read as zeros into an array of that size."""
    n = 1 << 40
    for name in ("step", "call"):
        del h[name]
        h.create_dataset(name, shape=(n,), maxshape=(None,), dtype=np.int64, chunks=(1 << 16,))
    h.attrs["records"] = np.int64(n)


def _unknown_filter(h) -> None:
    data, attrs = h["outputs.0"][:], dict(h["outputs.0"].attrs)
    del h["outputs.0"]
    h.create_dataset("outputs.0", data=data, scaleoffset=2, chunks=(1, *data.shape[1:]))
    for k, v in attrs.items():
        h["outputs.0"].attrs[k] = v


def _huge_chunks(h) -> None:
    attrs = dict(h["outputs.0"].attrs)
    del h["outputs.0"]
    h.create_dataset("outputs.0", shape=(4, 8, 16), maxshape=(None, 8, 16), dtype=np.float32,
                     chunks=(1 << 19, 8, 16), compression="gzip")  # 256 MiB chunks
    for k, v in attrs.items():
        h["outputs.0"].attrs[k] = v


@pytest.mark.parametrize("alter, refused", [
    (_declare_huge_index, "declares shape (1099511627776,)"),
    (_unknown_filter, "uses HDF5 filters [6]"),
    (_huge_chunks, "declares chunks"),
])
def test_a_file_declaring_what_it_cannot_hold_is_refused_before_any_read(run_dir, alter, refused):
    """Sizes and filters a file declares are checked when it opens: an index read allocated what
    the file claimed (MemoryError, or the machine's memory), an unknown filter ran."""
    import h5py

    write_std_run(run_dir, n=4).close()
    with h5py.File(run_dir / "outputs" / "blocks.0.h5", "r+") as h:
        alter(h)
    run = open_run(run_dir)
    with pytest.warns(UserWarning, match="unreadable"):
        assert len(run[HID]) == 0 and run[HID].steps.size == 0
    assert refused in run[HID].problems[0] and "blocks.0.h5" in run[HID].problems[0]
    assert len(run[GID]) == 4
