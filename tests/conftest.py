"""Shared fixtures: real agora-node swarms on 127.0.0.1, reaped no matter how a test ends."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import subprocess
import sys
import uuid

import psutil
import pytest

from node.launcher import LocalSwarm
from node.lifecycle import _is_shm_manager
from tests.support.polling import poll_until

mp.set_start_method("fork", force=True)  # hivemind needs fork (docs/architecture.md, 'Processes and threads')

# schemathesis' pytest plugin imports its report writers in pytest_sessionfinish, through pytest's
# assertion rewriter (ast.parse). There, after the libp2p tests, CPython 3.11's AST recursion
# counter, shared between threads, now and then raised "SystemError: AST constructor recursion
# depth mismatch", and the run ended with a traceback after every test had passed. They are
# imported now, while this is the only thread. The allure writer cannot import here (no
# allure_commons) and would be compiled again at the end to fail again: it fails at once instead.
try:
    import allure_commons  # noqa: F401
except ImportError:
    sys.modules.setdefault("schemathesis.reporting.allure", None)
with contextlib.suppress(ImportError):
    import schemathesis.reporting.html.writer  # noqa: F401
    import schemathesis.reporting.junitxml  # noqa: F401

_swarms: list[LocalSwarm] = []


@pytest.fixture(scope="session")
def node_popen():
    """How the tests start nodes: forked from an interpreter that has done a node's imports
    (tests/support/node_zygote.py: 4-5 s of CPU less for each of the suite's hundreds of nodes),
    or, with AGORA_TEST_FORK_NODES=0, each as a fresh `python -m node.cli` like the CLI tests'."""
    if os.environ.get("AGORA_TEST_FORK_NODES", "1") == "0":
        yield subprocess.Popen
        return
    from tests.support.node_zygote import NodeZygote

    zygote = NodeZygote({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        yield zygote.popen
    finally:
        zygote.close()


@pytest.fixture
def make_swarm(tmp_path, node_popen):
    """Build LocalSwarms for a test; every node they start is stopped and reaped afterwards."""
    created: list[LocalSwarm] = []

    def factory(config: str, **kwargs) -> LocalSwarm:
        kwargs.setdefault("popen", node_popen)
        swarm = LocalSwarm(str(tmp_path / f"swarm{len(created)}"), config, **kwargs)
        created.append(swarm)
        _swarms.append(swarm)
        return swarm

    yield factory
    for swarm in created:
        swarm.stop_all(timeout_s=20)
        # stop_all ends with a SIGKILL to each node's process group, which the kernel completes
        # asynchronously: wait for the groups to empty instead of sampling them once
        poll_until(lambda: not swarm.survivors(), 5, "every process of the swarm's nodes to exit "
                   "(a node left processes behind)")
        assert swarm.leaked_shared_memory() == [], "a node left /dev/shm segments behind"


@pytest.fixture
def s3():
    """A real S3-compatible server (moto, tests/support/s3.py) for one test. The AWS variables a
    test sets in this process with `apply_env` are put back afterwards."""
    from tests.support.s3 import S3Server

    server = S3Server().start()
    saved = {key: os.environ.get(key) for key in server.env}
    try:
        yield server
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def run_config_path(tmp_path):
    """Write a tiny run config with a unique run id and the given overrides; return its path."""
    from protocol.run_config import dump_run_config, load_run_config

    def write(**overrides) -> str:
        overrides.setdefault("run_id", f"test-{uuid.uuid4().hex[:8]}")
        # held-out evaluation adds forwards on every worker; tests of other things run without it
        # (tests of evaluation, metrics and status ask for it), so the suite's load stays as it was
        overrides.setdefault("evaluation", {"every_steps": 0})
        path = tmp_path / f"{overrides['run_id']}.yaml"
        dump_run_config(load_run_config("tiny", overrides), path)
        return str(path)

    return write


LONGEST_FIRST = (
    "tests/integration/test_averaging.py",
    "tests/integration/test_credentials_lifecycle.py",
    "tests/integration/test_home_router.py",
    "tests/integration/test_export.py",
    "tests/integration/test_stage_skipping.py",
    "tests/integration/test_evidence_swarm.py",
    "tests/integration/test_netlab_scenario.py",
    "tests/integration/test_sparseloco_swarm.py",
    "tests/integration/test_spot_checks.py",
    "tests/integration/test_dashboard.py",
    "tests/integration/test_health_monitor.py",
    "tests/integration/test_node_lifecycle.py",
)
"""The test files that took longest in a clean-clone scripts/test, longest first. scripts/test
hands files to its pytest workers in collection order (--no-loadscope-reorder): these first, then
the other integration and authorizer files, then the unit tests, so that no long file starts last
and runs alone while the other workers have finished."""


def pytest_itemcollected(item):
    """Every test under tests/integration is an integration test, whether or not its file says so:
    scripts/test runs a failed one once more alone, and a file that forgot its `pytestmark` would
    otherwise fail the whole run on one miss of a deadline under load."""
    if item.nodeid.startswith("tests/integration/"):
        item.add_marker(pytest.mark.integration)


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> tuple[int, int]:
        path = item.nodeid.split("::", 1)[0]
        if path in LONGEST_FIRST:
            return 0, LONGEST_FIRST.index(path)
        return (2 if path.startswith("tests/unit/") else 1), 0

    items.sort(key=rank)  # stable: the order within a file, and among the rest, stays


def pytest_runtest_logreport(report):
    """With AGORA_TEST_FINISHED_LOG set (scripts/test), the controlling process writes down each
    test that finished (and each that failed), so the tests a pytest worker never finished can be
    run again without forgetting the failures, and how long each took."""
    path = os.environ.get("AGORA_TEST_FINISHED_LOG")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration
    with open(path, "a", encoding="utf-8") as log:
        if report.failed:
            log.write(f"FAILED {report.nodeid}\n")
        if report.when == "teardown":
            log.write(f"DURATION {_durations.pop(report.nodeid, 0.0):.1f} {report.nodeid}\n")
            log.write(report.nodeid + "\n")


_durations: dict[str, float] = {}
"""Seconds of each running test's setup, call and teardown so far (for the finished log's DURATION
lines: scripts/_slowest_tests.py lists the slowest at the end of scripts/test)."""


def pytest_sessionfinish(session, exitstatus):
    for swarm in _swarms:
        swarm.stop_all(timeout_s=10)
    # torch's shared-memory manager must outlive pytest's own shared tensors: killing it makes
    # torch abort at exit ("Broken pipe", status 134); it leaves by itself.
    leftovers = [p for p in psutil.Process(os.getpid()).children(recursive=True)
                 if p.is_running() and not _is_shm_manager(p)]
    for proc in leftovers:
        try:
            proc.kill()
        except psutil.Error:
            pass


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server in a temporary directory, for the tests' PostgreSQL variants."""
    from authorizer.testing import PostgresServer, postgres_missing

    reason = postgres_missing()
    if reason is not None:
        pytest.skip(f"PostgreSQL variant skipped: {reason}")
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()
