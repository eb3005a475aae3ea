"""The quick-start example of docs/hooks.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "hooks.md"


def test_quick_start_runs(capsys):
    block = re.search(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S).group(1)
    exec(compile(block, str(DOC), "exec"), {})
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["0", "2", "2", "1", "0", "0", "2"]
    assert all("('0',)" in line for line in lines[2:5])
