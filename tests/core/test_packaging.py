"""pyproject.toml lists every subpackage, so a built wheel holds all of the code (the editable
install finds unlisted subpackages anyway, which would hide the gap until a user installs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"tracker": "hookline.tracker", "storage": "hookline.storage", "cli": "hookline.cli"}


def _source_packages() -> set[str]:
    found = set()
    for folder, name in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((name, *rel)))
    return found


def _listed_packages() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^packages\s*=\s*\[(.*?)\]", text, flags=re.S | re.M)
    assert block, "pyproject.toml has no [tool.setuptools] packages list"
    return set(re.findall(r'"([^"]+)"', block.group(1)))


def test_every_subpackage_is_listed_in_pyproject() -> None:
    source, listed = _source_packages(), _listed_packages()
    assert source - listed == set(), f"add these to [tool.setuptools] packages: {sorted(source - listed)}"
    assert listed - source == set(), f"listed but not in the tree: {sorted(listed - source)}"
