"""From a lie to a revocation with real processes: a worker admitted by a real authorizer cheats
(tests/support/adversary_node.py), a trainer's spot check disagrees, a third replica settles it,
the trainer sends the three signed results to the authorizer, which checks them by itself, bans
the cheater's account, and the revocation reaches the cheater, which leaves. With two replicas a
stage, the trainers' own verdicts carry it there once trainers of two accounts report it."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from authorizer.testing import AuthorizerProcess
from protocol.exit_codes import ExitCode
from tests.support.adversary_node import adversary_prefix
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
ADMIN = "test-admin-token-0123456789"


def _start_authorizer(config: str, tmp_path, *, stage_capacity: int) -> AuthorizerProcess:
    return AuthorizerProcess(
        ["--run-config", config, "--data-dir", str(tmp_path / "authorizer"), "--port", "0",
         "--credential-ttl-s", "600", "--admin-token", ADMIN, "--stage-capacity", str(stage_capacity)],
        log_path=str(tmp_path / "authorizer.log")).start()


def _node_args(authorizer: AuthorizerProcess, account: str) -> list[str]:
    return ["--authorizer", authorizer.url, "--account-token", account]


@pytest.mark.timeout(420)
def test_a_cheater_a_third_replica_convicts_is_revoked_by_the_authorizer_and_leaves(make_swarm, run_config_path,
                                                                                   tmp_path):
    config = run_config_path(stages=TWO_STAGES, run_id=f"evidence-{uuid.uuid4().hex[:6]}",
                             verification={"spot_check_rate": 0.3})
    authorizer = _start_authorizer(config, tmp_path, stage_capacity=3)
    try:
        swarm = make_swarm(None, common_args=["--revocation-refresh-s", "2"])
        honest = [swarm.start("worker", args=_node_args(authorizer, f"honest{i}")) for i in range(5)]
        # wherever it is placed, it lies: a head's or body's outputs x3, a tail's losses x3
        cheater = swarm.start("worker", args=_node_args(authorizer, "mallory"),
                              prefix=adversary_prefix("scale:3", "loss:3"))
        assert sorted(w.stage for w in [*honest, cheater]) == [0, 0, 0, 1, 1, 1], "three replicas a stage"
        trainer = swarm.start("trainer", args=[*_node_args(authorizer, "carol"), "--max-samples", "240",
                                               "--lanes", "4"])
        assert swarm.wait(trainer, 300) == 0, trainer.log_tail()
        summary = trainer.summary()
        checks = summary["spot_checks"]
        assert summary["samples_completed"] == 240, summary
        assert set(checks["excluded"]) == {cheater.peer_id} and checks["evidence"] == {"upheld": 1}, checks
        decided = [d for d in checks["disputes"] if d["struck"]]
        # Every verdict falls on the cheater, and a third replica's re-execution gives some of them.
        # Not all: a tail-loss dispute whose third replica is busy is decided by each tail's losses
        # against its own gradient (the slope test), which puts the same liar in the wrong.
        # In full: a failure must say who was struck and by what (the summary is cut short by pytest).
        assert decided and all(d["struck"] == cheater.peer_id for d in decided) and any(
            d["arbiter"] for d in decided), f"cheater {cheater.peer_id}; decided disputes: {json.dumps(decided)}"
        assert set(checks["strikes_by_mechanism"]) == {cheater.peer_id}, checks["strikes_by_mechanism"]

        # the authorizer's own record: upheld against the cheater, reported by the trainer
        listed = httpx.get(f"{authorizer.url}/v1/admin/evidence", headers={"Authorization": f"Bearer {ADMIN}"},
                           timeout=10)
        assert listed.status_code == 200, listed.text
        reports = listed.json()
        reports = reports.get("reports", reports) if isinstance(reports, dict) else reports
        assert [r["verdict"] for r in reports] == ["upheld"], reports
        assert reports[0]["accused_peer_id"] == cheater.peer_id, reports

        # the revocation spreads: the cheater finds itself banned and leaves; the honest stay
        poll_until(lambda: cheater.proc.poll() is not None, 60, "the revoked cheater to leave")
        assert cheater.proc.returncode == ExitCode.REVOKED, cheater.log_tail()
        assert all(w.proc.poll() is None for w in honest), [w.log_tail() for w in honest if w.proc.poll()]
        again = swarm.start("trainer", args=[*_node_args(authorizer, "dave"), "--max-samples", "40"])
        assert swarm.wait(again, 120) == 0 and again.summary()["samples_completed"] == 40
        assert again.summary()["spot_checks"]["disputed"] == 0
    finally:
        authorizer.stop()


@pytest.mark.timeout(480)
def test_with_two_replicas_a_stage_trainers_of_two_accounts_get_the_cheater_revoked(make_swarm, run_config_path,
                                                                                     tmp_path):
    """No third replica: each trainer's loss measurements convict the liar, each trainer reports the
    pair's contradiction when it excludes it, and the second report (another account) reaches the
    authorizer's quorum of two: the account is banned and the liar leaves."""
    config = run_config_path(stages=TWO_STAGES, run_id=f"evidence2-{uuid.uuid4().hex[:6]}",
                             verification={"spot_check_rate": 0.3})
    authorizer = _start_authorizer(config, tmp_path, stage_capacity=2)
    try:
        swarm = make_swarm(None, common_args=["--revocation-refresh-s", "2"])
        honest = [swarm.start("worker", args=_node_args(authorizer, f"honest{i}")) for i in range(3)]
        cheater = swarm.start("worker", args=_node_args(authorizer, "mallory"),
                              prefix=adversary_prefix("scale:3", "loss:3"))
        assert sorted(w.stage for w in [*honest, cheater]) == [0, 0, 1, 1], "two replicas a stage"
        trainers = [swarm.start("trainer", args=[*_node_args(authorizer, name), "--max-samples", "200",
                                                 "--lanes", "4"]) for name in ("carol", "dave")]
        for trainer in trainers:
            assert swarm.wait(trainer, 360) == 0, trainer.log_tail()
        verdicts = []
        for trainer in trainers:
            checks = trainer.summary()["spot_checks"]
            assert set(checks["excluded"]) == {cheater.peer_id}, checks
            verdicts += list(checks["evidence"])
        assert sorted(verdicts) in (["pending", "upheld"], ["already_revoked", "upheld"]), verdicts

        listed = httpx.get(f"{authorizer.url}/v1/admin/evidence", headers={"Authorization": f"Bearer {ADMIN}"},
                           timeout=10).json()["reports"]
        assert {r["accused_peer_id"] for r in listed} == {cheater.peer_id}, listed
        assert "upheld" in [r["verdict"] for r in listed] and all(len(r["witness_peer_ids"]) == 1 for r in listed)
        poll_until(lambda: cheater.proc.poll() is not None, 60, "the revoked cheater to leave")
        assert cheater.proc.returncode == ExitCode.REVOKED, cheater.log_tail()
        assert all(w.proc.poll() is None for w in honest), [w.log_tail() for w in honest if w.proc.poll()]
    finally:
        authorizer.stop()
