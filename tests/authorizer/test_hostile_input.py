"""Hostile HTTP input against a live authorizer: schemathesis drives every operation of the served
OpenAPI spec with valid and invalid data, hypothesis throws raw bytes at every endpoint; nothing
may produce a 500 or crash the server, every error is the typed JSON shape, and the server still
answers /v1/run afterwards. Bounded: a few hundred requests in all."""

from __future__ import annotations

import collections
import gc
import json

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from tests.authorizer.helpers import ADMIN

# schemathesis imports its OpenAPI modules lazily, inside `from_url`, and pytest rewrites them
# (the package is a pytest plugin). CPython 3.11.7's AST constructor raises "recursion depth
# mismatch" when a garbage collection runs Python finalizers in the middle of that (seen in CI,
# with subprocess transports' finalizers pending). Import them here, with the collector paused.
gc.disable()
try:
    import schemathesis.specs.openapi.schemas  # noqa: E402, F401
finally:
    gc.enable()

pytestmark = pytest.mark.timeout(150)
# POST /v1/evidence takes msgpack (its spec says binary): generated bodies go as the raw bytes they are.
schemathesis.serializer.alias("application/msgpack", "application/octet-stream")

_SETTINGS = dict(deadline=None, database=None, derandomize=False,
                 suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def target(module_starter):
    # reachability stays off: generated joins would otherwise be dialed back; the checks that run
    # still see every body. A generated policy update may switch it on, hence the short timeout.
    return module_starter("--checks", "capability,integrity,accountability", "--join-rate", "1000",
                          "--reachability-timeout-s", "0.5")


def assert_typed(response, where: str) -> None:
    assert response.status_code < 500, f"{where}: {response.status_code} {response.text[:500]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
        assert body["error"]["message"].strip(), body


def assert_alive(url: str) -> None:
    response = httpx.get(f"{url}/v1/run", timeout=10)
    assert response.status_code == 200 and response.json()["run_id"] == "tiny"


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error(target, mode):
    schema = schemathesis.openapi.from_url(f"{target.url}/openapi.json", timeout=10)
    operations = [op.ok() for op in schema.get_all_operations()]
    assert len(operations) >= 11  # every endpoint is in the spec
    strategy = schema.as_strategy(generation_mode=mode, headers=dict(ADMIN))
    session = __import__("requests").Session()
    seen: collections.Counter = collections.Counter()

    @settings(max_examples=200, **_SETTINGS)
    @given(case=strategy)
    def check(case):
        response = case.call(base_url=target.url, session=session, timeout=10)
        assert_typed(response, f"{case.method} {case.formatted_path}")
        seen[(case.method, case.path, response.status_code // 100)] += 1

    check()
    assert_alive(target.url)
    assert len({(method, path) for method, path, _ in seen}) >= 8, seen  # most operations were exercised
    if mode == GenerationMode.POSITIVE:
        assert any(kind == 2 for _, _, kind in seen), seen


_PATHS = [("POST", "/v1/join"), ("POST", "/v1/renew"), ("POST", "/v1/leave"), ("POST", "/v1/admin/bans"),
          ("POST", "/v1/admin/unban"), ("PATCH", "/v1/admin/policy"), ("GET", "/v1/join/x"),
          ("GET", "/v1/admin/participants"), ("POST", "/v1/evidence"), ("GET", "/v1/admin/evidence")]
_JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=6),
    max_leaves=30,
)


def test_raw_bodies_never_break_the_server(target):
    with httpx.Client(base_url=target.url, timeout=10) as http:

        @settings(max_examples=150, **_SETTINGS)
        @given(where=st.sampled_from(_PATHS),
               body=st.one_of(st.binary(max_size=300), _JSONISH.map(lambda v: json.dumps(v).encode())),
               content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                             "multipart/form-data; boundary=x", ""]))
        def check(where, body, content_type):
            method, path = where
            headers = {**ADMIN, **({"content-type": content_type} if content_type else {})}
            assert_typed(http.request(method, path, content=body, headers=headers), f"{method} {path}")

        check()
    assert_alive(target.url)


def test_oversized_and_pathological_requests(target):
    with httpx.Client(base_url=target.url, timeout=30) as http:
        big = http.post("/v1/join", content=b"{" + b" " * 200_000 + b"}", headers={"content-type": "application/json"})
        assert big.status_code == 413 and big.json()["error"]["code"] == "payload_too_large"

        def chunks():
            for _ in range(100):
                yield b" " * 1024

        chunked = http.post("/v1/join", content=chunks(), headers={"content-type": "application/json"})
        assert chunked.status_code == 413
        deep = http.post("/v1/join", content=b"[" * 30_000 + b"]" * 30_000, headers={"content-type": "application/json"})
        assert_typed(deep, "deeply nested json")
        assert deep.status_code == 400
        for raw in (b"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: x\r\n\r\n{}",
                    b"POST /v1/join HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{}",  # body cut short
                    b"GARBAGE\r\n\r\n", b"\x16\x03\x01\x00\xa5\x01\x00\x00"):  # the last: a TLS hello
            assert _raw_exchange(target.url, raw) in (b"", *(str(c).encode() for c in range(400, 500)))
        for path in ("/v1/join/" + "a" * 5000, "/v1/join/%00%ff", "/v1/nothing", "/v1/join/../../etc/passwd"):
            assert_typed(http.get(path), path)
        assert http.delete("/v1/run").json()["error"]["code"] == "method_not_allowed"
        assert http.get("/v1/admin/policy").json()["error"]["code"] == "admin_unauthorized"
        assert http.get("/v1/admin/policy", headers={"Authorization": "Bearer wrong"}).status_code == 401
        bad_b64 = http.post("/v1/join", json={"peer_id": "12D3KooW" + "a" * 44, "public_key": "!!!", "role": "worker",
                                              "hardware": {}, "client_version": "1"})
        assert bad_b64.status_code == 400 and "public_key" in bad_b64.json()["error"]["message"]
    assert_alive(target.url)
    assert target.proc.poll() is None


def _raw_exchange(url: str, request: bytes) -> bytes:
    """Send raw bytes, return the status code of the answer (b"" if the server just closed)."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    return answer.split(b" ", 2)[1] if answer.startswith(b"HTTP/1.1 ") else b""


def test_generated_joins_with_valid_identities_reach_the_store(target):
    """Schemathesis cannot forge a peer id that matches its key, so most of its joins stop at
    the identity check; these carry real identities and hostile everything else."""
    from authorizer.testing import NodeKey

    printable = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=64)
    with httpx.Client(base_url=target.url, timeout=10) as http:

        @settings(max_examples=80, **_SETTINGS)
        @given(role=st.sampled_from(["worker", "trainer"]), device=printable,
               vram=st.integers(0, 1 << 50), ram=st.integers(0, 1 << 50),
               bandwidth=st.floats(0, 1e7), latency=st.floats(0, 1e7),
               version=st.from_regex(r"[A-Za-z0-9.+_-]{1,64}", fullmatch=True),
               digest=st.from_regex(r"[A-Za-z0-9:+/=._-]{0,160}", fullmatch=True),
               account=st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), max_size=256),
               maddrs=st.lists(st.sampled_from(["/ip4/127.0.0.1/tcp/1", "/ip6/::1/udp/9/quic-v1", "/dns4/x.example/tcp/4"]),
                               max_size=8))
        def check(role, device, vram, ram, bandwidth, latency, version, digest, account, maddrs):
            key = NodeKey.generate()
            body = key.join_body(role=role, account_token=account, client_version=version, package_digest=digest,
                                 announce_maddrs=maddrs, device_name=device, vram_bytes=vram, ram_bytes=ram,
                                 bandwidth_mbps=bandwidth, latency_ms=latency)
            response = http.post("/v1/join", json=body)
            assert response.status_code == 200, response.text
            ticket = response.json()
            assert ticket["status"] in ("queued", "admitted", "rejected") and ticket["peer_id"] == key.peer_id
            if ticket["status"] == "rejected":
                assert ticket["rejection"]["reason"] and ticket["rejection"]["message"]
            polled = http.get(f"/v1/join/{ticket['ticket']}")
            assert polled.status_code == 200 and polled.json()["ticket"] == ticket["ticket"]

        check()
    assert_alive(target.url)
