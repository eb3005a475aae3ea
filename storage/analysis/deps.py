"""The optional packages of the analysis tools, imported on use with one line naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

from ..errors import MissingDependencyError

__all__ = ["EXTRA", "require"]

#: What installs every package :func:`require` is asked for.
EXTRA = 'pip install "hookline[analysis]"'


def require(module: str, feature: str) -> ModuleType:
    """Import ``module`` (``"pandas"``, ``"xarray"``, ``"dask.array"``...) for ``feature``.

    Raises:
        MissingDependencyError: the module is not installed; the one-line message names the
            extra that installs it.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(
            f"{feature} needs {module.split('.')[0]}, which is not installed: {EXTRA} "
            f"(import failed: {e})") from e
