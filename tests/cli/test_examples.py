"""The offline-analysis examples in docs/examples/ run on runs recorded in the test."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"


def _run(script: str, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run([sys.executable, str(EXAMPLES / script), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cka_two_runs(runs, tmp_path):
    out = _run("cka_two_runs.py", runs["a"], runs["b"], "outputs[fc1]", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = [l.split() for l in out.stdout.splitlines() if l.strip() and l.split()[0].isdigit()]
    assert [int(l[0]) for l in lines] == [0, 3, 6, 9]
    vals = [float(l[2]) for l in lines]
    assert vals[0] == pytest.approx(1.0, abs=1e-6)  # same init and data at step 0
    assert all(0 <= v <= 1 + 1e-9 for v in vals)
    same = _run("cka_two_runs.py", runs["a"], runs["a_same"], "outputs[head]", cwd=tmp_path)
    assert same.returncode == 0 and "mean CKA 1.0000" in same.stdout


def test_cka_example_uses_tokens_as_samples(tmp_path):
    """(batch, seq, d) records: CKA over batch*seq token samples (as a direct numpy CKA of the
    reshaped records gives), and over all steps stacked."""
    from hookline.storage import RunWriter

    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((2, 8, 4)) for _ in range(3)]
    ys = [x @ rng.standard_normal((4, 4)) + 0.8 * rng.standard_normal(x.shape) for x in xs]
    for name, module, arrays in (("a", "mlp", xs), ("b", "model.mlp", ys)):  # b named as under Lightning
        w = RunWriter(tmp_path / name)
        w.add_handle(f"outputs[{module}]", module_name=module, hook_fn_name="outputs")
        for step, arr in enumerate(arrays):
            w.write(f"outputs[{module}]", step, 0, {"outputs.0": arr})
        w.close()

    def cka(x, y):
        x, y = x - x.mean(0), y - y.mean(0)
        return np.linalg.norm(y.T @ x) ** 2 / (np.linalg.norm(x.T @ x) * np.linalg.norm(y.T @ y))

    out = _run("cka_two_runs.py", tmp_path / "a", tmp_path / "b", "outputs[mlp]", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    vals = [float(l.split()[2]) for l in out.stdout.splitlines() if l.strip() and l.split()[0].isdigit()]
    assert vals == pytest.approx([cka(x.reshape(16, 4), y.reshape(16, 4)) for x, y in zip(xs, ys)], abs=1e-4)
    stacked = cka(np.vstack([x.reshape(16, 4) for x in xs]), np.vstack([y.reshape(16, 4) for y in ys]))
    assert f"all steps {stacked:.4f}" in out.stdout and "'model.'" in out.stdout  # Lightning-style names paired


def test_grad_norm_trajectories(runs, tmp_path):
    png = tmp_path / "norms.png"
    out = _run("grad_norm_trajectories.py", png, runs["a"], runs["b"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "grads[fc1]" in out.stdout and "grads[head]" in out.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    bad = _run("grad_norm_trajectories.py", png, runs["a"], "--prefix", "nothing[", cwd=tmp_path)
    assert bad.returncode != 0 and "nothing[" in bad.stderr
