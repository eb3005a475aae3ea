"""The frameworks are optional extras: the core never imports them, and an integration used
without its framework says which extra to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_the_core_imports_neither_framework():
    out = _python("""
        import sys
        import hookline.cli.main, hookline.storage, hookline.tracker, hookline.tracker.integrations
        from hookline.tracker import Recorder
        print(sorted(m for m in ("transformers", "lightning", "accelerate") if m in sys.modules))
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("module, framework", [("transformers", "transformers"), ("lightning", "lightning")])
def test_a_missing_framework_names_the_extra_to_install(module, framework):
    out = _python(f"""
        import sys
        sys.modules[{framework!r}] = None  # as if not installed: importing it raises ImportError
        from hookline.storage.errors import HooklineError, MissingDependencyError
        try:
            import hookline.tracker.integrations.{module}
        except MissingDependencyError as e:
            assert isinstance(e, HooklineError) and isinstance(e, ImportError)
            print(e)
        else:
            raise SystemExit("imported without {framework}")
    """)
    assert out.returncode == 0, out.stderr
    assert f"pip install 'hookline[{module}]'" in out.stdout
