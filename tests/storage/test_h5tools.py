"""Files written by hookline read with the HDF5 project's own tools (Debian ``hdf5-tools``).

``h5ls -r`` and ``h5dump`` are a second, independent reader (their own HDF5 build, 1.10 on
Debian 12) of what docs/format.md promises: every dataset and group where the document says,
the attributes it names, and the raw values (bfloat16 as its bits, ragged fields flat).

The tools come from Debian's ``hdf5-tools`` package, not from pip. ``.ci/run`` installs them and
sets ``HOOKLINE_REQUIRE_H5TOOLS=1``, which turns a missing tool into a failure there; on a
machine without them these tests say how to install them instead of running.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from hookline.storage import RunWriter, open_run
from hookline.tracker import HookManager, Recorder, select


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        msg = f"{name} not found: install Debian's hdf5-tools (apt-get install hdf5-tools)"
        if os.environ.get("HOOKLINE_REQUIRE_H5TOOLS") == "1":
            pytest.fail(msg + "; HOOKLINE_REQUIRE_H5TOOLS=1 requires it")
        pytest.skip(msg)
    return path


def _run(*args: str) -> str:
    p = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{args} exited {p.returncode}: {p.stderr[-2000:]}"
    return p.stdout


def _h5ls(path: Path) -> dict[str, str]:
    """``h5ls -r``: object path -> description (``Group`` or ``Dataset {3/Inf, 2}``)."""
    out = {}
    for line in _run(_tool("h5ls"), "-r", str(path)).splitlines():
        name, _, desc = line.partition(" ")
        out[name] = desc.strip()
    return out


def _dump_values(path: Path, dataset: str) -> np.ndarray:
    """A dataset's values as printed by ``h5dump`` (flat, floats with 9 significant digits)."""
    text = _run(_tool("h5dump"), "-y", "-w", "0", "-m", "%.9g", "-d", dataset, str(path))
    m = re.search(r"DATA \{(.*?)\}", text, re.S)
    assert m, text[:2000]
    tokens = [t for t in re.split(r"[,\s]+", m.group(1)) if t]
    return np.array([float(t) for t in tokens])


def _dump_attr(path: Path, obj: str, attr: str) -> str:
    text = _run(_tool("h5dump"), "-a", f"{obj}/{attr}" if obj != "/" else f"/{attr}", str(path))
    m = re.search(r"DATA \{\s*\(0\): (.*?)\s*\}", text, re.S)
    assert m, text[:2000]
    return m.group(1).strip().strip('"')


@pytest.fixture
def recorded_run(tmp_path: Path) -> Path:
    """A run recorded from a real model: float32 outputs, grads with a None entry, a ragged
    field (sequence length changes per step), and a bfloat16 field."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    mgr = HookManager()
    run_dir = tmp_path / "run"
    with Recorder(run_dir) as rec:
        lin = select(model, "*", types=torch.nn.Linear)
        mgr.register_forward_hook(rec.outputs, **lin)
        mgr.register_backward_hook(rec.grads, **lin)
        mgr.register_forward_hook(rec.hook("outputs", dtype=torch.bfloat16, name="outputs_bf16"), **select(model, "1"))
        for step, seq in enumerate((4, 2, 7)):
            with rec.step(step):
                model(torch.randn(seq, 6)).sum().backward()
    mgr.remove_all_hooks()
    return run_dir


def test_h5ls_lists_the_documented_layout(recorded_run: Path):
    with open_run(recorded_run) as run:
        assert len(run.handles) == 5
        for hid in run.handles:
            h = run[hid]
            path = recorded_run / f"{h.key}.h5"
            listing = _h5ls(path)
            n = len(h)
            assert listing["/step"] == listing["/call"] == f"Dataset {{{n}/Inf}}"
            assert listing["/_index"] == "Group"
            for name in h.fields:
                f = h[name]
                assert listing[f"/_index/{name}"] == "Group"
                assert listing[f"/_index/{name}/record"].startswith(f"Dataset {{{len(f)}/Inf")
                if f.shape is None:  # ragged: flat data + offsets + shapes
                    assert f"/_index/{name}/offset" in listing and f"/_index/{name}/shape" in listing
                    total = sum(int(np.prod(f[i].shape)) for i in range(len(f)))
                    assert listing[f"/{name}"] == f"Dataset {{{total}/Inf}}"
                else:
                    dims = ", ".join(str(d) for d in f.shape)
                    assert listing[f"/{name}"] == f"Dataset {{{len(f)}/Inf, {dims}}}"


def test_h5dump_reads_attributes_and_values(recorded_run: Path):
    dump = _tool("h5dump")
    with open_run(recorded_run) as run:
        for hid in run.handles:
            h = run[hid]
            path = recorded_run / f"{h.key}.h5"
            header = _run(dump, "-H", str(path))
            for attr in ("handle_id", "module_name", "module_type", "category", "format_version", "hookline_format"):
                assert f'ATTRIBUTE "{attr}"' in header, (hid, attr)
            assert _dump_attr(path, "/", "handle_id") == hid
            assert _dump_attr(path, "/", "module_name") == h.module_name
            assert int(_dump_attr(path, "/", "format_version")) == 1
            assert np.array_equal(_dump_values(path, "/step"), [0, 1, 2])
            for name in h.fields:
                f = h[name]
                dt = _dump_attr(path, f"/{name}", "dtype")
                assert dt == f.dtype_name
                values = _dump_values(path, f"/{name}")
                if f.dtype_name == "bfloat16":
                    # Stored as the raw 16 bits: h5dump prints the integers; the reader's
                    # float32 is those bits shifted into the high half.
                    f32 = np.concatenate([f[i].reshape(-1) for i in range(len(f))])
                    assert f32.dtype == np.float32 and not (f32.view(np.uint32) & 0xFFFF).any()
                    assert np.array_equal(values, (f32.view(np.uint32) >> 16).astype(np.float64))
                else:
                    # %.9g round-trips float32 exactly: parse back into the field's dtype.
                    expect = np.concatenate([np.asarray(f[i]).reshape(-1) for i in range(len(f))])
                    assert np.array_equal(values.astype(expect.dtype), expect), (hid, name)


def test_h5ls_reads_sealed_segments_of_an_unclosed_run(tmp_path: Path):
    """Segments sealed by flush() (what a crash leaves) are plain HDF5 files too."""
    w = RunWriter(tmp_path / "run", merge_on_close=False)
    w.add_handle("outputs[fc]", module_name="fc", module_type="torch.nn.Linear", category="forward_hook",
                 hook_fn_name="outputs")
    for i in range(3):
        w.write("outputs[fc]", i, 0, {"outputs.0": np.full((2, 3), i, np.float32)})
        w.flush()
    w.close()
    segs = sorted((tmp_path / "run").rglob("*.h5seg"))
    assert len(segs) == 3
    for i, seg in enumerate(segs):
        assert _h5ls(seg)["/outputs.0"] == "Dataset {1/Inf, 2, 3}"
        assert np.array_equal(_dump_values(seg, "/outputs.0"), np.full(6, i))
