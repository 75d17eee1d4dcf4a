"""Two replicas per stage with real processes on 127.0.0.1 [issue 20]: every stage step holds
exactly `target_batch_size` samples over both replicas, no computed sample is thrown away as late,
and the replicas, adding up their gradients before every step, end with the same weights. A
replica killed mid-run costs only the steps it held samples of; every sample is accounted for."""

from __future__ import annotations

import collections
import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
COMMON = ["--announce-period-s", "1"]
TARGET = 16


def _weights(directory: str) -> dict[str, torch.Tensor]:
    [name] = [n for n in os.listdir(directory) if n.endswith(".safetensors")]
    return load_file(os.path.join(directory, name))


def _steps_from_log(path: str) -> collections.Counter:
    latest = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            latest[record["sample_id"]] = record["step"]  # a retried sample counts once, at its last line
    return collections.Counter(latest.values())


def _start(make_swarm, run_config_path, tmp_path, samples: int):
    config = run_config_path(stages=TWO_STAGES, target_batch_size=TARGET)
    swarm = make_swarm(config, common_args=COMMON)
    workers, dirs = [], {}
    for stage in (0, 1):
        for replica in (0, 1):
            dirs[(stage, replica)] = str(tmp_path / f"s{stage}r{replica}")
            workers.append(swarm.start("worker", stage=stage, wait_ready=not workers, name=f"worker-s{stage}-r{replica}",
                                       args=["--checkpoint-dir", dirs[(stage, replica)], "--checkpoint-period-s", "3600"]))
    for worker in workers[1:]:
        swarm.wait_ready(worker)
    log = str(tmp_path / "samples.jsonl")
    trainer = swarm.start("trainer", env={"AGORA_SAMPLE_LOG": log},
                          args=["--lanes", "6", "--max-samples", str(samples), "--discovery-period-s", "1"])
    return swarm, workers, dirs, trainer, log


@pytest.mark.timeout(300)
def test_two_replicas_per_stage_step_on_exact_batches_stay_equal_and_survive_a_kill(make_swarm, run_config_path,
                                                                                   tmp_path):
    """One swarm for both checks (integration time is the suite's budget): exact, equal steps
    while all four replicas live; then a tail replica is SIGKILLed and nothing is lost."""
    swarm, workers, dirs, trainer, log = _start(make_swarm, run_config_path, tmp_path, samples=480)
    start = time.monotonic()
    while time.monotonic() - start < 90 and (not os.path.exists(log) or sum(1 for _ in open(log)) < 240):
        time.sleep(0.2)
    before_kill = _steps_from_log(log)
    assert len(before_kill) >= 8, before_kill
    # Every step before the kill (the last may still be filling): 16 over both replicas.
    done = sorted(before_kill)[:-1]
    assert all(before_kill[s] == TARGET for s in done), sorted(before_kill.items())
    victim = workers[3]  # a tail replica
    victim.proc.send_signal(signal.SIGKILL)

    assert swarm.wait(trainer, 200) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] + summary["samples_dropped"] == 480, summary
    assert summary["samples_completed"] >= 440, summary
    steps = _steps_from_log(log)
    # As the trainers saw it, one step may hold more: when the victim was the tail's tagger, the
    # survivor takes over from the counts published so far (roles/worker/steps/step_tagger.py) and
    # fills the open step again, while samples the victim tagged for it and answered before it
    # died are in the trainer's log with that step; their tail gradients died with it. What
    # each surviving replica applied stays exact (samples_per_step_max below).
    over = {step: n for step, n in steps.items() if n > TARGET}
    assert len(over) <= 1 and all(n <= 2 * TARGET for n in over.values()), sorted(steps.items())
    served = collections.Counter()
    for worker in workers[:3]:
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
        found = worker.summary()
        assert found is not None, worker.log_tail()
        figures = found["steps"]
        assert figures["samples_per_step_max"] <= TARGET, (worker.name, figures)
        # A sample of the over-full step that reaches a replica after it closed that step is
        # discarded there and counted as late: never more than the step held beyond the target.
        assert figures["late_samples"] <= sum(n - TARGET for n in over.values()), (worker.name, figures, over)
        # Short steps only for samples really lost with the killed replica, and they say why.
        short, closed_by = figures["short_steps"], figures["closed_by"]
        assert short <= 4, (worker.name, figures)
        assert sum(n for reason, n in closed_by.items() if reason != "complete") >= short, (worker.name, figures)
        exchange = found["gradient_exchange"]
        assert exchange["steps_complete"] >= len(done) - 1, (worker.name, exchange)
        tagging = found["tagging"]  # the tail's tags and the head's forward gate
        if tagging.get("tickets_to_peers", 0) > 0:
            served[worker.stage] += 1
    # One head replica gated the forwards of both: the other asked it.
    assert served[0] == 1, served
    # The same updates on the same start: stage 0's replicas hold the same weights, bit for bit.
    a, b = _weights(dirs[(0, 0)]), _weights(dirs[(0, 1)])
    assert all(torch.equal(a[name], b[name]) for name in a), "stage 0 replicas differ"
