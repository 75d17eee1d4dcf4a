"""Stage skipping with real processes [issue 12, part 2]: a 3-stage tiny model with one worker per
stage; the body's only worker is SIGKILLed mid-run, the trainer routes around it, and a new worker
for that stage is used again within one discovery period."""

from __future__ import annotations

import json
import os
import signal
import statistics
import time

import pytest

from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

DISCOVERY_S = 1.0


def _samples(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # the line being written
            pass
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("routing", ["trainer", "workers"])
def test_a_body_stage_whose_only_worker_dies_is_skipped_until_a_new_worker_serves_it(
        make_swarm, run_config_path, tmp_path, routing):
    """On the worker-to-worker path the head finds the body unreachable and sends the sample to the
    tail itself (roles/worker/serving/chain.py)."""
    config = run_config_path(target_batch_size=8, routing={"path": routing})
    swarm = make_swarm(config)
    worker_args = ["--max-batch", "8", "--announce-period-s", "1"]
    head = swarm.start("worker", stage=0, args=worker_args)
    body = swarm.start("worker", stage=1, args=worker_args, wait_ready=False)
    tail = swarm.start("worker", stage=2, args=worker_args, wait_ready=False)
    swarm.wait_ready(body)
    swarm.wait_ready(tail)
    log = str(tmp_path / "samples.jsonl")
    trainer = swarm.start("trainer", args=["--lanes", "2", "--discovery-period-s", str(DISCOVERY_S),
                                           "--request-timeout-s", "5", "--progress-log-period-s", "1"],
                          env={"AGORA_SAMPLE_LOG": log})

    poll_until(lambda: len(_samples(log)) >= 96, 90, "96 samples before the kill", period_s=0.2)
    # Counted before the kill: samples go on completing while the body is killed and reaped, and
    # those that complete meanwhile may already skip it (342 skipped in 4.5 s in one run).
    before = len(_samples(log))
    swarm.stop(body, signal.SIGKILL)
    poll_until(lambda: sum(1 for s in _samples(log)[before:] if s["skipped"] == [1]) >= 160, 90,
               "160 samples that skipped stage 1", period_s=0.2)

    replacement = swarm.start("worker", stage=1, args=worker_args)
    ready_at = time.monotonic()
    at_ready = len(_samples(log))
    poll_until(lambda: any(s["skipped"] == [] for s in _samples(log)[at_ready:]), 30,
               "a sample through the new stage-1 worker", period_s=0.05)
    reused_after_s = time.monotonic() - ready_at
    poll_until(lambda: sum(1 for s in _samples(log)[at_ready:] if s["skipped"] == []) >= 24, 60,
               "24 samples through the new stage-1 worker", period_s=0.2)
    assert swarm.stop(trainer, signal.SIGTERM) == 0, trainer.log_tail()
    summary = trainer.summary()
    for node in (replacement, head, tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()

    samples = _samples(log)
    pre, skipped = samples[:before], [s for s in samples[before:] if s["skipped"] == [1]]
    after_ready = samples[at_ready:]
    print(f"\nstage skipping: {len(pre)} samples before the kill, {len(skipped)} skipping stage 1, "
          f"{len(samples) - before - len(skipped)} through stage 1 after it, new worker used "
          f"{reused_after_s:.2f} s after its readiness line; summary skipped_stages "
          f"{summary['skipped_stages']}, dropped {summary['dropped_by_reason']}")

    # every sample is accounted for; the kill costs no more than the samples in flight at it
    assert summary["samples_completed"] + summary["samples_dropped"] == summary["samples_started"]
    assert summary["samples_in_flight"] == 0
    assert summary["samples_completed"] == len(samples)
    assert summary["samples_dropped"] <= 4, summary["dropped_by_reason"]
    assert all(s["skipped"] in ([], [1]) for s in samples)
    assert all(s["skipped"] == [] for s in pre)

    # counted in the summary, and stage 1 only
    counted = summary["skipped_stages"]
    assert set(counted) == {"1"}, counted
    assert len(skipped) == summary["samples_skipping_a_stage"]
    # the counts are routings around the stage: a sample that skipped it and was then dropped
    # (the tail timed out under CI's load: 2,977 routings, 2,975 completed samples) counts too
    routed_around = sum(counted["1"].values())
    assert len(skipped) <= routed_around <= len(skipped) + summary["samples_dropped"], \
        (routed_around, len(skipped), summary["dropped_by_reason"])
    assert summary["stages_skipped_now"] == []

    # training went on: the loss while skipping stays below the run's start and keeps falling
    first = statistics.mean(s["loss"] for s in pre[:16])
    early_skip = statistics.mean(s["loss"] for s in skipped[:40])
    late_skip = statistics.mean(s["loss"] for s in skipped[-40:])
    assert late_skip < first * 0.9, (first, early_skip, late_skip)
    assert late_skip < early_skip, (first, early_skip, late_skip)

    # the new worker is used within one discovery period (plus a sample's round trip, which took
    # 3.2 s once and 5.3 s once under CI's load), and from then on the stage is not skipped any more
    assert reused_after_s <= DISCOVERY_S + 8.0, reused_after_s
    last_skipped = max(i for i, s in enumerate(after_ready) if s["skipped"]) if any(
        s["skipped"] for s in after_ready) else -1
    assert sum(1 for s in after_ready[last_skipped + 1:]) >= 24
    served = replacement.summary()["counters"]
    assert served["forward_requests"] >= 24 and served["backward_requests"] >= 24, served


@pytest.mark.timeout(160)
def test_with_skipping_disabled_an_empty_body_stage_drops_samples_as_no_workers(make_swarm, run_config_path):
    config = run_config_path(target_batch_size=8, skipping={"enabled": False})
    swarm = make_swarm(config)
    worker_args = ["--announce-period-s", "1"]
    swarm.start("worker", stage=0, args=worker_args)
    body = swarm.start("worker", stage=1, args=worker_args, wait_ready=False)
    swarm.start("worker", stage=2, args=worker_args)
    swarm.wait_ready(body)
    trainer = swarm.start("trainer", args=["--lanes", "2", "--discovery-period-s", str(DISCOVERY_S),
                                           "--request-timeout-s", "5", "--progress-log-period-s", "0.5"])
    poll_until(lambda: "samples completed" in open(trainer.log_path).read(), 60, "the trainer to train",
               period_s=0.2)
    swarm.stop(body, signal.SIGKILL)
    try:  # about 5 s here; CI once saw none within 60 s, and printed nothing to tell why
        poll_until(lambda: "no_workers" in open(trainer.log_path).read(), 90, "samples dropped as no_workers",
                   period_s=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- trainer ---\n{trainer.log_tail()}") from None
    assert swarm.stop(trainer, signal.SIGTERM) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["skipped_stages"] == {}
    assert summary["dropped_by_reason"].get("no_workers", 0) > 0, summary
    assert summary["samples_completed"] + summary["samples_dropped"] == summary["samples_started"]
