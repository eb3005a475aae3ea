"""Recording at real-model scale (issue 24): a thousand handles under a low open-file limit, and
records whose contents make the norm pass work hardest, each in a subprocess that measures its own
peak memory against the budget (SPEC §8: ``max_buffer_mb`` + 64 MB over the no-capture baseline).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from _storage_support import RSS_CODE

from hookline.storage import RunWriter, open_run
from hookline.storage.writer.norms import SLICE, row_norms
from hookline.storage.writer.queue import Record

MB = 1 << 20


def _child(code: str, timeout: float = 240) -> dict:
    out = subprocess.run([sys.executable, "-c", RSS_CODE + textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def _chain(n: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(n)])


@pytest.mark.slow
def test_a_thousand_handles_under_an_open_file_limit_of_1024(tmp_path):
    """500 Linear modules, outputs + grads (1,000 handles of 4 KiB records) x 10 steps under
    `ulimit -n 1024`: one `.h5` per handle and nothing else, every record back bit-exactly,
    close well under a minute, peak memory within the budget + 64 MB over the same loop without
    capture. (Before parked files: every record past max_open_files was its own ~85 KB segment,
    and 0.64 MB per open segment was not counted.)"""
    d = tmp_path / "run"
    res = _child(f"""
        import json, time
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, max(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])))
        import torch
        torch.set_num_threads(1)
        from hookline.tracker import HookManager, Recorder
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(500)])
        def step(s):
            model(torch.full((16, 64), 0.01 * s)).sum().backward()
        for s in range(3):  # the baseline: the same loop, no capture
            step(s)
        base = rss_now()
        mgr = HookManager()
        rec = Recorder({str(d)!r}, max_buffer_mb=64)
        mods = dict(model.named_children())
        mgr.register_forward_hook(rec.outputs, **mods)
        mgr.register_backward_hook(rec.grads, **mods)
        for s in range(10):
            model.zero_grad()
            with rec.step(s):
                step(s)
        t0 = time.perf_counter()
        summary = rec.close()
        close_s = time.perf_counter() - t0
        print(json.dumps({{"base": base, "peak": rss_peak(), "close_s": close_s,
                          "max_open": rec._writer.max_open_files, "records": summary.records}}))
    """)
    over = (res["peak"] - res["base"]) / MB
    assert over <= 64 + 64, f"peak RSS {over:.0f} MB over the baseline, budget 64 MB + 64"
    assert res["close_s"] < 60
    assert res["records"] == 1000 * 10
    files = sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())
    assert files == sorted(["manifest.json"] + [f"{kind}/{i}.h5" for kind in ("outputs", "grads")
                                                 for i in range(500)])
    model = _chain(500)
    want = []  # every module's output at every step: what the model computes
    with torch.no_grad():
        for s in range(10):
            x = torch.full((16, 64), 0.01 * s)
            outs = []
            for lin in model:
                x = lin(x)
                outs.append(x.numpy())
            want.append(outs)
    with open_run(d) as run:
        assert len(run.handles) == 1000
        grad_in_next = None
        for i in reversed(range(500)):  # every record of every handle, each field read once
            out = run[f"outputs[{i}]"]["outputs.0"]
            assert list(out.steps) == list(range(10))
            got = out.read()
            np.testing.assert_array_equal(got, np.stack([want[s][i] for s in range(10)]))
            np.testing.assert_allclose(out.norms(), np.linalg.norm(got.reshape(10, -1), axis=1), rtol=1e-5)
            g = run[f"grads[{i}]"]
            assert list(g.steps) == list(range(10))
            if grad_in_next is not None:  # the gradient of module i's output is that of module i+1's input
                np.testing.assert_array_equal(g["grad_out.0"].read(), grad_in_next)
            grad_in_next = g["grad_in.0"].read() if i else None


@pytest.mark.slow
@pytest.mark.parametrize("content", ["zeros", "denormals", "inf", "nan"])
def test_records_whose_norms_need_float64_stay_within_the_budget(tmp_path, content):
    """64 MB records of zeros, denormals, inf or NaN under a 64 MB budget: the norm pass works
    in bounded slices, so peak memory stays within the budget + 64 MB over the same loop without
    capture (a float64 retry over the whole record used to allocate 3x the record)."""
    d = tmp_path / "run"
    fill = {"zeros": "0.0", "denormals": "1e-40", "inf": "float('inf')", "nan": "float('nan')"}[content]
    res = _child(f"""
        import json
        import torch
        from hookline.tracker import HookManager, Recorder
        x = torch.full((16 << 20,), {fill})  # 64 MB of float32
        ident = torch.nn.Identity()
        for _ in range(2):
            ident(x)
        base = rss_now()
        mgr = HookManager()
        rec = Recorder({str(d)!r}, max_buffer_mb=64)
        mgr.register_forward_hook(rec.outputs, x=ident)
        for s in range(4):
            with rec.step(s):
                ident(x)
        rec.close()
        print(json.dumps({{"base": base, "peak": rss_peak()}}))
    """)
    over = (res["peak"] - res["base"]) / MB
    assert over <= 64 + 64, f"peak RSS {over:.0f} MB over the baseline, budget 64 MB + 64"
    with open_run(d) as run:
        f = run["outputs[x]"]["outputs.0"]
        assert len(f) == 4
        want = {"zeros": 0.0, "denormals": float(np.sqrt(16 << 20) * np.float32(1e-40)), "inf": np.inf}.get(content)
        norms = f.norms()
        if content == "nan":
            assert np.isnan(norms).all()
        else:
            np.testing.assert_allclose(norms, want, rtol=1e-6)
        np.testing.assert_array_equal(f[3][:5], np.full(5, np.float32(eval(fill)), np.float32))


def test_row_norms_of_big_records_go_slice_by_slice(monkeypatch):
    """The norm of a record bigger than SLICE adds up its slices in float64, with a float64
    retry only for slices that need it, and equals the float64 norm."""
    rng = np.random.default_rng(1)
    big = rng.standard_normal((2, 3 * SLICE + 7)).astype(np.float32)
    big[1, :SLICE] = 1e-30  # an underflowing slice beside ordinary ones
    big[1, -3:] = 3e38  # and an overflowing one
    got = row_norms(big, "float32")
    want = np.linalg.norm(big.astype(np.float64), axis=1)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    tiny = np.full((3, 4), 1e-40, np.float32)  # denormals, many records per slice
    np.testing.assert_allclose(row_norms(tiny, "float32"), [2e-40] * 3, rtol=1e-4)


def test_parked_files_make_one_segment_per_handle_per_flush(tmp_path):
    """With more handles than max_open_files and records big enough to be written before the
    flush, files are parked and reopened, never sealed early: each flush publishes exactly one
    segment per handle, whatever the order the handles write in."""
    d = tmp_path / "r"
    x = np.ones((256, 1024), np.float32)  # 1 MiB: written as it arrives
    with RunWriter(d, max_open_files=3, fsync=False, merge_on_close=False) as w:
        for i in range(10):
            w.add_handle(f"h{i}")
        for s in range(4):
            for i in (range(10) if s % 2 == 0 else reversed(range(10))):
                w.write(f"h{i}", s, 0, {"x": x * (s + i)})
        w.flush()
        assert w.stats().parked_files > 0
    segs = sorted(p.name for p in d.glob("*.h5seg"))
    assert segs == sorted(f"h{i}.r000000000000-000000000004.h5seg" for i in range(10))
    with open_run(d) as run:
        for i in range(10):
            assert [float(r[0, 0]) for r in run[f"h{i}"]["x"].read()] == [s + i for s in range(4)]


def test_write_rows_sorts_records_of_many_handles_into_their_files(tmp_path):
    """write_rows: one block of records of several handles lands in each handle in block order,
    counted per handle; a handle whose field registry refuses the block registers nothing."""
    d = tmp_path / "r"
    with RunWriter(d) as w:
        for h in ("a", "b", "c"):
            w.add_handle(h)
        w.write("c", 0, 0, {"x": np.zeros(3, np.int64)})  # c's x is int64 from now on
        block = np.arange(12, dtype=np.float32).reshape(4, 3)
        assert w.write_rows(["a", "b", "a", "b"], [0, 0, 1, 1], [0, 0, 0, 0], {"x": block})
        with pytest.raises(Exception, match="changed dtype"):
            w.write_rows(["a", "c"], [2, 2], [0, 0], {"x": block[:2], "y": block[:2]})
        assert w.write("a", 2, 0, {"x": block[0] * 0 + 7})
        st = w.stats()
        assert (st.handles["a"].records, st.handles["b"].records) == (3, 2)
    with open_run(d) as run:
        np.testing.assert_array_equal(run["a"]["x"].read(), np.stack([block[0], block[2], block[0] * 0 + 7]))
        np.testing.assert_array_equal(run["b"]["x"].read(), block[[1, 3]])
        assert list(run["a"].steps) == [0, 1, 2] and run["a"].fields == ["x"]  # y was not registered


def test_write_rows_lean_path_keeps_records_order_dtypes_and_steps(tmp_path):
    """Blocks of several handles' records after each handle's first (the lean path: fields
    checked once per part and layout): floats, signed ints and bfloat16 given as signed bits
    (stored unsigned) read back bit-exact in block order
    with their steps and calls, one or several rows per handle per block; a block of another
    record shape goes the general way (the field turns ragged) and loses nothing."""
    d = tmp_path / "r"
    ids = [f"h{i}" for i in range(5)]
    rng = np.random.default_rng(0)
    want: dict[str, list] = {h: [] for h in ids}
    with RunWriter(d, fsync=False) as w:
        for h in ids:
            w.add_handle(h)
        for s in range(6):
            rows = ids + ["h1", "h3", "h1"] if s % 2 else ids  # h1 thrice, h3 twice in odd blocks
            k = len(rows)
            x = rng.standard_normal((k, 4)).astype(np.float32)
            n = rng.integers(-2**31, 2**31 - 1, (k, 2), dtype=np.int32)
            b = rng.integers(-2**15, 2**15 - 1, (k, 3), dtype=np.int16)
            calls = list(range(k))
            assert w.write_rows(rows, [s] * k, calls, {"x": x, "n": n, "b": (b, "bfloat16")})
            for j, h in enumerate(rows):
                want[h].append((s, calls[j], x[j], n[j], b[j]))
        x6 = np.full((2, 7), 3.5, np.float32)  # another shape: h0 and h2's x turns ragged
        zn, zb = np.zeros((2, 2), np.int32), np.zeros((2, 3), np.int16)
        assert w.write_rows(["h0", "h2"], [6, 6], [0, 0], {"x": x6, "n": zn, "b": (zb, "bfloat16")})
        want["h0"].append((6, 0, x6[0], zn[0], zb[0]))
        want["h2"].append((6, 0, x6[1], zn[1], zb[1]))
    with open_run(d) as run:
        for h in ids:
            r = run[h]
            assert list(r.steps) == [v[0] for v in want[h]], h
            assert list(r.calls) == [v[1] for v in want[h]], h
            got_x = r["x"].read()
            for g, v in zip(got_x, want[h]):
                np.testing.assert_array_equal(g, v[2])
            got_n = r["n"].read()
            assert got_n.dtype == np.int32
            np.testing.assert_array_equal(got_n, np.stack([v[3] for v in want[h]]))
            for j, v in enumerate(want[h]):
                back = r["b"].to_torch(j)
                assert back.dtype == torch.bfloat16
                np.testing.assert_array_equal(back.view(torch.int16).numpy(), v[4])


def _started(w, ids):
    """Declare handles ``ids`` and wait until the writer thread started them; returns its thread,
    queue, part tools and the handles."""
    for h in ids:
        w.add_handle(h)
    w.flush()
    return w._thread, w._queue, w._thread.ctx.tools, [w._handles[h] for h in ids]


def _stage_as_the_writer(w, hs, step, x):
    """Stage a block of records ``x`` (row ``j`` of ``hs[j]``, field ``x``) as the writer thread
    would, charged as ``write_rows`` charges it. The caller holds the queue's lock (the writer
    thread waits for it meanwhile)."""
    w._queue.pending += x.nbytes
    w._thread._stage(Record(hs[0], [step] * len(hs), [0] * len(hs), {"x": (x, "float32")}, x.nbytes, hs))


def test_the_writer_counts_its_staged_bytes_as_they_change(tmp_path):
    """The writer checks its staged memory once per batch from a running count (a walk over
    every handle's fields cost the writer thread ~20% of its time at 5,000 handles): the count
    equals the open parts' staged bytes as blocks of many handles' records are staged (general
    and lean path), relieved above the high mark and sealed; every record reads back."""
    d = tmp_path / "r"
    ids = [f"h{i}" for i in range(300)]
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((300, 1024)).astype(np.float32) for _ in range(6)]  # 4 KiB records
    with RunWriter(d, max_buffer_mb=8, fsync=False) as w:  # writes partial chunks above 4 MB staged
        th, q, tools, hs = _started(w, ids)
        counts = []
        with q.cond:
            for s, x in enumerate(xs):
                _stage_as_the_writer(w, hs, s, x)
                assert tools.staged == sum(h.part.staged_bytes() for h in th.parts.active.values()) > 0
                th.parts.relieve_memory(th.budget, waiting=False)
                assert tools.staged == sum(h.part.staged_bytes() for h in th.parts.active.values())
                counts.append(tools.staged)
        assert max(counts) <= th.budget.staged_high and min(counts[3:]) <= th.budget.staged_low  # relieved
        w.flush()
        assert tools.staged == 0 and q.pending == 0
    with open_run(d) as run:
        for i in (0, 7, 299):
            np.testing.assert_array_equal(run[f"h{i}"]["x"].read(), np.stack([x[i] for x in xs]))


def test_a_shared_blocks_lent_copy_counts_against_the_budget_until_its_last_row_is_written(tmp_path):
    """A shared block's rows are staged as views of one copy of them: the copy's bytes stay
    counted against the budget until its last row is written (its memory is freed only then),
    so a block that would fit if they returned row by row is refused (policy "drop"); once
    the last row is written, they return. Every record reads back."""
    d = tmp_path / "r"
    ids = ["a", "b", "c"]
    x0 = np.arange(3 * 1024, dtype=np.float32).reshape(3, 1024)  # 4 KiB records
    x1 = -x0
    row = x0.nbytes // 3
    with RunWriter(d, max_buffer_mb=1, policy="drop", fsync=False) as w:
        th, q, tools, hs = _started(w, ids)
        with q.cond:
            for s, x in enumerate((x0, x1)):
                _stage_as_the_writer(w, hs, s, x)
            assert tools.lent == x1.nbytes  # step 0 made the parts' fields; step 1 went lean: one copy
            for h in hs[:2]:  # a's and b's records are written; c's row holds the copy
                h.part.write_out(h.part.fields["x"], full_only=False)
            assert q.pending == tools.held == row + x1.nbytes  # c's first record + the whole copy
            fits_row_by_row = q._max_bytes - 2 * row  # c's two records: what per-row release would leave
            assert not w.make_room("a", fits_row_by_row)  # refused: the copy is still in memory
            hs[2].part.write_out(hs[2].part.fields["x"], full_only=False)
            assert q.pending == tools.lent == tools.held == 0
            assert w.make_room("a", fits_row_by_row)
        assert w.stats().handles["a"].dropped == 1
    with open_run(d) as run:
        for i, h in enumerate(ids):
            np.testing.assert_array_equal(run[h]["x"].read(), np.stack([x0[i], x1[i]]))


#: Handles of the writer-level scale test: 3,000 keeps it near a minute on 2 cores (each handle
#: costs its file's HDF5 work at close); HOOKLINE_SCALE_HANDLES=10000 checks the documented limit.
SCALE_HANDLES = int(os.environ.get("HOOKLINE_SCALE_HANDLES", "3000"))


@pytest.mark.slow
def test_thousands_of_handles_through_the_writer_at_default_settings(tmp_path):
    """Thousands of handles (blocks of records of many handles, as a recorder's shared blocks) at
    the default settings: a bounded number of files open, one `.h5` per handle after close, every
    record back."""
    d = tmp_path / "run"
    n = SCALE_HANDLES
    ids = [f"outputs[m{i}]" for i in range(n)]
    with RunWriter(d) as w:
        for hid in ids:
            w.add_handle(hid)
        assert w.max_open_files <= 102
        for s in range(2):
            for b in range(0, n, 256):
                rows = ids[b : b + 256]
                block = np.arange(b, b + len(rows), dtype=np.float32)[:, None] + np.full((1, 16), s, np.float32)
                assert w.write_rows(rows, [s] * len(rows), [0] * len(rows), {"x": block})
    assert len(list(d.rglob("*.h5"))) == n and not list(d.rglob("*.h5seg*"))
    with open_run(d) as run:
        assert len(run.handles) == n
        for i in (0, n // 3, n - 1):
            np.testing.assert_array_equal(run[f"outputs[m{i}]"]["x"].read(), [[i] * 16, [i + 1] * 16])
        assert all(len(run[hid]) == 2 for hid in ids[::97])


def test_row_norms_of_overflowing_records_warn_nothing():
    """A float32 sum of squares that overflows is recomputed in float64: no RuntimeWarning
    reaches the user's log from the writer thread."""
    block = np.full((2, 1000), 1e30, np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norms = row_norms(block, "float32")
    assert np.allclose(norms, [1e30 * np.sqrt(1000)] * 2, rtol=1e-6)
