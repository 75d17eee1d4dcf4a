"""What one peer may hold of a server: streams, unauthenticated streams, buffered bytes and idle
time are bounded, refusals are typed and counted, and honest calls keep working meanwhile.
Real libp2p daemons in-process, with small limits so the test runs in seconds."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hivemind.p2p import P2P

from protocol.codec import pack, unpack
from protocol.errors import ErrorCode, PeerUnavailable
from protocol.framing import read_frame, write_frame
from protocol.stream_limits import StreamBudget, StreamLimits
from protocol.transport import RpcClient, RpcServer, hello_frame
from tests.support.polling import poll_until

HANDLER = "agora/v1/echo"
LIMITS = StreamLimits(hello_timeout_s=1.5, idle_timeout_s=2.0, max_streams_per_peer=4,
                      max_unauthenticated_per_peer=2, max_unauthenticated_total=3, max_buffered_bytes_per_peer=1000)


def test_budget_bookkeeping():
    budget = StreamBudget(LIMITS)
    assert budget.open("a") is None and budget.open("a") is None
    assert budget.open("a") == "too_many_unauthenticated"  # per peer
    assert budget.open("b") is None
    assert budget.open("c") == "too_many_unauthenticated"  # in total
    budget.authenticated("a")
    budget.authenticated("a")
    assert budget.open("a") is None and budget.open("a") is None  # now 4 streams, 2 unauthenticated
    budget.authenticated("a")
    assert budget.open("a") == "too_many_streams"
    budget.close("a", authenticated=True)
    budget.close("a", authenticated=False)
    assert budget.streams["a"] == 2 and budget.unauthenticated["a"] == 0
    assert budget.reserve("a", 600) and not budget.reserve("a", 600) and budget.reserve("b", 600)
    budget.release("a", 600)
    assert budget.reserve("a", 1000) and "a" in budget.buffered
    budget.release("a", 1000)
    assert "a" not in budget.buffered


async def _pair(limits: StreamLimits = LIMITS):
    server_p2p = await P2P.create()
    maddrs = await server_p2p.get_visible_maddrs()
    attacker = await P2P.create(initial_peers=maddrs)
    honest = await P2P.create(initial_peers=maddrs)
    server = RpcServer(server_p2p, limits=limits, max_frame_bytes=1 << 16)

    async def echo(peer_id, body):
        return {"echo": body}

    await server.add_handler(HANDLER, echo)
    return server, server_p2p, attacker, honest


DISCONNECTED = {"ok": False, "error": None}
"""A refused stream whose refusal was lost: the server closes a stream it refuses without reading
what the peer sent, and libp2p may reset it before the refusal is read."""


async def _open(p2p, server_p2p, *, hello: bool):
    """A raw stream; with `hello`, past its hello. Returns (reader, writer, first reply or None)."""
    _, reader, writer = await p2p.call_binary_stream_handler(server_p2p.peer_id, HANDLER)
    if not hello:
        return reader, writer, None
    await write_frame(writer, hello_frame(HANDLER, server_p2p.peer_id.to_base58())[0])
    try:
        return reader, writer, unpack(await read_frame(reader))
    except PeerUnavailable:
        return reader, writer, DISCONNECTED


async def _closed(reader) -> bool:
    try:
        await asyncio.wait_for(read_frame(reader), 5)
    except Exception:  # noqa: BLE001 - end of stream, whatever its form
        return True
    return False


def run(coro):
    asyncio.run(asyncio.wait_for(coro, 90))


def test_streams_per_peer_are_capped_and_idle_ones_closed_while_others_are_served():
    async def scenario():
        # one at a time: a peer may have only two streams before their hello at once
        server, server_p2p, attacker, honest = await _pair(dataclasses.replace(LIMITS, idle_timeout_s=5.0))
        client = RpcClient(honest, timeout_s=5)
        try:
            opened = [await _open(attacker, server_p2p, hello=True) for _ in range(10)]
            acks = [reply for _, _, reply in opened]
            assert sum(1 for a in acks if a["ok"]) == LIMITS.max_streams_per_peer
            refused = [a["error"] for a in acks if not a["ok"]]
            assert len(refused) == 6
            assert all(e is None or e["code"] == ErrorCode.RATE_LIMITED and "too_many_streams" in e["message"]
                       for e in refused), refused
            assert server.streams_refused["too_many_streams"] == 6
            refused_streams = [reader for reader, _, ack in opened if not ack["ok"]]
            assert all(await asyncio.gather(*(_closed(r) for r in refused_streams))), "refused streams stay open"
            # another peer is served while the attacker holds its streams
            assert await client.call(server_p2p.peer_id, HANDLER, {"x": 1}) == {"echo": {"x": 1}}
            # the parked streams are closed after the idle timeout, and counted
            for reader, _, ack in opened:
                if ack["ok"]:
                    assert await _closed(reader)
            assert server.streams_closed["idle_timeout"] >= LIMITS.max_streams_per_peer
            counters = server.counters()
            assert counters["streams_refused_too_many_streams"] == 6 and counters["rejected_rate_limited"] == 6
            # once closed, the same peer may open streams again
            _, writer, ack = await _open(attacker, server_p2p, hello=True)
            assert ack["ok"] is True
            writer.close()
            for _, writer, _ in opened:
                writer.close()
        finally:
            await client.close()
            for p2p in (attacker, honest, server_p2p):
                await p2p.shutdown()

    run(scenario())


def test_streams_without_a_hello_are_few_and_short_lived():
    async def scenario():
        server, server_p2p, attacker, honest = await _pair()
        client = RpcClient(honest, timeout_s=5)
        try:
            silent = await asyncio.gather(*(_open(attacker, server_p2p, hello=False) for _ in range(6)))
            # two are held (the per-peer cap); the others are refused at once with a typed error
            reading = asyncio.gather(*(asyncio.wait_for(read_frame(r), 10) for r, _, _ in silent),
                                     return_exceptions=True)
            # another peer is served while the attacker holds its two
            assert await client.call(server_p2p.peer_id, HANDLER, {"x": 2}) == {"echo": {"x": 2}}
            replies = await reading
            refused = [unpack(f) for f in replies if isinstance(f, bytes)]
            assert len(refused) == 4 and all(r["error"]["code"] == ErrorCode.RATE_LIMITED for r in refused)
            assert server.streams_refused["too_many_unauthenticated"] == 4
            # the two held ones were closed after the hello timeout (reading them above waited for that)
            assert server.streams_closed["hello_timeout"] == 2
            assert server.budget.unauthenticated_total == 0
            for _, writer, _ in silent:
                writer.close()
        finally:
            await client.close()
            for p2p in (attacker, honest, server_p2p):
                await p2p.shutdown()

    run(scenario())


def test_bytes_in_flight_per_peer_are_budgeted():
    async def scenario():
        server, server_p2p, attacker, honest = await _pair()
        try:
            reader, writer, ack = await _open(attacker, server_p2p, hello=True)
            assert ack["ok"]
            writer.write((2000).to_bytes(4, "big") + b"x" * 100)  # announces more than its budget
            await writer.drain()
            reply = unpack(await read_frame(reader))
            assert reply["error"]["code"] == ErrorCode.RATE_LIMITED and "over_byte_budget" in reply["error"]["message"]
            assert server.streams_refused["over_byte_budget"] == 1
            await asyncio.to_thread(poll_until, lambda: not server.budget.buffered, 5, "the reservation to be released")
            writer.close()
        finally:
            for p2p in (attacker, honest, server_p2p):
                await p2p.shutdown()

    run(scenario())


def test_the_client_stops_reusing_a_stream_before_the_server_would_close_it():
    async def scenario():
        server, server_p2p, attacker, honest = await _pair()
        client = RpcClient(honest, timeout_s=5)
        try:
            assert await client.call(server_p2p.peer_id, HANDLER, {"n": 1}) == {"echo": {"n": 1}}
            assert await client.call(server_p2p.peer_id, HANDLER, {"n": 2}) == {"echo": {"n": 2}}
            assert server.budget.streams[honest.peer_id.to_base58()] == 1, "one stream, reused"
            await asyncio.to_thread(poll_until, lambda: server.streams_closed["idle_timeout"] >= 1, 10,
                                    "the server to close the idle stream")
            # the pooled stream is stale: the client opens a new one instead of failing
            assert await client.call(server_p2p.peer_id, HANDLER, {"n": 3}) == {"echo": {"n": 3}}
        finally:
            await client.close()
            for p2p in (attacker, honest, server_p2p):
                await p2p.shutdown()

    run(scenario())


def test_unsent_hello_bytes_cannot_be_parked_in_a_frame():
    """A hello announced at the size cap but never completed is closed at the hello timeout."""
    async def scenario():
        server, server_p2p, attacker, honest = await _pair()
        try:
            reader, writer, _ = await _open(attacker, server_p2p, hello=False)
            writer.write((4000).to_bytes(4, "big") + pack({"version": 2})[:3])
            await writer.drain()
            assert await _closed(reader)
            assert server.streams_closed["hello_timeout"] == 1
            writer.close()
        finally:
            for p2p in (attacker, honest, server_p2p):
                await p2p.shutdown()

    run(scenario())


def test_a_client_keeps_below_the_servers_stream_cap_and_queues_the_rest():
    """More concurrent calls than the server lets one peer hold: the client waits for a stream
    instead of being refused, closing idle streams of other handlers to make room."""
    async def scenario():
        limits = dataclasses.replace(LIMITS, idle_timeout_s=30.0, max_unauthenticated_per_peer=8,
                                     max_unauthenticated_total=256)
        server, server_p2p, attacker, honest = await _pair(limits)

        async def slow(peer_id, body):
            await asyncio.sleep(0.2)  # a slow handler: behaviour under test, not a wait
            return {"i": body["i"]}

        await server.add_handler("agora/v1/slow", slow)
        client = RpcClient(honest, timeout_s=20)
        try:
            assert await client.call(server_p2p.peer_id, HANDLER, {"x": 0}) == {"echo": {"x": 0}}  # learns the cap
            replies = await asyncio.gather(*(client.call(server_p2p.peer_id, "agora/v1/slow", {"i": i})
                                             for i in range(12)))
            assert [r["i"] for r in replies] == list(range(12))
            assert server.streams_refused == {}, server.streams_refused
            assert client._open[server_p2p.peer_id] <= LIMITS.max_streams_per_peer
        finally:
            await client.close()
            for p2p in (attacker, honest, server_p2p):
                await p2p.shutdown()

    run(scenario())
