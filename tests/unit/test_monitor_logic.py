"""The health monitor's decisions on hand-made observations: gone detection, progress counted
once, reconciliation against admissions, alerts raised and resolved."""

from __future__ import annotations

from authorizer.monitor.health import (
    EVENT_HOLD_S, STALL_INTERVALS, STALL_MIN_S, AlertBook, Condition, admission_conditions, averaging_conditions,
    loss_conditions, memory_conditions, rejection_conditions, replica_conditions, stage_summaries, stall_conditions,
)
from authorizer.monitor.membership import NodeState, Placement, is_stale, update_membership
from authorizer.monitor.observation import Observation, Sighting
from authorizer.monitor.progress import count_progress, run_eval, run_loss
from protocol.dht_schema import AveragingRecord, ProgressRecord, RoundSummaryRecord, TrainerRecord, WorkerRecord
from protocol.records import RecordRejection

PEER = "12D3KooWPeerAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
OTHER = "12D3KooWPeerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB"


def worker_sighting(peer: str, stage: int, expiration: float, *, phase: str = "active", step: int = 0,
                    rss: int | None = None, total: int | None = None) -> Sighting:
    return Sighting(peer, "worker", stage, expiration,
                    worker=WorkerRecord(stage=stage, max_batch=8, throughput=2.0, phase=phase, host_rss_bytes=rss,
                                        host_memory_total_bytes=total),
                    progress=ProgressRecord(local_step=step, samples_accumulated=0, time=0.0, samples_consumed=step * 8))


def observe(t: float, *sightings: Sighting, complete: bool = True, tombstoned=(), rejections=()) -> Observation:
    return Observation(t=t, sightings={s.peer_id: s for s in sightings}, complete=complete,
                       tombstoned=set(tombstoned), rejections=list(rejections))


def report(samples: int, tokens: int, t: float, first_loss: float | None = 5.0, loss: float = 4.0) -> TrainerRecord:
    return TrainerRecord(samples_completed=samples, samples_dropped=0, tokens=tokens, first_loss=first_loss,
                         recent_loss=loss, time=t)


# ---- membership ----


def test_a_refreshed_node_stays_present_and_a_silent_one_is_gone_after_two_missed_refreshes():
    nodes: dict[str, NodeState] = {}
    ttl = 3.0  # announcer: TTL of three 1 s periods
    for t in (100.0, 101.0, 102.0):
        update_membership(nodes, observe(t, worker_sighting(PEER, 0, t + ttl)), None)
        assert nodes[PEER].present and nodes[PEER].last_seen == t
    stored = 102.0  # the node dies right after this refresh; its record lives until 105
    update_membership(nodes, observe(104.0, worker_sighting(PEER, 0, stored + ttl)), None)
    assert nodes[PEER].present, "one missed refresh is not enough"
    changed, samples = update_membership(nodes, observe(105.5, worker_sighting(PEER, 0, stored + ttl)), None)
    assert nodes[PEER].state == "gone" and nodes[PEER].gone_at == 105.5 and nodes[PEER].last_seen == 102.0
    assert changed == [nodes[PEER]] and samples == []
    assert is_stale(stored + ttl, ttl, stored + 2 * ttl / 3 + 1.01) and not is_stale(stored + ttl, ttl, stored + 2.9)


def test_an_expired_or_withdrawn_record_means_gone_but_a_failed_read_proves_nothing():
    nodes: dict[str, NodeState] = {}
    update_membership(nodes, observe(10.0, worker_sighting(PEER, 0, 25.0), worker_sighting(OTHER, 1, 25.0)), None)
    update_membership(nodes, observe(12.0, complete=False), None)
    assert nodes[PEER].present and nodes[OTHER].present
    update_membership(nodes, observe(14.0, worker_sighting(OTHER, 1, 29.0), tombstoned={PEER}), None)
    assert nodes[PEER].state == "gone" and nodes[PEER].phase == "left" and nodes[OTHER].present
    update_membership(nodes, observe(16.0), None)
    assert nodes[OTHER].state == "gone" and nodes[OTHER].gone_at == 16.0
    # history stays, and a node that comes back is present again
    update_membership(nodes, observe(18.0, worker_sighting(OTHER, 1, 33.0)), None)
    assert nodes[OTHER].present and nodes[OTHER].gone_at is None and nodes[OTHER].first_seen == 10.0


def test_admitted_flag_follows_the_admissions_when_known():
    nodes: dict[str, NodeState] = {}
    update_membership(nodes, observe(1.0, worker_sighting(PEER, 0, 20.0)), {PEER: Placement("worker", 0)})
    assert nodes[PEER].admitted
    update_membership(nodes, observe(2.0, worker_sighting(PEER, 0, 21.0)), {})
    assert not nodes[PEER].admitted
    update_membership(nodes, observe(3.0, worker_sighting(PEER, 0, 22.0)), None)
    assert not nodes[PEER].admitted, "unknown admissions leave the flag as it was"


# ---- progress ----


def test_progress_is_counted_once_however_often_a_report_is_read():
    cursors: dict = {}
    assert (count_progress(cursors, {PEER: report(10, 100, 1.0)}).samples, cursors[PEER].samples) == (10, 10)
    again = count_progress(cursors, {PEER: report(10, 100, 1.0)})
    assert (again.samples, again.tokens, again.cursors) == (0, 0, [])
    later = count_progress(cursors, {PEER: report(25, 250, 2.0), OTHER: report(5, 50, 2.0)})
    assert (later.samples, later.tokens) == (15 + 5, 150 + 50)
    older = count_progress(cursors, {PEER: report(20, 200, 1.5)})  # a stale replica's older report
    assert older.samples == 0 and cursors[PEER].samples == 25


def test_a_restarted_trainer_process_starts_a_new_baseline():
    cursors: dict = {}
    count_progress(cursors, {PEER: report(40, 400, 1.0)})
    restarted = count_progress(cursors, {PEER: report(3, 30, 2.0)})  # counters went down: a new process
    assert (restarted.samples, restarted.tokens, cursors[PEER].process) == (3, 30, 2)
    # the first-loss mean moves while a trainer's first samples complete: not a new process
    count_progress(cursors, {PEER: report(5, 50, 3.0, first_loss=6.0)})
    same = count_progress(cursors, {PEER: report(9, 90, 4.0, first_loss=5.5)})
    assert (same.samples, cursors[PEER].process) == (4, 2)


def test_a_restarted_monitor_resumes_from_its_cursors():
    cursors: dict = {}
    first = count_progress(cursors, {PEER: report(10, 100, 1.0)})
    resumed = {peer: cursor for peer, cursor in cursors.items()}  # what the database hands back
    second = count_progress(resumed, {PEER: report(18, 180, 2.0)})
    assert first.samples + second.samples == 18


def test_run_loss_is_the_mean_of_present_trainers():
    reports = {PEER: report(1, 1, 1.0, loss=2.0), OTHER: report(1, 1, 1.0, loss=4.0)}
    assert run_loss(reports, {PEER, OTHER}) == 3.0 and run_loss(reports, {PEER}) == 2.0
    assert run_loss(reports, set()) is None


def test_run_eval_is_the_latest_heldout_loss_of_a_present_trainer():
    old = report(10, 100, 1.0).model_copy(update={"eval_loss": 4.5, "eval_step": 20})
    new = report(10, 100, 1.0).model_copy(update={"eval_loss": 4.0, "eval_step": 40, "eval_stderr": 0.03})
    plain = report(10, 100, 1.0)
    assert run_eval({PEER: old, OTHER: new}, {PEER, OTHER}) == (4.0, 40, 0.03)
    assert run_eval({PEER: old, OTHER: new}, {PEER}) == (4.5, 20, None), "a trainer no longer present does not count"
    assert run_eval({PEER: plain}, {PEER}) == (None, None, None), "no trainer evaluated (yet)"
    broken = new.model_copy(update={"eval_loss": float("nan")})
    assert run_eval({PEER: old, OTHER: broken}, {PEER, OTHER}) == (4.5, 20, None)


# ---- health checks ----


def test_forged_trainer_reports_and_unplanned_stages_come_from_rejections():
    rejections = [
        RecordRejection(at=1.0, key="run/trainers", peer_id=PEER, reason="wrong_role", role="worker", stage=0),
        RecordRejection(at=1.0, key="run/stage/1/workers", peer_id=PEER, reason="wrong_stage", role="worker", stage=0),
        RecordRejection(at=1.0, key="run/stage/0/workers", peer_id=OTHER, reason="bad_signature"),
    ]
    found = {(c.kind, c.subject): c for c in rejection_conditions(observe(1.0, rejections=rejections))}
    assert set(found) == {("forged_trainer_report", PEER), ("unplanned_stage", PEER)}
    assert "stage 1" in found[("unplanned_stage", PEER)].message and "placed on stage 0" in \
        found[("unplanned_stage", PEER)].message


def test_admissions_reconcile_present_nodes():
    obs = observe(5.0, worker_sighting(PEER, 1, 20.0), worker_sighting(OTHER, 0, 20.0))
    nodes: dict[str, NodeState] = {}
    update_membership(nodes, obs, None)
    found = {(c.kind, c.subject) for c in admission_conditions(obs, nodes, {PEER: Placement("worker", 0)})}
    assert found == {("unplanned_stage", PEER), ("not_admitted", OTHER)}
    assert admission_conditions(obs, nodes, None) == [], "no admissions table, nothing to reconcile"


def test_stage_summaries_and_the_stage_checks():
    nodes: dict[str, NodeState] = {}
    rounds = [RoundSummaryRecord(kind="step", round=i, segment=0, digest="d", status="failed" if i % 4 else "complete",
                                 group_size=2, expected_group_size=2, duration_s=1.0, weight=1.0, finished_at=50.0 + i)
              for i in range(8)]
    sighting = worker_sighting(PEER, 0, 30.0, step=7)
    sighting.averaging = AveragingRecord(rounds_complete=2, rounds_failed=6, recent=rounds)
    update_membership(nodes, observe(10.0, sighting, worker_sighting(OTHER, 0, 30.0, phase="weight_sync", step=3)),
                      None)
    stages = stage_summaries(nodes, 2, [1, 1])
    assert stages[0]["replicas"] == 2 and stages[0]["phases"]["active"] == 1 and stages[0]["phases"]["weight_sync"] == 1
    assert stages[0]["step"] == 7 and stages[0]["throughput"] == 4.0
    assert stages[0]["averaging"]["success_rate"] == 0.25 and stages[0]["averaging"]["last_round_at"] == 57.0
    assert stages[1]["replicas"] == 0 and stages[1]["step"] is None
    assert {c.subject for c in replica_conditions(stages, started=True)} == {"stage 1"}
    assert replica_conditions(stages, started=False) == []
    assert [c.subject for c in averaging_conditions(stages)] == ["stage 0"]
    assert [c.subject for c in stall_conditions(stages, {0: (STALL_INTERVALS, STALL_MIN_S)}, trainers=1)] == ["stage 0"]
    assert stall_conditions(stages, {0: (STALL_INTERVALS, STALL_MIN_S)}, trainers=0) == []
    assert stall_conditions(stages, {0: (STALL_INTERVALS - 1, STALL_MIN_S)}, trainers=1) == []
    assert stall_conditions(stages, {0: (STALL_INTERVALS, STALL_MIN_S - 1)}, trainers=1) == []


def test_loss_divergence_and_memory_pressure():
    assert loss_conditions([3.0, 2.0, 1.5, 1.4, 1.3], best=1.3) == []
    assert [c.kind for c in loss_conditions([1.0, 1.1, 1.2, 1.3, 2.5], best=1.0)] == ["diverging_loss"]
    assert loss_conditions([2.5, 2.4, 2.3, 2.2, 2.1], best=1.0) == [], "high but falling is not diverging"
    nodes: dict[str, NodeState] = {}
    update_membership(nodes, observe(1.0, worker_sighting(PEER, 0, 20.0, rss=95, total=100),
                                     worker_sighting(OTHER, 0, 20.0, rss=50, total=100)), None)
    assert [c.subject for c in memory_conditions(nodes)] == [PEER]


def test_alerts_are_raised_once_refreshed_and_resolved():
    book = AlertBook([])
    stalled = Condition("stalled", "stage 0", "stage 0 stalled")
    raised, refreshed, resolved = book.apply([stalled], 10.0)
    assert [a.kind for a in raised] == ["stalled"] and raised[0].severity == "critical" and not refreshed
    raised, refreshed, resolved = book.apply([stalled], 12.0)
    assert not raised and refreshed[0].last_at == 12.0 and refreshed[0].first_at == 10.0
    raised, refreshed, resolved = book.apply([], 14.0)
    assert [a.resolved_at for a in resolved] == [14.0] and not book.active


def test_event_alerts_stay_active_for_the_hold_time():
    book = AlertBook([])
    forged = Condition("forged_trainer_report", PEER, "forged")
    book.apply([forged], 100.0)
    assert book.apply([], 100.0 + EVENT_HOLD_S - 1)[2] == []
    assert [a.kind for a in book.apply([], 100.0 + EVENT_HOLD_S)[2]] == ["forged_trainer_report"]


# ---- the validator's rejection log and witness (protocol/records.py) ----


def test_the_validator_logs_rejections_with_the_credential_and_witnesses_trainer_reports(tmp_path):
    import asyncio
    import time as _time

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from hivemind.dht.routing import DHTID
    from hivemind.dht.validation import DHTRecord
    from hivemind.utils import MSGPackSerializer

    from protocol.auth_state import SharedAuthState
    from protocol.codec import unpack
    from protocol.credentials import Credential, root_public_key_bytes, sign_credential
    from protocol.dht_schema import schema_for_run, trainers_key, workers_key
    from protocol.identity import load_or_create_identity
    from protocol.records import SignedRecordValidator, drain_observations

    run, root = "records-run", Ed25519PrivateKey.generate()

    def node(name: str, role: str, stage):
        identity = load_or_create_identity(str(tmp_path / f"{name}.key"))
        state = SharedAuthState(str(tmp_path / name), run_id=run, root_public_key=root_public_key_bytes(root))
        now = int(_time.time())
        state.publish_credential(sign_credential(root, Credential(
            run_id=run, peer_id=identity.peer_id.to_base58(), public_key=identity.public_key, role=role, stage=stage,
            issued_at=now, expires_at=now + 600, serial=1)))
        return identity, SignedRecordValidator(identity, schema_for_run(run, 2), run_id=run, auth=state)

    def signed(identity, validator, key: str, value: dict) -> DHTRecord:
        record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(identity.peer_id.to_base58()),
                           MSGPackSerializer.dumps(value), _time.time() + 30)
        return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)

    worker, worker_validator = node("worker", "worker", 0)
    trainer, trainer_validator = node("trainer", "trainer", None)
    monitor_identity, monitor = node("monitor", "monitor", None)
    monitor.witness = True
    value = report(12, 120, _time.time()).model_dump(mode="json")
    assert monitor.validate(signed(trainer, trainer_validator, trainers_key(run), value))
    assert not monitor.validate(signed(worker, worker_validator, trainers_key(run), value))
    assert not monitor.validate(signed(worker, worker_validator, workers_key(run, 1),
                                       WorkerRecord(stage=1, max_batch=4, throughput=1.0).model_dump(mode="json")))
    assert not monitor.validate(signed(monitor_identity, monitor, workers_key(run, 0),
                                       WorkerRecord(stage=0, max_batch=4, throughput=1.0).model_dump(mode="json")))
    drained = asyncio.run(drain_observations(None, None, token=monitor.token))
    found = [(r["key"], r["peer_id"], r["reason"], r["role"], r["stage"]) for r in drained["rejections"]]
    assert found == [
        (trainers_key(run), worker.peer_id.to_base58(), "wrong_role", "worker", 0),
        (workers_key(run, 1), worker.peer_id.to_base58(), "wrong_stage", "worker", 0),
        (workers_key(run, 0), monitor_identity.peer_id.to_base58(), "wrong_role", "monitor", None),
    ]
    witnessed = drained["trainer_reports"][trainer.peer_id.to_base58()][1]
    assert TrainerRecord.model_validate(unpack(witnessed)).samples_completed == 12
    assert asyncio.run(drain_observations(None, None, token=monitor.token))["rejections"] == [], "drained once"


def test_a_worker_that_announces_only_relayed_addresses_is_marked_as_reached_through_a_relay():
    relay = "/ip4/198.51.100.4/tcp/4001/p2p/12D3KooWJuPgSpvLGMwJrtHkVTZswJgm4m6v52iyyocHMr5VFDJc"
    home = worker_sighting(PEER, 1, 120.0)
    home.worker = home.worker.model_copy(update={"maddrs": [f"{relay}/p2p-circuit/p2p/{PEER}"],
                                                  "relayed_bytes": 123456})
    public = worker_sighting(OTHER, 1, 120.0)
    public.worker = public.worker.model_copy(update={"maddrs": [f"/ip4/203.0.113.7/tcp/31337/p2p/{OTHER}"]})
    nodes: dict[str, NodeState] = {}
    update_membership(nodes, observe(100.0, home, public), None)
    assert nodes[PEER].relayed is True and nodes[PEER].relayed_bytes == 123456
    assert nodes[OTHER].relayed is False and nodes[OTHER].relayed_bytes is None
