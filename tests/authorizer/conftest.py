"""Real authorizer processes on 127.0.0.1 and a real PostgreSQL 15, reaped however a test ends.

`start_authorizer(*args)` starts `agora-node --role authorizer --port 0 ...` and returns it once its
readiness line gave the URL; every process it started is stopped (or killed) at teardown. The
`db_url` fixture is parametrized over SQLite and PostgreSQL; the PostgreSQL server is started
once per session (initdb in a temporary directory, run as the postgres user) and each test gets
a fresh database in it.
"""

from __future__ import annotations

import os
import subprocess
import uuid

import pytest

from authorizer.testing import AuthorizerProcess, NodeKey

from tests.authorizer.helpers import ADMIN_TOKEN

_all: list[AuthorizerProcess] = []


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """A fresh, empty database of each kind."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/authorizer.db"
    server = request.getfixturevalue("postgres")
    return server.create_database(f"t_{uuid.uuid4().hex[:12]}")


class Starter:
    """Starts authorizers (`starter(*extra_args, db=..., data_dir=...)`) and reaps them all."""

    def __init__(self, tmp_path, popen=subprocess.Popen):
        self.tmp_path = tmp_path
        self.popen = popen
        self.started: list[AuthorizerProcess] = []

    def __call__(self, *args: str, db: str | None = None, data_dir: str | None = None, run_config: str = "tiny",
                 port: str | None = "0", timeout_s: float = 60) -> AuthorizerProcess:
        """`port=None` passes no --port: the authorizer then uses the one its data directory recorded."""
        data_dir = data_dir or str(self.tmp_path / "data")
        argv = ["--run-config", run_config, "--data-dir", data_dir,
                "--admin-token", ADMIN_TOKEN, "--log-level", "info", *args]
        if port is not None:
            argv += ["--port", port]
        if db is not None:
            argv += ["--db", db]
        process = AuthorizerProcess(argv, log_path=str(self.tmp_path / f"authorizer-{len(self.started)}.log"),
                                     popen=self.popen)
        self.started.append(process)
        _all.append(process)
        return process.start(timeout_s=timeout_s)

    def stop_all(self) -> None:
        for process in self.started:
            process.stop()


@pytest.fixture
def start_authorizer(tmp_path, node_popen):
    starter = Starter(tmp_path, node_popen)
    yield starter
    starter.stop_all()


@pytest.fixture(scope="module")
def module_starter(tmp_path_factory, node_popen):
    """Like start_authorizer, for one authorizer shared by a module's tests."""
    starter = Starter(tmp_path_factory.mktemp("authorizer"), node_popen)
    yield starter
    starter.stop_all()


@pytest.fixture
def node_keys():
    """`node_keys(n)`: n fresh Ed25519 node identities."""
    return lambda n: [NodeKey.generate() for _ in range(n)]


def pytest_sessionfinish(session, exitstatus):
    for process in _all:
        if process.proc is not None and process.proc.poll() is None:
            process.kill()


os.environ.setdefault("OMP_NUM_THREADS", "1")
