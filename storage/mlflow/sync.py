"""sync(): upload a run directory to an existing MLflow run in one final pass (``hookline sync``);
the MLflow run it was recorded for comes from its manifests (:func:`recorded_run_id`)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import FormatError, InvalidArgumentError
from .report import SyncReport
from .rundir import load_manifests
from .upload import PassMode, Uploader

__all__ = ["recorded_run_id", "sync"]


def recorded_run_id(run_dir: str | os.PathLike, rank: int | None = None) -> str | None:
    """The MLflow run a run directory was recorded for: its manifests' ``meta.mlflow_run_id``
    (``Recorder(..., mlflow_run_id=...)`` and the framework callbacks write it).

    Args:
        run_dir: the hookline run directory.
        rank: read only this rank's manifest (default: every manifest in the directory).

    Returns:
        The run id, or ``None`` when the run was recorded without MLflow.

    Raises:
        UnknownNameError: the directory does not exist.
        FormatError: it holds no readable manifest, or its ranks' manifests name different runs.
    """
    ids = {}
    for path, man in load_manifests(Path(run_dir), rank):
        rid = (man.get("meta") or {}).get("mlflow_run_id")
        if rid is not None:
            ids.setdefault(str(rid), path.name)
    if len(ids) > 1:
        named = ", ".join(f"{name}: {rid!r}" for rid, name in ids.items())
        raise FormatError(f"the manifests of {str(run_dir)!r} name different MLflow runs ({named}); "
                          "pass the one to upload to (--run-id / run_id=)")
    return next(iter(ids), None)


def sync(run_dir: str | os.PathLike, run_id: str | None = None, *, tracking_uri: str | None = None,
         rank: int | None = None, mlflow_timeout: float | None = None) -> SyncReport:
    """Upload a run directory to an existing MLflow run; safe to repeat (nothing twice).

    This is what ``hookline sync RUN_DIR --run-id ID`` calls, e.g. after the server was down
    during training. Failures of single uploads/requests do not raise: they are listed in the
    returned report (``report.ok`` is False) and the next call retries exactly what is missing.

    Args:
        run_dir: the hookline run directory.
        run_id: the MLflow run id; default: the run the directory was recorded for
            (:func:`recorded_run_id`).
        tracking_uri: tracking server/store (default: MLflow's resolution).
        rank: sync only this rank's manifest (default: every manifest in the directory).
        mlflow_timeout: seconds each MLflow call may take (default ``$HOOKLINE_MLFLOW_TIMEOUT``,
            else 60; file transfers get one more second per MiB): a server that answers errors or
            hangs fails the sync within about that time.

    Returns:
        The :class:`SyncReport` (what was uploaded, skipped, logged, and what failed).

    Raises:
        UnknownNameError: if the run or the directory does not exist.
        TrackingError: if the tracking store cannot be used at all (:class:`TrackingUnreachableError`:
            it does not answer, answers errors, or runs out of the time budget).
        InvalidArgumentError: the store does not exist (a ``sqlite:`` file, MLflow's default
            ``./mlflow.db`` included), a bad argument, or no ``run_id`` for a directory recorded
            without MLflow.
        FormatError: if the directory holds no readable manifest.
    """
    if run_id is None:
        run_id = recorded_run_id(run_dir, rank)
        if run_id is None:
            raise InvalidArgumentError(
                f"run directory {str(run_dir)!r} was recorded without an MLflow run: name the run to upload "
                "it to (`hookline sync RUN_DIR --run-id ID`, or sync(run_dir, run_id))")
    uploader = Uploader(run_id, rank=rank, tracking_uri=tracking_uri, existing_store=True,
                        mlflow_timeout=mlflow_timeout)  # checks the arguments
    uploader.check_run()  # clear error for an unknown id before anything else (the pass reuses the run)
    return uploader.run(Path(run_dir), PassMode.FINAL)
