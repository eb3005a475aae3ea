"""docs/integrations.md: its examples run as written, and the README and docs/index.md link it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from _integ_support import experiment_runs

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "integrations.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)


def _run(code: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("which", ["transformers", "lightning"])
def test_example_runs_as_written(which, tmp_path, mlflow_experiment):
    pytest.importorskip(which)
    uri, experiment = mlflow_experiment
    (code,) = [b for b in _python_blocks() if f"hookline.tracker.integrations.{which} import" in b]
    out = _run(code, tmp_path, dict(os.environ))
    assert out.returncode == 0, out.stderr[-5000:]
    lines = out.stdout.splitlines()
    run_line = next(line for line in lines if line.startswith("MLflow run"))
    if which == "transformers":
        assert "steps [0, 0, 2, 2, 4, 4] calls [0, 1, 0, 1, 0, 1]" in out.stdout
        run_id = run_line.split()[-1]
        (mlrun,) = experiment_runs(uri, experiment)  # MLFLOW_EXPERIMENT_NAME: the Trainer's run
        assert mlrun.info.run_id == run_id and "loss" in mlrun.data.metrics
    else:
        assert "['grads[net.0]', 'grads[net.2]'] [0, 1, 2, 3, 4]" in out.stdout
        _, _, logger_id, recorder_id = run_line.split()
        assert logger_id == recorder_id and len(logger_id) == 32


def test_integrations_page_is_linked():
    assert "(docs/integrations.md)" in (ROOT / "README.md").read_text()
    assert "(integrations.md)" in (ROOT / "docs" / "index.md").read_text()
    assert len(_python_blocks()) == 2
