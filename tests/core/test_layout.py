"""The layout rules of docs/architecture.md, checked on the source text (imports are read with
``ast``, including imports inside functions and under ``TYPE_CHECKING``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"tracker": "hookline.tracker", "storage": "hookline.storage", "cli": "hookline.cli"}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, name in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((name, *parts))] = path
    return mods


MODULES = _modules()


def _imports(mod: str, path: Path) -> list[tuple[ast.stmt, str, list[str], bool]]:
    """(node, imported module, imported names, at module level) for every import of ``mod``."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                out.append((node, a.name, [], id(node) in top))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            out.append((node, target, [a.name for a in node.names], id(node) in top))
    return out


def _owner(name: str) -> str | None:
    """The project module that ``name`` (a module or a name inside one) belongs to."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for mod, path in MODULES.items():
        for _, target, names, _top in _imports(mod, path):
            targets = [f"{target}.{n}" if f"{target}.{n}" in MODULES else target for n in names] or [target]
            for t in targets:
                owner = _owner(t)
                # a module importing its own package's __init__ (e.g. a relative ``from . import x``
                # of a sibling) is resolved to the sibling above; the package itself is not an edge
                if owner and owner != mod and not mod.startswith(owner + "."):
                    edges[mod].add(owner)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_the_module_table_covers_the_tree() -> None:
    assert {"hookline.tracker.hooks.manager", "hookline.storage.writer", "hookline.cli.main"} <= set(MODULES)


def test_no_import_cycle() -> None:
    assert _cycles(_edges()) == []


def test_a_cycle_is_found_when_there_is_one() -> None:
    # the checker itself can fail: a made-up pair of modules importing each other
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]


@pytest.mark.parametrize("lower, upper", [("hookline.storage", "hookline.tracker"),
                                          ("hookline.storage", "hookline.cli"),
                                          ("hookline.tracker", "hookline.cli"),
                                          ("hookline.tracker.hooks", "hookline.tracker.capture"),
                                          ("hookline.tracker.hooks", "hookline.tracker.integrations"),
                                          ("hookline.tracker.capture", "hookline.tracker.integrations")])
def test_dependency_direction(lower: str, upper: str) -> None:
    wrong = [(m, t) for m, ts in _edges().items() if m.startswith(lower + ".") or m == lower
             for t in ts if t == upper or t.startswith(upper + ".")]
    assert wrong == [], f"{lower} must not import {upper}"


def test_storage_never_imports_torch_at_module_level_and_mlflow_only_lazily() -> None:
    bad = []
    for mod, path in MODULES.items():
        for node, target, _names, top in _imports(mod, path):
            root = target.split(".")[0]
            if mod.startswith("hookline.storage") and root == "torch" and top:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports torch at module level")
            # the demo plays the user's training script and logs its own params and loss
            allowed = mod.startswith("hookline.storage.mlflow.") or mod == "hookline.cli.demo"
            if root == "mlflow" and (top or not allowed):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports mlflow "
                           f"({'at module level' if top else 'outside storage/mlflow/'})")
    assert bad == []


def test_no_private_name_crosses_a_module() -> None:
    bad = []
    for mod, path in MODULES.items():
        for node, target, names, _top in _imports(mod, path):
            if _owner(target) is None:
                continue  # a third-party or stdlib module
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}.{n}")
    assert bad == []


def test_files_stay_small_or_say_why() -> None:
    long = []
    for mod, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        doc = ast.get_docstring(ast.parse(text)) or ""
        if lines > MAX_LINES and not re.search(r"lines, kept in one file", doc):
            long.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert long == [], f"split these, or say in the module docstring why not ('~N lines, kept in one file: ...'): {long}"


def test_every_module_states_its_job() -> None:
    missing = [str(p.relative_to(ROOT)) for p in MODULES.values() if not ast.get_docstring(ast.parse(p.read_text()))]
    assert missing == []


def test_functions_stay_short() -> None:
    """Over ~80 lines a function is split where its steps have names (docstrings not counted)."""
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                body = node.body
                if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]
                n = node.end_lineno - body[0].lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert long == []


def test_no_module_shadows_a_lazily_exported_name() -> None:
    """``import hookline.storage.X`` binds the module X on the package: a lazily exported name
    equal to a module's name would then read as the module (``verify`` once did)."""
    import subprocess
    import sys

    import hookline.storage as storage

    clashes = [n for n in storage._LAZY if f"hookline.storage.{n}" in MODULES]
    assert clashes == []
    # and in a fresh interpreter: importing every storage module first leaves the names callable
    code = ("import importlib, hookline.storage as s\n"
            f"for m in {sorted(m for m in MODULES if m.startswith('hookline.storage.') and '.mlflow' not in m)!r}:\n"
            "    importlib.import_module(m)\n"
            "from hookline.storage import verify, open_run, sync, compare_runs\n"
            "assert all(callable(f) and not hasattr(f, '__path__') and type(f).__name__ == 'function' "
            "for f in (verify, open_run, sync, compare_runs)), (verify, open_run, sync, compare_runs)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
