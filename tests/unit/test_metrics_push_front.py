"""The push front in process (authorizer.metrics_push behind the app's BodyLimit), forwarding to a
real Pushgateway: who may push what, each refusal typed and counted, and the body limit of the
push path alone raised to 4 MiB."""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from authorizer.app import MAX_BODY_BYTES, BodyLimit
from authorizer.errors import AuthorizerError
from authorizer.metrics_push import MAX_PUSH_BODY_BYTES, PUSH_REGISTRY, PushFront, push_router
from protocol.credentials import Credential, root_public_key_bytes, sign_credential
from protocol.identity import Identity
from protocol.metrics_token import make_push_token
from tests.support.prometheus import shared_pushgateway as pushgateway  # noqa: F401 (a fixture)

ROOT = Ed25519PrivateKey.generate()
RUN = "run-front"
NODE = Identity(Ed25519PrivateKey.generate(), path="")
OTHER = Identity(Ed25519PrivateKey.generate(), path="")
PEER, OTHER_PEER = NODE.peer_id.to_base58(), OTHER.peer_id.to_base58()


def credential(identity: Identity = NODE, root=ROOT, serial: int = 1) -> bytes:
    now = int(time.time())
    return sign_credential(root, Credential(
        run_id=RUN, peer_id=identity.peer_id.to_base58(), public_key=identity.public_key, role="worker", stage=0,
        issued_at=now, expires_at=now + 1800, serial=serial)).to_bytes()


def token(identity: Identity = NODE, **kwargs) -> dict[str, str]:
    return {"Authorization": f"Bearer {make_push_token(identity, credential(identity, **kwargs))}"}


def body(peer: str = PEER, *, series: int = 1, **labels) -> bytes:
    registry = CollectorRegistry()
    names = {"run": RUN, "role": "worker", "stage": "0", "peer": peer, **labels}
    gauge = Gauge("agora_worker_stage_step", "step", [*names, "n"], registry=registry)
    for n in range(series):
        gauge.labels(**names, n=str(n)).set(n)
    return generate_latest(registry)


def path(instance: str = PEER, job: str = "agora-node") -> str:
    return f"/v1/metrics/push/metrics/job/{job}/instance/{instance}"


def counted(outcome: str) -> float:
    return PUSH_REGISTRY.get_sample_value("agora_metrics_push_front_total", {"outcome": outcome}) or 0.0


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def make_app():
    """`make_app(gateway_url, revoked=(serials, peers))`: a client of the push router with the app's
    error shape and BodyLimit, as authorizer.app assembles them, on one event loop until teardown."""
    clients: list[TestClient] = []

    def make(gateway_url: str | None, revoked=((), ())) -> tuple[TestClient, Clock]:
        client, clock = build_app(gateway_url, revoked)
        clients.append(client.__enter__())
        return client, clock

    yield make
    for client in clients:
        client.__exit__(None, None, None)


def build_app(gateway_url: str | None, revoked) -> tuple[TestClient, Clock]:
    app = FastAPI()
    clock = Clock()

    async def read_revoked(now: float):
        return list(revoked[0]), list(revoked[1])

    app.state.pushgateway_url = gateway_url
    if gateway_url is not None:
        app.state.metrics_push = PushFront(gateway_url=gateway_url, root_public_key=root_public_key_bytes(ROOT),
                                           run_id=RUN, revoked=read_revoked, clock=clock)
    app.include_router(push_router)

    @app.exception_handler(AuthorizerError)
    async def _error(_: Request, exc: AuthorizerError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers() or None)

    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)
    return TestClient(app), clock


def refusal(response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"]
    return error["message"]


def test_a_nodes_push_is_forwarded_under_its_peer_id(make_app, pushgateway):
    client, _ = make_app(pushgateway.url)
    before = counted("ok")
    response = client.put(path(), content=body(), headers={**token(), "Content-Type": "text/plain; version=0.0.4"})
    assert response.status_code == 200, response.text
    assert counted("ok") == before + 1
    assert {"job": "agora-node", "instance": PEER} in [
        {k: g[k] for k in ("job", "instance")} for g in pushgateway.groups() if "instance" in g]
    lines = [line for line in pushgateway.metrics_text().splitlines()
             if line.startswith("agora_worker_stage_step{") and f'instance="{PEER}"' in line]
    assert lines and f'peer="{PEER}"' in lines[0] and 'job="agora-node"' in lines[0]

    assert client.delete(path(), headers=token()).status_code == 202
    assert PEER not in [g.get("instance") for g in pushgateway.groups()]


@pytest.mark.parametrize("headers, reason", [
    ({}, "missing_token"),
    ({"Authorization": "Basic abc"}, "missing_token"),
    ({"Authorization": "Bearer not-a-token"}, "malformed"),
])
def test_no_or_junk_token_is_401(make_app, pushgateway, headers, reason):
    client, _ = make_app(pushgateway.url)
    before = counted(reason)
    response = client.put(path(), content=body(), headers=headers)
    assert refusal(response, 401, "push_unauthorized").startswith(reason)
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert counted(reason) == before + 1


def test_forged_token_is_401(make_app, pushgateway):
    client, _ = make_app(pushgateway.url)
    forged = token(root=Ed25519PrivateKey.generate())  # a credential no authorizer of this run signed
    before = counted("credential_bad_signature")
    assert refusal(client.put(path(), content=body(), headers=forged), 401,
                   "push_unauthorized").startswith("credential_bad_signature")
    assert counted("credential_bad_signature") == before + 1


def test_revoked_credential_is_401(make_app, pushgateway):
    client, _ = make_app(pushgateway.url, revoked=((), (PEER,)))
    assert refusal(client.put(path(), content=body(), headers=token()), 401,
                   "push_unauthorized").startswith("credential_revoked")


def test_another_nodes_instance_or_job_is_403(make_app, pushgateway):
    client, _ = make_app(pushgateway.url)
    before = counted("wrong_grouping")
    assert PEER in refusal(client.put(path(OTHER_PEER), content=body(), headers=token()), 403, "push_forbidden")
    refusal(client.put(path(job="other"), content=body(), headers=token()), 403, "push_forbidden")
    refusal(client.put(path() + "/extra/label", content=body(), headers=token()), 403, "push_forbidden")
    assert counted("wrong_grouping") == before + 3
    assert OTHER_PEER not in [g.get("instance") for g in pushgateway.groups()]


@pytest.mark.parametrize("labels", [{"peer": OTHER_PEER}, {"run": "another-run"}, {"role": "trainer"},
                                    {"instance": OTHER_PEER}])
def test_labels_naming_another_node_are_403(make_app, pushgateway, labels):
    client, _ = make_app(pushgateway.url)
    pushed = body(**labels) if "peer" not in labels else body(peer=labels["peer"])
    before = counted("wrong_labels")
    refusal(client.put(path(), content=pushed, headers=token()), 403, "push_forbidden")
    assert counted("wrong_labels") == before + 1


def test_not_text_format_is_415_and_junk_is_400(make_app, pushgateway):
    client, _ = make_app(pushgateway.url)
    refusal(client.put(path(), content=b"\x00\x01", headers={
        **token(), "Content-Type": "application/vnd.google.protobuf; proto=io.prometheus.client.MetricFamily"}),
        415, "unsupported_media_type")
    refusal(client.put(path(), content=body(), headers={**token(), "Content-Encoding": "gzip"}),
            415, "unsupported_media_type")
    refusal(client.put(path(), content=b"this is { not metrics", headers=token()), 400, "invalid_request")


def test_push_path_takes_4_mib_and_no_more(make_app, pushgateway):
    client, _ = make_app(pushgateway.url)
    big = body(series=3000)
    assert MAX_BODY_BYTES < len(big) < MAX_PUSH_BODY_BYTES
    assert client.put(path(), content=big, headers=token()).status_code == 200
    refusal(client.put(path(), content=b"#" * (MAX_PUSH_BODY_BYTES + 1), headers=token()), 413, "payload_too_large")
    # other paths keep the app's 64 KiB
    refusal(client.post("/v1/join", content=b"{" + b" " * MAX_BODY_BYTES + b"}"), 413, "payload_too_large")


def test_a_peer_pushing_too_fast_is_429(make_app, pushgateway):
    client, clock = make_app(pushgateway.url)
    statuses = [client.put(path(), content=body(), headers=token()).status_code for _ in range(12)]
    assert statuses[:10] == [200] * 10 and statuses[10:] == [429, 429]
    clock.now += 1.0  # one push a second refills
    assert client.put(path(), content=body(), headers=token()).status_code == 200


def test_no_gateway_is_404_and_a_dead_gateway_is_502(make_app):
    client, _ = make_app(None)
    refusal(client.put(path(), content=body(), headers=token()), 404, "not_found")
    dead, _ = make_app("http://127.0.0.1:9")  # discard port: nothing answers
    before = counted("gateway_failed")
    refusal(dead.put(path(), content=body(), headers=token()), 502, "pushgateway_unavailable")
    assert counted("gateway_failed") == before + 1
