"""Access to an MLflow tracking store: connecting, the reachability check, run lookup, error text.

Design (modelled on Lightning's ``MLFlowLogger``): an explicit :class:`mlflow.MlflowClient` plus a
run id everywhere, never the fluent active-run stack (``mlflow.start_run``/``mlflow.log_*``),
which is per-thread/per-process global state. ``mlflow`` is imported inside :func:`connect`.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any, Callable

from ..errors import HookTypeError, InvalidArgumentError, TrackingError, TrackingUnreachableError, UnknownNameError

__all__ = ["REACH_TIMEOUT_S", "BUDGET_S", "BYTES_PER_S", "CallBudget", "PendingCall", "budget_seconds", "connect",
           "check_reachable", "resolve_tracking_uri", "tracking_uri_of", "get_run", "artifact_repository",
           "fetch_artifact",
           "short_error", "active_run"]

#: Seconds hookline's own MLflow calls may take by default (``mlflow_timeout=...``,
#: ``$HOOKLINE_MLFLOW_TIMEOUT``): a call still running after that (MLflow retrying HTTP 500s for
#: minutes, a server that accepts the request and never answers) ends its operation with a
#: :class:`TrackingUnreachableError`. File transfers get one more second per :data:`BYTES_PER_S`.
BUDGET_S = 60.0

#: Bytes per second a file transfer is granted on top of :data:`BUDGET_S` (1 MiB/s).
BYTES_PER_S = 1 << 20

#: Seconds the reachability probe waits at most (less when the budget is smaller).
REACH_TIMEOUT_S = 10.0

def budget_seconds(value: float | None = None) -> float:
    """The time budget of hookline's MLflow calls: ``value`` when given, else
    ``$HOOKLINE_MLFLOW_TIMEOUT``, else :data:`BUDGET_S` (60).

    Raises:
        InvalidArgumentError: the value is not a positive, finite number of seconds.
    """
    if value is None:
        raw: object = os.environ.get("HOOKLINE_MLFLOW_TIMEOUT") or str(BUDGET_S)
        where = "HOOKLINE_MLFLOW_TIMEOUT"
    else:
        raw, where = value, "mlflow_timeout"
    try:
        seconds = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(raw, bool) or not 0 < seconds < float("inf"):
        raise InvalidArgumentError(f"{where} must be a positive number of seconds (e.g. 60), got {raw!r}")
    return seconds


def shown_uri(uri: str) -> str:
    """A tracking URI without credentials, for messages."""
    if not uri.startswith(("http://", "https://")):
        return uri
    parts = urllib.parse.urlsplit(uri)
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


class CallBudget:
    """Runs hookline's MLflow calls with a time limit, without touching MLflow's settings.

    Each call runs on a daemon thread and is waited for at most the budget (plus one second per
    :data:`BYTES_PER_S` of a file transfer); a call that takes longer is left to finish (or fail)
    in the background, and :meth:`call` raises. MLflow's own retries, timeouts and environment
    variables, and the user's own MLflow calls, are unchanged.

    Args:
        uri: the tracking URI (named in errors, without credentials).
        seconds: the budget; default :func:`budget_seconds`.
    """

    def __init__(self, uri: str, seconds: float | None = None) -> None:
        self.uri = shown_uri(str(uri))
        self.seconds = budget_seconds(seconds)

    def __repr__(self) -> str:
        return f"CallBudget({self.uri!r}, seconds={self.seconds:g})"

    def call(self, what: str, fn: Callable[..., Any], *args: Any, size: int = 0, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, waited for at most the budget.

        Args:
            what: the call, for the error message (``"get_run"``, ``"upload of 'hookline/x.h5'"``).
            fn: the MLflow call.
            size: bytes transferred (a file upload or download gets ``size / BYTES_PER_S`` s more).

        Raises:
            TrackingUnreachableError: the call did not finish in time.
            Exception: whatever ``fn`` raised.
        """
        return self.start(what, fn, *args, size=size, **kwargs).result()

    def start(self, what: str, fn: Callable[..., Any], *args: Any, size: int = 0, **kwargs: Any) -> PendingCall:
        """Start ``fn(*args, **kwargs)`` on a daemon thread; :meth:`PendingCall.result` waits for it
        at most the rest of the budget (counted from now). Arguments as :meth:`call`."""
        return PendingCall(self, what, self.limit(size), fn, args, kwargs)

    def limit(self, size: int = 0) -> float:
        """Seconds a call transferring ``size`` bytes may take."""
        return self.seconds + max(0, int(size)) / BYTES_PER_S

    def overrun(self, what: str, limit: float) -> TrackingUnreachableError:
        """The error for ``what`` not finished within ``limit`` seconds (not raised)."""
        return TrackingUnreachableError(
            f"the MLflow tracking server at {self.uri!r} did not finish {what} within {limit:g} s (hookline's time "
            "budget for one MLflow call: mlflow_timeout=... / $HOOKLINE_MLFLOW_TIMEOUT, default "
            f"{BUDGET_S:g} s; MLflow keeps retrying a server that answers errors, and waits for one that does not "
            "answer): check the server; recorded files stay on disk, `hookline sync` uploads them later")


class PendingCall:
    """One MLflow call running on a daemon thread within a time limit (:meth:`CallBudget.start`)."""

    def __init__(self, budget: CallBudget, what: str, limit: float, fn: Callable[..., Any], args: tuple,
                 kwargs: dict[str, Any]) -> None:
        self._budget, self._what, self._limit = budget, what, limit
        self._box: dict[str, Any] = {}
        self._done = threading.Event()
        self._t0 = time.monotonic()

        def run() -> None:
            try:
                self._box["value"] = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                self._box["error"] = e
            finally:
                self._done.set()

        try:
            threading.Thread(target=run, name="hookline-mlflow-call", daemon=True).start()
        except RuntimeError:  # interpreter exit (Python 3.12 starts no thread then): unbounded
            run()

    @classmethod
    def finished(cls, budget: CallBudget, what: str, value: Any) -> PendingCall:
        """A call that has already returned ``value`` (no thread)."""
        done = cls.__new__(cls)
        done._budget, done._what, done._limit = budget, what, budget.seconds
        done._box = {"value": value}
        done._done = threading.Event()
        done._done.set()
        done._t0 = time.monotonic()
        return done

    def done(self) -> bool:
        """Whether the call has returned (or raised); never waits."""
        return self._done.is_set()

    def result(self) -> Any:
        """The call's value, once it finished within its limit.

        Raises:
            TrackingUnreachableError: the call did not finish in time (it is left running).
            Exception: whatever the call raised.
        """
        if not self._done.wait(max(0.0, self._t0 + self._limit - time.monotonic())):
            raise self._budget.overrun(self._what, self._limit)
        if "error" in self._box:
            raise self._box["error"]
        return self._box.get("value")


def resolve_tracking_uri(tracking_uri: str | None) -> str:
    """The tracking URI an :class:`mlflow.MlflowClient` for ``tracking_uri`` talks to: the URI
    itself, else MLflow's resolution (``mlflow.set_tracking_uri``, ``$MLFLOW_TRACKING_URI``, else
    MLflow's default, ``sqlite:///mlflow.db`` in the working directory)."""
    if tracking_uri:
        return str(tracking_uri)
    import mlflow

    return str(mlflow.get_tracking_uri())


def _check_store_exists(uri: str, implicit: bool) -> None:
    """Refuse a local store (``sqlite:`` file, ``file:`` or plain directory) that does not exist."""
    path = None
    if uri.startswith("sqlite:///"):
        path = urllib.parse.unquote(uri[len("sqlite:///"):].split("?", 1)[0])
        hint = "sqlite:///relative.db is relative to the working directory, sqlite:////abs.db absolute"
    elif uri.startswith("file:"):
        path = urllib.parse.unquote(urllib.parse.urlsplit(uri).path)
        hint = "file:///abs/mlruns names a directory store"
    elif "://" not in uri and not uri.startswith(("databricks", "uc:")) and uri:
        path, hint = uri, "a plain path names a directory store"
    if not path or os.path.exists(path):
        return
    shown = str(Path(path).absolute())
    if implicit:
        raise InvalidArgumentError(
            f"no MLflow store here: no tracking URI was given, so MLflow's default {uri!r} is used, and "
            f"{shown!r} does not exist; pass --tracking-uri URI / tracking_uri=... (e.g. "
            "http://127.0.0.1:5000 or sqlite:////path/to/mlflow.db), set MLFLOW_TRACKING_URI, or run from the "
            "folder that holds mlflow.db"
        )
    raise InvalidArgumentError(
        f"no MLflow store at tracking URI {uri!r}: {shown!r} does not exist ({hint}); pass the URI of an "
        "existing store (e.g. http://127.0.0.1:5000)"
    )


def connect(tracking_uri: str | None, *, existing: bool = False, timeout: float | None = None,
            probe: bool = True) -> Any:
    """An :class:`mlflow.MlflowClient` for ``tracking_uri`` (default: MLflow's resolution), after
    checking that an HTTP tracking server answers.

    Args:
        tracking_uri: the tracking URI.
        existing: the store must exist already (reading runs, syncing to a run): a ``sqlite:``
            file or store directory that is not there is a typo or the wrong folder, not a new
            store to create (this holds for MLflow's implicit default ``./mlflow.db`` too).
        timeout: the time budget (:func:`budget_seconds`); bounds the reachability probe.
        probe: check that the server answers (False: the caller's first request does, e.g.
            :func:`get_run` with ``probe=True``).

    Raises:
        InvalidArgumentError: MLflow cannot use the URI (e.g. ``htp://...``), or (``existing``)
            its store does not exist.
        TrackingUnreachableError: the server does not answer properly (see :func:`check_reachable`).
    """
    try:
        from mlflow import MlflowClient
    except ImportError as e:  # pragma: no cover - mlflow is a dependency
        raise TrackingError(
            "the MLflow adapter needs mlflow: install it with `pip install mlflow` "
            f"(import failed: {e})"
        ) from e
    if existing:
        _check_store_exists(resolve_tracking_uri(tracking_uri), implicit=not tracking_uri)
    try:
        client = MlflowClient(tracking_uri=tracking_uri)
    except Exception as e:  # noqa: BLE001 - mlflow's own URI errors
        raise InvalidArgumentError(
            f"MLflow cannot use the tracking URI {tracking_uri!r}: {short_error(e)}; use e.g. "
            "http://127.0.0.1:5000, sqlite:///mlflow.db or a local directory"
        ) from e
    if probe:
        check_reachable(tracking_uri_of(client), budget=timeout)
    return client


def _probe_timeout(budget: float | None) -> float:
    """Seconds the probe waits: at most :data:`REACH_TIMEOUT_S`, at most the budget."""
    return min(REACH_TIMEOUT_S, budget_seconds(budget))


def check_reachable(uri: str, timeout: float | None = None, *, budget: float | None = None) -> None:
    """Raise :class:`TrackingUnreachableError` unless the HTTP(S) tracking server at ``uri``
    answers one API request properly within ``timeout`` seconds. Other stores (sqlite, files,
    databases) are not checked.

    The probe is ``GET <uri>/api/2.0/mlflow/experiments/get?experiment_id=0``, sent once, without
    MLflow's retries. Any answer below 500 counts (404 behind a proxy, 401 without credentials:
    MLflow's own settings handle those), and so does a TLS handshake error (MLflow has its own
    certificate settings); a 5xx answer, a refused connection or no answer in time do not.

    Args:
        uri: the tracking URI.
        timeout: seconds to wait; default the smaller of 10 and the budget.
        budget: the time budget (:func:`budget_seconds`: ``$HOOKLINE_MLFLOW_TIMEOUT``, default 60).

    Raises:
        HookTypeError: ``uri`` is not a str.
        InvalidArgumentError: the budget (or ``$HOOKLINE_MLFLOW_TIMEOUT``) is not a positive number.
        TrackingUnreachableError: no proper answer in time (the message never shows credentials).
    """
    if not isinstance(uri, str):
        raise HookTypeError(f"tracking URI must be a str such as 'http://127.0.0.1:5000', got {uri!r}")
    if timeout is None:
        timeout = _probe_timeout(budget)
    if not uri.startswith(("http://", "https://")):
        return
    _probe(uri, "/api/2.0/mlflow/experiments/get", "experiment_id=0", timeout)


def _probe(uri: str, api: str, query: str, timeout: float) -> bytes | None:
    """``GET <uri><api>?<query>`` once, without retries: the body of a 2xx answer; None for another
    answer below 500 or a TLS handshake error (the server is there; MLflow's own settings handle
    credentials and certificates).

    Raises:
        TrackingUnreachableError: a 5xx answer, a refused connection or no answer in time.
    """
    import ssl
    import urllib.error
    import urllib.request

    shown = shown_uri(uri)
    parts = urllib.parse.urlsplit(shown)
    path = parts.path.rstrip("/") + api
    url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, query, ""))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.read()
    except urllib.error.HTTPError as e:
        if e.code < 500:
            return None  # an answer (401, 404 behind a proxy...): the server is there
        raise TrackingUnreachableError(
            f"the MLflow tracking server at {shown!r} is failing: it answered HTTP {e.code} {e.reason} to GET "
            f"{path}: check the server and its log (e.g. its backend store); recorded files stay on disk, "
            "`hookline sync` uploads them later") from e
    except (OSError, ValueError) as e:  # URLError, refused, timed out, unresolvable, bad URL
        r = getattr(e, "reason", None) or e
        if isinstance(r, (ssl.SSLError, ssl.CertificateError)):
            return None  # it answered the TLS handshake (MLflow has its own certificate settings)
        timed_out = isinstance(r, TimeoutError) or "timed out" in str(r)
        reason = f"no answer to GET {path}" if timed_out else f"{r}"
        raise TrackingUnreachableError(
            f"cannot reach the MLflow tracking server at {shown!r} ({reason}; waited up to {timeout:g} s): start "
            "it, or pass the right tracking URI (tracking_uri=... / --tracking-uri / MLFLOW_TRACKING_URI); recorded "
            "files stay on disk, `hookline sync` uploads them later") from e


def _probe_run(client: Any, run_id: str, budget: CallBudget) -> Any:
    """The run, fetched by the reachability probe itself (one ``runs/get`` without MLflow's
    retries, classified as :func:`check_reachable` classifies its answer); None when the answer is
    no run (an unknown run, credentials needed...): then MLflow's own ``get_run`` says why."""
    uri = tracking_uri_of(client)
    if not uri.startswith(("http://", "https://")):
        return None
    body = _probe(uri, "/api/2.0/mlflow/runs/get", urllib.parse.urlencode({"run_id": run_id}),
                  min(REACH_TIMEOUT_S, budget.seconds))
    try:
        import json

        from mlflow.entities import Run
        from mlflow.protos.service_pb2 import GetRun
        from mlflow.utils.proto_json_utils import parse_dict

        msg = GetRun.Response()
        parse_dict(json.loads(body or b"{}"), msg)
        return Run.from_proto(msg.run) if msg.HasField("run") and msg.run.info.run_id == run_id else None
    except Exception:  # noqa: BLE001 - not a run: MLflow's get_run decides
        return None


def tracking_uri_of(client: Any) -> str:
    """The tracking URI a :class:`mlflow.MlflowClient` talks to (``"?"`` when it does not say)."""
    return str(getattr(client, "tracking_uri", None) or "?")


def _get_run(client: Any, run_id: str, budget: CallBudget | None) -> Any:
    """MLflow's ``get_run``, its errors classified (see :func:`get_run`)."""
    try:
        run = client.get_run(run_id) if budget is None else budget.call("get_run", client.get_run, run_id)
    except TrackingError:
        raise
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
        text = str(e)
        down = "Failed to establish a new connection" in text or "Max retries exceeded" in text
        raise (TrackingUnreachableError if down else TrackingError)(
            f"cannot reach MLflow run {run_id!r} at tracking URI {uri!r}: {short_error(e)}") from e
    return run


def get_run(client: Any, run_id: str, budget: CallBudget | None = None, *, probe: bool = False) -> Any:
    """``client.get_run(run_id)`` with hookline errors that quote the run id and the tracking URI.

    Args:
        client: the :class:`mlflow.MlflowClient`.
        run_id: the run.
        budget: the time budget of the call (default: none).
        probe: the request is also the reachability probe (an HTTP server that answers 5xx or
            not at all fails within :data:`REACH_TIMEOUT_S` as :func:`check_reachable` does, and a
            server that answers with the run needs no second request); needs ``budget``.

    Raises:
        UnknownNameError: the run does not exist, or is deleted (MLflow accepts artifacts into a
            deleted run but refuses its metrics).
        TrackingUnreachableError: the call ran out of its budget (or the probe failed).
        TrackingError: any other failure.
    """
    run = _probe_run(client, run_id, budget) if probe and budget is not None else None
    if run is None:
        run = _get_run(client, run_id, budget)
    if getattr(run.info, "lifecycle_stage", "active") == "deleted":
        raise UnknownNameError(
            f"MLflow run {run_id!r} at tracking URI {tracking_uri_of(client)!r} is deleted: restore it "
            "(`mlflow runs restore --run-id ...`, the MLflow UI) or use another run"
        )
    return run


def artifact_repository(client: Any, run: Any) -> Any:
    """The artifact repository of ``run``, built from the run already fetched (None: let the
    client resolve it, e.g. for a Databricks workspace or a run without an artifact URI).

    ``MlflowClient.log_artifact``/``download_artifacts`` look the run up again (one more
    ``get_run`` per client and run, and per call for downloads); a pass that has just fetched the
    run goes to its repository directly, with the same repository MLflow would build.
    """
    uri = tracking_uri_of(client)
    artifact_uri = getattr(getattr(run, "info", None), "artifact_uri", None)
    if not artifact_uri or uri.startswith("databricks"):
        return None
    try:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        return get_artifact_repository(artifact_uri, tracking_uri=uri)
    except Exception:  # noqa: BLE001 - a scheme that needs the client's own resolution
        return None


def fetch_artifact(client: Any, run_id: str, artifact: str, folder: Path, repo: Any = None) -> Path:
    """Download the file ``artifact`` of a run into ``folder``; its local path. With ``repo`` (the
    run's artifact repository) one GET and no progress bar, else through the client.
    """
    fetch_one = getattr(repo, "_download_file", None)  # (one GET; MLflow's own name since 1.x)
    if fetch_one is not None:
        got = folder / artifact.rsplit("/", 1)[-1]
        fetch_one(remote_file_path=artifact, local_path=str(got))
        return got
    if repo is not None:
        return Path(repo.download_artifacts(artifact, dst_path=str(folder)))
    return Path(client.download_artifacts(run_id, artifact, dst_path=str(folder)))


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
