"""sync(): upload a run directory to an existing MLflow run in one final pass (``hookline sync``)."""

from __future__ import annotations

import os
from pathlib import Path

from .report import SyncReport
from .upload import PassMode, Uploader

__all__ = ["sync"]


def sync(run_dir: str | os.PathLike, run_id: str, *, tracking_uri: str | None = None,
         rank: int | None = None, mlflow_timeout: float | None = None) -> SyncReport:
    """Upload a run directory to an existing MLflow run; safe to repeat (nothing twice).

    This is what ``hookline sync RUN_DIR --run-id ID`` calls, e.g. after the server was down
    during training. Failures of single uploads/requests do not raise: they are listed in the
    returned report (``report.ok`` is False) and the next call retries exactly what is missing.

    Args:
        run_dir: the hookline run directory.
        run_id: the MLflow run id.
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
            ``./mlflow.db`` included), or a bad argument.
        FormatError: if the directory holds no readable manifest.
    """
    uploader = Uploader(run_id, rank=rank, tracking_uri=tracking_uri, existing_store=True,
                        mlflow_timeout=mlflow_timeout)  # checks the arguments
    uploader.check_run()  # clear error for an unknown id before anything else (the pass reuses the run)
    return uploader.run(Path(run_dir), PassMode.FINAL)
