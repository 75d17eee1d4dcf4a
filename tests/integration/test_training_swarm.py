"""A real swarm on 127.0.0.1, driven through the CLI: a 2-stage tiny model with two workers in
stage 0 and one trainer with 2 lanes."""

from __future__ import annotations

import re
import signal
import time

import pytest

from tests.support.faults_node import faults_prefix
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]


def _log_has(node, text: str) -> bool:
    with open(node.log_path, errors="replace") as f:
        return text in f.read()


def _completed_samples_logged(trainer) -> bool:
    """The trainer's progress line ("N samples completed, ...") reports at least one sample."""
    with open(trainer.log_path, errors="replace") as f:
        return any(int(m.group(1)) > 0 for m in re.finditer(r"(\d+) samples completed", f.read()))


def _worker_summaries(swarm):
    return {n.name: n.summary() for n in swarm.nodes if n.role == "worker"}


@pytest.mark.timeout(240)
def test_two_stage_swarm_trains_and_accounts_for_every_sample(make_swarm, run_config_path):
    config = run_config_path(stages=TWO_STAGES, target_batch_size=8)
    swarm = make_swarm(config)
    first = swarm.start("worker", stage=0, args=["--max-batch", "8"])
    second = swarm.start("worker", stage=0, args=["--max-batch", "8"], wait_ready=False)
    tail = swarm.start("worker", stage=1, args=["--max-batch", "8"], wait_ready=False)
    swarm.wait_ready(second)
    swarm.wait_ready(tail)
    trainer = swarm.start("trainer", args=["--lanes", "2", "--max-samples", "240", "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 180) == 0, trainer.log_tail()
    summary = trainer.summary()

    assert summary["samples_started"] == 240
    assert summary["samples_completed"] + summary["samples_dropped"] == summary["samples_started"]
    assert summary["samples_in_flight"] == 0
    assert summary["samples_dropped"] == 0, summary["dropped_by_reason"]
    assert summary["last_loss"] < summary["first_loss"] * 0.85, summary

    served = summary["served"]["0"]
    assert set(served) == {first.peer_id, second.peer_id}, "both stage-0 workers must serve"
    assert min(served.values()) >= 0.15 * 240, served
    assert summary["backward_fallbacks"] == 0

    for node in (first, second, tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
    workers = _worker_summaries(swarm)
    for name, worker in workers.items():
        assert worker is not None, f"{name} printed no summary"
        assert worker["counters"].get("backward_unpinned", 0) == 0, "a backward ran off its forward's worker"
    stage0_backward = sum(w["counters"]["backward_requests"] for w in workers.values() if w["stage"] == 0)
    assert stage0_backward == summary["samples_completed"]
    # the head replicas kept their forwards' activations: most backwards ran through the kept graph
    stage0_kept = sum(w["counters"].get("backward_kept", 0) for w in workers.values() if w["stage"] == 0)
    assert stage0_kept >= 0.5 * stage0_backward, [w["kept_activations"] for w in workers.values()]
    assert 240 // 16 <= workers[tail.name]["local_step"] <= 240 // 8  # steps overshoot the target by < 2x
    poll_until(lambda: swarm.survivors() == [], 5, "every process of the swarm's nodes to exit")  # see conftest


@pytest.mark.timeout(240)
def test_training_survives_a_killed_worker(make_swarm, run_config_path):
    """SIGKILL one of two replicas mid-run: its samples are retried on the survivor or counted."""
    config = run_config_path(stages=TWO_STAGES, target_batch_size=8)
    swarm = make_swarm(config)
    survivor = swarm.start("worker", stage=0)
    victim = swarm.start("worker", stage=0, wait_ready=False)
    tail = swarm.start("worker", stage=1, wait_ready=False)
    swarm.wait_ready(victim)
    swarm.wait_ready(tail)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", "300", "--discovery-period-s", "1",
                                           "--request-timeout-s", "5"])
    poll_until(lambda: _log_has(tail, "step 3"), 60, "the tail stage to reach step 3", period_s=0.2)
    swarm.stop(victim, signal.SIGKILL)
    assert swarm.wait(trainer, 180) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] + summary["samples_dropped"] == 300
    assert summary["samples_in_flight"] == 0
    assert summary["samples_completed"] >= 280, summary
    assert summary["served"]["0"].get(survivor.peer_id, 0) > summary["served"]["0"].get(victim.peer_id, 0)


@pytest.mark.timeout(120)
def test_sigterm_drains_a_trainer_and_its_counts_add_up(make_swarm, run_config_path):
    config = run_config_path(stages=TWO_STAGES)
    swarm = make_swarm(config)
    swarm.start("worker", stage=0)
    swarm.start("worker", stage=1)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--discovery-period-s", "1",
                                           "--progress-log-period-s", "0.5"])
    poll_until(lambda: _completed_samples_logged(trainer), 60, "the trainer to complete samples", period_s=0.2)
    assert swarm.stop(trainer, signal.SIGTERM) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] > 0
    assert summary["samples_completed"] + summary["samples_dropped"] == summary["samples_started"]
    assert summary["samples_in_flight"] == 0


@pytest.mark.timeout(180)
def test_a_single_worker_stage_that_fails_calls_is_not_banned(make_swarm, run_config_path):
    """The only worker of stage 0 fails its first three forwards: the trainer backs off and
    retries it instead of banning it (a 30 s ban would drop every sample as `no_workers`)."""
    config = run_config_path(stages=TWO_STAGES, target_batch_size=8)
    swarm = make_swarm(config)
    head = swarm.start("worker", stage=0, prefix=faults_prefix(fail_forwards=3))
    tail = swarm.start("worker", stage=1, wait_ready=False)
    swarm.wait_ready(tail)
    trainer = swarm.start("trainer", args=["--lanes", "2", "--max-samples", "40", "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 120) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_dropped"] == 0, summary["dropped_by_reason"]
    assert summary["samples_completed"] == 40
    assert summary["forward_retries"] >= 3, summary
    for node in (head, tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
    assert head.summary()["requests"]["forward_internal"] == 3


RESTART_TO_SERVING_S = 90.0
"""Bound for a SIGKILLed worker restarted with its identity to serve again: a regression bound for a
loaded CI machine (two test files at once on two cores took 35 s before the first log line), not
the aim; scripts/bench_join.py measures the real figure under churn (issue 22, point 6)."""


@pytest.mark.timeout(300)
def test_a_sigkilled_worker_restarted_with_its_identity_serves_again_soon(make_swarm, run_config_path, tmp_path):
    """An admitted worker is SIGKILLed while a trainer trains through it, and restarted at once with
    the same --identity and port, as a supervisor restarts a contributor's node: it is admitted
    again, loads the stage's state from its replica and serves forwards within the bound, and the
    trainer accounts for every sample."""
    from tests.support.metrics import metric_value, scrape

    config = run_config_path(stages=TWO_STAGES, target_batch_size=8)
    swarm = make_swarm(None)
    policy = tmp_path / "policy.yaml"
    policy.write_text("honor_stage_preference: true\n")
    authorizer = swarm.start_authorizer(["--run-config", config, "--data-dir", str(tmp_path / "authorizer"),
                                         "--port", "0", "--policy-file", str(policy), "--stage-capacity", "3,2"])
    node = ["--authorizer", authorizer.url]
    key = str(tmp_path / "victim.key")
    victim_args = [*node, "--account-token", "victim", "--identity", key, "--metrics-port", "0"]
    swarm.start("worker", stage=0, args=[*node, "--account-token", "survivor"], timeout_s=120)
    victim = swarm.start("worker", stage=0, args=victim_args, wait_ready=False, name="victim")
    tail = swarm.start("worker", stage=1, args=[*node, "--account-token", "tail"], wait_ready=False)
    swarm.wait_ready(victim, timeout_s=120)
    swarm.wait_ready(tail, timeout_s=120)
    trainer = swarm.start("trainer", args=[*node, "--account-token", "trainer", "--lanes", "4",
                                           "--max-samples", "100000000", "--discovery-period-s", "2"], timeout_s=120)
    served = lambda n: metric_value(scrape(n), "agora_worker_requests", "_total", outcome="ok")  # noqa: E731
    poll_until(lambda: served(victim) > 0 and _log_has(tail, "step 2:"), 90, "the victim to serve and the stage to step",
               period_s=0.5)

    port = victim.maddrs[0].split("/tcp/")[1].split("/")[0]
    swarm.stop(victim, signal.SIGKILL)
    started = time.monotonic()
    again = swarm.start("worker", stage=0, args=[*victim_args, "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}"],
                        name="victim-again", timeout_s=RESTART_TO_SERVING_S)
    assert again.peer_id == victim.peer_id
    poll_until(lambda: served(again) > 0, max(1.0, RESTART_TO_SERVING_S - (time.monotonic() - started)),
               "the restarted worker to serve a request", period_s=0.25)
    took = time.monotonic() - started
    print(f"\nrestart to serving: {took:.1f}s")
    with open(again.log_path, errors="replace") as f:  # it serves its replica's state, not the seed's
        assert re.search(r"joined stage 0 in \w+: loaded step \d+ from 1 (?:peer|donor)", f.read()), again.log_tail()

    assert swarm.stop(trainer, signal.SIGTERM) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] + summary["samples_dropped"] == summary["samples_started"]
    assert summary["samples_in_flight"] == 0
    assert sum(summary["dropped_by_reason"].values()) == summary["samples_dropped"]
    assert summary["samples_completed"] > 0
