"""MLflow adapter: register a hookline run directory with an MLflow run, and read it back.

Everything MLflow-related in hookline goes through this module. ``mlflow`` is imported lazily,
inside functions, so ``import hookline.storage`` stays cheap and works without mlflow.

Design (modelled on Lightning's ``MLFlowLogger``): an explicit :class:`mlflow.MlflowClient` plus
a run id everywhere, never the fluent active-run stack (``mlflow.start_run``/``mlflow.log_*``),
which is per-thread/per-process global state.

What one sync pass does (:meth:`MlflowAdapter.log_run_dir`, :meth:`MlflowAdapter.submit`,
:func:`sync`):

1. reads the run directory's manifest(s) (``manifest.json`` / ``manifest.rank<r>.json``);
2. uploads every handle file whose size/SHA-256 differs from the ``.../synced`` tag of the run
   as artifact ``hookline/<file>`` (``<file>`` is the manifest's relative path, i.e.
   ``<key>.h5`` or ``<key>.rank<r>.h5``), several at once on a small thread pool;
3. logs the per-record L2 norms of every field as metric series (step = training step) for the
   records not yet logged, plus ``norm_max``/``norm_last`` summary metrics, with ``log_batch``;
4. logs the per-handle and run-level tags with ``log_batch``;
5. uploads the manifest(s) last, as ``hookline/manifest.json`` / ``hookline/manifest.rank<r>.json``.

Idempotence: files are compared by size + SHA-256 against the ``synced`` tags and skipped when
equal; metric points carry deterministic timestamps (manifest creation time + record index), so a
repeated point is identical and MLflow's SQL store drops it instead of storing a duplicate; the
``records`` tag is the watermark of records already logged, so a repeat pass does not even send
them again.

Naming scheme (see docs/mlflow.md): with ``K = handle_key(handle_id)`` (plus ``-rank<r>`` when
ranked) a handle's tags are ``hookline.K/<name>`` and its metrics ``hookline.K/<field>.norm``,
``.norm_max``, ``.norm_last``. ``K`` holds at most one ``/`` and field names are escaped like
handle keys (no ``/``), so the last ``/`` always separates the handle from the name; run-level
tags (``hookline.version``, ``hookline.has.<ModuleType>``...) contain no ``/`` at all.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from .errors import (
    DuplicateNameError,
    FormatError,
    HookTypeError,
    InvalidArgumentError,
    TrackingError,
    TrackingUnreachableError,
    UnknownNameError,
)
from .format import MANIFEST_RE, run_identity
from .keys import _esc, handle_key

__all__ = [
    "MlflowAdapter",
    "MlflowSource",
    "SyncReport",
    "sync",
    "mlflow_source",
    "tag_key",
    "metric_key",
    "parse_run_uri",
]

log = logging.getLogger("hookline.mlflow")

#: MLflow's limit on tag/metric key length.
MAX_MLFLOW_KEY = 250
#: MLflow's limit on tag value length (longer values are cut, with a marker).
MAX_TAG_VALUE = 8000
#: Artifact folder that holds a run directory inside the MLflow run.
ARTIFACT_ROOT = "hookline"
#: ``mode="stats"`` fields other than ``.norm`` get no metric series of their own.
_STATS_SUFFIXES = (".mean", ".std", ".min", ".max", ".absmax", ".hist")
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")
_METRICS, _FILES, _FINAL = 0, 1, 2  # what a pass does: metrics+tags; + files present; + all files (final)


# --------------------------------------------------------------------------------------------
# naming
# --------------------------------------------------------------------------------------------


def _fit(prefix: str, body: str, tail: str = "") -> str:
    """``prefix + body + tail`` cut to MLflow's 250 characters by hashing the end of ``body``."""
    key = prefix + body + tail
    if len(key) <= MAX_MLFLOW_KEY:
        return key
    budget = MAX_MLFLOW_KEY - len(prefix) - len(tail) - 18
    if budget < 0:  # cannot happen with handle_key's MAX_KEY_LEN, but never emit a bad key
        raise InvalidArgumentError(f"MLflow key prefix {prefix!r} is too long; use a shorter handle id")
    head = body[:budget]
    if head[-2:].startswith("-"):
        head = head[:-2]
    elif head.endswith("-"):
        head = head[:-1]
    digest = hashlib.sha1(body.encode("utf-8")).hexdigest()[:16]
    return f"{prefix}{head}-h{digest}{tail}"


def _handle_prefix(handle_id: str, rank: int | None) -> str:
    key = handle_key(handle_id)
    return f"hookline.{key}" + (f"-rank{int(rank)}" if rank is not None else "") + "/"


def tag_key(handle_id: str, name: str, *, rank: int | None = None) -> str:
    """The MLflow tag key of one per-handle tag.

    Args:
        handle_id: the hook handle id, e.g. ``"outputs[blocks.0]"``.
        name: tag name: ``id``, ``module``, ``module_type``, ``category``, ``fields``, ``shape``,
            ``dtype``, ``records``, ``artifact`` or ``synced``.
        rank: the distributed rank, if the run was recorded with one.

    Returns:
        e.g. ``"hookline.outputs/blocks.0/id"`` (``"hookline.outputs/blocks.0-rank1/id"``).
    """
    return _fit(_handle_prefix(handle_id, rank), _esc(name))


def metric_key(handle_id: str, field_name: str, stat: str = "norm", *, rank: int | None = None) -> str:
    """The MLflow metric key of a field's norm series or summary.

    Args:
        handle_id: the hook handle id, e.g. ``"grads[blocks.0]"``.
        field_name: the field, e.g. ``"grad_out.0"``.
        stat: ``"norm"`` (per-step series), ``"norm_max"`` or ``"norm_last"``.
        rank: the distributed rank, if the run was recorded with one.

    Returns:
        e.g. ``"hookline.grads/blocks.0/grad_out.0.norm_max"``. Keys longer than 250 characters
        keep their start and end and replace the middle of the field name by ``-h<sha1[:16]>``.
    """
    return _fit(_handle_prefix(handle_id, rank), _esc(field_name), "." + stat)


def _type_name(module_type: str | None) -> str | None:
    if not module_type:
        return None
    return _esc(str(module_type).rsplit(".", 1)[-1])


def _cut(value: str) -> str:
    if len(value) <= MAX_TAG_VALUE:
        return value
    return value[: MAX_TAG_VALUE - 20] + "...[truncated]"


# --------------------------------------------------------------------------------------------
# mlflow access
# --------------------------------------------------------------------------------------------


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
            f"MLflow cannot use the tracking URI {tracking_uri!r}: {_short(e)}; use e.g. "
            "http://127.0.0.1:5000, sqlite:///mlflow.db or a local directory"
        ) from e
    check_reachable(_uri_of(client))
    return client


def check_reachable(uri: str, timeout: float | None = None) -> None:
    """Raise :class:`TrackingUnreachableError` unless the HTTP(S) tracking server at ``uri``
    answers ``GET /health`` (any HTTP status counts: it answered) within ``timeout`` seconds.
    Other stores (sqlite, files, databases) are not checked."""
    if not isinstance(uri, str):
        raise HookTypeError(f"tracking URI must be a str such as 'http://127.0.0.1:5000', got {uri!r}")
    if not uri.startswith(("http://", "https://")):
        return
    import ssl
    import urllib.error
    import urllib.parse
    import urllib.request

    if timeout is None:
        raw = os.environ.get("HOOKLINE_MLFLOW_TIMEOUT") or str(REACH_TIMEOUT_S)
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not 0 < timeout < float("inf"):
            raise InvalidArgumentError(
                f"HOOKLINE_MLFLOW_TIMEOUT must be a positive number of seconds, got {raw!r}")
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


def _uri_of(client: Any) -> str:
    return str(getattr(client, "_tracking_client", None) and client._tracking_client.tracking_uri or "?")


def _get_run(client: Any, run_id: str) -> Any:
    """``client.get_run`` with hookline errors that quote the run id and the tracking URI."""
    try:
        run = client.get_run(run_id)
    except Exception as e:  # noqa: BLE001 - classify mlflow's errors
        code = getattr(e, "error_code", "")
        uri = _uri_of(client)
        if code == "RESOURCE_DOES_NOT_EXIST" or "not found" in str(e).lower():
            raise UnknownNameError(
                f"MLflow run {run_id!r} not found at tracking URI {uri!r}: check the run id "
                "(`mlflow runs list`, the MLflow UI) or pass the right tracking URI "
                "(tracking_uri=... / --tracking-uri / MLFLOW_TRACKING_URI)"
            ) from e
        raise TrackingError(f"cannot reach MLflow run {run_id!r} at tracking URI {uri!r}: {_short(e)}") from e
    if getattr(run.info, "lifecycle_stage", "active") == "deleted":
        # (MLflow accepts artifacts into a deleted run but refuses its metrics)
        raise UnknownNameError(
            f"MLflow run {run_id!r} at tracking URI {_uri_of(client)!r} is deleted: restore it "
            "(`mlflow runs restore --run-id ...`, the MLflow UI) or use another run"
        )
    return run


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else type(e).__name__
    return f"{type(e).__name__}: {first[:500]}"


# --------------------------------------------------------------------------------------------
# local run directory
# --------------------------------------------------------------------------------------------


def _load_manifests(run_dir: Path, rank: int | None) -> list[tuple[Path, dict]]:
    if not run_dir.is_dir():
        raise UnknownNameError(
            f"run directory {str(run_dir)!r} does not exist: pass the directory a Recorder/RunWriter wrote"
        )
    found = sorted(p for p in run_dir.iterdir() if MANIFEST_RE.fullmatch(p.name))
    if rank is not None:
        ranked = [p for p in found if p.name == f"manifest.rank{int(rank)}.json"]
        found = ranked or [p for p in found if p.name == "manifest.json"]
    if not found:
        raise FormatError(
            f"{str(run_dir)!r} has no manifest.json: it is not a hookline run directory "
            "(run `hookline verify` on it, or pass the directory a Recorder wrote)"
        )
    out = []
    for p in found:
        try:
            man = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise FormatError(f"manifest {str(p)!r} is not readable JSON ({e}); run `hookline verify` on the run") from e
        if not isinstance(man, dict) or not isinstance(man.get("handles", {}), dict):
            raise FormatError(f"manifest {str(p)!r} has no 'handles' mapping; run `hookline verify` on the run")
        out.append((p, man))
    return out


def _created_ms(man: dict) -> int:
    created = man.get("created")
    if isinstance(created, str):
        try:
            return int(_dt.datetime.fromisoformat(created).timestamp() * 1000)
        except ValueError:
            pass
    return 0


def _file_digest(path: Path, cache: dict) -> str:
    """``"<size>:<sha256>"`` of a file, memoised on (size, mtime_ns)."""
    st = path.stat()
    sig = (st.st_size, st.st_mtime_ns)
    hit = cache.get(path)
    if hit is not None and hit[0] == sig:
        return hit[1]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    digest = f"{st.st_size}:{h.hexdigest()}"
    cache[path] = (sig, digest)
    return digest


def _norm_fields(fields: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """``(field, metric_base, already_a_norm)`` for the fields that get a norm series.

    ``fields`` is a manifest handle entry's ``fields`` (name -> ``{"shape": ...}``). A stats-mode
    norm is a scalar per record named ``<field>.norm``; a tensor field that merely has that name
    (a module returning ``{"norm": tensor}``) gets its own L2 norm like any other.
    """

    def stats_norm(name: str) -> bool:
        info = fields.get(name)
        return name.endswith(".norm") and isinstance(info, dict) and info.get("shape") == []

    out = []
    for f in fields:
        if stats_norm(f):  # mode="stats": the field *is* the per-record L2 norm
            out.append((f, f[: -len(".norm")], True))
        elif f.endswith(_STATS_SUFFIXES) and stats_norm(f.rsplit(".", 1)[0] + ".norm"):
            continue  # other summaries of a stats-mode field
        else:
            out.append((f, f, False))
    return out


@dataclass
class _Series:
    """New norm points of one field: entries whose handle record index is >= the watermark."""

    base: str  # metric base name (field name, without ``.norm`` for stats-mode fields)
    records: np.ndarray  # handle record index of each new entry (-> deterministic timestamps)
    steps: np.ndarray
    norms: np.ndarray
    all_norms: np.ndarray  # every entry (for the summaries)
    all_steps: np.ndarray
    all_records: np.ndarray


def _read_series(run: Any, handle_id: str, rank: int | None, fields: list[tuple[str, str, bool]],
                 start: int) -> tuple[int, list[_Series]]:
    """Handle record count and the per-field norm series of records ``start:`` (storage reader)."""
    h = run.handle(handle_id, rank=rank) if rank is not None else run.handle(handle_id)
    n = len(h)
    out = []
    present = set(h.fields)
    for name, base, is_norm in fields:
        if name not in present:
            continue
        fld = h[name]
        recs = np.asarray(fld.records, dtype=np.int64)
        if is_norm:  # mode="stats": the stored value is the norm
            vals = np.abs(np.asarray(fld.read(), dtype=np.float64).reshape(len(fld), -1)[:, 0]) if len(fld) \
                else np.zeros(0)
        else:
            vals = np.asarray(fld.norms(), dtype=np.float64)
        steps = np.asarray(fld.steps, dtype=np.int64)
        new = recs >= start
        out.append(_Series(base, recs[new], steps[new], vals[new], vals, steps, recs))
    return n, out


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


@dataclass
class SyncReport:
    """What one or more sync passes did.

    Attributes:
        run_id: the MLflow run.
        uploaded: artifact paths uploaded (``hookline/...``).
        skipped: artifact paths already present with the same size and SHA-256.
        metrics: number of metric points sent.
        tags: number of tags sent.
        errors: one line per failure (empty when everything succeeded).
        seconds: wall time of the pass(es).
        pending: files not uploaded yet because the writer has not finished them (mid-run passes).
        unreachable: a pass found the tracking server not answering (:meth:`error` is then a
            :class:`TrackingUnreachableError`, also a ``ConnectionError``).
    """

    run_id: str
    uploaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    metrics: int = 0
    tags: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    pending: list[str] = field(default_factory=list)
    unreachable: bool = False
    #: the run itself was refused (unknown, deleted, holding another run directory)
    bad_run: bool = False

    @property
    def ok(self) -> bool:
        """True when nothing failed."""
        return not self.errors

    def merge(self, other: SyncReport) -> None:
        """Add ``other``'s counts and errors to this report."""
        self.uploaded += other.uploaded
        self.skipped += other.skipped
        self.metrics += other.metrics
        self.tags += other.tags
        self.errors += other.errors
        self.seconds += other.seconds
        self.pending += other.pending
        self.unreachable = self.unreachable or other.unreachable
        self.bad_run = self.bad_run or other.bad_run

    def error(self, run_dir: Path | str | None = None) -> TrackingError:
        """A :class:`TrackingError` describing the failures, with the command that repairs them."""
        where = str(run_dir) if run_dir is not None else "RUN_DIR"
        unique = list(dict.fromkeys(self.errors))  # (each failed pass reports the same dead server)
        lines = "; ".join(unique[:5]) + (f"; ... ({len(unique)} errors)" if len(unique) > 5 else "")
        target = "<an existing run id>" if self.bad_run else self.run_id
        err = (TrackingUnreachableError if self.unreachable else TrackingError)(
            f"MLflow upload to run {self.run_id!r} failed: {lines}. Local files are complete; "
            f"upload later with `hookline sync {where} --run-id {target}`"
        )
        err.report = self  # type: ignore[attr-defined]
        return err


def _origin_key(rank: Any) -> str:
    return "hookline.origin" if rank is None else f"hookline.origin-rank{rank}"


def _check_origin(run_id: str, run_dir: Path, manifests: list, tags_now: dict[str, str]) -> dict[str, str]:
    """The run's ``hookline.origin`` tags (each rank's run directory, by its manifest's
    ``run_uuid``); refuse a run directory other than the one already synced to this MLflow run: its
    handle files have the same artifact paths and its records the same metric keys, so it would
    replace the first one's files and lose its metric points."""
    tags = {}
    for _, man in manifests:
        key = _origin_key(man.get("rank"))
        mine = run_identity(man)
        if not mine:
            continue  # identity unknown (a manifest rebuilt from old files): neither checked nor set
        have = tags_now.get(key)
        if have is not None and have != mine:
            raise DuplicateNameError(
                f"MLflow run {run_id!r} already holds the hookline data of another run directory "
                f"({key} {have!r}; {str(run_dir)!r} is {mine!r}): one run directory per MLflow run; "
                "record or sync this one into a new MLflow run (e.g. a child run of this one)"
            )
        tags[key] = mine
    return tags


# --------------------------------------------------------------------------------------------
# adapter
# --------------------------------------------------------------------------------------------

_LIVE: "weakref.WeakSet[MlflowAdapter]" = weakref.WeakSet()
_EXIT_HOOKED = False
_EXIT_LOCK = threading.Lock()


def exit_timeout() -> float:
    """Seconds the uploads at interpreter exit may take: ``$HOOKLINE_MLFLOW_EXIT_TIMEOUT``,
    default (and for a value that is not a positive number) 120."""
    try:
        t = float(os.environ.get("HOOKLINE_MLFLOW_EXIT_TIMEOUT") or 120)
    except ValueError:
        return 120.0
    return t if t > 0 else 120.0


def _close_all_at_exit() -> None:
    timeout = exit_timeout()
    for adapter in list(_LIVE):
        try:
            report = adapter.close(timeout=timeout, raise_on_error=False)
        except Exception as e:  # noqa: BLE001 - never raise at interpreter exit
            log.error("hookline: closing the MLflow adapter at exit failed: %s", e)
            continue
        if not report.ok:
            log.error("hookline: %s", report.error(adapter._last_dir))


def _hook_exit() -> None:
    global _EXIT_HOOKED
    with _EXIT_LOCK:
        if _EXIT_HOOKED:
            return
        _EXIT_HOOKED = True
    at_exit_before_executors(_close_all_at_exit)


def at_exit_before_executors(fn: Any) -> None:
    """Run ``fn`` at interpreter exit while thread pools still work.

    threading's exit hooks run (last registered first) *before* concurrent.futures shuts its
    executors down, so final uploads can still use a thread pool; plain ``atexit`` runs after
    that. A Recorder with MLflow registers here after its adapter did, so it finishes its files
    before the adapters' final uploads. Falls back to ``atexit``.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError
        register(fn)
    except RuntimeError:
        import atexit

        atexit.register(fn)


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

    Raises:
        InvalidArgumentError: for an empty/malformed run id or a negative rank.
    """

    def __init__(self, run_id: str, tracking_uri: str | None = None, rank: int | None = None, *,
                 max_workers: int = 4, upload_on_submit: bool = False) -> None:
        if not isinstance(run_id, str):
            raise HookTypeError(
                f"MLflow run id must be a str (the 32-hex id of an existing run), got "
                f"{type(run_id).__name__} {run_id!r:.60}"
            )
        if not re.fullmatch(r"[\w\-]+", run_id):
            raise InvalidArgumentError(
                f"MLflow run id {run_id!r} is not valid: pass the 32-hex id of an existing run "
                "(e.g. mlflow.start_run().info.run_id or `mlflow runs list`)"
            )
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise InvalidArgumentError(f"rank {rank!r} is not valid: pass a non-negative int or None")
        if max_workers < 1:
            raise InvalidArgumentError(f"max_workers {max_workers!r} must be >= 1")
        self.run_id = run_id
        self.tracking_uri = tracking_uri
        self.rank = rank
        self.max_workers = int(max_workers)
        self.upload_on_submit = bool(upload_on_submit)
        self._client_obj: Any = None
        self._client_lock = threading.Lock()
        self._pass_lock = threading.Lock()  # one pass at a time (background or synchronous)
        self._cond = threading.Condition()
        self._pending: dict[Path, int] = {}  # run_dir -> mode: 0 metrics+tags, 1 + files, 2 final
        self._busy = False
        self._thread: threading.Thread | None = None
        self._seen: list[Path] = []
        self._last_dir: Path | None = None
        self._report = SyncReport(run_id)  # counts since the last wait()
        self._errs: dict[tuple[Path, int], list[str]] = {}  # outstanding failures per (dir, mode)
        self._closed = False
        self._final: SyncReport | None = None
        self._hashes: dict[Path, tuple] = {}
        _LIVE.add(self)
        _hook_exit()

    # -- public API ---------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The :class:`mlflow.MlflowClient` (created on first use)."""
        with self._client_lock:
            if self._client_obj is None:
                self._client_obj = connect(self.tracking_uri)
            return self._client_obj

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
        with self._pass_lock:
            report = self._pass(path, _FINAL if artifacts else _METRICS)
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
        """
        if self._closed:
            from .errors import WriterClosedError

            raise WriterClosedError(f"MLflow adapter for run {self.run_id!r} is closed: create a new one")
        path = Path(run_dir)
        self._remember(path)
        up = self.upload_on_submit if artifacts is None else bool(artifacts)
        with self._cond:
            self._pending[path] = max(self._pending.get(path, _METRICS), _FILES if up else _METRICS)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._worker, name=f"hookline-mlflow-{self.run_id[:8]}",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()

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
                        self._pending[d] = _FINAL
                    if self._thread is None or not self._thread.is_alive():
                        self._thread = threading.Thread(target=self._worker, name="hookline-mlflow", daemon=True)
                        self._thread.start()
                    self._cond.notify_all()
            self._final = self.wait(timeout, raise_on_error=False)
            self._closed = True
            with self._cond:
                self._cond.notify_all()
            _LIVE.discard(self)
        if not self._final.ok and raise_on_error:
            raise self._final.error(self._last_dir)
        return self._final

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

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    if self._closed:
                        return
                    self._cond.wait(1.0)
                    if not self._pending and self._closed:
                        return
                run_dir, up = next(iter(self._pending.items()))
                del self._pending[run_dir]
                self._busy = True
            try:
                with self._pass_lock:
                    rep = self._pass(run_dir, up)
            except BaseException as e:  # noqa: BLE001 - reported, never raised into training
                rep = SyncReport(self.run_id, errors=[f"{run_dir}: {_short(e)}"],
                                 bad_run=isinstance(e, (UnknownNameError, DuplicateNameError)))
            with self._cond:
                errors, rep.errors = rep.errors, []
                self._report.merge(rep)
                if errors:
                    self._errs[(run_dir, up)] = errors
                else:  # a later successful pass covers what earlier failed passes of this scope missed
                    for k in [k for k in self._errs if k[0] == run_dir and k[1] <= up]:
                        del self._errs[k]
                self._busy = False
                self._cond.notify_all()

    # -- one pass -----------------------------------------------------------------------------

    def _pass(self, run_dir: Path, mode: int) -> SyncReport:
        t0 = time.perf_counter()
        report = SyncReport(self.run_id)
        try:
            self._pass_inner(run_dir, mode, report)
        except (UnknownNameError, FormatError, DuplicateNameError):
            raise
        except Exception as e:  # noqa: BLE001 - collected into the report
            report.errors.append(_short(e) if isinstance(e, TrackingError) else f"{run_dir}: {_short(e)}")
            report.unreachable = report.unreachable or isinstance(e, TrackingUnreachableError)
        report.seconds = time.perf_counter() - t0
        if report.errors:
            log.warning("hookline: MLflow sync of %s to run %s: %s", run_dir, self.run_id, "; ".join(report.errors))
        return report

    def _pass_inner(self, run_dir: Path, mode: int, report: SyncReport) -> None:
        from mlflow.entities import Metric, RunTag

        manifests = _load_manifests(run_dir, self.rank)
        client = self.client
        check_reachable(_uri_of(client))  # fail in seconds, not after MLflow's minutes of retries
        tags_now = dict(_get_run(client, self.run_id).data.tags)
        origin = _check_origin(self.run_id, run_dir, manifests, tags_now)

        # 1. start the handle-file uploads (they run while the norms are read and logged)
        uploads: list[tuple[str, Path, str, str]] = []  # (artifact path, local, digest, synced tag)
        plans = []
        for mpath, man in manifests:
            rank = man.get("rank") if man.get("rank") is not None else self.rank
            for hid, entry in sorted(man.get("handles", {}).items()):
                plans.append((man, rank, hid, entry))
                rel = entry.get("file")
                if mode == _METRICS or not rel:
                    continue
                local = run_dir / rel
                if not local.is_file():
                    if mode == _FINAL:
                        report.errors.append(
                            f"handle {hid!r}: file {str(local)!r} is missing (the writer is still running, or was "
                            "killed: close it, or run `hookline verify --repair` on the run directory, then sync again)")
                    else:
                        report.pending.append(f"{ARTIFACT_ROOT}/{Path(rel).as_posix()}")
                    continue
                apath = f"{ARTIFACT_ROOT}/{Path(rel).as_posix()}"
                digest = _file_digest(local, self._hashes)
                skey = tag_key(hid, "synced", rank=rank)
                if tags_now.get(skey) == digest:
                    report.skipped.append(apath)
                else:
                    uploads.append((apath, local, digest, skey))
        pool, futures = self._start_uploads(uploads)
        run = None
        try:
            # 2. metrics: norm series for the records not logged yet, summaries
            metrics: list[Any] = []
            tags: dict[str, str] = {}
            types: set[str] = set()
            for man, rank, hid, entry in plans:
                created = _created_ms(man)
                fields = _norm_fields(entry.get("fields", {}) or {})
                rkey = tag_key(hid, "records", rank=rank)
                try:
                    done = int(tags_now.get(rkey, "0"))
                except ValueError:
                    done = 0
                n_total = int(entry.get("records", 0) or 0)
                if fields and n_total > done:  # the manifest is rewritten at every flush
                    if run is None:
                        from .reader import open_run

                        run = open_run(run_dir)
                    try:
                        n_total, series = _read_series(run, hid, man.get("rank"), fields, done)
                    except Exception as e:  # noqa: BLE001 - a broken file must not stop the others
                        report.errors.append(f"handle {hid!r}: reading norms failed: {_short(e)} "
                                             "(run `hookline verify` on the run directory)")
                        continue
                    for sr in series:
                        if not len(sr.steps):
                            continue
                        key = metric_key(hid, sr.base, "norm", rank=rank)
                        metrics.extend(Metric(key, float(v), created + int(r), int(st))
                                       for r, st, v in zip(sr.records, sr.steps, sr.norms))
                        # summaries over all entries, at the largest step so far (MLflow shows the
                        # value at the largest step: steps that restart per epoch must not hide a
                        # newer summary) and the last entry's (deterministic) timestamp: a repeat
                        # is an identical point, which the store drops
                        finite = sr.all_norms[~np.isnan(sr.all_norms)]
                        vmax = float(finite.max()) if finite.size else float("nan")
                        ts, st = created + int(sr.all_records[-1]), int(sr.all_steps.max())
                        metrics.append(Metric(metric_key(hid, sr.base, "norm_max", rank=rank), vmax, ts, st))
                        metrics.append(Metric(metric_key(hid, sr.base, "norm_last", rank=rank),
                                              float(sr.all_norms[-1]), ts, st))
                tags.update(self._handle_tags(hid, entry, rank, max(n_total, done)))
                t = _type_name(entry.get("module_type"))
                if t:
                    types.add(t)
            if metrics:
                try:
                    client.log_batch(self.run_id, metrics=metrics, synchronous=True)
                except Exception as e:  # noqa: BLE001
                    raise TrackingError(f"logging {len(metrics)} metric points failed: {_short(e)}") from e
                report.metrics += len(metrics)
        finally:
            if run is not None:
                run.close()
            results = self._finish_uploads(pool, futures)
        for (apath, _local, digest, skey), err in zip(uploads, results):
            if err is None:
                report.uploaded.append(apath)
                tags[skey] = digest
            else:
                report.errors.append(f"upload of {apath!r} failed: {err}")
        for man, rank, hid, entry in plans:
            skey = tag_key(hid, "synced", rank=rank)
            if entry.get("file") and (skey in tags or skey in tags_now):
                tags[tag_key(hid, "artifact", rank=rank)] = f"{ARTIFACT_ROOT}/{Path(entry['file']).as_posix()}"
        # 3. run-level tags
        tags.update(origin)
        tags["hookline.version"] = _version()
        fmt = {str(m.get("format_version")) for _, m in manifests if m.get("format_version") is not None}
        if fmt:
            tags["hookline.format_version"] = ",".join(sorted(fmt))
        count_key = "hookline.handles" if self.rank is None else f"hookline.handles-rank{self.rank}"
        tags[count_key] = str(len(plans))
        for t in sorted(types):
            tags[f"hookline.has.{t}"] = "true"
        changed = {k: v for k, v in tags.items() if tags_now.get(k) != v}
        if changed:
            try:
                client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in changed.items()], synchronous=True)
            except Exception as e:  # noqa: BLE001
                raise TrackingError(f"logging {len(changed)} tags failed: {_short(e)}") from e
            report.tags += len(changed)
        # 4. manifests last (after the files they describe)
        if mode != _METRICS and not report.errors and not report.pending:
            mtags = {}
            for mpath, _man in manifests:
                digest = _file_digest(mpath, self._hashes)
                mkey = f"hookline.synced.{_esc(mpath.name)}"
                apath = f"{ARTIFACT_ROOT}/{mpath.name}"
                if tags_now.get(mkey) == digest:
                    report.skipped.append(apath)
                    continue
                try:
                    client.log_artifact(self.run_id, str(mpath), ARTIFACT_ROOT)
                except Exception as e:  # noqa: BLE001
                    report.errors.append(f"upload of {apath!r} failed: {_short(e)}")
                    continue
                report.uploaded.append(apath)
                mtags[mkey] = digest
            if mtags:
                try:
                    client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in mtags.items()], synchronous=True)
                except Exception as e:  # noqa: BLE001
                    raise TrackingError(f"logging {len(mtags)} tags failed: {_short(e)}") from e
                report.tags += len(mtags)

    def _handle_tags(self, hid: str, entry: dict, rank: int | None, records: int) -> dict[str, str]:
        fields = entry.get("fields", {}) or {}
        vals = {
            "id": hid,
            "module": entry.get("module_name"),
            "module_type": entry.get("module_type"),
            "category": entry.get("category"),
            "fields": json.dumps(sorted(fields)),
            "shape": json.dumps({f: (v or {}).get("shape") for f, v in sorted(fields.items())}),
            "dtype": json.dumps({f: (v or {}).get("dtype") for f, v in sorted(fields.items())}),
            "records": str(records),
        }
        return {tag_key(hid, k, rank=rank): _cut(str(v)) for k, v in vals.items() if v is not None}

    def _start_uploads(self, uploads: list) -> tuple[Any, list]:
        if not uploads:
            return None, []
        client = self.client
        run_id = self.run_id

        def one(apath: str, local: Path) -> None:
            client.log_artifact(run_id, str(local), apath.rsplit("/", 1)[0])

        try:
            pool = ThreadPoolExecutor(max_workers=min(self.max_workers, len(uploads)),
                                      thread_name_prefix="hookline-upload")
            return pool, [pool.submit(one, a, p) for a, p, _d, _k in uploads]
        except RuntimeError:  # interpreter shutting down: no new threads; upload sequentially
            out = []
            for a, p, _d, _k in uploads:
                try:
                    one(a, p)
                    out.append(None)
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return None, out

    @staticmethod
    def _finish_uploads(pool: Any, futures: list) -> list[str | None]:
        errs: list[str | None] = []
        for fut in futures:
            if pool is None:  # sequential fallback: futures are results already
                errs.append(None if fut is None else _short(fut))
                continue
            try:
                fut.result()
                errs.append(None)
            except Exception as e:  # noqa: BLE001
                errs.append(_short(e))
        if pool is not None:
            pool.shutdown(wait=True)
        return errs


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hookline")
    except Exception:  # noqa: BLE001
        return "unknown"


def sync(run_dir: str | os.PathLike, run_id: str, *, tracking_uri: str | None = None,
         rank: int | None = None) -> SyncReport:
    """Upload a run directory to an existing MLflow run; safe to repeat (nothing twice).

    This is what ``hookline sync RUN_DIR --run-id ID`` calls, e.g. after the server was down
    during training. Failures of single uploads/requests do not raise: they are listed in the
    returned report (``report.ok`` is False) and the next call retries exactly what is missing.

    Args:
        run_dir: the hookline run directory.
        run_id: the MLflow run id.
        tracking_uri: tracking server/store (default: MLflow's resolution).
        rank: sync only this rank's manifest (default: every manifest in the directory).

    Returns:
        The :class:`SyncReport` (what was uploaded, skipped, logged, and what failed).

    Raises:
        UnknownNameError: if the run or the directory does not exist.
        TrackingError: if the tracking store cannot be reached at all.
        FormatError: if the directory holds no readable manifest.
    """
    adapter = MlflowAdapter(run_id, tracking_uri=tracking_uri, rank=rank)
    try:
        adapter._client_obj = connect(tracking_uri, existing=True)
        _get_run(adapter.client, run_id)  # clear error for an unknown id before anything else
        path = Path(run_dir)
        adapter._remember(path)
        with adapter._pass_lock:
            return adapter._pass(path, _FINAL)
    finally:
        adapter._closed = True
        adapter._final = adapter._report
        _LIVE.discard(adapter)


# --------------------------------------------------------------------------------------------
# reading back: the reader's source protocol
# --------------------------------------------------------------------------------------------


def parse_run_uri(uri: str, tracking_uri: str | None = None) -> tuple[str, str, str | None]:
    """Split an MLflow run reference into ``(run_id, artifact_root, tracking_uri)``.

    Accepts ``runs:/<run_id>[/<path>]``, ``mlflow-artifacts:[//host:port]/.../<run_id>/artifacts[/<path>]``
    and a bare 32-hex run id. ``artifact_root`` defaults to ``hookline``.

    Raises:
        InvalidArgumentError: for anything else (the message shows the accepted forms).
    """
    text = str(uri).strip()
    m = re.fullmatch(r"runs:/+([0-9A-Za-z_\-]+)(?:/(.*))?", text)
    if m:
        return m[1], (m[2] or "").strip("/") or ARTIFACT_ROOT, tracking_uri
    m = re.fullmatch(r"mlflow-artifacts:(?://([^/]+))?/(?:.*/)?([0-9a-f]{32})/artifacts(?:/(.*))?", text)
    if m:
        tu = tracking_uri or (f"http://{m[1]}" if m[1] else None)
        return m[2], (m[3] or "").strip("/") or ARTIFACT_ROOT, tu
    if _RUN_ID.fullmatch(text):
        return text, ARTIFACT_ROOT, tracking_uri
    raise InvalidArgumentError(
        f"not an MLflow run reference: {uri!r}; use 'runs:/<run_id>', "
        "'mlflow-artifacts:/<experiment_id>/<run_id>/artifacts/hookline' or a 32-hex run id "
        "(with tracking_uri=... / --tracking-uri)"
    )


def _cache_base(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HOOKLINE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hookline"


class MlflowSource:
    """A hookline run stored as MLflow artifacts, downloaded one file at a time into a cache.

    Implements the reader's source protocol: :meth:`manifests` and :meth:`path`. Create it with
    :func:`mlflow_source`.

    Attributes:
        run_id: the MLflow run id.
        root: artifact folder of the run directory (``hookline``).
        cache_dir: where files land: ``<cache base>/<run_id>/<root>/...``.
        client: the :class:`mlflow.MlflowClient`.
    """

    def __init__(self, run_id: str, root: str, client: Any, cache_dir: Path) -> None:
        self.run_id = run_id
        self.root = root
        self.client = client
        self.cache_dir = cache_dir
        self._sizes: dict[str, dict[str, int | None]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MlflowSource(run_id={self.run_id!r}, root={self.root!r}, cache_dir={str(self.cache_dir)!r})"

    @property
    def uri(self) -> str:
        """``runs:/<run_id>/<root>``."""
        return f"runs:/{self.run_id}/{self.root}"

    def _listing(self, folder: str) -> dict[str, int | None]:
        if folder not in self._sizes:
            try:
                items = self.client.list_artifacts(self.run_id, folder)
            except Exception as e:  # noqa: BLE001
                raise TrackingError(f"listing artifacts {folder!r} of MLflow run {self.run_id!r} failed: {_short(e)}") from e
            self._sizes[folder] = {i.path.rsplit("/", 1)[-1]: i.file_size for i in items if not i.is_dir}
        return self._sizes[folder]

    def _download(self, apath: str) -> Path:
        final = self.cache_dir / apath
        tmp = self.cache_dir / ".partial" / uuid.uuid4().hex
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            got = Path(self.client.download_artifacts(self.run_id, apath, dst_path=str(tmp)))
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got, final)
        except Exception as e:  # noqa: BLE001
            raise TrackingError(
                f"downloading {apath!r} of MLflow run {self.run_id!r} failed: {_short(e)}; "
                f"check that the run was synced (`hookline sync RUN_DIR --run-id {self.run_id}`)"
            ) from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    def manifests(self) -> list[dict]:
        """Download (fresh, every call) and parse the run's ``manifest*.json`` artifacts.

        Raises:
            FormatError: if the run has no hookline manifest (it was never synced).
        """
        names = sorted(n for n in self._listing(self.root) if MANIFEST_RE.fullmatch(n))
        if not names:
            raise FormatError(
                f"MLflow run {self.run_id!r} has no {self.root}/manifest.json artifact: it holds no hookline "
                f"data (sync a run directory with `hookline sync RUN_DIR --run-id {self.run_id}`)"
            )
        out = []
        with self._lock:
            for n in names:
                p = self._download(f"{self.root}/{n}")
                try:
                    out.append(json.loads(p.read_text(encoding="utf-8")))
                except ValueError as e:
                    raise FormatError(f"artifact {self.root}/{n} of run {self.run_id!r} is not valid JSON: {e}") from e
        return out

    def path(self, rel: str) -> Path:
        """Local path of a file of the run directory, downloaded on first use.

        Args:
            rel: path relative to the run directory, as in the manifest (``outputs/blocks.0.h5``).

        Returns:
            The cached file (re-downloaded when its size differs from the artifact's).
        """
        rel = Path(rel).as_posix()
        if rel.startswith("/") or ".." in rel.split("/"):
            raise InvalidArgumentError(f"artifact path {rel!r} must be relative to the run directory, without '..'")
        apath = f"{self.root}/{rel}"
        folder, name = apath.rsplit("/", 1)
        with self._lock:
            local = self.cache_dir / apath
            listing = self._listing(folder)
            if name not in listing:
                raise UnknownNameError(
                    f"MLflow run {self.run_id!r} has no artifact {apath!r}: the run was not fully synced "
                    f"(run `hookline sync RUN_DIR --run-id {self.run_id}`)"
                )
            if local.is_file() and (listing[name] is None or local.stat().st_size == listing[name]):
                return local
            return self._download(apath)

    def size(self, rel: str) -> int | None:
        """Size in bytes of a file of the run directory as MLflow lists it (no download), or
        None when MLflow does not say or the file is not there."""
        apath = f"{self.root}/{Path(rel).as_posix()}"
        folder, name = apath.rsplit("/", 1)
        with self._lock:
            return self._listing(folder).get(name)


def mlflow_source(uri: str, *, tracking_uri: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> MlflowSource:
    """Open an MLflow run's hookline data for reading (used by ``open_run("runs:/<id>")``).

    Nothing but the manifests is downloaded until a handle file is asked for with
    :meth:`MlflowSource.path`.

    Args:
        uri: ``runs:/<run_id>[/hookline]``, ``mlflow-artifacts:/.../<run_id>/artifacts/hookline``
            or a bare 32-hex run id.
        tracking_uri: tracking server/store (default: from an ``mlflow-artifacts://host`` URI,
            else MLflow's resolution).
        cache_dir: cache base; files land in ``<cache_dir>/<run_id>/``. Default
            ``$HOOKLINE_CACHE_DIR``, else ``~/.cache/hookline``.

    Raises:
        InvalidArgumentError: for a malformed URI.
        UnknownNameError: if the run does not exist at the tracking URI.
        TrackingError: if MLflow cannot be reached.
    """
    run_id, root, tu = parse_run_uri(uri, tracking_uri)
    client = connect(tu, existing=True)
    _get_run(client, run_id)
    return MlflowSource(run_id, root, client, _cache_base(cache_dir) / run_id)
