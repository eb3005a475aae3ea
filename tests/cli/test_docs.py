"""Every command has -h/--help with an example, and docs/cli.md documents every command and option."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from hookline.cli.main import cli

ROOT = Path(__file__).resolve().parents[2]
CLI_MD = ROOT / "docs" / "cli.md"
COMMANDS = sorted(cli.commands)


def _section(name: str) -> str:
    text = CLI_MD.read_text(encoding="utf-8")
    m = re.search(rf"^## `hookline {name}`.*?(?=^## |\Z)", text, re.S | re.M)
    assert m, f"docs/cli.md has no '## `hookline {name}`' section"
    return m.group(0)


def test_expected_commands():
    assert set(COMMANDS) == {"demo", "runs", "show", "compare", "export", "verify", "sync"}


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_has_example(cli_runner, name, flag):
    res = cli_runner.invoke(cli, [name, flag])
    assert res.exit_code == 0, res.stderr
    assert f"Usage: cli {name}" in res.stdout or f"Usage: hookline {name}" in res.stdout
    assert "Example:" in res.stdout and f"hookline {name}" in res.stdout.split("Example:", 1)[1]


def test_group_help_and_version(cli_runner):
    for flag in ("-h", "--help"):
        res = cli_runner.invoke(cli, [flag])
        assert res.exit_code == 0 and "Example:" in res.stdout
        for name in COMMANDS:
            assert name in res.stdout
    res = cli_runner.invoke(cli, ["--version"])
    assert res.exit_code == 0 and "hookline" in res.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_command_documented_with_all_options(name):
    section = _section(name)
    cmd = cli.commands[name]
    for p in cmd.params:
        if isinstance(p, click.Option):
            longest = max(p.opts, key=len)
            if longest == "--help":
                continue
            assert longest in section, f"docs/cli.md: `hookline {name}` does not document {longest}"
        elif isinstance(p, click.Argument):
            assert (p.metavar or p.name.upper()).strip("[]") in section, (name, p.name)
    assert "Example" in section or "```" in section


def test_json_keys_documented():
    """The --json keys the tests rely on are all named in docs/cli.md."""
    text = CLI_MD.read_text(encoding="utf-8")
    for key in ("cosine", "rel_l2", "norm_ratio", "common_steps", "only_a", "only_b", "mismatched", "summary",
                "shape_a", "dtype_a", "n_steps", "ragged", "norm_mean", "norm_last", "module_types", "uploaded",
                "skipped", "missing_in_a", "no_common_steps", "shape_mismatch"):
        assert f"`{key}`" in text or f'"{key}"' in text, key


def test_docs_index_links():
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for page in ("quickstart.md", "hooks.md", "capture.md", "format.md", "storage.md", "mlflow.md", "cli.md",
                 "performance.md", "architecture.md", "distributed.md"):
        assert f"({page})" in index, page
    for example in ("cka_two_runs.py", "grad_norm_trajectories.py"):
        assert example in index


@pytest.mark.parametrize("page", ["index.md", "quickstart.md", "cli.md"])
def test_relative_links_resolve(page):
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#\s]+)\)", text):
        if "://" in target:
            continue
        assert (ROOT / "docs" / target).exists(), f"{page} links to missing {target}"


def test_group_options_documented():
    text = CLI_MD.read_text(encoding="utf-8")
    for p in cli.params:
        if isinstance(p, click.Option) and "--help" not in p.opts:
            for opt in p.opts:
                assert f"`{opt}`" in text or opt in text, f"docs/cli.md does not document hookline {opt}"


@pytest.mark.parametrize("args", [["export", "x", "y", "z", "--format", "npz"], ["nosuch"], ["--bad"],
                                  ["compare", "a"], ["runs", "--max-results", "0"]])
def test_usage_errors_are_one_line(cli_runner, args):
    res = cli_runner.invoke(cli, args)
    assert res.exit_code == 2
    err = res.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("Error: ") and err.endswith("--help')"), err


def test_bare_hookline_prints_the_formatted_help(cli_runner):
    # click's no-args help is a UsageError subclass (click >= 8.2): it must not be collapsed.
    res = cli_runner.invoke(cli, [], prog_name="hookline")
    out = res.stdout + res.stderr
    assert "Usage: hookline" in out and "Commands:" in out, out
    assert not out.startswith("Error:"), out
    assert len(out.splitlines()) > 10
