"""MLflow run references: which strings name an MLflow run, and the run id and folder they name.

Imports neither mlflow nor the reader: ``hookline.storage`` registers :func:`is_mlflow_reference`
with the reader's source registry at import time.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import InvalidArgumentError
from ..keys import MLFLOW_RUN_ID_PATTERN, is_mlflow_run_id
from .keys import ARTIFACT_ROOT

__all__ = ["URI_PREFIXES", "is_mlflow_reference", "parse_run_uri"]

#: Prefixes of the URIs that name an MLflow run (or a folder of its artifacts).
URI_PREFIXES = ("runs:/", "mlflow-artifacts:")

_RUNS_URI = re.compile(r"runs:/+([0-9A-Za-z_\-]+)(?:/(.*))?")
_ARTIFACTS_URI = re.compile(rf"mlflow-artifacts:(?://([^/]+))?/(?:.*/)?({MLFLOW_RUN_ID_PATTERN})/artifacts(?:/(.*))?")


def is_mlflow_reference(text: str, tracking_uri: str | None) -> bool:
    """Whether ``open_run(text, tracking_uri=...)`` reads an MLflow run: a ``runs:/`` or
    ``mlflow-artifacts:`` URI, or (with a tracking URI) a bare run id that is not a local path."""
    if text.startswith(URI_PREFIXES):
        return True
    return tracking_uri is not None and is_mlflow_run_id(text) and not Path(text).exists()


def parse_run_uri(uri: str, tracking_uri: str | None = None) -> tuple[str, str, str | None]:
    """Split an MLflow run reference into ``(run_id, artifact_root, tracking_uri)``.

    Accepts ``runs:/<run_id>[/<path>]``, ``mlflow-artifacts:[//host:port]/.../<run_id>/artifacts[/<path>]``
    and a bare 32-hex run id. ``artifact_root`` defaults to ``hookline``.

    Args:
        uri: the reference.
        tracking_uri: the tracking URI given with it (default: from an ``mlflow-artifacts://host``
            URI, else None: MLflow's resolution).

    Raises:
        InvalidArgumentError: for anything else (the message shows the accepted forms).
    """
    text = str(uri).strip()
    m = _RUNS_URI.fullmatch(text)
    if m:
        return m[1], (m[2] or "").strip("/") or ARTIFACT_ROOT, tracking_uri
    m = _ARTIFACTS_URI.fullmatch(text)
    if m:
        tu = tracking_uri or (f"http://{m[1]}" if m[1] else None)
        return m[2], (m[3] or "").strip("/") or ARTIFACT_ROOT, tu
    if is_mlflow_run_id(text):
        return text, ARTIFACT_ROOT, tracking_uri
    raise InvalidArgumentError(
        f"not an MLflow run reference: {uri!r}; use 'runs:/<run_id>', "
        "'mlflow-artifacts:/<experiment_id>/<run_id>/artifacts/hookline' or a 32-hex run id "
        "(with tracking_uri=... / --tracking-uri)"
    )
