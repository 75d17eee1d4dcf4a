"""Held-out evaluation on a live swarm: one worker per stage of the tiny model and one trainer (data
shard 0, so it evaluates) with `evaluation.every_steps: 3`. The trainer reports held-out losses
from step 0 on in its metrics and summary; the workers served the evaluation's forwards and
counted none of them as training (every stage's samples and steps are the trainer's samples)."""

from __future__ import annotations

import math
import signal

import pytest

from tests.support.metrics import metric_value, scrape
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

SAMPLES = 8


@pytest.mark.timeout(180)
def test_trainer_0_reports_heldout_loss_and_training_counts_stay_exact(make_swarm, run_config_path):
    config = run_config_path(target_batch_size=4, evaluation={"every_steps": 3, "samples": SAMPLES})
    swarm = make_swarm(config)
    workers = [swarm.start("worker", stage=0, args=["--max-batch", "8"])]
    workers += [swarm.start("worker", stage=s, args=["--max-batch", "8"], wait_ready=False) for s in (1, 2)]
    for node in workers[1:]:
        swarm.wait_ready(node)
    trainer = swarm.start("trainer", args=["--lanes", "2", "--metrics-port", "0", "--discovery-period-s", "1"])

    poll_until(lambda: metric_value(scrape(trainer), "agora_evaluations", "_total") >= 2, 90,
               "the trainer to take two held-out evaluations", period_s=0.5)
    seen = scrape(trainer)
    loss = metric_value(seen, "agora_eval_loss")
    assert math.isfinite(loss) and loss > 0
    assert metric_value(seen, "agora_eval_perplexity") == pytest.approx(math.exp(loss), rel=1e-6)
    assert metric_value(seen, "agora_eval_step") >= 3
    assert 0 < metric_value(seen, "agora_eval_loss_stderr") < loss

    assert swarm.stop(trainer, signal.SIGTERM) == 0, trainer.log_tail()
    summary = trainer.summary()
    evaluations = summary["eval"]
    assert len(evaluations) >= 2 and evaluations[0]["step"] == 0, evaluations
    assert all(math.isfinite(e["loss"]) and e["samples"] == SAMPLES and e["dropped"] == 0 for e in evaluations)
    assert [e["step"] for e in evaluations] == sorted(e["step"] for e in evaluations)
    assert evaluations[1]["step"] >= 3, "the next evaluation waits for the next multiple of every_steps"
    completed = summary["samples_completed"]
    assert completed > 0 and summary["samples_dropped"] == 0, summary["dropped_by_reason"]

    for node in workers:
        assert swarm.stop(node, signal.SIGTERM) == 0, node.log_tail()
    for node in workers:
        worker = node.summary()
        counters, steps = worker["counters"], worker["steps"]
        assert counters["eval_requests"] >= 2 * SAMPLES, (node.name, counters)
        assert worker["requests"].get("evaluate_ok", 0) == counters["eval_requests"], worker["requests"]
        # no held-out forward counted as training: every stage saw exactly the trainer's samples
        assert counters["backward_requests"] == completed, (node.name, counters, completed)
        if node.stage < 2 and summary["forward_retries"] == 0:
            assert counters["forward_requests"] == completed, (node.name, counters, completed)
        in_steps = round((steps["samples_per_step_mean"] or 0) * steps["taken"])
        assert in_steps + steps["discarded_at_shutdown"] + steps["late_samples"] == completed, (node.name, steps)
