"""Metrics on a live swarm: one worker per stage of the tiny model and one trainer, each with
--metrics-port 0. Every catalogue metric is exposed with its type and the node's labels, and the
counters and histograms move as training proceeds; /healthz and /readyz answer."""

from __future__ import annotations

import pytest

from tests.support.metrics import http_get, metric_value, metrics_url, scrape
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

NODE_LABELS = {"run", "role", "stage", "peer"}

COMMON = {
    "agora_node_info": ("gauge", {"version", "protocol"}),
    "agora_node_ready": ("gauge", set()),
    "agora_process_resident_memory_bytes": ("gauge", set()),
    "agora_host_memory_total_bytes": ("gauge", set()),
    "agora_device_memory_used_bytes": ("gauge", set()),
    "agora_device_memory_total_bytes": ("gauge", set()),
    "agora_dht_operation_seconds": ("histogram", {"op"}),
    "agora_auth_rejections": ("counter", {"channel", "reason"}),
    "agora_credential_expiry_timestamp_seconds": ("gauge", set()),
    "agora_bytes_sent": ("counter", {"channel"}),
    "agora_bytes_received": ("counter", {"channel"}),
}
WORKER = {
    "agora_worker_queue_wait_seconds": ("histogram", {"pass"}),
    "agora_worker_forward_seconds": ("histogram", set()),
    "agora_worker_backward_seconds": ("histogram", set()),
    "agora_worker_batch_size": ("histogram", {"pass"}),
    "agora_worker_utilization_ratio": ("gauge", set()),
    "agora_worker_queue_length": ("gauge", {"pass"}),
    "agora_worker_requests": ("counter", {"pass", "outcome"}),
    "agora_worker_optimizer_steps": ("counter", set()),
    "agora_worker_stage_step": ("gauge", set()),
    "agora_worker_sync_phase": ("gauge", {"phase"}),
    "agora_averaging_rounds": ("counter", {"outcome"}),
    "agora_averaging_round_seconds": ("histogram", set()),
    "agora_averaging_completeness_ratio": ("gauge", set()),
    "agora_averaging_reducer": ("gauge", {"how"}),
    "agora_averaging_divergence_resyncs": ("counter", set()),
}
TRAINER = {
    "agora_trainer_loss": ("gauge", set()),
    "agora_trainer_tokens": ("counter", set()),
    "agora_trainer_tokens_per_second": ("gauge", set()),
    "agora_trainer_samples": ("counter", {"outcome", "reason"}),
    "agora_trainer_lanes": ("gauge", set()),
    "agora_trainer_lanes_busy": ("gauge", set()),
    "agora_trainer_retries": ("counter", {"reason"}),
    "agora_eval_loss": ("gauge", set()),
    "agora_eval_perplexity": ("gauge", set()),
    "agora_eval_loss_stderr": ("gauge", set()),
    "agora_eval_step": ("gauge", set()),
    "agora_evaluations": ("counter", set()),
}


def _check_catalogue(families: dict, catalogue: dict, node, run_id: str) -> None:
    expected_labels = {"run": run_id, "role": node.role, "stage": "" if node.stage is None else str(node.stage),
                       "peer": node.peer_id}
    for name, (kind, own) in catalogue.items():
        assert name in families, f"{node.name} does not expose {name}"
        family = families[name]
        assert family.type == kind, f"{name} is a {family.type}, not a {kind}"
        for sample in family.samples:
            extra = {"le"} if sample.name.endswith("_bucket") else set()
            assert set(sample.labels) == NODE_LABELS | own | extra, (name, sample.labels)
            assert {k: sample.labels[k] for k in NODE_LABELS} == expected_labels, (name, sample.labels)


@pytest.mark.timeout(360)
def test_every_node_exposes_the_catalogue_and_it_moves_with_training(make_swarm, run_config_path):
    config = run_config_path(target_batch_size=8, averaging={"average_every": 2}, evaluation={"every_steps": 20, "samples": 16})
    run_id = config.rsplit("/", 1)[-1].removesuffix(".yaml")
    swarm = make_swarm(config)
    metrics = ["--metrics-port", "0"]
    workers = [swarm.start("worker", stage=0, args=metrics)]
    workers += [swarm.start("worker", stage=s, args=metrics, wait_ready=False) for s in (1, 2)]
    for node in workers:
        swarm.wait_ready(node, 120)
    for node in workers:
        assert http_get(metrics_url(node) + "/healthz")[0] == 200
        poll_until(lambda: http_get(metrics_url(node) + "/readyz")[0] == 200, 60, f"{node.name} to be ready")
        assert http_get(metrics_url(node) + "/nothing")[0] == 404
    before = {node.name: scrape(node) for node in workers}

    trainer = swarm.start("trainer", args=[*metrics, "--lanes", "2", "--discovery-period-s", "1"], timeout_s=120)
    poll_until(lambda: metric_value(scrape(workers[-1]), "agora_worker_stage_step") >= 3, 240,
               "the tail to take 3 steps", period_s=1.0)
    poll_until(lambda: metric_value(scrape(workers[0]), "agora_averaging_rounds", "_total") >= 1, 120,
               "the head to have an averaging round due (skipped: it is alone in its stage)", period_s=1.0)
    assert http_get(metrics_url(trainer) + "/readyz")[0] == 200
    after = {node.name: scrape(node) for node in workers}
    seen = scrape(trainer)

    _check_catalogue(seen, {**COMMON, **TRAINER}, trainer, run_id)
    assert metric_value(seen, "agora_trainer_tokens", "_total") > 0
    assert metric_value(seen, "agora_trainer_samples", "_total", outcome="completed") > 0
    assert metric_value(seen, "agora_trainer_loss") > 0
    assert metric_value(seen, "agora_trainer_lanes") == 2
    assert metric_value(seen, "agora_bytes_sent", "_total", channel="pipeline") > 0
    assert metric_value(seen, "agora_bytes_received", "_total", channel="pipeline") > 0
    assert metric_value(seen, "agora_dht_operation_seconds", "_count", op="get") > 0
    assert metric_value(seen, "agora_node_ready") == 1

    for node in workers:
        old, new = before[node.name], after[node.name]
        _check_catalogue(new, {**COMMON, **WORKER}, node, run_id)
        moved = lambda name, suffix="", **labels: (metric_value(new, name, suffix, **labels)  # noqa: E731
                                                   - metric_value(old, name, suffix, **labels))
        assert moved("agora_worker_requests", "_total", outcome="ok", **{"pass": "backward"}) > 0, node.name
        assert moved("agora_worker_backward_seconds", "_count") > 0, node.name
        assert moved("agora_worker_queue_wait_seconds", "_count", **{"pass": "backward"}) > 0, node.name
        assert moved("agora_worker_batch_size", "_count", **{"pass": "backward"}) > 0, node.name
        if node.stage != 2:  # the tail fuses its forward into the backward
            assert moved("agora_worker_forward_seconds", "_count") > 0, node.name
        assert moved("agora_worker_optimizer_steps", "_total") > 0, node.name
        assert moved("agora_worker_stage_step") > 0, node.name
        assert moved("agora_bytes_received", "_total", channel="pipeline") > 0, node.name
        assert moved("agora_bytes_sent", "_total", channel="pipeline") > 0, node.name
        assert moved("agora_dht_operation_seconds", "_count", op="store") > 0, node.name
        assert metric_value(new, "agora_worker_sync_phase", phase="active") == 1
        assert metric_value(new, "agora_worker_sync_phase") == 1  # exactly one phase is current
        assert 0 < metric_value(new, "agora_worker_utilization_ratio") <= 1
        assert metric_value(new, "agora_node_ready") == 1
        assert metric_value(new, "agora_process_resident_memory_bytes") > 0
        assert metric_value(new, "agora_host_memory_total_bytes") > metric_value(new, "agora_process_resident_memory_bytes")
    assert metric_value(after[workers[0].name], "agora_averaging_rounds", "_total", outcome="skipped") >= 1


@pytest.mark.timeout(120)
def test_a_metrics_port_in_use_is_a_config_error_before_joining(make_swarm, run_config_path):
    swarm = make_swarm(run_config_path())
    first = swarm.start("worker", stage=0, args=["--metrics-port", "0"])
    port = metrics_url(first).rsplit(":", 1)[1]
    second = swarm.start("worker", stage=1, args=["--metrics-port", port], wait_ready=False)
    assert swarm.wait(second, 90) == 2, second.log_tail()
    assert f"--metrics-port {port} is already in use" in second.log_tail()
