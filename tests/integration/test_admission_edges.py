"""Admission at its edges, with real processes: a node the run's owner bans learns it from the
revocation list, says so in one line and exits 5 within one refresh, leaving nothing behind in
the temp directory."""

from __future__ import annotations

import glob
import os
import tempfile
import time
import uuid

import httpx
import pytest

from protocol.exit_codes import ExitCode
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

ADMIN = "edges-admin-token-0123456789"


@pytest.mark.timeout(180)
def test_banned_trainer_says_so_and_exits_5(make_swarm, run_config_path, tmp_path):
    config = run_config_path(run_id=f"edges-{uuid.uuid4().hex[:6]}")
    swarm = make_swarm(None)
    authorizer = swarm.start_authorizer([
        "--run-config", config, "--data-dir", str(tmp_path / "authorizer"), "--port", "0", "--admin-token", ADMIN,
        "--checks", "capability,integrity,reachability"])
    trainer = swarm.start("trainer", args=["--authorizer", authorizer.url, "--revocation-refresh-s", "1"])
    trust_dirs = poll_until(lambda: glob.glob(os.path.join(tempfile.gettempdir(), f"agora-trust-{trainer.pid}-*")),
                            10, "the trainer's trust directory")

    response = httpx.post(f"{authorizer.url}/v1/admin/bans", json={"peer_id": trainer.peer_id, "reason": "test"},
                          headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert response.status_code == 200 and response.json()["ended_tickets"] == 1, response.text
    banned_at = time.monotonic()
    assert swarm.wait(trainer, 60) == ExitCode.REVOKED, trainer.log_tail(40)
    took_s = time.monotonic() - banned_at
    assert took_s < 15, f"exit took {took_s:.1f} s"  # one refresh (1 s) plus the trainer's drain

    with open(trainer.log_path, errors="replace") as log:
        lines = log.read().splitlines()
    banned = [line for line in lines if "banned" in line]
    assert len(banned) == 1, "\n".join(banned)
    assert f"peer {trainer.peer_id} is banned" in banned[0] and "exit code 5" in banned[0]
    assert not any("Traceback" in line for line in lines), "\n".join(lines[-40:])
    assert not any(os.path.exists(d) for d in trust_dirs), "the trust directory was left behind"
    print(f"banned trainer exited 5 after {took_s:.1f} s")
