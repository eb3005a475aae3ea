"""The frameworks are optional extras: the core never imports them, and an integration used
without its framework says which extra to install.

One fresh interpreter checks all three (starting one, torch imported, costs seconds): the core
first, while neither framework is imported; then each integration with its framework made
unimportable (``sys.modules[name] = None``), which changes nothing for the other checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

FRAMEWORKS = [("transformers", "transformers"), ("lightning", "lightning")]

CHECKS = textwrap.dedent(f"""
    import json, sys
    import hookline.cli.main, hookline.storage, hookline.tracker, hookline.tracker.integrations
    from hookline.tracker import Recorder
    out = {{"core": sorted(m for m in ("transformers", "lightning", "accelerate") if m in sys.modules)}}
    from hookline.storage.errors import HooklineError, MissingDependencyError
    for module, framework in {FRAMEWORKS!r}:
        sys.modules[framework] = None  # as if not installed: importing it raises ImportError
        try:
            __import__(f"hookline.tracker.integrations.{{module}}")
        except MissingDependencyError as e:
            assert isinstance(e, HooklineError) and isinstance(e, ImportError)
            out[module] = str(e)
        else:
            out[module] = f"imported without {{framework}}"
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def checked() -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", CHECKS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_core_imports_neither_framework(checked):
    assert checked["core"] == []


@pytest.mark.parametrize("module, framework", FRAMEWORKS)
def test_a_missing_framework_names_the_extra_to_install(module, framework, checked):
    assert f"pip install 'hookline[{module}]'" in checked[module], checked[module]
    assert f"pip install -e '.[{module}]'" in checked[module]  # (from a clone: where hookline is not on an index)
