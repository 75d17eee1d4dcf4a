"""The node's side of the authorizer API (node.admission): URLs checked at once, a countdown
while no authorizer answers, and failover between authorizers sharing one PostgreSQL database
for join, poll, renewal, revocations and leave."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import httpx
import pytest

from node.admission import AuthorizerClient, CredentialKeeper, join_run, parse_authorizer_url
from node.timefmt import duration, until
from protocol.errors import ConfigError
from tests.authorizer.helpers import ADMIN

pytestmark = pytest.mark.timeout(150)
HARDWARE = {"device_name": "cpu", "vram_bytes": 0, "ram_bytes": 1 << 34, "bandwidth_mbps": 1000.0, "latency_ms": 1.0}
CHECKS = ("--checks", "capability,integrity", "--join-rate", "100")


@pytest.mark.parametrize("text, phrase", [
    ("127.0.0.1:8000", "has no scheme; write it as a URL, e.g. http://127.0.0.1:8000"),
    ("ftp://host:8000", "uses ftp://"),
    ("http://:8000", "names no host"),
    ("http://host:99999", "has a bad port"),
    ("http://host:port", "has a bad port"),
    ("http://host:0", "port 0"),
])
def test_malformed_authorizer_url_is_one_sentence(text, phrase):
    with pytest.raises(ConfigError) as raised:
        parse_authorizer_url(text)
    assert phrase in str(raised.value) and "\n" not in str(raised.value)


def test_authorizer_urls_are_normalised():
    assert parse_authorizer_url(" http://Host:8000/ ") == "http://Host:8000"
    assert parse_authorizer_url("https://auth.example/agora/") == "https://auth.example/agora"


def test_times_read_as_dates_and_durations():
    assert [duration(s) for s in (0.4, 12, 292, 1800, 7500)] == ["0.4 s", "12 s", "4 min 52 s", "30 min", "2 h 5 min"]
    text = until(time.time() + 1800)
    assert text.startswith("until ") and " UTC, in 30 min" in text


def _dead_url() -> str:
    """A URL nothing listens on: a port bound and closed again (refused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_unreachable_authorizer_counts_down_then_gives_up(caplog):
    from protocol.identity import Identity
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    url = _dead_url()
    identity = Identity(Ed25519PrivateKey.generate(), path="")

    async def attempt():
        client = AuthorizerClient(url)
        try:
            await join_run(client, identity, "trainer", hardware=HARDWARE, announce_maddrs=[], timeout_s=2.5)
        finally:
            await client.close()

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="node.admission"), pytest.raises(ConfigError) as raised:
        asyncio.run(attempt())
    assert time.monotonic() - started < 10
    lines = [r.getMessage() for r in caplog.records]
    assert lines and all(f"authorizer {url} unreachable (connection refused); retrying in" in line for line in lines)
    assert "giving up in" in lines[0]
    assert "gave up after 2.5 s (--admission-timeout-s)" in str(raised.value)


def test_failover_between_two_authorizers_on_one_database(start_authorizer, postgres, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from protocol.identity import Identity

    db = postgres.create_database(f"failover_{int(time.time() * 1000)}")
    data = str(tmp_path / "shared")
    one = start_authorizer(*CHECKS, "--credential-ttl-s", "60", db=db, data_dir=data)
    two = start_authorizer(*CHECKS, "--credential-ttl-s", "60", db=db, data_dir=data)
    dead = _dead_url()
    identity = Identity(Ed25519PrivateKey.generate(), path="")
    peer_id = identity.peer_id.to_base58()

    async def scenario():
        client = AuthorizerClient([dead, one.url, two.url])
        try:
            admission = await join_run(client, identity, "trainer", hardware=HARDWARE, announce_maddrs=[],
                                       timeout_s=10)
            assert client.url == one.url  # the dead one was skipped, and the client sticks to one
            run_id = admission.credential.credential.run_id
            one.kill()  # the authorizer the node uses dies
            renewed = []
            keeper = CredentialKeeper(client, identity, run_id, admission.credential, renewed.append)
            await keeper._renew(asyncio.Event())
            assert keeper.failure is None and renewed and client.url == two.url
            assert renewed[0].credential.serial != admission.credential.credential.serial
            revocations = await client.revocations()
            assert revocations.run_id == run_id
            left = await client.leave(identity, run_id)
            assert left.status.value == "left"
        finally:
            await client.close()

    asyncio.run(scenario())
    with httpx.Client(base_url=two.url, timeout=30) as http:
        rows = http.get("/v1/admin/participants", headers=ADMIN).json()["participants"]
        assert [(r["peer_id"], r["status"]) for r in rows] == [(peer_id, "left")]
        assert http.get("/v1/run").json()["trainers"]["admitted"] == 0
