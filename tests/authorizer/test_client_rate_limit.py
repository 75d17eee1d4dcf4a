"""The node's admission client against a rate-limiting authorizer (a real process with small limits,
over real HTTP): a join or poll answered 429 waits the Retry-After and goes on, within
--admission-timeout-s; a renewal answered 429 is retried before the credential expires."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from authorizer.testing import NodeKey
from node.admission import AdmissionRejected, AuthorizerClient, CredentialKeeper, join_run
from protocol.identity import Identity

pytestmark = pytest.mark.timeout(120)
HARDWARE = {"device_name": "cpu", "vram_bytes": 0, "ram_bytes": 1 << 34, "bandwidth_mbps": 1000.0, "latency_ms": 1.0}
JOIN_RATE = 0.25  # a token every 4 s: Retry-After 4, longer than a loaded machine stalls between two calls
NODE_BURST = 3


@pytest.fixture(scope="module")
def authorizer(module_starter):
    return module_starter("--checks", "capability,integrity", "--join-rate", "1000",
                          "--source-join-burst", "2", "--source-join-rate", str(JOIN_RATE),
                          "--node-request-burst", str(NODE_BURST), "--node-request-rate", "0.5")


def identity() -> Identity:
    return Identity(Ed25519PrivateKey.generate(), path="")


def spend_join_tokens(url: str) -> None:
    """Join with throwaway identities until this address is refused: its join bucket is empty."""
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(10):
            if http.post("/v1/join", json=NodeKey.generate().join_body(role="trainer")).status_code == 429:
                return
    raise AssertionError("the join limit never answered 429")


async def join(url: str, node: Identity, timeout_s: float):
    client = AuthorizerClient(url)
    try:
        return await join_run(client, node, "trainer", hardware=HARDWARE, announce_maddrs=[], timeout_s=timeout_s)
    finally:
        await client.close()


def test_joins_answered_429_wait_and_are_admitted(authorizer, caplog):
    spend_join_tokens(authorizer.url)

    async def fleet():
        return await asyncio.gather(*(join(authorizer.url, identity(), 30) for _ in range(3)))

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="node.admission"):
        admissions = asyncio.run(fleet())
    assert all(a.credential.credential.serial for a in admissions)
    assert time.monotonic() - started >= 1 / JOIN_RATE  # three joins on an empty bucket: tokens were waited for
    lines = [r.getMessage() for r in caplog.records if "is rate limiting this node" in r.getMessage()]
    assert lines and all("too many joins from 127.0.0.1" in line and "retrying in" in line for line in lines)


def test_rate_limited_past_the_admission_timeout_is_not_admitted(authorizer):
    spend_join_tokens(authorizer.url)
    started = time.monotonic()
    with pytest.raises(AdmissionRejected) as raised:
        asyncio.run(join(authorizer.url, identity(), 0.5))
    assert raised.value.reason == "rate_limited" and raised.value.exit_code == 4
    assert "gave up after 0.5 s (--admission-timeout-s)" in str(raised.value)
    assert time.monotonic() - started < 1 / JOIN_RATE + 1


def test_a_renewal_answered_429_is_retried_before_the_credential_expires(authorizer, caplog):
    node = identity()
    spend_join_tokens(authorizer.url)  # the join itself waits once, too

    async def scenario():
        client = AuthorizerClient(authorizer.url)
        try:
            admission = await join_run(client, node, "trainer", hardware=HARDWARE, announce_maddrs=[], timeout_s=30)
            run_id = admission.credential.credential.run_id
            # spend the node's own tokens with renewals of its own, until it is refused
            async with httpx.AsyncClient(base_url=authorizer.url, timeout=30) as http:
                key = NodeKey.from_identity(node)
                for _ in range(NODE_BURST + 2):
                    answer = await http.post("/v1/renew", json=key.proof_body("renew", run_id))
                    if answer.status_code == 429:
                        assert json.loads(answer.content)["error"]["code"] == "rate_limited"
                        assert int(answer.headers["retry-after"]) >= 1
                        break
                else:
                    raise AssertionError("the node's renewals were never limited")
            renewed = []
            keeper = CredentialKeeper(client, node, run_id, admission.credential, renewed.append)
            stop = asyncio.Event()
            await asyncio.wait_for(keeper._renew(stop), 30)
            return admission, keeper, renewed, stop
        finally:
            await client.close()

    with caplog.at_level(logging.WARNING, logger="node.admission"):
        admission, keeper, renewed, stop = asyncio.run(scenario())
    assert keeper.failure is None and not stop.is_set() and len(renewed) == 1
    assert renewed[0].credential.serial > admission.credential.credential.serial
    assert renewed[0].credential.expires_at > time.time()
    assert any("retrying renewal in" in r.getMessage() and "rate limiting" in r.getMessage() for r in caplog.records)
