"""MlflowSource: the reader's source for a run synced to MLflow, downloading files into a cache.

``open_run("runs:/<id>")`` reaches :func:`mlflow_source` through the reader's source registry
(``hookline.storage`` registers it), so the reader never imports this module itself.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

from ..confine import check_relative
from ..errors import FormatError, TrackingError, TrackingUnreachableError, UnknownNameError
from ..format import MANIFEST_RE
from .client import CallBudget, connect, fetch_artifact, get_run, short_error, tracking_uri_of
from .uri import parse_run_uri

__all__ = ["MlflowSource", "mlflow_source"]


def _cache_base(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HOOKLINE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "hookline"


class MlflowSource:
    """A hookline run stored as MLflow artifacts, downloaded one file at a time into a cache.

    Implements the reader's source protocol: :meth:`manifests` and :meth:`path` (and
    :meth:`size`). Create it with :func:`mlflow_source`. Listing a folder and downloading a file
    are one request each, straight to the run's artifact repository (``MlflowClient``'s own
    ``list_artifacts``/``download_artifacts`` look the run up again, and look for logged models,
    on every call), each bounded by the time budget.

    Attributes:
        run_id: the MLflow run id.
        root: artifact folder of the run directory (``hookline``).
        cache_dir: where files land: ``<cache base>/<run_id>/<root>/...``.
        client: the :class:`mlflow.MlflowClient`.
        budget: the time budget of each call.
        downloads: the artifact paths downloaded so far, in order.
    """

    def __init__(self, run_id: str, root: str, client: Any, cache_dir: Path, budget: CallBudget | None = None,
                 artifact_uri: str | None = None) -> None:
        self.run_id = run_id
        self.root = root
        self.client = client
        self.cache_dir = cache_dir
        self.budget = budget or CallBudget(tracking_uri_of(client))
        self.downloads: list[str] = []
        self._artifact_uri = artifact_uri
        self._repo: Any = None
        self._sizes: dict[str, dict[str, int | None]] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MlflowSource(run_id={self.run_id!r}, root={self.root!r}, cache_dir={str(self.cache_dir)!r})"

    def _repository(self) -> Any:
        """The run's artifact repository (None: go through the client, e.g. without an artifact URI)."""
        if tracking_uri_of(self.client).startswith("databricks"):
            return None  # (MLflow adds the workspace's credentials to such artifact URIs itself)
        if self._repo is None and self._artifact_uri:
            from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

            try:
                self._repo = get_artifact_repository(self._artifact_uri, tracking_uri=tracking_uri_of(self.client))
            except Exception:  # noqa: BLE001 - e.g. a scheme that needs the client's own resolution
                self._artifact_uri = None
        return self._repo

    def _listing(self, folder: str) -> dict[str, int | None]:
        if folder not in self._sizes:
            repo = self._repository()
            try:
                if repo is not None:
                    items = self.budget.call(f"listing {folder!r}", repo.list_artifacts, folder)
                else:
                    items = self.budget.call(f"listing {folder!r}", self.client.list_artifacts, self.run_id, folder)
            except TrackingUnreachableError:
                raise
            except Exception as e:  # noqa: BLE001
                raise TrackingError(
                    f"listing artifacts {folder!r} of MLflow run {self.run_id!r} failed: {short_error(e)}") from e
            self._sizes[folder] = {i.path.rsplit("/", 1)[-1]: i.file_size for i in items if not i.is_dir}
        return self._sizes[folder]

    def _fetch(self, apath: str, tmp: Path) -> Path:
        """Download one artifact into the folder ``tmp``; its local path."""
        return fetch_artifact(self.client, self.run_id, apath, tmp, self._repository())

    def _download(self, apath: str, size: int | None = None) -> Path:
        final = self.cache_dir / apath
        tmp = self.cache_dir / ".partial" / uuid.uuid4().hex
        tmp.mkdir(parents=True, exist_ok=True)
        try:
            got = self.budget.call(f"the download of {apath!r}", self._fetch, apath, tmp, size=size or 0)
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(got, final)
            self.downloads.append(apath)
        except TrackingUnreachableError:
            raise
        except Exception as e:  # noqa: BLE001
            raise TrackingError(
                f"downloading {apath!r} of MLflow run {self.run_id!r} failed: {short_error(e)}; "
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
                p = self._download(f"{self.root}/{n}", self._sizes[self.root].get(n))
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

        Raises:
            FormatError: ``rel`` is absolute or leads out with ``..`` (:mod:`..confine`): the
                cache holds nothing outside the run's folder.
        """
        rel = Path(check_relative(rel, what="file", where=f"runs:/{self.run_id}")).as_posix()
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
            return self._download(apath, listing[name])

    def size(self, rel: str) -> int | None:
        """Size in bytes of a file of the run directory as MLflow lists it (no download), or
        None when MLflow does not say or the file is not there."""
        try:
            apath = f"{self.root}/{Path(check_relative(rel, what='file', where=self.run_id)).as_posix()}"
        except FormatError:
            return None  # (not a file of the run: reading it says why)
        folder, name = apath.rsplit("/", 1)
        with self._lock:
            return self._listing(folder).get(name)


def mlflow_source(uri: str, *, tracking_uri: str | None = None, cache_dir: str | os.PathLike | None = None,
                  mlflow_timeout: float | None = None) -> MlflowSource:
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
        mlflow_timeout: seconds each MLflow call may take (default ``$HOOKLINE_MLFLOW_TIMEOUT``,
            else 60; a download gets one more second per MiB).

    Raises:
        InvalidArgumentError: for a malformed URI, or a store that does not exist.
        UnknownNameError: if the run does not exist at the tracking URI.
        TrackingError: if MLflow cannot be reached (:class:`TrackingUnreachableError`: it does not
            answer, answers errors, or a call runs out of the time budget).
    """
    run_id, root, tu = parse_run_uri(uri, tracking_uri)
    client = connect(tu, existing=True, timeout=mlflow_timeout, probe=False)
    budget = CallBudget(tracking_uri_of(client), mlflow_timeout)
    run = get_run(client, run_id, budget, probe=True)  # (its runs/get is the reachability probe)
    return MlflowSource(run_id, root, client, _cache_base(cache_dir) / run_id, budget,
                        getattr(run.info, "artifact_uri", None))
