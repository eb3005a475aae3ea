"""Handle files uploaded to an MLflow run on a few threads, within hookline's time budget."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import TrackingUnreachableError
from .client import CallBudget, short_error

__all__ = ["FileUpload", "ParallelUploads"]


@dataclass
class FileUpload:
    """One handle file to upload.

    Attributes:
        artifact: its artifact path (``hookline/<file>``).
        local: the local file.
        digest: its ``<size>:<sha256>``.
    """

    artifact: str
    local: Path
    digest: str


class ParallelUploads:
    """Artifact uploads on up to ``max_workers`` threads, each started as soon as it is :meth:`add`-ed.

    Plain daemon threads, not a ``concurrent.futures`` executor: an adapter left open makes its
    final pass at interpreter exit, when executors refuse new work; daemon, so that an upload
    stuck past the exit time limit does not keep the process alive. :meth:`wait` waits at most
    ``budget.limit(all the files' bytes)``; uploads still running then are reported (:attr:`down`:
    the error, else None) and left behind. ``client``/``run_id``: where to upload; ``repo``: the
    run's artifact repository (:func:`~.client.artifact_repository`), else the client's.
    """

    def __init__(self, client: Any, run_id: str, max_workers: int, budget: CallBudget, repo: Any = None) -> None:
        self._client = client
        self._run_id = run_id
        self._repo = repo
        self._budget = budget
        self._max = max_workers
        self.down: TrackingUnreachableError | None = None
        self._uploads: list[FileUpload] = []
        self._errors: list[str | None] = []
        self._done: list[bool] = []
        self._queue: collections.deque[int] = collections.deque()
        self._cond = threading.Condition()
        self._no_more = False
        self._first = threading.Event()  # the first upload finished (MLflow cached the run's repository)
        if repo is not None:
            self._first.set()  # (the repository is at hand: no lookup to wait for)
        self._t0 = time.monotonic()
        self._threads: list[threading.Thread] = []

    def prestart(self, n: int) -> None:
        """Start the threads for ``n`` uploads now (e.g. while the run is fetched), so that
        :meth:`add` hands its upload to a waiting thread instead of starting one."""
        while len(self._threads) < min(self._max, n):
            if not self._start_thread():
                return

    def target(self, repo: Any) -> None:
        """Upload into ``repo`` (the run's artifact repository, known once the run is fetched;
        None: through the client); call before the first :meth:`add`."""
        self._repo = repo
        if repo is not None:
            self._first.set()
        self._t0 = time.monotonic()  # (the time limit counts from here, not from the run's fetch)

    def _start_thread(self) -> bool:
        t = threading.Thread(target=self._work, name="hookline-upload", daemon=True)
        try:
            t.start()
        except RuntimeError:  # Python 3.12 starts no thread at interpreter exit: wait() uploads
            return False
        self._threads.append(t)
        return True

    def add(self, up: FileUpload) -> None:
        """Start uploading ``up`` (on a free thread)."""
        with self._cond:
            self._uploads.append(up)
            self._errors.append(None)
            self._done.append(False)
            self._queue.append(len(self._uploads) - 1)
            self._cond.notify()
        if len(self._threads) < min(self._max, len(self._uploads)):
            self._start_thread()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._no_more:
                    self._cond.wait()
                if not self._queue or self.down is not None:
                    return  # (all done, or given up: the rest is reported as not finished)
                i = self._queue.popleft()
            if i:  # (MLflow looks the run up for the first upload: once, not once per thread)
                self._first.wait()
            up = self._uploads[i]
            try:
                if self._repo is not None:
                    self._repo.log_artifact(str(up.local), up.artifact.rsplit("/", 1)[0])
                else:
                    self._client.log_artifact(self._run_id, str(up.local), up.artifact.rsplit("/", 1)[0])
            except Exception as e:  # noqa: BLE001 - reported per file
                self._errors[i] = short_error(e)
            self._done[i] = True
            self._first.set()

    def wait(self) -> list[str | None]:
        """Wait for the uploads (at most the budget); each one's error (None: uploaded), in order."""
        with self._cond:
            self._no_more = True
            self._cond.notify_all()
        if not self._threads:
            self._work()  # no thread could start: upload here, one after the other
        limit = self._budget.limit(sum(up.local.stat().st_size for up in self._uploads))
        for t in self._threads:
            t.join(max(0.0, self._t0 + limit - time.monotonic()))
        errors = list(self._errors)
        late = [up.artifact for up, done in zip(self._uploads, self._done) if not done]
        if late:
            self.down = self._budget.overrun(f"the upload of {', '.join(map(repr, late[:3]))}"
                                             + (f" and {len(late) - 3} more" if len(late) > 3 else ""), limit)
            errors = [e if done else "not finished in time" for e, done in zip(errors, self._done)]
        return errors
