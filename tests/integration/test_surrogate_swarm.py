"""A real swarm of surrogate stages [report 3.5.1] on 127.0.0.1: the surrogate-1b preset, shrunk to
short samples and a small batch by overrides, trains through agora-node processes with slept
delays, averages its payload, and reports a loss; an 8b surrogate worker plans its memory."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import uuid

import pytest

from protocol.run_config import dump_run_config, load_run_config
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration


def _surrogate_config(tmp_path) -> str:
    run_id = f"test-surrogate-{uuid.uuid4().hex[:8]}"
    run = load_run_config("surrogate-1b", {
        "run_id": run_id, "seq_len": 64, "target_batch_size": 8, "evaluation": {"every_steps": 0},
        "stages": [{"first_layer": 0, "last_layer": 4}, {"first_layer": 4, "last_layer": 12},
                   {"first_layer": 12, "last_layer": 16}],
        "optimizer": {"lr": 1e-2, "warmup_steps": 0, "total_steps": 1000, "weight_decay": 0.0},
        "surrogate": {"mirrors": "1b", "mirror_segments": 20, "forward_s": 0.005, "forward_per_sample_s": 0.001,
                      "backward_s": 0.01, "backward_per_sample_s": 0.002},
    })
    path = tmp_path / f"{run_id}.yaml"
    dump_run_config(run, path)
    return str(path)


@pytest.mark.timeout(180)  # four nodes starting on two loaded cores (CI took >90 s once)
def test_surrogate_swarm_completes_samples_and_reports_loss(make_swarm, tmp_path):
    swarm = make_swarm(_surrogate_config(tmp_path))
    head = swarm.start("worker", stage=0, args=["--max-batch", "8"])
    body = swarm.start("worker", stage=1, args=["--max-batch", "8"], wait_ready=False)
    tail = swarm.start("worker", stage=2, args=["--max-batch", "8"], wait_ready=False)
    swarm.wait_ready(body)
    swarm.wait_ready(tail)
    trainer = swarm.start("trainer", args=["--lanes", "4", "--max-samples", "96", "--discovery-period-s", "1"])
    assert swarm.wait(trainer, 120) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] == 96, summary
    assert summary["samples_dropped"] == 0, summary["dropped_by_reason"]
    assert math.isfinite(summary["first_loss"]) and math.isfinite(summary["last_loss"])
    assert summary["last_loss"] < summary["first_loss"], summary

    for node in (head, body, tail):
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
    workers = {n.stage: n.summary() for n in swarm.nodes if n.role == "worker"}
    assert workers[1]["counters"]["backward_requests"] == workers[2]["counters"]["backward_requests"] == 96
    assert workers[0]["local_step"] >= 96 // 16
    poll_until(lambda: swarm.survivors() == [], 5, "every process of the swarm's nodes to exit")


@pytest.mark.timeout(60)
def test_an_8b_surrogate_body_worker_plans_a_modest_memory():
    """The dry run plans a surrogate-8b body stage from its config, without building it."""
    result = subprocess.run(
        [sys.executable, "-m", "node.cli", "--role", "worker", "--config", "surrogate-8b", "--stage", "1",
         "--device", "cpu", "--dry-run", "--insecure-open-run"],
        capture_output=True, text=True, timeout=50)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "surrogate with 44.2M averaged-only values" in result.stdout
    assert "fits" in result.stdout
