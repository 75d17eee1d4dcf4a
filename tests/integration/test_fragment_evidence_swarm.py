"""From a signed SparseLoCo lie to a revocation with real processes: three replicas of stage 0 average
with SparseLoCo under a real authorizer, one of them (tests/support/adversary_node.py,
`sloco_scale:1000`) sends its pseudo-gradient fragment 1000 times too large, signed. The two honest
replicas refuse it for its norm, report it with their own fragments as witnesses, the authorizer
checks the evidence by itself and bans the liar's account, and the revocation reaches the liar,
which leaves; the honest replicas train on."""

from __future__ import annotations

import signal
import uuid

import httpx
import pytest

from protocol.exit_codes import ExitCode
from tests.integration.test_evidence_swarm import ADMIN, TWO_STAGES, _node_args, _start_authorizer
from tests.support.adversary_node import adversary_prefix
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TARGET, H, STEPS = 16, 5, 15


@pytest.mark.timeout(300)
def test_a_replica_that_signs_a_poisoned_fragment_is_revoked_on_its_peers_evidence(make_swarm, run_config_path,
                                                                                  tmp_path):
    config = run_config_path(stages=TWO_STAGES, target_batch_size=TARGET, run_id=f"fragments-{uuid.uuid4().hex[:6]}",
                             averaging={"method": "sparseloco",
                                        "sparseloco": {"inner_steps": H, "round_timeout_s": 15.0}})
    authorizer = _start_authorizer(config, tmp_path, stage_capacity=3)
    try:
        policy = httpx.patch(f"{authorizer.url}/v1/admin/policy", json={"honor_stage_preference": True},
                             headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
        assert policy.status_code == 200, policy.text
        swarm = make_swarm(None, common_args=["--revocation-refresh-s", "2", "--announce-period-s", "1"])
        honest = [swarm.start("worker", stage=0, name=f"honest-{i}", wait_ready=False,
                              args=_node_args(authorizer, f"honest{i}")) for i in range(2)]
        liar = swarm.start("worker", stage=0, name="liar", wait_ready=False, args=_node_args(authorizer, "mallory"),
                           prefix=adversary_prefix("sloco_scale:1000"))
        tail = swarm.start("worker", stage=1, name="tail", wait_ready=False, args=_node_args(authorizer, "tailor"))
        for worker in (*honest, liar, tail):
            swarm.wait_ready(worker)
        assert [w.stage for w in (*honest, liar, tail)] == [0, 0, 0, 1]
        trainer = swarm.start("trainer", args=[*_node_args(authorizer, "carol"), "--lanes", "6", "--max-samples",
                                               str(STEPS * TARGET), "--discovery-period-s", "1"])

        # the revocation spreads: the liar finds itself banned and leaves; the honest stay
        poll_until(lambda: liar.proc.poll() is not None, 200, "the revoked liar to leave")
        assert liar.proc.returncode == ExitCode.REVOKED, liar.log_tail()
        assert swarm.wait(trainer, 200) == 0, trainer.log_tail()

        listed = httpx.get(f"{authorizer.url}/v1/admin/evidence", headers={"Authorization": f"Bearer {ADMIN}"},
                           timeout=10).json()["reports"]
        assert listed and {r["accused_peer_id"] for r in listed} == {liar.peer_id}, listed
        assert all(r["kind"] == "fragment" and r["stage"] == 0 for r in listed), listed
        assert [r["verdict"] for r in listed].count("upheld") == 1, listed
        assert {r["verdict"] for r in listed} <= {"upheld", "already_revoked"}, listed
        assert {r["reporter_peer_id"] for r in listed} <= {w.peer_id for w in honest}, listed

        verdicts = []
        for worker in honest:
            assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
            slc = worker.summary()["sparseloco"]
            assert list(slc["refused_senders"]) == [liar.peer_id], slc
            verdicts += [verdict for verdict, n in slc["evidence"].items() for _ in range(n)]
        assert sorted(verdicts) == sorted(r["verdict"] for r in listed), (verdicts, listed)
        with open(liar.log_path) as log:
            assert "adversary: altered 1 samples (sloco_scale:1000)" in log.read()
    finally:
        authorizer.stop()
