"""docs/analysis.md: the examples of its tables, lazy-array and dask.distributed sections run as
written, in order, from an empty directory: the first three as one script, the cluster example
as a script of its own (process workers re-import the script that starts them)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "analysis.md"
SECTIONS = ("## Tables (pandas)", "## Labelled lazy arrays (xarray, Dask)", "## Scaling out on dask.distributed")


def _blocks() -> list[str]:
    text = DOC.read_text()
    start = text.index(SECTIONS[0])
    end = text.index("\n## ", text.index(SECTIONS[-1]) + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], re.DOTALL)


def _run(cwd: Path, name: str, code: str) -> subprocess.CompletedProcess:
    (cwd / name).write_text(code)
    out = subprocess.run([sys.executable, name], cwd=cwd, env=dict(os.environ, MPLBACKEND="Agg"),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-5000:]
    return out


def test_examples_run_as_written(tmp_path):
    blocks = _blocks()
    assert len(blocks) == 4
    out = _run(tmp_path, "analysis_examples.py", "\n".join(blocks[:3]))
    lines = out.stdout.splitlines()
    # tables: 8 recorded steps x (2 runs x 3 Linear layers + 2 x 2 summarised ReLUs)
    assert "(8, 10) -> norms.png" in out.stdout
    png = (tmp_path / "norms.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert re.search(r"^lr=0\.05\s+1\s+[\d.]+\s+[\d.]+$", out.stdout, re.MULTILINE), out.stdout
    # lazy arrays
    assert "('record', 'batch', 'feature') (8, 32, 64)" in out.stdout
    assert "step 10: (1, 64)" in out.stdout  # one call in step 10
    assert any(line.startswith("mean activation per step from 20:") and line.endswith("at steps [20 25 30 35]")
               for line in lines), out.stdout
    assert "Tensor (8, 32, 64) torch.float32" in out.stdout
    assert "(8, 64)" in out.stdout  # the ReLU histogram: 64 bins per record
    # dask.distributed
    out = _run(tmp_path, "cluster_example.py", blocks[3])
    assert re.search(r"^grad_out of layer 0: mean \S+ rms \S+$", out.stdout, re.MULTILINE), out.stdout
    assert "std per record: 8 records, steps [ 0  5 10 15] ..." in out.stdout


def test_analysis_page_is_linked():
    assert "(docs/analysis.md)" in (ROOT / "README.md").read_text()
    assert "(analysis.md)" in (ROOT / "docs" / "index.md").read_text()
