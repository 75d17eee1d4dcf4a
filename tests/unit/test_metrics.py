"""The metrics plumbing in process: protocol.stats, the node's registry and sources, the metrics
port, and the all-reduce payload estimate."""

from __future__ import annotations

import asyncio
import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from node.metrics.registry import NodeMetrics
from node.metrics.server import MetricsServer
from protocol.errors import ConfigError
from protocol.stats import BusyWindow, Distribution, RecentRate, powers_of_two
from roles.worker.averaging.rounds import _payload_bytes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_distribution_counts_values_at_or_below_each_bound():
    d = Distribution([1.0, 2.0, 4.0])
    for value in (0.5, 1.0, 1.5, 4.0, 9.0):
        d.observe(value)
    snap = d.snapshot()
    assert snap.cumulative == (2, 3, 4, 5)
    assert snap.count == 5 and snap.total == pytest.approx(16.0)


def test_batch_size_bounds_are_powers_of_two_up_to_the_max():
    assert powers_of_two(8) == (1.0, 2.0, 4.0, 8.0)
    assert powers_of_two(6) == (1.0, 2.0, 4.0, 6.0)
    assert powers_of_two(1) == (1.0, )


def test_busy_window_is_the_busy_share_of_the_recent_window():
    clock = Clock()
    busy = BusyWindow(window_s=10.0, clock=clock)
    clock.now += 10
    busy.record(102.0, 104.0)
    busy.record(106.0, 107.0)
    assert busy.ratio() == pytest.approx(0.3)
    clock.now += 8  # the window is now [108, 118]: nothing recorded in it
    assert busy.ratio() == 0.0


def test_recent_rate_counts_only_the_window_since_the_start():
    clock = Clock()
    rate = RecentRate(window_s=10.0, clock=clock)
    clock.now += 2
    rate.add(100)
    assert rate.rate() == pytest.approx(50.0)  # 2 s since the start
    clock.now += 20
    assert rate.rate() == 0.0


def _families(metrics: NodeMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}


def test_every_series_carries_the_node_labels_and_a_broken_source_is_skipped_and_logged_once(caplog):
    metrics = NodeMetrics("worker", "12D3KooWpeer")
    metrics.labels.run, metrics.labels.stage = "run-1", "2"
    metrics.bytes["pipeline"] = lambda: (10, 20)
    d = Distribution([0.1, 1.0])
    d.observe(0.5)

    def broken(f):
        raise RuntimeError("bug in a source")

    metrics.add("broken", broken)
    metrics.add("fine", lambda f: [f.histogram("agora_test_seconds", "test", {("forward", ): d.snapshot()},
                                               ("pass", ))])
    with caplog.at_level(logging.WARNING, logger="agora.metrics"):
        first, second = _families(metrics), _families(metrics)
    assert sum("'broken' failed" in r.getMessage() for r in caplog.records) == 1
    assert first.keys() == second.keys()
    histogram = first["agora_test_seconds"]
    assert histogram.type == "histogram"
    buckets = {s.labels["le"]: s.value for s in histogram.samples if s.name.endswith("_bucket")}
    assert buckets == {"0.1": 0, "1.0": 1, "+Inf": 1}
    for family in first.values():
        for sample in family.samples:
            assert (sample.labels["run"], sample.labels["role"], sample.labels["stage"], sample.labels["peer"]) == \
                ("run-1", "worker", "2", "12D3KooWpeer"), sample
    assert first["agora_bytes_sent"].samples[0].value == 10


def test_readiness_needs_the_node_serving_and_the_role_ready():
    metrics = NodeMetrics("trainer", "p")
    assert metrics.ready_reason() == "starting"
    metrics.readiness = lambda: None
    assert metrics.ready_reason() == "starting"
    metrics.not_ready = "serving"
    assert metrics.ready_reason() is None
    metrics.not_ready = "draining"
    assert metrics.ready_reason() == "draining"


async def _http(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_metrics_port_serves_metrics_health_and_readiness():
    async def scenario():
        metrics = NodeMetrics("worker", "p")
        server = MetricsServer(metrics, "127.0.0.1", 0)
        await server.start()
        try:
            status, body = await _http(server.port, "/metrics")
            assert status == 200 and b"agora_node_info" in body
            assert (await _http(server.port, "/healthz"))[0] == 200
            status, body = await _http(server.port, "/readyz")
            assert status == 503 and b"starting" in body
            metrics.not_ready, metrics.readiness = "serving", lambda: None
            assert (await _http(server.port, "/readyz"))[0] == 200
            assert (await _http(server.port, "/elsewhere"))[0] == 404
            assert (await _http(server.port, "/metrics", "POST"))[0] == 405
            taken = MetricsServer(metrics, "127.0.0.1", server.port)
            with pytest.raises(ConfigError, match="already in use"):
                await taken.start()
        finally:
            await server.close()

    asyncio.run(scenario())


def test_payload_bytes_of_a_butterfly_round():
    peers = ["a", "b", "c"]
    sizes = [10, 20, 30]
    # as sender b: parts of a's and c's slices out, their averages back (5 values of a's never came)
    telemetry = {"index": 1, "reducer": {"received": {"a": 20, "b": 20, "c": 20}}}
    sent, received = _payload_bytes(telemetry, peers, sizes, failed_total=5)
    # sent: 40 values of parts + our averaged slice (20) to the 2 others; received: 35 back + 2 x 20 parts
    assert sent == 4 * (40 + 2 * 20)
    assert received == 4 * (35 + 40)
    assert _payload_bytes({"reducer": None}, peers, sizes, 0) == (0, 0)
