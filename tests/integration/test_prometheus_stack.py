"""The metrics pipeline end to end [report 3.6.3.1]: a real authorizer with --pushgateway in front
of a real Pushgateway; one worker admitted by it pushes its metrics through the front
(--metrics-push), another serves --metrics-port; a real Prometheus scrapes the Pushgateway (with
honor_labels) and that worker, and its HTTP API shows both nodes' series with their run, role,
stage and peer labels, and a pushed counter advancing. The front refuses a push without a token,
with a forged one, and one for another node's instance."""

from __future__ import annotations

import base64
import time
import uuid

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from authorizer.testing import NodeKey
from protocol.credentials import Credential, sign_credential
from protocol.identity import Identity
from protocol.metrics_token import make_push_token
from protocol.readiness import parse_ready_line
from tests.support.polling import poll_until
from tests.support.prometheus import Prometheus, Pushgateway, missing, sample_value, wait_for_series

pytestmark = pytest.mark.integration

ADMIN = "prometheus-stack-admin-token-0123"


@pytest.fixture
def pushgateway(tmp_path):
    reason = missing()
    if reason:
        pytest.skip(reason)
    gateway = Pushgateway(str(tmp_path / "pushgateway"))
    try:
        yield gateway.start()
    finally:
        gateway.stop()


def metrics_address(node) -> str:
    """host:port of the node's --metrics-port, from its readiness line's metrics= field."""
    for line in node.stdout_lines:
        fields = parse_ready_line(line)
        if fields is not None and fields.get("metrics"):
            return fields["metrics"].removeprefix("http://").rstrip("/")
    raise AssertionError(f"{node.name} printed no readiness line with metrics=")


def admitted_credential(url: str, run_id: str, key: NodeKey) -> bytes:
    """Join as a trainer with `key` and return the credential bytes once admitted."""
    response = httpx.post(f"{url}/v1/join", json=key.join_body(role="trainer", run_id=run_id), timeout=30)
    assert response.status_code == 200, response.text
    ticket = response.json()["ticket"]

    seen = {}

    def admitted():
        seen.update(httpx.get(f"{url}/v1/join/{ticket}", timeout=30).json())
        assert seen["status"] in ("queued", "admitted"), seen
        return seen["admission"]["credential_msgpack"] if seen["status"] == "admitted" else None

    try:
        return base64.b64decode(poll_until(admitted, 90, "the test's trainer identity to be admitted", period_s=0.5))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last answer {seen}") from None


def push_body(run_id: str, peer: str, role: str = "trainer") -> bytes:
    registry = CollectorRegistry()
    Gauge("agora_trainer_lanes", "lanes", ["run", "role", "stage", "peer"], registry=registry).labels(
        run=run_id, role=role, stage="", peer=peer).set(1)
    return generate_latest(registry)


def front_counts(url: str) -> dict[str, float]:
    """The push front's counts by outcome on the authorizer's /metrics ({} if it does not answer)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    if response.status_code != 200:
        return {}
    return {sample.labels["outcome"]: sample.value
            for family in text_string_to_metric_families(response.text)
            if family.name == "agora_metrics_push_front" for sample in family.samples
            if sample.name == "agora_metrics_push_front_total"}


@pytest.mark.timeout(420)
def test_pushed_and_scraped_nodes_reach_prometheus(make_swarm, run_config_path, pushgateway, tmp_path):
    run_id = f"prom-{uuid.uuid4().hex[:6]}"
    config = run_config_path(run_id=run_id)
    swarm = make_swarm(None)
    authorizer = swarm.start_authorizer([
        "--run-config", config, "--data-dir", str(tmp_path / "authorizer"), "--port", "0", "--admin-token", ADMIN,
        "--checks", "capability,integrity", "--pushgateway", pushgateway.url, "--no-monitor"], timeout_s=120)
    push_url = f"{authorizer.url}/v1/metrics/push"
    pushing = swarm.start("worker", args=["--authorizer", authorizer.url, "--metrics-push", push_url,
                                          "--metrics-push-interval-s", "1"], name="pushing", timeout_s=180)
    scraped = swarm.start("worker", args=["--authorizer", authorizer.url, "--metrics-port", "0"], name="scraped",
                          timeout_s=180)
    assert None not in (pushing.stage, scraped.stage) and pushing.stage != scraped.stage, "placed on two stages"

    prometheus = Prometheus(str(tmp_path / "prometheus"), [
        {"job_name": "pushgateway", "honor_labels": True,
         "static_configs": [{"targets": [pushgateway.url.removeprefix("http://")]}]},
        {"job_name": "agora-node", "static_configs": [{"targets": [metrics_address(scraped)]}]},
    ])
    try:
        prometheus.start()
        # the pushed node: its grouping key (job, instance = peer id) and its own labels
        [series] = wait_for_series(prometheus, f'agora_node_ready{{peer="{pushing.peer_id}"}}', 120,
                                   "the pushing worker's series in Prometheus (through the front and the gateway)")
        assert {k: series["metric"].get(k) for k in ("job", "instance", "run", "role", "stage", "peer")} == {
            "job": "agora-node", "instance": pushing.peer_id, "run": run_id, "role": "worker",
            "stage": str(pushing.stage), "peer": pushing.peer_id}, series
        # the scraped node: the scrape's job and instance, its own labels
        [series] = wait_for_series(prometheus, f'agora_node_ready{{peer="{scraped.peer_id}"}}', 120,
                                   "the scraped worker's series in Prometheus")
        assert {k: series["metric"].get(k) for k in ("job", "instance", "run", "role", "stage", "peer")} == {
            "job": "agora-node", "instance": metrics_address(scraped), "run": run_id, "role": "worker",
            "stage": str(scraped.stage), "peer": scraped.peer_id}, series
        assert sample_value(wait_for_series(prometheus, 'up{job="agora-node"} == 1', 60)[0]) == 1

        # a pushed counter advances: every push counts itself
        pushes = f'agora_metrics_pushes_total{{peer="{pushing.peer_id}", outcome="ok"}}'
        first = sample_value(wait_for_series(prometheus, pushes, 60)[0])
        poll_until(lambda: sample_value(prometheus.query(pushes)[0]) > first, 120,
                   "the pushed agora_metrics_pushes_total to advance in Prometheus", period_s=0.5)
        assert wait_for_series(prometheus, f'push_time_seconds{{instance="{pushing.peer_id}"}}', 60)
    finally:
        prometheus.stop()

    # what the front refuses, against the real authorizer
    target = f"{push_url}/metrics/job/agora-node/instance/{pushing.peer_id}"
    before = front_counts(authorizer.url)
    body = push_body(run_id, pushing.peer_id, role="worker")

    answer = httpx.put(target, content=body, timeout=30)
    assert answer.status_code == 401 and answer.json()["error"]["message"].startswith("missing_token"), answer.text

    # forged: a credential for the pushing node's peer id, signed by a root key that is not the run's
    forger = Identity(Ed25519PrivateKey.generate(), path="")
    now = int(time.time())
    forged = sign_credential(Ed25519PrivateKey.generate(), Credential(
        run_id=run_id, peer_id=forger.peer_id.to_base58(), public_key=forger.public_key, role="worker", stage=0,
        issued_at=now, expires_at=now + 600, serial=1)).to_bytes()
    answer = httpx.put(target, content=body, timeout=30,
                       headers={"Authorization": f"Bearer {make_push_token(forger, forged)}"})
    assert answer.status_code == 401, answer.text
    assert answer.json()["error"]["message"].startswith("credential_bad_signature"), answer.text

    # a real admitted node's token, for another node's instance
    key = NodeKey.generate()
    other = Identity(key.private_key, path="")  # type: ignore[arg-type]
    token = make_push_token(other, admitted_credential(authorizer.url, run_id, key))
    answer = httpx.put(target, content=body, timeout=30, headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 403 and answer.json()["error"]["code"] == "push_forbidden", answer.text
    # the same token for its own instance is forwarded
    answer = httpx.put(f"{push_url}/metrics/job/agora-node/instance/{key.peer_id}", timeout=30,
                       content=push_body(run_id, key.peer_id), headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code == 200, answer.text
    assert key.peer_id in [group.get("instance") for group in pushgateway.groups()]

    refusals = ("missing_token", "credential_bad_signature", "wrong_grouping")

    def counted() -> dict[str, float]:  # the authorizer caches /metrics for about a second
        after = front_counts(authorizer.url)
        return after if all(after.get(o, 0) > before.get(o, 0) for o in refusals) else {}

    after = poll_until(counted, 30, "the push front's refusals on the authorizer's /metrics", period_s=0.5)
    for outcome in refusals:
        assert after[outcome] == before.get(outcome, 0) + 1, (outcome, before, after)
    assert after.get("ok", 0) > before.get("ok", 0)
