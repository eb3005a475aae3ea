"""Sync bookkeeping of an MLflow run: which file digests it holds, kept in an artifact, not in tags.

A pass uploads a file only when its ``<size>:<sha256>`` differs from the digest recorded here; the
record is the artifact ``hookline/sync.json`` (``hookline/sync.rank<r>.json`` for a ranked
uploader), written after the uploads it describes. Tags would show every digest on the run page;
an artifact keeps the page readable. The run tag ``hookline.bytes`` (:func:`~.keys.bytes_tag`),
set by the same pass, says that it exists, so the first pass of a run makes no request for it (the
tag may arrive first: a record that is then missing or unreadable reads as empty, and the files
are compared afresh). It is read and written straight through the run's artifact repository (one
request each, no progress bar) when the pass has it.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from ..errors import TrackingError
from .client import fetch_artifact, short_error
from .keys import ARTIFACT_ROOT, bytes_tag

__all__ = ["SyncState"]

log = logging.getLogger("hookline.mlflow")

_FORMAT = "hookline-sync"


class SyncState:
    """The digests of the files an MLflow run holds (artifact path -> ``<size>:<sha256>``).

    Args:
        rank: the uploader's rank (None: unranked); it names the artifact.
    """

    def __init__(self, rank: int | None = None) -> None:
        self.rank = rank
        self.files: dict[str, str] = {}
        self._changed = False

    @property
    def artifact(self) -> str:
        """The artifact path: ``hookline/sync.json`` or ``hookline/sync.rank<r>.json``."""
        return f"{ARTIFACT_ROOT}/sync.json" if self.rank is None else f"{ARTIFACT_ROOT}/sync.rank{int(self.rank)}.json"

    @classmethod
    def load(cls, client: Any, run_id: str, rank: int | None, run_tags: dict[str, str],
             repo: Any = None) -> SyncState:
        """The run's state; empty when the run has none yet (no ``hookline.bytes`` tag: no request)
        or it does not read (then files are compared afresh and uploaded again: safe, only slower).

        Args:
            client: the :class:`mlflow.MlflowClient`.
            run_id: the MLflow run.
            rank: the uploader's rank.
            run_tags: the run's tags now.
            repo: the run's artifact repository (:func:`~.client.artifact_repository`): the record
                is then one request, without a progress bar (``MlflowClient.download_artifacts``
                looks the run up again, lists the path and searches its logged models first).
        """
        state = cls(rank)
        if bytes_tag(rank) not in run_tags:
            return state
        try:
            with tempfile.TemporaryDirectory(prefix="hookline-sync-") as tmp:
                got = fetch_artifact(client, run_id, state.artifact, Path(tmp), repo)
                doc = json.loads(got.read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001 - a missing or damaged record costs re-uploads only
            log.debug("hookline: reading %s of run %s failed (%s); comparing every file afresh",
                      state.artifact, run_id, short_error(e))
            return state
        files = doc.get("files") if isinstance(doc, dict) and doc.get("format") == _FORMAT else None
        if isinstance(files, dict):
            state.files = {str(k): str(v) for k, v in files.items() if isinstance(v, str)}
        return state

    def get(self, artifact: str) -> str | None:
        """The recorded digest of ``artifact`` (None: not uploaded, as far as the record says)."""
        return self.files.get(artifact)

    def put(self, artifact: str, digest: str) -> None:
        """Record that ``artifact`` now holds the file with ``digest``."""
        if self.files.get(artifact) != digest:
            self.files[artifact] = digest
            self._changed = True

    def size_of(self, artifacts: list[str], more: dict[str, str] | None = None) -> int:
        """Bytes of the recorded files among ``artifacts`` (the size part of their digests), with
        the digests ``more`` (artifact -> digest) recorded on top."""
        files = {**self.files, **(more or {})}
        total = 0
        for a in artifacts:
            head = (files.get(a) or "").split(":", 1)[0]
            total += int(head) if head.isdigit() else 0
        return total

    def save(self, client: Any, run_id: str, repo: Any = None) -> bool:
        """Upload the record if it changed (into ``repo``, the run's artifact repository, when
        given); True when it did.

        Raises:
            TrackingError: the upload failed (the next pass uploads the unrecorded files again).
        """
        if not self._changed:
            return False
        text = json.dumps({"format": _FORMAT, "files": dict(sorted(self.files.items()))}, indent=1)
        try:
            if repo is None:
                client.log_text(run_id, text, self.artifact)
            else:
                with tempfile.TemporaryDirectory(prefix="hookline-sync-") as tmp:
                    local = Path(tmp) / self.artifact.rsplit("/", 1)[-1]
                    local.write_text(text, encoding="utf-8")
                    repo.log_artifact(str(local), ARTIFACT_ROOT)
        except Exception as e:  # noqa: BLE001
            raise TrackingError(f"upload of {self.artifact!r} failed: {short_error(e)}") from e
        self._changed = False
        return True

