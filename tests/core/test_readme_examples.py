"""The code in README.md and docs/capture.md runs as written, and the worked example runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.DOTALL)


@pytest.mark.parametrize("doc", ["README.md", "docs/capture.md"])
def test_first_python_block_runs(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _python_blocks(ROOT / doc)[0]
    exec(compile(code, doc, "exec"), {"__name__": "__doc_example__"})
    assert (tmp_path / "runs" / "baseline" / "manifest.json").exists()


def test_readme_commands_are_the_ci_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme)
    assert len(commands) == 2 and "hookline demo" in commands[0] and "pytest" in commands[1]
    for c in commands:
        assert c in ci, f"README command not run verbatim by .ci/run: {c}"


def test_worked_example_runs(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "docs/examples/record_mlp.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "grads[2]" in out.stdout and (tmp_path / "lr0.5" / "manifest.json").exists()
