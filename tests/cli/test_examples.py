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


def test_linear_cka_properties():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from cka_two_runs import linear_cka
    finally:
        sys.path.remove(str(EXAMPLES))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 8))
    q, _ = np.linalg.qr(rng.standard_normal((8, 8)))
    assert linear_cka(x, 3.0 * x @ q) == pytest.approx(1.0)  # invariant to rotation and scale
    assert linear_cka(x, rng.standard_normal((50, 8))) < 0.5


def test_grad_norm_trajectories(runs, tmp_path):
    png = tmp_path / "norms.png"
    out = _run("grad_norm_trajectories.py", png, runs["a"], runs["b"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "grads[fc1]" in out.stdout and "grads[head]" in out.stdout
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    bad = _run("grad_norm_trajectories.py", png, runs["a"], "--prefix", "nothing[", cwd=tmp_path)
    assert bad.returncode != 0 and "nothing[" in bad.stderr
