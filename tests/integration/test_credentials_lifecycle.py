"""A node's credential over time: renewed at two thirds of its life, kept through an authorizer
outage by retrying, and the node stops with its documented exit code when renewal is refused."""

from __future__ import annotations

import signal
import uuid

import httpx
import pytest

from node.admission import EXIT_RENEWAL_REFUSED
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

ADMIN = "lifecycle-admin-token-0123456789"


def _wait_for_log(node, text: str, count: int, timeout_s: float) -> None:
    """Wait until `node` logged `text` `count` times; fail at once if it exits first."""
    def logged() -> bool:
        with open(node.log_path, errors="replace") as f:
            if f.read().count(text) >= count:
                return True
        assert node.proc.poll() is None, f"{node.name} exited (code {node.proc.returncode})"
        return False

    try:
        poll_until(logged, timeout_s, f"{node.name} to log {text!r} {count}x", period_s=0.25)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{node.log_tail()}") from None


@pytest.mark.timeout(330)
def test_renewal_outage_and_refusal(make_swarm, run_config_path, tmp_path):
    config = run_config_path(run_id=f"life-{uuid.uuid4().hex[:6]}")
    swarm = make_swarm(None)
    data = str(tmp_path / "authorizer")
    # 60 s credentials: after the outage is seen, a restarted authorizer has about 20 s to come up.
    # It is forked from the tests' zygote (tests/support/node_zygote.py) and ready in a few seconds;
    # started from scratch, CI's loaded machine once took longer than 20 s (90 s then).
    args = ["--run-config", config, "--data-dir", data, "--credential-ttl-s", "60", "--admin-token", ADMIN,
            "--checks", "capability,integrity,reachability"]
    authorizer = swarm.start_authorizer([*args, "--port", "0"])
    worker = swarm.start("worker", args=["--authorizer", authorizer.url])

    _wait_for_log(worker, "credential renewed", 1, 70)  # at 2/3 of 60 s
    swarm.stop(authorizer, signal.SIGKILL)
    _wait_for_log(worker, "retrying renewal", 1, 70)  # the next renewal meets the outage
    assert worker.proc.poll() is None, "the node rides out the outage while its credential is valid"
    # The same command without --port: the port bound at the first start is kept in the data dir.
    restarted = swarm.start_authorizer(args, name="authorizer-restarted")
    assert restarted.url == authorizer.url, "a restarted authorizer serves the same URL"
    _wait_for_log(worker, "credential renewed", 2, 40)  # so the root key is the same one

    response = httpx.post(f"{authorizer.url}/v1/admin/bans", json={"peer_id": worker.peer_id, "reason": "test"},
                          headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert response.status_code == 200, response.text
    assert swarm.wait(worker, 60) == EXIT_RENEWAL_REFUSED
    assert "this node was banned" in worker.log_tail()  # by renewal or by the revocation list, whichever is first
