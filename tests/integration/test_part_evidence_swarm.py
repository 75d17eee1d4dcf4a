"""From a sealed AsyncSPARTA lie to a revocation with real processes: three replicas of stage 0
average with AsyncSPARTA on the idle clock under a real authorizer, two honest reducers and a
sender (tests/support/adversary_node.py, `spart_scale:1000`) whose every all-reduce part is 1000
times too large, sealed with its key. The reducers refuse its parts for their norm, report them
with their own and each other's parts as witnesses, the authorizer checks the evidence by itself
and bans the liar's account, and the revocation reaches the liar, which leaves; the honest
replicas average on."""

from __future__ import annotations

import signal
import uuid

import httpx
import pytest

from protocol.exit_codes import ExitCode
from tests.integration.test_averaging import IDLE_ROUNDS
from tests.integration.test_evidence_swarm import ADMIN, TWO_STAGES, _node_args, _start_authorizer
from tests.support.adversary_node import adversary_prefix
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration


@pytest.mark.timeout(240)
def test_a_replica_that_seals_poisoned_parts_is_revoked_on_its_reducers_evidence(make_swarm, run_config_path,
                                                                                 tmp_path):
    config = run_config_path(stages=TWO_STAGES, run_id=f"parts-{uuid.uuid4().hex[:6]}", averaging=IDLE_ROUNDS)
    authorizer = _start_authorizer(config, tmp_path, stage_capacity=3)
    try:
        policy = httpx.patch(f"{authorizer.url}/v1/admin/policy", json={"honor_stage_preference": True},
                             headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert policy.status_code == 200, policy.text
        swarm = make_swarm(None, common_args=["--revocation-refresh-s", "2", "--announce-period-s", "1"])
        honest = [swarm.start("worker", stage=0, name=f"honest-{i}", wait_ready=False,
                              args=[*_node_args(authorizer, f"honest{i}"), "--reducer"]) for i in range(2)]
        for worker in honest:
            swarm.wait_ready(worker)
        liar = swarm.start("worker", stage=0, name="liar", args=_node_args(authorizer, "mallory"),
                           prefix=adversary_prefix("spart_scale:1000"))
        assert [w.stage for w in (*honest, liar)] == [0, 0, 0]

        # once its sync phases are over, its parts count: refused, reported, banned, revoked
        poll_until(lambda: liar.proc.poll() is not None, 150, "the revoked liar to leave")
        assert liar.proc.returncode == ExitCode.REVOKED, liar.log_tail()

        listed = httpx.get(f"{authorizer.url}/v1/admin/evidence", headers={"Authorization": f"Bearer {ADMIN}"},
                           timeout=10).json()["reports"]
        assert listed and {r["accused_peer_id"] for r in listed} == {liar.peer_id}, listed
        assert all(r["kind"] == "part" and r["stage"] == 0 for r in listed), listed
        assert [r["verdict"] for r in listed].count("upheld") == 1, listed
        assert {r["verdict"] for r in listed} <= {"upheld", "already_revoked"}, listed
        assert {r["reporter_peer_id"] for r in listed} <= {w.peer_id for w in honest}, listed
        assert all(r["distances"][0] > 100 for r in listed), listed

        verdicts = []
        for worker in honest:
            assert worker.proc.poll() is None, worker.log_tail()
            assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
            averaging = worker.summary()["averaging"]
            rejected = [r["rejected_senders"] for r in averaging["rounds"] if r.get("rejected_senders")]
            assert rejected and all(set(r) == {liar.peer_id} and "norm" in r[liar.peer_id] for r in rejected), rejected
            verdicts += [verdict for verdict, n in averaging["evidence"].items() for _ in range(n)]
        assert sorted(verdicts) == sorted(r["verdict"] for r in listed), (verdicts, listed)
        with open(liar.log_path) as log:
            assert "adversary: altered 1 samples (spart_scale:1000)" in log.read()
    finally:
        authorizer.stop()
