"""verify_mlflow_run(): check the hookline data an MLflow run holds (``hookline verify runs:/ID``).

The run's manifests and every handle file they name are downloaded fresh into a temporary folder
(not the reader's cache: what is checked is what MLflow holds now) and verified there as a local
run directory, with the same checks and the same report as ``verify(run_dir)``.
"""

from __future__ import annotations

import tempfile
from typing import Any

from ..errors import FormatError, UnknownNameError
from ..verifier import verify
from ..verify_report import VerifyReport
from .keys import ARTIFACT_ROOT
from .source import mlflow_source

__all__ = ["verify_mlflow_run"]


def verify_mlflow_run(uri: str, *, tracking_uri: str | None = None,
                      mlflow_timeout: float | None = None) -> VerifyReport:
    """Check an MLflow run's hookline data: which handles and records the uploaded files hold.

    Args:
        uri: ``runs:/<run_id>``, an ``mlflow-artifacts:`` URI of the run's ``hookline`` folder, or
            a bare run id.
        tracking_uri: tracking server/store (default: MLflow's resolution).
        mlflow_timeout: seconds each MLflow call may take (default ``$HOOKLINE_MLFLOW_TIMEOUT``,
            else 60; a download gets one more second per MiB).

    Returns:
        The :class:`~hookline.storage.VerifyReport` of the downloaded copy, its ``path`` the
        ``runs:/<run_id>`` URI. A file the manifest names that MLflow does not hold shows as that
        handle's missing records. Nothing can be repaired in MLflow: repair the local run
        directory (``hookline verify RUN_DIR --repair``) and upload it again (``hookline sync``).

    Raises:
        InvalidArgumentError: a malformed URI, or a store that does not exist.
        UnknownNameError: the run does not exist at the tracking URI.
        FormatError: the run holds no hookline manifest (it was never synced).
        TrackingError: MLflow cannot be reached, or a download failed.
    """
    with tempfile.TemporaryDirectory(prefix="hookline-verify-") as tmp:
        src = mlflow_source(uri, tracking_uri=tracking_uri, cache_dir=tmp, mlflow_timeout=mlflow_timeout)
        for rel in _named_files(src.manifests()):
            try:
                src.path(rel)
            except (UnknownNameError, FormatError):
                continue  # (not in MLflow, or leading outside the run: the verify below reports it)
        report = verify(src.cache_dir / src.root)
    report.path = f"runs:/{src.run_id}" if src.root == ARTIFACT_ROOT else f"runs:/{src.run_id}/{src.root}"
    return report


def _named_files(manifests: list[Any]) -> list[str]:
    """The handle files the manifests name, in order, each once."""
    files: dict[str, None] = {}
    for man in manifests:
        handles = man.get("handles") if isinstance(man, dict) else None
        for entry in (handles or {}).values() if isinstance(handles, dict) else ():
            rel = entry.get("file") if isinstance(entry, dict) else None
            if isinstance(rel, str) and rel:
                files[rel] = None
    return list(files)
