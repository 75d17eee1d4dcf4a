"""The tests' node zygote (tests/support/node_zygote.py): a forked child behaves as the process
`python -m MODULE ARGS` would, as far as the launcher can see: its stdout, stderr, environment,
working directory, network namespace, exit code and death by signal."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import uuid

import pytest

from tests.support.node_zygote import PRELOADED, NodeZygote, ZygoteChild
from tests.support.polling import poll_until


def test_every_preloaded_module_exists():
    assert [name for name in PRELOADED if importlib.util.find_spec(name) is None] == []


def test_only_plain_module_runs_are_forked():
    python = sys.executable
    assert NodeZygote.forkable([python, "-m", "node.cli", "--role", "worker"]) == \
        (["node.cli", "--role", "worker"], {}, None)
    assert NodeZygote.forkable(["env", "PYTHONPATH=/x", "A=b=c", python, "-m", "m", "--", python]) == \
        (["m", "--", python], {"PYTHONPATH": "/x", "A": "b=c"}, None)
    assert NodeZygote.forkable(["ip", "netns", "exec", "ns1", python, "-m", "node.cli"]) == (["node.cli"], {}, "ns1")
    assert NodeZygote.forkable(["ip", "netns", "exec", "ns1", "sh", "-c", "x"]) is None
    assert NodeZygote.forkable(["/usr/bin/python3", "-m", "node.cli"]) is None
    assert NodeZygote.forkable([python, "script.py"]) is None


@pytest.fixture(scope="module")
def zygote():
    zygote = NodeZygote(preload=())
    yield zygote
    zygote.close()


def _run(zygote, tmp_path, args: list[str], env: dict[str, str] | None = None) -> tuple[ZygoteChild, str]:
    err_path = tmp_path / "stderr.log"
    with open(err_path, "w") as err:
        child = zygote.popen([sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=err, text=True,
                             env={**os.environ, **(env or {})}, start_new_session=True)
    assert isinstance(child, ZygoteChild), "forked, not started afresh"
    return child, str(err_path)


def test_a_forked_run_has_its_own_output_environment_and_exit_code(zygote, tmp_path):
    code = "import os, sys; print(os.environ['PROBE'], os.getcwd(), os.getpgid(0) == os.getpid()); sys.exit(7)"
    child, err = _run(zygote, tmp_path, ["tests.support.zygote_probe", code], env={"PROBE": "seen"})
    assert child.wait(30) == 7
    out = child.stdout.read().split()
    assert out[:3] == ["seen", os.getcwd(), "True"], out  # its environment, our directory, its own session
    assert child.pid != os.getpid() and child.poll() == 7


def test_an_uncaught_exception_prints_a_traceback_and_exits_1(zygote, tmp_path):
    child, err = _run(zygote, tmp_path, ["tests.support.zygote_probe", "raise ValueError('boom')"])
    assert child.wait(30) == 1
    with open(err) as f:
        assert "ValueError: boom" in f.read()


def test_a_signal_ends_it_as_popen_reports(zygote, tmp_path):
    code = "import time; print('up', flush=True); time.sleep(60)"
    child, _ = _run(zygote, tmp_path, ["tests.support.zygote_probe", code])
    assert child.stdout.readline().strip() == "up"
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.1)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == -signal.SIGTERM
    poll_until(lambda: not os.path.exists(f"/proc/{child.pid}"), 10, "the child reaped")


def test_each_child_has_its_own_hivemind_locks(tmp_path):
    """hivemind creates process-wide locks at import; forked children of one zygote must not share
    them, or one node killed while holding one blocks every other (as it did before the reset)."""
    zygote = NodeZygote(preload=("hivemind",))
    try:
        hold = ("from hivemind.utils.mpfuture import MPFuture; import time; MPFuture._update_lock.acquire(); "
                "print('held', flush=True); time.sleep(60)")
        holder, _ = _run(zygote, tmp_path, ["tests.support.zygote_probe", hold])
        assert holder.stdout.readline().strip() == "held"
        take = ("from hivemind.utils.mpfuture import MPFuture; import sys; "
                "sys.exit(0 if MPFuture._update_lock.acquire(timeout=5) else 9)")
        taker, _ = _run(zygote, tmp_path, ["tests.support.zygote_probe", take])
        assert taker.wait(60) == 0, "the second child waited on the first child's lock"
        holder.kill()
        assert holder.wait(30) == -signal.SIGKILL
    finally:
        zygote.close()


@pytest.fixture
def netns():
    """A network namespace of its own (`ip netns add`), deleted afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    name = f"agora-zt-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    yield name
    subprocess.run(["ip", "netns", "delete", name], check=False)


def test_a_run_behind_ip_netns_exec_is_forked_into_that_namespace(zygote, tmp_path, netns):
    code = "import os; print(os.stat('/proc/self/ns/net').st_ino)"
    with open(tmp_path / "stderr.log", "w") as err:
        child = zygote.popen(["ip", "netns", "exec", netns, sys.executable, "-m", "tests.support.zygote_probe", code],
                             stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    assert isinstance(child, ZygoteChild), "forked, not started afresh"
    assert child.wait(30) == 0
    assert int(child.stdout.read()) == os.stat(f"/run/netns/{netns}").st_ino != os.stat("/proc/self/ns/net").st_ino

    with open(tmp_path / "stderr.log", "w") as err:
        missing = zygote.popen(["ip", "netns", "exec", netns + "-gone", sys.executable, "-m",
                                "tests.support.zygote_probe", "print('ran')"],
                               stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
    assert missing.wait(30) == 1 and missing.stdout.read() == ""
    assert f"{netns}-gone" in (tmp_path / "stderr.log").read_text()
