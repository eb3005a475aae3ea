"""MLflow updates while training runs: when a Recorder asks its adapter for a metrics pass.

The writer seals what it holds every ``autoflush_s`` seconds (and at every ``flush()``),
rewriting the run's manifest each time. At most every ``mlflow_update_s`` seconds, at a step
boundary, :class:`LiveUpdates` looks at the manifest's modification time and, when the writer
sealed something since the last look, submits a background pass
(:meth:`~hookline.storage.MlflowAdapter.submit`: metrics and tags of the sealed records, never
blocking the training thread). So the run page's norm series grow during a long run, at most
``mlflow_update_s`` after each seal, instead of appearing at ``close()``.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

from hookline.storage.writer.checks import AUTOFLUSH_FIX, check_seconds

__all__ = ["LiveUpdates", "check_intervals"]


def check_intervals(mlflow_update_s: Any, autoflush_s: Any) -> tuple[float | None, float | None]:
    """A Recorder's ``mlflow_update_s`` and ``autoflush_s``, checked (:func:`check_seconds`)."""
    return (check_seconds(mlflow_update_s, "mlflow_update_s",
                          "pass e.g. 60, or None to update MLflow only at flush() and close()"),
            check_seconds(autoflush_s, "autoflush_s", AUTOFLUSH_FIX))


class LiveUpdates:
    """Submits a metrics pass when the writer sealed records since the last one.

    Args:
        adapter: the recorder's :class:`~hookline.storage.MlflowAdapter` (None: no MLflow run,
            nothing to do).
        manifest: this writer's manifest (rewritten at every seal), in the run directory the
            adapter syncs.
        every_s: seconds between two looks (None: never; passes at ``flush()`` and ``close()`` only).
    """

    def __init__(self, adapter: Any, manifest: Path, every_s: float | None) -> None:
        self.adapter = adapter
        self.manifest = manifest
        self.every_s = every_s
        self._next = time.monotonic() + every_s if adapter is not None and every_s is not None else math.inf
        self._seen: int | None = None  # the manifest's mtime at the last pass submitted here

    def tick(self) -> None:
        """Called at every step boundary: one clock read, unless a look is due."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s  # type: ignore[operator]
        try:
            mtime = os.stat(self.manifest).st_mtime_ns
        except OSError:  # nothing sealed yet
            return
        if mtime != self._seen:
            self._seen = mtime
            self.adapter.submit(self.manifest.parent)  # (the run directory)
