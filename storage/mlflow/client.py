"""Access to an MLflow tracking store: connecting, the reachability check, run lookup, error text.

Design (modelled on Lightning's ``MLFlowLogger``): an explicit :class:`mlflow.MlflowClient` plus a
run id everywhere, never the fluent active-run stack (``mlflow.start_run``/``mlflow.log_*``),
which is per-thread/per-process global state. ``mlflow`` is imported inside :func:`connect`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import HookTypeError, InvalidArgumentError, TrackingError, TrackingUnreachableError, UnknownNameError

__all__ = ["REACH_TIMEOUT_S", "connect", "check_reachable", "tracking_uri_of", "get_run", "short_error", "active_run"]

#: Seconds a tracking server gets to answer hookline's reachability check before a pass or a
#: command gives up (``$HOOKLINE_MLFLOW_TIMEOUT``). MLflow itself retries a refused connection for
#: about four minutes per request, so without the check a dead server blocks ``close()``.
REACH_TIMEOUT_S = 10.0


def connect(tracking_uri: str | None, *, existing: bool = False) -> Any:
    """An :class:`mlflow.MlflowClient` for ``tracking_uri`` (default: MLflow's resolution), after
    checking that an HTTP tracking server answers.

    Args:
        tracking_uri: the tracking URI.
        existing: the store must exist already (reading runs, syncing to a run): a ``sqlite:``
            URI naming a file that is not there is a typo, not a new store to create.

    Raises:
        InvalidArgumentError: MLflow cannot use the URI (e.g. ``htp://...``), or (``existing``)
            its sqlite file does not exist.
        TrackingUnreachableError: the server does not answer within ``$HOOKLINE_MLFLOW_TIMEOUT``
            seconds (default 10).
    """
    if existing and tracking_uri and tracking_uri.startswith("sqlite:///"):
        db = tracking_uri[len("sqlite:///"):].split("?", 1)[0]  # (sqlite:///x.db?timeout=20)
        if db and not os.path.exists(db):
            raise InvalidArgumentError(
                f"no MLflow store at tracking URI {tracking_uri!r}: {str(Path(db).absolute())!r} does not "
                "exist (sqlite:///relative.db is relative to the working directory, sqlite:////abs.db absolute)"
            )
    try:
        from mlflow import MlflowClient
    except ImportError as e:  # pragma: no cover - mlflow is a dependency
        raise TrackingError(
            "the MLflow adapter needs mlflow: install it with `pip install mlflow` "
            f"(import failed: {e})"
        ) from e
    try:
        client = MlflowClient(tracking_uri=tracking_uri)
    except Exception as e:  # noqa: BLE001 - mlflow's own URI errors
        raise InvalidArgumentError(
            f"MLflow cannot use the tracking URI {tracking_uri!r}: {short_error(e)}; use e.g. "
            "http://127.0.0.1:5000, sqlite:///mlflow.db or a local directory"
        ) from e
    check_reachable(tracking_uri_of(client))
    return client


def _probe_timeout() -> float:
    """``$HOOKLINE_MLFLOW_TIMEOUT`` (default :data:`REACH_TIMEOUT_S`), checked."""
    raw = os.environ.get("HOOKLINE_MLFLOW_TIMEOUT") or str(REACH_TIMEOUT_S)
    try:
        timeout = float(raw)
    except ValueError:
        timeout = -1.0
    if not 0 < timeout < float("inf"):
        raise InvalidArgumentError(f"HOOKLINE_MLFLOW_TIMEOUT must be a positive number of seconds, got {raw!r}")
    return timeout


def check_reachable(uri: str, timeout: float | None = None) -> None:
    """Raise :class:`TrackingUnreachableError` unless the HTTP(S) tracking server at ``uri``
    answers ``GET /health`` (any HTTP status counts: it answered) within ``timeout`` seconds.
    Other stores (sqlite, files, databases) are not checked.

    Args:
        uri: the tracking URI.
        timeout: seconds to wait; default ``$HOOKLINE_MLFLOW_TIMEOUT``, else 10.

    Raises:
        HookTypeError: ``uri`` is not a str.
        InvalidArgumentError: ``$HOOKLINE_MLFLOW_TIMEOUT`` is not a positive number.
        TrackingUnreachableError: no answer in time (the message never shows credentials).
    """
    if not isinstance(uri, str):
        raise HookTypeError(f"tracking URI must be a str such as 'http://127.0.0.1:5000', got {uri!r}")
    if not uri.startswith(("http://", "https://")):
        return
    import ssl
    import urllib.error
    import urllib.parse
    import urllib.request

    if timeout is None:
        timeout = _probe_timeout()
    parts = urllib.parse.urlsplit(uri)
    # (credentials in the URI are MLflow's business: the probe needs only the host)
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port:
        netloc += f":{parts.port}"
    url = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/") + "/health", "", ""))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read(64)
    except urllib.error.HTTPError:
        return  # an answer (401, 404 behind a proxy...): the server is there
    except (OSError, ValueError) as e:  # URLError, refused, timed out, unresolvable, bad URL
        reason = getattr(e, "reason", None) or e
        if isinstance(reason, (ssl.SSLError, ssl.CertificateError)):
            return  # it answered the TLS handshake (MLflow has its own certificate settings)
        shown = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))  # (no password)
        raise TrackingUnreachableError(
            f"cannot reach the MLflow tracking server at {shown!r} ({reason}; waited up to {timeout:g} s): "
            "start it, or pass the right tracking URI (tracking_uri=... / --tracking-uri / "
            "MLFLOW_TRACKING_URI); recorded files stay on disk, `hookline sync` uploads them later"
        ) from e


def tracking_uri_of(client: Any) -> str:
    """The tracking URI a :class:`mlflow.MlflowClient` talks to (``"?"`` when it does not say)."""
    return str(getattr(client, "tracking_uri", None) or "?")


def get_run(client: Any, run_id: str) -> Any:
    """``client.get_run(run_id)`` with hookline errors that quote the run id and the tracking URI.

    Raises:
        UnknownNameError: the run does not exist, or is deleted (MLflow accepts artifacts into a
            deleted run but refuses its metrics).
        TrackingError: any other failure.
    """
    try:
        run = client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - classify mlflow's errors
        code = getattr(e, "error_code", "")
        uri = tracking_uri_of(client)
        if code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(e).lower():
            raise UnknownNameError(
                f"MLflow run {run_id!r} not found at tracking URI {uri!r}: check the run id "
                "(`hookline runs`, `mlflow runs list --experiment-id <id>`, the MLflow UI) or pass the right "
                "tracking URI "
                "(tracking_uri=... / --tracking-uri / MLFLOW_TRACKING_URI)"
            ) from e
        raise TrackingError(f"cannot reach MLflow run {run_id!r} at tracking URI {uri!r}: {short_error(e)}") from e
    if getattr(run.info, "lifecycle_stage", "active") == "deleted":
        raise UnknownNameError(
            f"MLflow run {run_id!r} at tracking URI {tracking_uri_of(client)!r} is deleted: restore it "
            "(`mlflow runs restore --run-id ...`, the MLflow UI) or use another run"
        )
    return run


def short_error(e: BaseException) -> str:
    """``"<ExceptionType>: <first line, at most 500 characters>"`` of an error, for reports."""
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    return f"{type(e).__name__}: {first[:500]}"


def active_run() -> tuple[str | None, str]:
    """The run and the store that MLflow's fluent API writes to in this thread: the id of the
    active run (None when there is none) and the fluent tracking URI.

    That is where a framework that logs through ``mlflow.start_run``/``mlflow.log_*`` (Hugging
    Face's ``MLflowCallback``) puts its metrics; hookline itself never uses the fluent API.
    """
    import mlflow

    run = mlflow.active_run()
    return (run.info.run_id if run is not None else None), mlflow.get_tracking_uri()
