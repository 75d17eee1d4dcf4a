"""Worker-to-worker routing (run config `routing.path: workers`, issue 23) with real processes: the
trainer hands each sample to a head worker, the workers pass it on stage to stage and back, and
the trainer sees one call per sample. Every guarantee of the trainer-driven path holds: exact
steps, pinned backwards through kept activations, every sample completed or dropped with a reason,
also when a body worker is SIGKILLed mid-run."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.support.faults_node import faults_prefix
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

THREE_STAGES = [{"first_layer": 0, "last_layer": 1}, {"first_layer": 1, "last_layer": 2},
                {"first_layer": 2, "last_layer": 3}]
WORKERS = {"path": "workers"}


def _summaries(swarm):
    return {node.name: node.summary() for node in swarm.nodes if node.role == "worker"}


@pytest.mark.timeout(240)
def test_samples_pass_worker_to_worker_and_every_stage_steps_on_the_same_samples(make_swarm, run_config_path):
    # spot checks on: an honest chain's hops, checked through what the workers kept, all agree
    config = run_config_path(stages=THREE_STAGES, target_batch_size=8, routing=WORKERS,
                             verification={"spot_check_rate": 0.2})
    swarm = make_swarm(config)
    heads = [swarm.start("worker", stage=0, args=["--max-batch", "8"], wait_ready=i == 0) for i in range(2)]
    body = swarm.start("worker", stage=1, args=["--max-batch", "8"], wait_ready=False)
    tail = swarm.start("worker", stage=2, args=["--max-batch", "8"], wait_ready=False)
    for node in (heads[1], body, tail):
        swarm.wait_ready(node)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", "160", "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 180) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["routing"] == "workers"
    assert summary["samples_started"] == 160 and summary["samples_in_flight"] == 0
    assert summary["samples_dropped"] == 0, summary["dropped_by_reason"]
    assert summary["last_loss"] < summary["first_loss"] * 0.9, summary
    assert set(summary["served"]["0"]) == {h.peer_id for h in heads}, "both heads take samples"
    assert summary["served"]["1"] == {body.peer_id: 160} and summary["served"]["2"] == {tail.peer_id: 160}
    checks = summary["spot_checks"]
    assert checks["agreed"] >= 1 and checks["disputed"] == 0 and not checks["strikes"], checks
    assert checks["chain"]["handed"] >= 1 and checks["unbound"] == checks["not_kept"] == 0, checks

    for node in (*heads, body, tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
    workers = _summaries(swarm)
    by_stage = {stage: [w for w in workers.values() if w["stage"] == stage] for stage in range(3)}
    # One chain call per sample and stage; nobody called the plain forward or backward handlers.
    for stage, replicas in by_stage.items():
        assert sum(w["requests"].get("chain_ok", 0) for w in replicas) == 160, (stage, [w["requests"] for w in replicas])
        assert sum(w["chained"].get("completed", 0) for w in replicas) == 160
        assert not any(k.startswith(("forward_", "backward_")) for w in replicas for k in w["requests"])
        assert sum(w["counters"]["backward_requests"] for w in replicas) == 160
        assert all(w["counters"].get("backward_unpinned", 0) == 0 for w in replicas)
    # Every stage took the same steps on the same samples.
    steps = {stage: {w["local_step"] for w in replicas} for stage, replicas in by_stage.items()}
    assert steps[0] == steps[1] == steps[2] == {160 // 8}, steps
    kept = sum(w["counters"].get("backward_kept", 0) for stage in (0, 1) for w in by_stage[stage])
    assert kept >= 0.5 * 2 * 160, "the head and the body ran most backwards through their kept forwards"
    poll_until(lambda: swarm.survivors() == [], 5, "every process of the swarm's nodes to exit")


@pytest.mark.timeout(240)
def test_a_body_worker_killed_mid_run_loses_no_sample_silently(make_swarm, run_config_path):
    """The head retries a sample the dead body held on the other body (it still has the
    coordinates); a sample the chain cannot finish is dropped with its reason, never lost."""
    config = run_config_path(stages=THREE_STAGES, target_batch_size=8, routing=WORKERS,
                             staleness={"step_close_timeout_s": 3.0})
    swarm = make_swarm(config)
    head = swarm.start("worker", stage=0, args=["--max-batch", "8"])
    bodies = [swarm.start("worker", stage=1, args=["--max-batch", "8"], wait_ready=False) for _ in range(2)]
    tail = swarm.start("worker", stage=2, args=["--max-batch", "8"], wait_ready=False)
    for node in (*bodies, tail):
        swarm.wait_ready(node)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", "400", "--discovery-period-s", "1",
                                           "--request-timeout-s", "10", "--progress-log-period-s", "0.5"])
    victim = bodies[1]
    poll_until(lambda: _completed(trainer) >= 60, 120, "60 samples through the chain", period_s=0.3)
    # Freeze the victim first, so that samples are surely in its hands (queued, mid-forward or
    # waiting on the tail) when it dies.
    victim.proc.send_signal(signal.SIGSTOP)
    time.sleep(1.5)
    swarm.stop(victim, signal.SIGKILL)
    assert swarm.wait(trainer, 200) == 0, trainer.log_tail()
    summary = trainer.summary()
    print(f"after the kill: {summary['samples_completed']} completed, dropped {summary['dropped_by_reason']}, "
          f"served by stage 1 {summary['served']['1']}, retries {summary['forward_retries']}")
    assert summary["samples_started"] == 400 and summary["samples_in_flight"] == 0
    assert summary["samples_completed"] + summary["samples_dropped"] == 400
    # Samples in the victim's hands are dropped and named; the rest go through the other body.
    assert set(summary["dropped_by_reason"]) <= {"worker_failures", "bad_reply"}, summary["dropped_by_reason"]
    assert summary["samples_dropped"] <= 8, summary["dropped_by_reason"]
    assert summary["samples_completed"] >= 392
    survivor = bodies[0]
    assert summary["served"]["1"][survivor.peer_id] > summary["served"]["1"].get(victim.peer_id, 0)
    for node in (head, survivor, tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
    chained = head.summary()["chained"]
    print(f"head: {chained}")
    assert chained.get("next_failed", 0) >= 1, "samples in the victim's hands went to the other body"
    assert chained.get("completed", 0) == summary["samples_completed"]
    assert sum(n for k, n in chained.items() if k.startswith("dropped_")) == summary["samples_dropped"]
    poll_until(lambda: swarm.survivors() == [], 5, "every process of the swarm's nodes to exit")


def _completed(trainer) -> int:
    with open(trainer.log_path, errors="replace") as f:
        found = [int(m.group(1)) for m in re.finditer(r"(\d+) samples completed", f.read())]
    return max(found, default=0)


@pytest.mark.timeout(180)
def test_a_stage_of_workers_too_old_to_chain_gets_its_samples_the_trainer_driven_way(make_swarm, run_config_path):
    """A run upgrading one operator at a time: the tail runs a version without worker-to-worker
    routing, so the trainer names it once and sends every sample the trainer-driven way."""
    config = run_config_path(stages=[{"first_layer": 0, "last_layer": 1}, {"first_layer": 1, "last_layer": 3}],
                             target_batch_size=8, routing=WORKERS)
    swarm = make_swarm(config)
    head = swarm.start("worker", stage=0, args=["--max-batch", "8"])
    old_tail = swarm.start("worker", stage=1, args=["--max-batch", "8"], prefix=faults_prefix(without_chain=1))
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", "24", "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 120) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] == 24 and summary["samples_dropped"] == 0, summary["dropped_by_reason"]
    assert summary["routing"] == "workers" and summary["routing_fallbacks"] == 24
    assert summary["served"]["1"] == {old_tail.peer_id: 24}
    named = [line for line in trainer.log_tail(10_000).splitlines() if "cannot pass samples worker to worker" in line]
    assert len(named) == 1 and old_tail.peer_id[-8:] in named[0], trainer.log_tail()
    for node in (head, old_tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
    assert not any(w["requests"].get("chain_ok") for w in _summaries(swarm).values())
