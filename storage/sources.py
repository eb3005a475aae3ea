"""Registry of the run sources that open_run() reads besides local directories.

A source is an object with ``manifests() -> list[dict]`` and ``path(rel) -> Path`` (optionally
``size(rel)``, ``discover(key, suffix)``, ``shared_manifests()`` and ``settled(manifest, rel)``;
see ``local.LocalSource``). Remote stores register a
*match* test and a *factory* here, so the reader opens them without importing them: the factory
is named as ``"module:function"`` and imported on first use. ``hookline.storage`` registers the
MLflow source (``runs:/...``) at import time.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from .errors import HookTypeError, InvalidArgumentError

__all__ = ["register_source", "find_source"]

#: ``match(text, tracking_uri) -> bool``: whether a run reference belongs to a source.
Match = Callable[[str, "str | None"], bool]

_SOURCES: list[tuple[Match, str]] = []  # in registration order: the first match wins


def register_source(match: Match, factory: str) -> None:
    """Let ``open_run`` read the run references that ``match`` accepts through ``factory``.

    Args:
        match: ``match(text, tracking_uri) -> bool``, called for every reference that is not a
            local run directory's path first; cheap, and imports nothing heavy.
        factory: ``"package.module:function"``, imported on first use; called as
            ``function(text, tracking_uri=..., cache_dir=...)``, it returns the source.
    """
    if not callable(match):
        raise HookTypeError(f"source match must be a callable match(text, tracking_uri) -> bool, got "
                            f"{type(match).__name__} {match!r:.60}")
    if not isinstance(factory, str) or ":" not in factory:
        raise InvalidArgumentError(f"source factory {factory!r:.80} must be a str reading 'package.module:function', "
                                   f"e.g. 'hookline.storage.mlflow.source:mlflow_source'")
    if (match, factory) not in _SOURCES:
        _SOURCES.append((match, factory))


def find_source(text: str, tracking_uri: str | None) -> Callable[..., Any] | None:
    """The factory of the first registered source that matches ``text``, imported; or None."""
    for match, factory in _SOURCES:
        if match(text, tracking_uri):
            module, _, name = factory.partition(":")
            return getattr(importlib.import_module(module), name)
    return None
