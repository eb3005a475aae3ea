"""MlflowAdapter: sync run directories into one MLflow run on a background thread, or synchronously.

The passes themselves are :class:`~.upload.Uploader`'s; the adapter queues and coalesces them,
runs them off the training thread, collects their failures, and closes at interpreter exit.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import DuplicateNameError, UnknownNameError, WriterClosedError
from .client import short_error
from .report import SyncReport
from .shutdown import close_at_exit, exit_timeout, forget
from .upload import PassMode, Uploader

__all__ = ["MlflowAdapter"]

log = logging.getLogger("hookline.mlflow")


class MlflowAdapter:
    """Registers run directories with one MLflow run, in the background or synchronously.

    The Recorder (or a user) creates one adapter per MLflow run and process. Construction is cheap
    and makes no request (mlflow is imported on first use, on the background thread when
    :meth:`submit` is used).

    Example:
        >>> adapter = MlflowAdapter(run.info.run_id)            # doctest: +SKIP
        >>> adapter.submit("runs/baseline")   # at each flush: returns at once
        >>> adapter.close()                   # at the end: final uploads, raises on failure

    Args:
        run_id: the MLflow run that receives the data (it must exist; hookline never creates
            or ends runs).
        tracking_uri: tracking server/store; default: MLflow's own resolution
            (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working directory).
        rank: distributed rank; when given, only this rank's manifest is synced and tag/metric
            keys carry ``-rank<r>`` (artifact names carry the writer's ``.rank<r>``).
        max_workers: parallel artifact uploads.
        upload_on_submit: also upload the handle files on every :meth:`submit` (default: only
            metrics and tags mid-run; files are uploaded by :meth:`close` / :meth:`log_run_dir`,
            since re-uploading growing files at every flush costs bandwidth).
        mlflow_timeout: seconds each of the adapter's MLflow calls may take (file uploads one
            more second per MiB); default ``$HOOKLINE_MLFLOW_TIMEOUT`` as set now, else 60.

    Raises:
        InvalidArgumentError: for an empty/malformed run id, a negative rank, or an
            ``mlflow_timeout`` (or ``$HOOKLINE_MLFLOW_TIMEOUT``) that is not a positive number.
    """

    def __init__(self, run_id: str, tracking_uri: str | None = None, rank: int | None = None, *,
                 max_workers: int = 4, upload_on_submit: bool = False, mlflow_timeout: float | None = None) -> None:
        self._uploader = Uploader(run_id, rank=rank, tracking_uri=tracking_uri, max_workers=max_workers,
                                  mlflow_timeout=mlflow_timeout)
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.rank = rank
        self.upload_on_submit = bool(upload_on_submit)
        self._cond = threading.Condition()
        self._pending: dict[Path, PassMode] = {}  # run_dir -> the largest mode submitted
        self._busy = False
        self._thread: threading.Thread | None = None
        self._seen: list[Path] = []
        self._last_dir: Path | None = None
        self._report = SyncReport(run_id)  # counts since the last wait()
        self._errs: dict[tuple[Path, PassMode], list[str]] = {}  # outstanding failures per (dir, mode)
        self._closed = False
        self._final: SyncReport | None = None
        close_at_exit(self)

    # -- public API ---------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The :class:`mlflow.MlflowClient` (created on first use)."""
        return self._uploader.client

    def prefetch(self) -> None:
        """Start fetching the MLflow run for the next pass, which is about to come (e.g. before
        the files of a closing run are finished); never raises, never blocks on the server."""
        if not self._closed:
            self._uploader.prefetch_run()

    def log_run_dir(self, run_dir: str | os.PathLike, *, artifacts: bool = True) -> SyncReport:
        """Synchronously sync a run directory to the run (files, tags, metrics, manifest).

        Idempotent: unchanged files are not uploaded again, logged metric points not repeated.

        Args:
            run_dir: the hookline run directory.
            artifacts: also upload the handle files and manifest(s).

        Returns:
            The :class:`SyncReport` of this pass.

        Raises:
            TrackingError: if anything failed (server down, upload error); the error's ``report``
                attribute holds the :class:`SyncReport`. What succeeded stays done; call again
                (or ``hookline sync``) to complete the run.
            UnknownNameError: if the run or the run directory does not exist.
            FormatError: if ``run_dir`` holds no readable manifest.
        """
        path = Path(run_dir)
        self._remember(path)
        report = self._uploader.run(path, PassMode.FINAL if artifacts else PassMode.METRICS)
        if not report.ok:
            raise report.error(path)
        return report

    def submit(self, run_dir: str | os.PathLike, *, artifacts: bool | None = None) -> None:
        """Schedule a background sync of ``run_dir`` and return at once (never blocks on MLflow).

        Submissions coalesce: while a pass runs, further submits of the same directory result in
        one more pass. Failures are collected and reported by :meth:`wait` / :meth:`close`.

        Args:
            run_dir: the hookline run directory.
            artifacts: upload the handle files too (default: the ``upload_on_submit`` setting).

        Raises:
            WriterClosedError: the adapter is closed.
        """
        if self._closed:
            raise WriterClosedError(f"MLflow adapter for run {self.run_id!r} is closed: create a new one")
        path = Path(run_dir)
        self._remember(path)
        up = self.upload_on_submit if artifacts is None else bool(artifacts)
        mode = PassMode.FILES if up else PassMode.METRICS
        with self._cond:
            self._pending[path] = max(self._pending.get(path, PassMode.METRICS), mode)
            self._start_worker(f"hookline-mlflow-{self.run_id[:8]}")

    def wait(self, timeout: float | None = None, *, raise_on_error: bool = True) -> SyncReport:
        """Block until every submitted pass finished (or failed).

        Args:
            timeout: seconds to wait at most (None: no limit). On timeout the report carries an
                error and the passes keep running in the background.
            raise_on_error: raise instead of returning a failed report.

        Returns:
            The combined :class:`SyncReport` of the passes since the previous ``wait``. Its
            ``errors`` are the failures not made good since by a later successful pass (a failed
            mid-run pass followed by a successful one is not an error any more).

        Raises:
            TrackingError: if a pass failed (or the wait timed out) and ``raise_on_error``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self._report.errors.append(f"timed out after {timeout:g} s waiting for MLflow uploads")
                    break
                self._cond.wait(left)
            report, self._report = self._report, SyncReport(self.run_id)
            report.errors = [e for errs in self._errs.values() for e in errs] + report.errors
            self._errs.clear()
        if not report.ok and raise_on_error:
            raise report.error(self._last_dir)
        return report

    def close(self, timeout: float | None = None, *, raise_on_error: bool = True) -> SyncReport:
        """Final sync (files included) of every directory seen, then stop. Idempotent.

        Returns after the uploads finished or failed. Call it at the end of training; it also
        runs at interpreter exit (with ``$HOOKLINE_MLFLOW_EXIT_TIMEOUT`` s, default 120, and
        errors logged instead of raised).

        Args:
            timeout: seconds to wait at most (None: no limit).
            raise_on_error: raise instead of returning a failed report.

        Returns:
            The combined :class:`SyncReport` of all passes not yet reported by :meth:`wait`.

        Raises:
            TrackingError: if something failed and ``raise_on_error``; the local files are complete
                and ``sync(run_dir, run_id)`` / ``hookline sync`` completes the run later.
        """
        if self._final is None:
            if self._seen:
                with self._cond:
                    for d in self._seen:
                        self._pending[d] = PassMode.FINAL
                    self._start_worker("hookline-mlflow")
            self._final = self.wait(timeout, raise_on_error=False)
            self._closed = True
            with self._cond:
                self._cond.notify_all()
            forget(self)
        if not self._final.ok and raise_on_error:
            raise self._final.error(self._last_dir)
        return self._final

    def close_at_exit(self) -> None:
        """Close as interpreter exit does: wait at most :func:`~.shutdown.exit_timeout` seconds
        and log failures on the ``hookline.mlflow`` logger instead of raising."""
        try:
            report = self.close(timeout=exit_timeout(), raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - never raise at interpreter exit
            log.error("hookline: closing the MLflow adapter at exit failed: %s", e)
            return
        if not report.ok:
            log.error("hookline: %s", report.error(self._last_dir))

    def __enter__(self) -> MlflowAdapter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close(raise_on_error=exc[0] is None)

    def __repr__(self) -> str:
        return f"MlflowAdapter(run_id={self.run_id!r}, tracking_uri={self.tracking_uri!r}, rank={self.rank!r})"

    # -- background worker --------------------------------------------------------------------

    def _remember(self, path: Path) -> None:
        if path not in self._seen:
            self._seen.append(path)
        self._last_dir = path

    def _start_worker(self, name: str) -> None:
        """Start the worker unless it runs, and wake it (call with ``self._cond`` held)."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._worker, name=name, daemon=True)
            self._thread.start()
        self._cond.notify_all()

    def _next_pass(self) -> tuple[Path, PassMode] | None:
        """The next submitted pass, taken off the queue (blocks); None once closed and idle."""
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait(1.0)
                if not self._pending and self._closed:
                    return None
            run_dir, mode = next(iter(self._pending.items()))
            if mode != PassMode.FINAL:  # (a submit() right before close(), as Recorder.close() does:
                self._cond.wait(0.05)  # let the final pass replace this one instead of following it)
                run_dir, mode = next(iter(self._pending.items()))
            del self._pending[run_dir]
            self._busy = True
            return run_dir, mode

    def _worker(self) -> None:
        while (job := self._next_pass()) is not None:
            run_dir, mode = job
            try:
                rep = self._uploader.run(run_dir, mode)
            except BaseException as e:  # noqa: BLE001 - reported, never raised into training
                rep = SyncReport(self.run_id, errors=[f"{run_dir}: {short_error(e)}"],
                                 bad_run=isinstance(e, (UnknownNameError, DuplicateNameError)))
            self._collect(run_dir, mode, rep)

    def _collect(self, run_dir: Path, mode: PassMode, rep: SyncReport) -> None:
        """Add a finished pass to the report of the next :meth:`wait`."""
        with self._cond:
            errors, rep.errors = rep.errors, []
            self._report.merge(rep)
            if errors:
                self._errs[(run_dir, mode)] = errors
            else:  # a later successful pass covers what earlier failed passes of this scope missed
                for k in [k for k in self._errs if k[0] == run_dir and k[1] <= mode]:
                    del self._errs[k]
            self._busy = False
            self._cond.notify_all()
