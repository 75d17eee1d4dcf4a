"""MetricsPusher against a real Pushgateway, and against a tiny front that records what it got:
grouping by peer id, the bearer token, outcomes counted, failures never raised and logged once,
and a push that never holds the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, Gauge

from node.metrics.push import MetricsPusher
from tests.support.prometheus import Pushgateway
from tests.support.prometheus import shared_pushgateway as pushgateway  # noqa: F401 (a fixture)

PEER_A = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
PEER_B = "12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
LABELS = {"run": "run-a", "role": "worker", "stage": "0", "peer": PEER_A}


def registry_with(value: float) -> CollectorRegistry:
    registry = CollectorRegistry()
    Gauge("agora_worker_stage_step", "step", list(LABELS), registry=registry).labels(**LABELS).set(value)
    return registry


def pusher(registry, url, instance=PEER_A, token=lambda: None, interval_s=1.0) -> MetricsPusher:
    return MetricsPusher(registry, url, {"job": "agora-node", "instance": instance}, token, interval_s,
                         labels=LABELS, timeout_s=10)


def pushes(registry, outcome: str) -> float:
    return registry.get_sample_value("agora_metrics_pushes_total", {**LABELS, "outcome": outcome}) or 0.0


def step_lines(gateway: Pushgateway) -> list[str]:
    return [line for line in gateway.metrics_text().splitlines() if line.startswith("agora_worker_stage_step{")]


def test_push_groups_by_peer_and_a_restart_replaces_its_own_group(pushgateway):
    first = registry_with(5)
    assert asyncio.run(pusher(first, pushgateway.url).push_once()) == "ok"
    assert pushes(first, "ok") == 1 and pushes(first, "failed") == 0
    assert asyncio.run(pusher(registry_with(9), pushgateway.url, instance=PEER_B).push_once()) == "ok"
    # the same identity restarted: a fresh registry, the same grouping key, replaces the old values
    assert asyncio.run(pusher(registry_with(7), pushgateway.url).push_once()) == "ok"

    # only these two instances: the gateway is on a shared machine, where a stray process may push too
    groups = [g for g in pushgateway.groups() if g.get("instance") in (PEER_A, PEER_B)]
    assert sorted(g["instance"] for g in groups) == sorted([PEER_A, PEER_B])
    assert all(g["job"] == "agora-node" for g in groups)
    lines = [line for line in step_lines(pushgateway) if PEER_A in line or PEER_B in line]
    mine = [line for line in lines if f'instance="{PEER_A}"' in line]
    assert len(mine) == 1 and mine[0].endswith(" 7"), lines
    assert any(f'instance="{PEER_B}"' in line and line.endswith(" 9") for line in lines), lines
    assert all('job="agora-node"' in line and 'run="run-a"' in line for line in lines)


def test_run_pushes_on_its_interval_and_once_more_at_stop(pushgateway):
    registry = registry_with(1)

    async def scene():
        stop = asyncio.Event()
        p = pusher(registry, pushgateway.url, instance="12D3KooWrun", interval_s=1.0)
        task = asyncio.create_task(p.run(stop))
        while pushes(registry, "ok") < 2:  # two pushes on the interval
            await asyncio.sleep(0.1)
        before = pushes(registry, "ok")
        stop.set()
        await asyncio.wait_for(task, 60)
        await p.close()
        return before

    before = asyncio.run(asyncio.wait_for(scene(), 120))
    assert pushes(registry, "ok") == before + 1, "one last push when stop is set"
    pushed = [line for line in pushgateway.metrics_text().splitlines()
              if line.startswith("agora_metrics_pushes_total{") and 'instance="12D3KooWrun"' in line
              and 'outcome="ok"' in line]
    assert pushed, "the pushes counter is pushed with the rest"


class Front:
    """A stand-in push front on 127.0.0.1:0: records each request, answers `status`, and can hold
    a request until released."""

    def __init__(self, status: int = 200, hold: bool = False):
        self.status, self.hold = status, hold
        self.requests: list[dict] = []
        self.arrived, self.release = threading.Event(), threading.Event()
        front = self

        class Handler(BaseHTTPRequestHandler):
            def do_PUT(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                front.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                front.arrived.set()
                if front.hold:
                    front.release.wait(60)
                payload = json.dumps({"error": {"code": "bad_push_token", "message": "credential_expired: renew"}})
                self.send_response(front.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload.encode())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metrics/push"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def front_factory():
    fronts = []

    def make(**kwargs) -> Front:
        fronts.append(Front(**kwargs))
        return fronts[-1]

    yield make
    for front in fronts:
        front.close()


def test_bearer_token_and_the_url_the_front_sees(front_factory):
    front = front_factory()
    tokens = iter(["tok-1", "tok-2"])
    registry = registry_with(3)
    p = pusher(registry, front.url + "/", token=lambda: next(tokens))
    assert asyncio.run(p.push_once()) == "ok"
    assert asyncio.run(p.push_once()) == "ok"
    assert [r["headers"].get("Authorization") for r in front.requests] == ["Bearer tok-1", "Bearer tok-2"]
    assert front.requests[0]["path"] == f"/v1/metrics/push/metrics/job/agora-node/instance/{PEER_A}"
    assert b"agora_worker_stage_step{" in front.requests[0]["body"]
    assert front.requests[0]["headers"]["Content-Type"].startswith("text/plain")


def test_no_token_sends_no_authorization(front_factory):
    front = front_factory()
    assert asyncio.run(pusher(registry_with(1), front.url).push_once()) == "ok"
    assert "Authorization" not in front.requests[0]["headers"]


def test_refusals_and_failures_are_counted_never_raised_and_logged_once(front_factory, caplog):
    front = front_factory(status=401)
    with socket.socket() as sock:  # a port with nothing listening: connection refused
        sock.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{sock.getsockname()[1]}/v1/metrics/push"
    registry = registry_with(1)
    refused, failing = pusher(registry, front.url, token=lambda: "t"), pusher(registry_with(1), dead)
    caplog.set_level(logging.INFO, logger="agora.metrics.push")

    async def scene():
        return [await refused.push_once() for _ in range(3)], [await failing.push_once() for _ in range(3)]

    refused_outcomes, failed_outcomes = asyncio.run(scene())
    assert refused_outcomes == ["refused"] * 3 and failed_outcomes == ["failed"] * 3
    assert pushes(registry, "refused") == 3 and pushes(registry, "ok") == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "agora.metrics.push"]
    assert len(lines) == 2, lines  # one per pusher within the minute
    assert "answered 401: credential_expired: renew" in lines[0] and "\n" not in lines[0]
    assert dead.split("/v1")[0] in lines[1]


def test_a_slow_push_never_holds_the_event_loop(front_factory):
    """The front holds the request until the loop itself releases it: a push that blocked the loop
    would never let that happen (the test would time out instead)."""
    front = front_factory(hold=True)
    registry = registry_with(1)

    async def scene():
        p = pusher(registry, front.url)
        task = asyncio.create_task(p.push_once())
        await asyncio.to_thread(front.arrived.wait, 60)
        assert not task.done()
        front.release.set()
        outcome = await asyncio.wait_for(task, 60)
        await p.close()
        return outcome

    assert asyncio.run(asyncio.wait_for(scene(), 120)) == "ok"


def test_grouping_key_must_name_the_job():
    with pytest.raises(ValueError, match="job"):
        MetricsPusher(CollectorRegistry(), "http://127.0.0.1:1", {"instance": PEER_A}, lambda: None, 1.0)


def test_close_without_a_push_is_a_no_op():
    p = pusher(registry_with(1), "http://127.0.0.1:1")
    asyncio.run(p.close())
    asyncio.run(p.close())
