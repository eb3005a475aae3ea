"""Shared pytest fixtures for hookline's tests (generic; no hook or storage fixtures here).

MLflow fixtures:

* ``mlflow_server`` (session): a real ``mlflow server`` on 127.0.0.1 (free port, sqlite backend,
  ``--artifacts-destination`` in a temp dir, ``--workers 1``, job execution off); yields its
  tracking URI (``http://127.0.0.1:<port>``). Started once per session (~10 s).
* ``mlflow_server_factory`` (function): ``start(root=None) -> MlflowServer`` for tests that need
  their own server (e.g. to kill it); every server it started is stopped at teardown.
  ``MlflowServer`` has ``uri``, ``kill()`` (SIGKILL, simulates a crash), ``stop()`` and
  ``restart()`` (same backend store and artifact dir, new process, same port).
* ``sqlite_tracking_uri`` (function): the embedded default store, as a per-test copy of a sqlite
  DB migrated once per session (a fresh migration costs seconds, and concurrent first migrations
  corrupt the DB). Sets ``MLFLOW_TRACKING_URI`` to it and changes the working directory to the
  test's ``tmp_path``, so MLflow's ``./mlruns`` artifacts and any default ``mlflow.db`` land there;
  the default experiment's artifacts go to ``tmp_path / "mlartifacts"``.

Autouse: every test gets ``MLFLOW_TRACKING_URI=sqlite:///<tmp_path>/mlflow.db`` (nothing is created
until MLflow is used) so that no test ever writes ``mlflow.db`` into the repository, and MLflow's
HTTP retries are cut (``MLFLOW_HTTP_REQUEST_MAX_RETRIES=2``, timeout 20 s) so that a test talking to
a dead server fails in seconds, not minutes. ``HOOKLINE_CACHE_DIR`` points into ``tmp_path`` too,
so reading ``runs:/...`` never fills ``~/.cache/hookline``. Tests that use MLflow should still use
one of the fixtures above (a fresh sqlite DB per test costs a migration).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Iterator

import pytest

_MLFLOW_BIN = Path(sys.executable).with_name("mlflow")

# Every file a writer describes to the structure cache is also walked and compared in tests
# (storage/_h5check.py, remember): the whole suite checks the writer's account of its files.
# Set here, before any writer runs, so subprocesses and spawned ranks inherit it.
os.environ["HOOKLINE_CHECK_WRITTEN"] = "1"


@pytest.fixture(autouse=True)
def _isolate_mlflow_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Point MLflow at a per-test location and make HTTP failures fast (see module docstring)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    monkeypatch.setenv("HOOKLINE_CACHE_DIR", str(tmp_path / "hookline-cache"))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """A ``mlflow server`` subprocess on 127.0.0.1 with a sqlite backend under ``root``.

    Args:
        root: directory for ``mlflow.db``, ``artifacts/`` and ``server.log``.
        port: TCP port (default: a free one).
    """

    def __init__(self, root: Path, port: int | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._auto_port = port is None
        self.port = port or _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.db = self.root / "mlflow.db"
        self.artifacts = self.root / "artifacts"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 180.0) -> MlflowServer:
        """Start the server and poll ``/health`` until it answers (raises after ``timeout`` s)."""
        env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        env.pop("MLFLOW_TRACKING_URI", None)
        cmd = [str(_MLFLOW_BIN), "server", "--backend-store-uri", f"sqlite:///{self.db}",
               "--artifacts-destination", str(self.artifacts), "--host", "127.0.0.1",
               "--port", str(self.port), "--workers", "1"]
        log = open(self.root / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root,
                                     start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._auto_port:  # lost the race for the free port: once more on another one
                    self._auto_port = False
                    self.port = _free_port()
                    self.uri = f"http://127.0.0.1:{self.port}"
                    return self.start(timeout)
                raise RuntimeError(f"mlflow server exited with {self.proc.returncode}; see {self.root / 'server.log'}")
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as r:
                    if r.status == 200:
                        self._auto_port = False  # restart() must keep this port
                        return self
            except OSError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"mlflow server on {self.uri} not healthy after {timeout} s; see {self.root / 'server.log'}")

    def _signal_group(self, sig: int) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)  # the server's own session: its workers too
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        """SIGKILL the server and its workers (a crash); the port is closed when this returns."""
        self._signal_group(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)
        self._wait_port_closed()

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``timeout`` s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # stragglers of the group, if any
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._wait_port_closed()

    def restart(self) -> MlflowServer:
        """Stop (if running) and start again on the same port, backend store and artifact dir."""
        self.stop()
        return self.start()

    def _wait_port_closed(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)


@pytest.fixture(scope="session")
def shared_mlflow_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MlflowServer]:
    """A real ``mlflow server`` shared by the whole session (its access log in ``root``).

    Tests that count requests in its log read the lines after those already there
    (tests run one at a time); only tests that kill or restart a server start their own
    (:func:`mlflow_server_factory`): each start costs ~10-20 s of imports on 2 cores.
    """
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mlflow_server(shared_mlflow_server: MlflowServer) -> str:
    """Tracking URI of the session's shared ``mlflow server``."""
    return shared_mlflow_server.uri


@pytest.fixture
def mlflow_server_factory(tmp_path: Path) -> Iterator[Callable[..., MlflowServer]]:
    """Start dedicated servers (``start(root=None)``); all are stopped at teardown. For tests that
    kill, restart or break a server; others use :func:`shared_mlflow_server`."""
    started: list[MlflowServer] = []

    def start(root: Path | None = None) -> MlflowServer:
        server = MlflowServer(root or tmp_path / f"mlflow-server-{len(started)}")
        started.append(server)
        return server.start()

    yield start
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def _mlflow_template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A sqlite tracking DB migrated once per session (copied per test)."""
    root = tmp_path_factory.mktemp("mlflow-template")
    db = root / "mlflow.db"
    from mlflow import MlflowClient

    old = os.getcwd()
    os.chdir(root)  # the default experiment's ./mlruns would be resolved here
    try:
        MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    finally:
        os.chdir(old)
    return db


@pytest.fixture
def sqlite_tracking_uri(_mlflow_template_db: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """``sqlite:///<tmp_path>/mlflow.db``: a migrated embedded store private to this test.

    Also sets ``MLFLOW_TRACKING_URI`` to it and chdirs into ``tmp_path`` (see module docstring).
    """
    db = tmp_path / "mlflow.db"
    shutil.copyfile(_mlflow_template_db, db)
    art = tmp_path / "mlartifacts"
    art.mkdir(exist_ok=True)
    with sqlite3.connect(db) as con:  # the default experiment's artifacts: into this test's dir
        con.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0", (art.as_uri(),))
    uri = f"sqlite:///{db}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    return uri


# glibc settings as the suite found them (a LocalCluster's Nanny adds MALLOC_TRIM_THRESHOLD_ to
# os.environ, possibly in a module-scoped fixture that starts before a test's own fixtures)
_MALLOC_AT_START = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}


@pytest.fixture(autouse=True)
def _no_leaked_malloc_settings() -> Iterator[None]:
    """Puts ``MALLOC_*`` back as the suite found them after every test: left in ``os.environ``,
    dask.distributed's ``MALLOC_TRIM_THRESHOLD_`` turns glibc's dynamic mmap threshold off in
    every later subprocess of the suite (the memory tests then measure other allocations)."""
    yield
    for k in [k for k in os.environ if k.startswith("MALLOC_") and k not in _MALLOC_AT_START]:
        del os.environ[k]
    os.environ.update(_MALLOC_AT_START)
