"""One sync pass of a run directory into an MLflow run: handle files, norm metrics, tags, manifests.

What a pass does (:meth:`Uploader.run`), each step a method of :class:`_Pass`:

1. reads the run directory's manifest(s) (``manifest.json`` / ``manifest.rank<r>.json``), starts
   fetching the MLflow run on a thread (that request is the reachability probe:
   :func:`~.client.get_run` with ``probe=True``) and, while it is on its way, checks the handle
   files on disk (their norms read from record 0 on); once the run is in, checks that it holds no
   other run directory (nothing is sent to the run before that);
2. starts uploading every handle file whose size/SHA-256 differs from the run's sync record
   (:mod:`.syncstate`), as artifact ``hookline/<file>`` (``<file>`` is the manifest's relative path, i.e.
   ``<key>.h5`` or ``<key>.rank<r>.h5``), several at once on plain threads, straight to the run's
   artifact repository;
3. meanwhile logs the per-record L2 norms of every field and their running maximum as metric
   series (step = training step) for the records not yet logged (:mod:`.runpage`), and the
   per-handle and run-level tags (and the ``hookline.origin`` param), with ``log_batch``: a small
   pass sends points, tags and params in one request, while the files upload;
4. once every file is uploaded, uploads the run's summary page (``hookline/summary.html``, see
   :mod:`.runsummary`) and the manifest(s), as ``hookline/manifest.json`` /
   ``hookline/manifest.rank<r>.json``, then the sync record; a ``hookline.bytes`` tag that an
   upload failure made wrong is corrected last.

Ordering rules: a manifest is uploaded only after every file it names (and only by a pass with no
error and nothing pending), so a reader that finds it finds its files; the sync record lists only
uploads that finished, and is written after them (a file it lists is never skipped unless it is
there); a ``records`` tag (the watermark) goes in the same ``log_batch`` request as its points, or
after them, and MLflow stores a request's metrics before its tags, so the watermark never runs
ahead of the points. Tags may reach the run while its files still upload: a search can find the run
a moment before its files are complete; a failed pass says so, and the next pass completes it.

Every MLflow call is bounded by the time budget (:class:`~.client.CallBudget`).

(~640 lines, kept in one file: the steps of a pass share its state and the ordering rules above,
which one reader must be able to check in one place.)

Idempotence: files are compared by size + SHA-256 against the sync record and skipped when
equal; metric points carry deterministic timestamps (manifest creation time + record index), so a
repeated point is identical and MLflow's SQL store drops it instead of storing a duplicate; the
``records`` tag is the watermark of records already logged, so a repeat pass does not even send
them again.
"""

from __future__ import annotations

import enum
import functools
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DuplicateNameError, FormatError, HookTypeError, InvalidArgumentError, TrackingError
from ..confine import RunRoot
from ..errors import TrackingUnreachableError, UnknownNameError
from ..format import check_manifest
from .client import REACH_TIMEOUT_S, CallBudget, PendingCall, artifact_repository, budget_seconds, connect, get_run, \
    short_error, tracking_uri_of
from .keys import (
    ARTIFACT_ROOT,
    FORMAT_VERSION_TAG,
    VERSION_TAG,
    bytes_tag,
    handles_tag,
    module_type_tag,
    tag_key,
)
from .report import SyncReport
from .rundir import NormSeries, check_origin, created_ms, file_damage, file_digest, load_manifests, norm_fields, \
    read_series, series_since
from .runpage import handle_tags, norm_points
from .runsummary import SummaryPage
from .syncstate import SyncState
from .transfer import FileUpload, ParallelUploads

__all__ = ["PREFETCH_FRESH_S", "PassMode", "Uploader"]

log = logging.getLogger("hookline.mlflow")

#: Seconds a run fetched by :meth:`Uploader.prefetch_run` stays fresh enough for a pass to use.
PREFETCH_FRESH_S = 10.0

#: Metric points plus tags in one ``log_batch`` request (MLflow's limits: 1,000 entities, 100 tags).
_ONE_REQUEST, _ONE_REQUEST_TAGS = 1000, 100


class PassMode(enum.IntEnum):
    """What a pass does; each mode does what the smaller ones do (pending passes merge to the largest)."""

    #: norm metrics and tags only (mid-run: the handle files are still growing segments)
    METRICS = 0
    #: also the handle files that are final already (the others are listed as pending)
    FILES = 1
    #: also every handle file (a missing one is an error) and then the manifests
    FINAL = 2


@dataclass
class _HandlePlan:
    """One handle of one manifest, as a pass sees it.

    Attributes:
        manifest: the manifest that lists the handle.
        rank: the rank in the handle's tag and metric keys (the manifest's, else the uploader's).
        handle_id: the handle id.
        entry: the manifest's entry of the handle.
    """

    manifest: dict
    rank: int | None
    handle_id: str
    entry: dict


@dataclass
class _LocalFile:
    """A handle's file as checked on disk (before or after the MLflow run is known).

    Attributes:
        artifact: its artifact path (``hookline/<file>``).
        local: the file (None: the manifest entry's path is refused).
        digest: its ``<size>:<sha256>`` ("": the file is missing).
        refused: why the manifest entry's path is not one to upload (None: it is).
        checked: the watermark its norms were read from (None: :func:`file_damage` not run yet).
        damage: why the file is damaged (None: sound, or not checked yet).
        series: its norm series from record ``checked`` on (None: not read).
    """

    artifact: str
    local: Path | None = None
    digest: str = ""
    refused: str | None = None
    checked: int | None = None
    damage: str | None = None
    series: list[NormSeries] | None = None


class Uploader:
    """Sync passes of run directories into one MLflow run, one pass at a time.

    Args:
        run_id: the MLflow run (it must exist; hookline never creates or ends runs).
        rank: distributed rank; when given, only this rank's manifest is synced and tag/metric
            keys carry ``-rank<r>``.
        tracking_uri: tracking server/store, connected on first use.
        existing_store: the store must exist already (see :func:`~.client.connect`).
        max_workers: parallel artifact uploads.
        mlflow_timeout: the time budget of each MLflow call (:func:`~.client.budget_seconds`:
            default ``$HOOKLINE_MLFLOW_TIMEOUT``, else 60 s).

    Raises:
        HookTypeError: ``run_id`` is not a str.
        InvalidArgumentError: for a malformed run id, a negative rank, ``max_workers < 1`` or a
            budget that is not a positive number.
    """

    def __init__(self, run_id: str, *, rank: int | None = None, tracking_uri: str | None = None,
                 existing_store: bool = False, max_workers: int = 4, mlflow_timeout: float | None = None) -> None:
        if not isinstance(run_id, str):
            raise HookTypeError(
                f"MLflow run id must be a str (the 32-hex id of an existing run), got "
                f"{type(run_id).__name__} {run_id!r:.60}"
            )
        # Stores may use other id formats: refuse only what can never be an id (MLflow checks the rest).
        if not re.fullmatch(r"[\w\-]+", run_id):
            raise InvalidArgumentError(
                f"MLflow run id {run_id!r} is not valid: pass the 32-hex id of an existing run "
                "(e.g. mlflow.start_run().info.run_id or `mlflow runs list --experiment-id <id>`)"
            )
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise InvalidArgumentError(f"rank {rank!r} is not valid: pass a non-negative int or None")
        if max_workers < 1:
            raise InvalidArgumentError(f"max_workers {max_workers!r} must be >= 1")
        self.run_id = run_id
        self.rank = rank
        self.tracking_uri = tracking_uri
        self.max_workers = int(max_workers)
        self.budget_s = budget_seconds(mlflow_timeout)
        self._existing_store = existing_store
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._pass_lock = threading.Lock()
        self._hashes: dict[Path, tuple[tuple[int, int], str]] = {}  # file digests, by (size, mtime)
        self._run_now: Any = None  # the MLflow run as fetched by check_run(), for the next pass
        self._prefetched: tuple[float, PendingCall] | None = None  # prefetch_run()'s call and its start
        self._down: tuple[float, TrackingUnreachableError] | None = None  # the server's last failure
        self.state: SyncState | None = None  # the run's sync record, read once (this uploader updates it)

    @property
    def client(self) -> Any:
        """The :class:`mlflow.MlflowClient` (connected on first use; the server is probed by the
        first request of each pass, its ``get_run``)."""
        with self._client_lock:
            if self._client is None:
                self._client = connect(self.tracking_uri, existing=self._existing_store, timeout=self.budget_s,
                                       probe=False)
            return self._client

    def budget(self) -> CallBudget:
        """A :class:`~.client.CallBudget` for this uploader's calls (connects on first use)."""
        return CallBudget(tracking_uri_of(self.client), self.budget_s)

    def check_run(self) -> Any:
        """Fetch the MLflow run now (clear errors for an unknown or deleted run before anything is
        read); the next pass uses it instead of fetching it again.

        Raises:
            UnknownNameError: the run does not exist or is deleted.
            TrackingError: the server failed (:class:`TrackingUnreachableError`: no proper answer).
        """
        self._run_now = get_run(self.client, self.run_id, self.budget(), probe=True)
        return self._run_now

    def reach(self) -> None:
        """Fail at once, again, when the server failed less than 10 s ago (the passes of one
        ``close()`` do not each wait for it)."""
        if self._down is not None and time.monotonic() - self._down[0] < REACH_TIMEOUT_S:
            raise self._down[1]

    def prefetch_run(self) -> None:
        """Start fetching the MLflow run now, for the next pass to use (:meth:`start_fetch`).

        ``Recorder.close()`` calls it before it closes its files: the server answers the pass's
        ``get_run`` while the files are being finished, when it has nothing else to do. Never
        raises: a failure (bad URI, server down) is the pass's to report, as without a prefetch.
        A prefetch older than :data:`PREFETCH_FRESH_S` is not used.
        """
        if self._down is not None and time.monotonic() - self._down[0] < REACH_TIMEOUT_S:
            return  # (the pass fails at once anyway)
        try:
            call = self._fetch(self.budget())
        except Exception:  # noqa: BLE001 - reported by the pass, which connects again
            return
        with self._client_lock:
            self._prefetched = (time.monotonic(), call)

    def start_fetch(self, budget: CallBudget) -> PendingCall:
        """The MLflow run: the one :meth:`check_run` fetched just before, else the fetch that
        :meth:`prefetch_run` started (if fresh), else fetched on a thread by the pass's probe
        (:func:`~.client.get_run` with ``probe=True``: a failing server fails in seconds, not
        after MLflow's minutes of retries) while the pass checks its files."""
        run, self._run_now = self._run_now, None
        if run is not None:
            return PendingCall.finished(budget, "get_run", run)
        with self._client_lock:
            ahead, self._prefetched = self._prefetched, None
        if ahead is not None and time.monotonic() - ahead[0] < PREFETCH_FRESH_S:
            return ahead[1]
        return self._fetch(budget)

    def _fetch(self, budget: CallBudget) -> PendingCall:
        """``get_run`` (the probe) started on a thread."""
        # (the probe and MLflow's get_run are each bounded: this limit is a backstop behind both)
        limit = budget.seconds + min(REACH_TIMEOUT_S, budget.seconds) + 1
        return PendingCall(budget, "get_run", limit, get_run, (self.client, self.run_id, budget), {"probe": True})

    def run(self, run_dir: Path, mode: PassMode) -> SyncReport:
        """One pass over ``run_dir`` (after a pass already running finished).

        Failures of requests and uploads, a failing server included, are collected in the returned
        report (and logged as a warning); the next pass retries what is missing.

        Raises:
            UnknownNameError: the run or the run directory does not exist (or the run is deleted).
            FormatError: the run directory has no readable manifest.
            DuplicateNameError: the MLflow run holds another run directory.
        """
        with self._pass_lock:
            t0 = time.perf_counter()
            report = SyncReport(self.run_id)
            try:
                _Pass(self, run_dir, mode, report, self._hashes).execute()
                self._down = None
            except (UnknownNameError, FormatError, DuplicateNameError):
                raise
            except Exception as e:  # noqa: BLE001 - collected into the report
                report.errors.append(short_error(e) if isinstance(e, TrackingError) else f"{run_dir}: {short_error(e)}")
                report.unreachable = report.unreachable or isinstance(e, TrackingUnreachableError)
                if isinstance(e, TrackingUnreachableError):
                    self._down = (time.monotonic(), e)
            report.seconds = time.perf_counter() - t0
            if report.errors:
                log.warning("hookline: MLflow sync of %s to run %s: %s", run_dir, self.run_id, "; ".join(report.errors))
            return report


class _Pass:
    """The state of one pass: what the MLflow run holds now, and the steps that bring it up to date."""

    def __init__(self, up: Uploader, run_dir: Path, mode: PassMode, report: SyncReport,
                 hashes: dict[Path, tuple[tuple[int, int], str]]) -> None:
        self.run_id = up.run_id
        self.rank = up.rank
        self.up = up
        self.run_dir = run_dir
        self.mode = mode
        self.report = report
        self.hashes = hashes
        self.client: Any = None
        self.tags_now: dict[str, str] = {}
        self.params_now: dict[str, str] = {}
        self.state = SyncState(up.rank)  # (read only by passes that upload files)
        self.manifests: list[tuple[Path, dict]] = []
        self.plans: list[_HandlePlan] = []
        #: handles (id, rank) whose file is refused: outside the run, or damaged (no upload, no tags)
        self.refused: set[tuple[str, int | None]] = set()
        self._run: Any = None  # the run directory opened with the storage reader, on first need
        self.budget: CallBudget | None = None
        self.repo: Any = None  # the run's artifact repository (None: uploads go through the client)
        #: norm series read while a file was checked (opened once): (handle id, rank) -> (records, series)
        self.series: dict[tuple[str, int | None], tuple[int, list[NormSeries]]] = {}
        self.origin: dict[str, str] | None = None  # the origin params (None: the run is not fetched yet)
        self._summary_page = SummaryPage(run_dir, up.rank)

    def _arrive(self, run: Any, running: ParallelUploads) -> None:
        """Take in the fetched MLflow run: its tags and params, the origin check (before anything
        is uploaded), its artifact repository (for the uploads) and the sync record."""
        self.tags_now, self.params_now = dict(run.data.tags), dict(run.data.params)
        self.origin = check_origin(self.run_id, self.run_dir, self.manifests, self.tags_now, self.params_now)
        self.repo = artifact_repository(self.client, run)  # (no second lookup of the run by MLflow)
        running.target(self.repo)
        if self.mode != PassMode.METRICS:
            if self.up.state is None:
                self.up.state = SyncState(self.rank) if bytes_tag(self.rank) not in self.tags_now else \
                    self.budget.call("reading the sync record", SyncState.load, self.client, self.run_id, self.rank,
                                     self.tags_now, self.repo)  # (no tag: no record, no request)
            self.state = self.up.state

    def execute(self) -> None:
        """Run the steps (module docstring) in order."""
        try:
            self._steps()
        finally:
            self._summary_page.discard()  # (a page this pass did not upload: errors, or files pending)

    def _steps(self) -> None:
        self.manifests = load_manifests(self.run_dir, self.rank)
        self.client = self.up.client
        self.up.reach()
        self.budget = self.up.budget()
        fetching = self.up.start_fetch(self.budget)  # (the files are checked meanwhile)
        self.plans = self._plan_handles()
        running = ParallelUploads(self.client, self.run_id, self.up.max_workers, self.budget)
        try:
            if self.mode != PassMode.METRICS:  # (threads started while the run is fetched)
                running.prestart(sum(1 for p in self.plans if p.entry.get("file")))
                self._summary_page.start()  # (drawn while the files upload)
            uploads = self._files_to_upload(running, fetching)  # (each starts as soon as its file is checked)
            if self.origin is None:
                self._arrive(fetching.result(), running)
            tags, type_tags, later = self._log_norms()
            tags.update(self._run_tags(type_tags))
            tags.update(self._expected_bytes(uploads))
            params = {k: v for k, v in self.origin.items() if self.params_now.get(k) != v}
            sending = self.budget.start("logging tags", self._send_tags, tags, params, later)  # (while files upload)
        finally:
            if self._run is not None:
                self._run.close()
            results = running.wait()
        self._note_uploads(uploads, results)
        if running.down is not None:  # the server stopped answering
            raise running.down
        saved: dict[str, str] = {}
        if self.mode != PassMode.METRICS:
            if not self.report.errors and not self.report.pending:
                self._upload_manifests()  # last: after the files they describe
            saved = self._save_state()
        sending.result()
        # (an upload failed: the hookline.bytes tag sent with the others was ahead of the record)
        self._log_batch([], {k: v for k, v in saved.items() if tags.get(k, self.tags_now.get(k)) != v})

    # -- step 1: handles and files ---------------------------------------------------------------

    def _plan_handles(self) -> list[_HandlePlan]:
        plans = []
        for _mpath, man in self.manifests:
            rank = man.get("rank") if man.get("rank") is not None else self.rank
            plans.extend(_HandlePlan(man, rank, hid, entry) for hid, entry in sorted(man.get("handles", {}).items()))
        return plans

    def _files_to_upload(self, running: ParallelUploads, fetching: PendingCall) -> list[FileUpload]:
        """The handle files whose digest differs from the sync record's, handed to ``running`` as
        they are found sound; the others are reported as skipped, pending (mid-run) or missing
        (final pass). Until ``fetching`` (the MLflow run) is in, files are checked ahead, their
        norms read from record 0 on; the run is taken in (:meth:`_arrive`) as soon as it is."""
        uploads: list[FileUpload] = []
        if self.mode == PassMode.METRICS:
            return uploads
        root = RunRoot(self.run_dir)
        ahead: list[tuple[_HandlePlan, _LocalFile]] = []
        for plan in [*self.plans, None]:
            if self.origin is None and (plan is None or fetching.done()):  # (the run is in, or must be now)
                self._arrive(fetching.result(), running)
                for early, lf in ahead:
                    self._decide(early, lf, running, uploads)
            lf = self._local_file(root, plan) if plan is not None else None
            if lf is None:
                continue
            if self.origin is None:
                if lf.digest:
                    self._check_file(plan, lf, 0)
                ahead.append((plan, lf))
            else:
                self._decide(plan, lf, running, uploads)
        return uploads

    def _local_file(self, root: RunRoot, plan: _HandlePlan) -> _LocalFile | None:
        """The handle's file, confined to the run directory, and its digest (None: no file entry)."""
        rel = plan.entry.get("file")
        if not rel:
            return None
        lf = _LocalFile(f"{ARTIFACT_ROOT}/{Path(rel).as_posix()}")
        try:  # (only a regular file inside the run directory is ever uploaded; a key leading
            # outside is a damaged manifest entry: the reader would not read the handle)
            root.key(plan.entry.get("key"), what=f"manifest key of handle {plan.handle_id!r}")
            local = root.file(rel, what=f"file of handle {plan.handle_id!r}")
        except FormatError as e:
            lf.refused = str(e)
            return lf
        lf.local = local
        if local.is_file():
            lf.digest = file_digest(local, self.hashes)
        return lf

    def _check_file(self, plan: _HandlePlan, lf: _LocalFile, start: int) -> None:
        """:func:`file_damage` of the file; a final pass also reads its norms from record ``start``
        on (the file is opened once for both)."""
        if lf.local is None:
            return
        got: dict[str, list[NormSeries]] = {}
        n_total = int(plan.entry.get("records", 0) or 0)
        fields = norm_fields(plan.entry.get("fields", {}) or {})
        want = (fields, start, got) if fields and n_total > start and self.readable else None
        lf.damage = file_damage(lf.local, plan.handle_id, plan.entry, exact=self.mode == PassMode.FINAL, norms=want,
                                manifest=plan.manifest)
        lf.checked, lf.series = start, got.get("series")

    def _decide(self, plan: _HandlePlan, lf: _LocalFile, running: ParallelUploads, uploads: list[FileUpload]) -> None:
        """Once the run is in: skip the file (the sync record has it), report it (refused, missing,
        pending, damaged) or start its upload."""
        if lf.local is None:
            self._refuse(plan, str(lf.refused))
            return
        if not lf.digest:
            if self.mode == PassMode.FINAL:
                self.report.errors.append(
                    f"handle {plan.handle_id!r}: file {str(lf.local)!r} is missing (the writer is still running, or "
                    "was killed: close it, or run `hookline verify --repair` on the run directory, then sync again)")
            else:
                self.report.pending.append(lf.artifact)
            return
        if self.state.get(lf.artifact) == lf.digest:
            self.report.skipped.append(lf.artifact)
            return
        done = self._records_logged(plan)
        if lf.checked is None:
            self._check_file(plan, lf, done)
        if lf.series is not None and int(plan.entry.get("records", 0) or 0) > done:
            self.series[(plan.handle_id, plan.rank)] = (int(plan.entry.get("records", 0) or 0),
                                                       series_since(lf.series, done))
        if lf.damage is None:
            uploads.append(FileUpload(lf.artifact, lf.local, lf.digest))
            running.add(uploads[-1])
        else:
            self._refuse(plan, f"handle {plan.handle_id!r}: file {str(lf.local)!r} is damaged ({lf.damage}); "
                               "not uploaded (run `hookline verify --repair` on the run directory, then sync again)")

    def _refuse(self, plan: _HandlePlan, why: str) -> None:
        """Leave a handle out of the pass (file, metrics, tags): its file is not one to upload."""
        self.report.errors.append(why)
        self.refused.add((plan.handle_id, plan.rank))

    def _note_uploads(self, uploads: list[FileUpload], errors: list[str | None]) -> None:
        """Report the finished uploads and record their digests in the sync record."""
        for up, err in zip(uploads, errors):
            if err is None:
                self.report.uploaded.append(up.artifact)
                self.state.put(up.artifact, up.digest)
            else:
                self.report.errors.append(f"upload of {up.artifact!r} failed: {err}")

    def _save_state(self) -> dict[str, str]:
        """Upload the sync record if it changed; the ``hookline.bytes`` tag that goes with it."""
        try:
            saved = self.budget.call("the upload of the sync record", self.state.save, self.client, self.run_id,
                                     self.repo)
        except TrackingUnreachableError:
            raise
        except TrackingError as e:
            self.report.errors.append(str(e))
            return {}
        key = bytes_tag(self.rank)
        if not saved and key not in self.tags_now:
            return {}
        return {key: str(self.state.size_of(self._plan_files()))}

    def _plan_files(self) -> list[str]:
        return [f"{ARTIFACT_ROOT}/{Path(p.entry['file']).as_posix()}" for p in self.plans if p.entry.get("file")]

    def _expected_bytes(self, uploads: list[FileUpload]) -> dict[str, str]:
        """The ``hookline.bytes`` tag as it will be once ``uploads`` are done, sent with the other
        tags while they upload (:meth:`_save_state` corrects it when an upload failed; a tag
        ahead of its sync record costs re-uploads at most: a record that does not read is empty)."""
        key = bytes_tag(self.rank)
        if self.mode == PassMode.METRICS or (not uploads and key not in self.tags_now):
            return {}
        return {key: str(self.state.size_of(self._plan_files(), {u.artifact: u.digest for u in uploads}))}

    # -- step 2: norm metrics --------------------------------------------------------------------

    def _log_norms(self) -> tuple[dict[str, str], set[str], list[Any]]:
        """Log the norm points not logged yet; return the handle tags, the module-type tags and
        the points left for the tags' request (a small pass sends both in one request, which
        MLflow stores metrics first: the ``records`` watermark never runs ahead of its points)."""
        metrics: list[Any] = []
        tags: dict[str, str] = {}
        type_tags: set[str] = set()
        for plan in self.plans:
            if (plan.handle_id, plan.rank) in self.refused:
                continue  # (its records are not what the manifest says: no metrics or tags from it)
            done = self._records_logged(plan)
            n_total = int(plan.entry.get("records", 0) or 0)
            fields = norm_fields(plan.entry.get("fields", {}) or {})
            if fields and n_total > done:  # the manifest is rewritten at every flush
                try:
                    n_total, series = self.series.get((plan.handle_id, plan.rank)) or \
                        read_series(self._open_run(), plan.handle_id, plan.manifest.get("rank"), fields, done)
                except Exception as e:  # noqa: BLE001 - a broken file must not stop the others
                    self.report.errors.append(f"handle {plan.handle_id!r}: reading norms failed: {short_error(e)} "
                                              "(run `hookline verify` on the run directory)")
                    continue
                metrics.extend(norm_points(plan.handle_id, series, created_ms(plan.manifest), rank=plan.rank))
            tags.update(handle_tags(plan.handle_id, max(n_total, done), rank=plan.rank))
            t = module_type_tag(plan.entry.get("module_type"))
            if t:
                type_tags.add(t)
        if len(metrics) <= _ONE_REQUEST and len(self.plans) * 12 + 20 <= _ONE_REQUEST_TAGS:
            return tags, type_tags, metrics
        self._log_batch(metrics, {})  # (now: while the files upload)
        return tags, type_tags, []

    @functools.cached_property
    def readable(self) -> bool:
        """Whether the reader accepts the manifests (else norms are read through it, and fail)."""
        try:
            for mpath, man in self.manifests:
                check_manifest(man, str(mpath))
        except FormatError:
            return False
        return True

    def _open_run(self) -> Any:
        if self._run is None:
            from ..reader import open_run

            self._run = open_run(self.run_dir)
        return self._run

    def _records_logged(self, plan: _HandlePlan) -> int:
        """The handle's watermark: records whose norms the run has (its ``records`` tag)."""
        try:
            return int(self.tags_now.get(tag_key(plan.handle_id, "records", rank=plan.rank), "0"))
        except ValueError:
            return 0

    # -- step 3: tags ----------------------------------------------------------------------------

    def _run_tags(self, type_tags: set[str]) -> dict[str, str]:
        tags = {}
        tags[VERSION_TAG] = _version()
        fmt = {str(m.get("format_version")) for _, m in self.manifests if m.get("format_version") is not None}
        if fmt:
            tags[FORMAT_VERSION_TAG] = ",".join(sorted(fmt))
        tags[handles_tag(self.rank)] = str(len(self.plans))
        for t in sorted(type_tags):
            tags[t] = "true"
        return tags

    def _send_tags(self, tags: dict[str, str], params: dict[str, str], metrics: list[Any]) -> None:
        """Log the tags whose value the run does not have yet, new params and the ``metrics`` left
        for this request: in one request when they fit in one, else the metrics first."""
        changed = {k: v for k, v in tags.items() if self.tags_now.get(k) != v}
        if len(metrics) + len(changed) + len(params) > _ONE_REQUEST or len(changed) + len(params) > _ONE_REQUEST_TAGS:
            self._log_batch(metrics, {})
            metrics = []
        self._log_batch(metrics, changed, params)

    def _log_batch(self, metrics: list[Any], tags: dict[str, str], params: dict[str, str] | None = None) -> None:
        """One ``log_batch`` (MLflow splits it when it is larger than one request allows)."""
        if not metrics and not tags and not params:
            return
        from mlflow.entities import Param, RunTag

        what = " and ".join(x for x in (f"{len(metrics)} metric points" if metrics else "",
                                        f"{len(tags)} tags" if tags else "", "params" if params else "") if x)
        try:
            self.budget.call(f"logging {what}", self.client.log_batch, self.run_id, metrics=metrics,
                             tags=[RunTag(k, v) for k, v in tags.items()],
                             params=[Param(k, v) for k, v in (params or {}).items()], synchronous=True)
        except TrackingUnreachableError:
            raise
        except Exception as e:  # noqa: BLE001
            raise TrackingError(f"logging {what} failed: {short_error(e)}") from e
        self.report.metrics += len(metrics)
        self.report.tags += len(tags)

    # -- step 4: manifests -----------------------------------------------------------------------

    def _upload_manifests(self) -> None:
        with self._summary_page as summary:  # (before the manifests: a run with a manifest has its page)
            if summary is not None and self._upload_small(summary, listed=False):
                self.report.summary = f"{ARTIFACT_ROOT}/{summary.name}"
        for mpath, _man in self.manifests:
            self._upload_small(mpath)

    def _upload_small(self, mpath: Path, listed: bool = True) -> bool:
        """Upload ``mpath`` as ``hookline/<name>`` unless the sync record has it unchanged;
        ``listed``: name it in the report's ``uploaded``/``skipped``. Returns whether it is there."""
        digest = file_digest(mpath, self.hashes)
        apath = f"{ARTIFACT_ROOT}/{mpath.name}"
        if self.state.get(apath) == digest:
            if listed:
                self.report.skipped.append(apath)
            return True
        try:
            if self.repo is not None:
                self.budget.call(f"the upload of {apath!r}", self.repo.log_artifact, str(mpath), ARTIFACT_ROOT,
                                 size=mpath.stat().st_size)
            else:
                self.budget.call(f"the upload of {apath!r}", self.client.log_artifact, self.run_id, str(mpath),
                                 ARTIFACT_ROOT, size=mpath.stat().st_size)
        except TrackingUnreachableError:
            raise
        except Exception as e:  # noqa: BLE001
            self.report.errors.append(f"upload of {apath!r} failed: {short_error(e)}")
            return False
        if listed:
            self.report.uploaded.append(apath)
        self.state.put(apath, digest)
        return True


@functools.lru_cache(maxsize=1)
def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hookline")
    except Exception:  # noqa: BLE001
        return "unknown"
