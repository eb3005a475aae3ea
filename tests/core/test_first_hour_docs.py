"""What a new user met in the docs and a new contributor in the test run: install lines that
work from a clone, the disk cost of the defaults where they are met, how-to pages apart from
internals with an answer one click from docs/index.md, and a default test run that leaves the
slow variants to ``pytest -m slow``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _resolves(page: Path, target: str) -> bool:
    path, _, anchor = target.partition("#")
    f = (page.parent / path).resolve() if path else page
    if not f.exists():
        return False
    return not anchor or anchor in {_anchor(h) for h in re.findall(r"^#+ (.*)$", f.read_text(), re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_extra_install_line_has_its_form_for_a_clone(page):
    """`pip install "hookline[x]"` works only where hookline is on a package index (or already
    installed); a page that shows it also shows `pip install -e ".[x]"` for a clone."""
    text = page.read_text()
    for extra in set(re.findall(r"""pip install ["']hookline\[(\w+)\]["']""", text)):
        assert re.search(rf"""pip install -e ["']\.\[{extra}\]["']""", text), (page.name, extra)


def test_the_disk_cost_of_the_defaults_is_stated_where_they_are_met():
    keywords = (DOCS / "integrations.md").read_text().split("## Keywords", 1)[1].split("\n## ", 1)[0]
    every = next(line for line in keywords.splitlines() if line.startswith("| `every=`"))
    assert "Default `every=1`" in every and re.search(r"\d+ KiB per step", every), every
    capture = (DOCS / "capture.md").read_text().split("## Steps and sampling", 1)[1].split("\n## ", 1)[0]
    assert "Default `every=1`" in capture
    recorder = (ROOT / "tracker" / "capture" / "recorder.py").read_text()  # (the Recorder's docstring; no torch import)
    assert "Default 1: every step" in " ".join(recorder.split())


def test_how_to_answers_are_one_click_from_the_index_and_internals_are_apart():
    index = (DOCS / "index.md").read_text()
    sections = re.findall(r"^## (.*)$", index, re.M)
    assert sections[:4] == ["How do I ...?", "How-to guides", "Reference", "Internals"], sections
    how = index.split("## How do I ...?", 1)[1].split("\n## ", 1)[0]
    links = re.findall(r"\]\(([^)\s]+)\)", how)
    assert len(links) >= 15
    assert all(_resolves(DOCS / "index.md", t) and not t.startswith(("internals/", "architecture", "performance"))
               for t in links), links
    internals = index.split("## Internals", 1)[1].split("\n## ", 1)[0]
    for page in ("architecture.md", "performance.md", "internals/capture.md", "internals/storage.md",
                 "internals/mlflow.md"):
        assert f"({page})" in internals and _resolves(DOCS / "index.md", page), page
    # the user pages hold no internals sections (threads, memory trimming, key scheme, cost)
    for page, moved in (("capture.md", ["What happens on the training thread", "What it costs"]),
                        ("storage.md", ["Writer design", "Memory budget and policies"]),
                        ("mlflow.md", ["Key scheme (why it is collision-free)", "Cost"])):
        heads = re.findall(r"^#+ (.*)$", (DOCS / page).read_text(), re.M)
        assert not set(moved) & set(heads), (page, heads)
        assert f"(internals/{page})" in (DOCS / page).read_text()
        inner = re.findall(r"^#+ (.*)$", (DOCS / "internals" / page).read_text(), re.M)
        assert set(moved) <= set(inner), (page, inner)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if "://" not in target:
            assert _resolves(page, target), f"{page.relative_to(ROOT)} links to missing {target}"


def test_the_default_test_run_leaves_the_slow_variants_to_ci():
    """The README's test command runs the default set; `pytest -m slow` the slower, fuller
    variants, which CI runs right after it."""
    import tomllib

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "-m 'not slow'" in addopts
    ci = (ROOT / ".ci" / "run").read_text()
    readme_cmd = ".venv/bin/python -m pytest\n"
    assert readme_cmd in (ROOT / "README.md").read_text().replace("```", "\n") and readme_cmd in ci
    assert ci.index(readme_cmd) < ci.index(".venv/bin/python -m pytest -m slow")
    assert "pytest -m slow" in (ROOT / "README.md").read_text()
