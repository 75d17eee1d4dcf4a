"""RPC over real libp2p streams in-process: typed errors for malformed frames, and the server
keeps serving honest requests afterwards."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from protocol.codec import encode_tensor, pack, unpack
from protocol.errors import ErrorCode, PeerTimeout, ProtocolError, RemoteError
from protocol.framing import read_frame, write_frame
from protocol.messages import (
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    parse_model,
    to_body,
)
from protocol.transport import RpcClient, RpcServer, hello_frame


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _pair():
    server_p2p = await P2P.create()
    client_p2p = await P2P.create(initial_peers=await server_p2p.get_visible_maddrs())
    server = RpcServer(server_p2p, max_frame_bytes=1 << 16)

    async def echo(peer_id, body):
        if body.get("boom"):
            raise ValueError("handler bug")
        if body.get("sleep"):  # a slow handler on request (timeouts, concurrent calls): behaviour, not a wait
            await asyncio.sleep(body["sleep"])
        return {"echo": body}

    await server.add_handler("agora/v1/echo", echo)
    return server_p2p, client_p2p, server


async def _raw_stream(client_p2p, server_p2p, handler="agora/v1/echo"):
    """A stream past its (open-run) hello, for sending hand-made frames."""
    _, reader, writer = await client_p2p.call_binary_stream_handler(server_p2p.peer_id, handler)
    await write_frame(writer, hello_frame(handler, server_p2p.peer_id.to_base58())[0])
    ack = unpack(await read_frame(reader))
    assert ack["ok"] is True, ack
    return reader, writer


def test_malformed_frames_get_typed_errors_and_serving_continues():
    async def scenario():
        server_p2p, client_p2p, server = await _pair()
        try:
            reader, writer = await _raw_stream(client_p2p, server_p2p)
            for garbage in (b"\xc1", pack([1, 2, 3]), pack({"version": 2, "body": {}}), pack({"seq": 1})):
                await write_frame(writer, garbage)
                reply = unpack(await read_frame(reader))
                assert reply["ok"] is False and isinstance(reply["error"]["code"], int)
            await write_frame(writer, pack({"seq": 1, "body": {"x": 1}}))  # same stream still serves
            assert unpack(await read_frame(reader)) == {"seq": 1, "ok": True, "body": {"echo": {"x": 1}}}
            writer.close()

            client = RpcClient(client_p2p, timeout_s=5)
            assert await client.call(server_p2p.peer_id, "agora/v1/echo", {"y": 2}) == {"echo": {"y": 2}}
            with pytest.raises(RemoteError) as info:
                await client.call(server_p2p.peer_id, "agora/v1/echo", {"boom": True})
            assert info.value.code == ErrorCode.INTERNAL
            with pytest.raises(PeerTimeout):
                await client.call(server_p2p.peer_id, "agora/v1/echo", {"sleep": 2}, timeout_s=0.3)
            assert await client.call(server_p2p.peer_id, "agora/v1/echo", {"z": 3}) == {"echo": {"z": 3}}
            assert server.rejected["malformed_frame"] == 4
            assert server.rejected["internal"] == 1
            await client.close()
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    run(scenario())


def test_a_stream_must_open_with_a_small_hello_of_our_protocol_version():
    async def scenario():
        server_p2p, client_p2p, server = await _pair()
        try:
            handler = "agora/v1/echo"
            old = pack({**unpack(hello_frame(handler, server_p2p.peer_id.to_base58())[0]), "version": 1})
            elsewhere = hello_frame("agora/v1/other", server_p2p.peer_id.to_base58())[0]
            for first, code in ((old, ErrorCode.UNSUPPORTED_VERSION), (elsewhere, ErrorCode.MALFORMED_FRAME),
                                (pack({"seq": 1, "body": {}}), ErrorCode.MALFORMED_FRAME)):
                _, reader, writer = await client_p2p.call_binary_stream_handler(server_p2p.peer_id, handler)
                await write_frame(writer, first)
                reply = unpack(await read_frame(reader))
                assert reply["ok"] is False and reply["error"]["code"] == code, reply
                with pytest.raises(Exception):  # the server closed the stream
                    await read_frame(reader)
                writer.close()
            assert "upgrade" in reply["error"]["message"] or code != ErrorCode.UNSUPPORTED_VERSION
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    run(scenario())


def test_oversized_frames_are_refused_before_reading_them():
    """Before its hello a stream may send at most a few KiB; after it, up to the frame limit."""
    async def scenario():
        server_p2p, client_p2p, server = await _pair()
        try:
            _, reader, writer = await client_p2p.call_binary_stream_handler(server_p2p.peer_id, "agora/v1/echo")
            writer.write((60 << 20).to_bytes(4, "big"))
            await writer.drain()
            reply = unpack(await read_frame(reader))
            assert reply["error"]["code"] == ErrorCode.FRAME_TOO_LARGE and "hello" in reply["error"]["message"]
            assert server.streams_refused["hello_too_large"] == 1

            reader, writer = await _raw_stream(client_p2p, server_p2p)
            writer.write((1 << 30).to_bytes(4, "big"))
            await writer.drain()
            reply = unpack(await read_frame(reader))
            assert reply["error"]["code"] == ErrorCode.FRAME_TOO_LARGE
            client = RpcClient(client_p2p, timeout_s=5)
            assert await client.call(server_p2p.peer_id, "agora/v1/echo", {"ok": 1}) == {"echo": {"ok": 1}}
            await client.close()
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    run(scenario())


def test_replayed_and_reordered_frames_end_the_stream():
    async def scenario():
        server_p2p, client_p2p, server = await _pair()
        try:
            for sequence, reason in (((1, 1), "replayed"), ((1, 3), "out_of_order")):
                reader, writer = await _raw_stream(client_p2p, server_p2p)
                first, second = sequence
                await write_frame(writer, pack({"seq": first, "body": {"a": 1}}))
                assert unpack(await read_frame(reader))["ok"] is True
                await write_frame(writer, pack({"seq": second, "body": {"a": 2}}))
                reply = unpack(await read_frame(reader))
                assert reply["ok"] is False and reason in reply["error"]["message"]
                with pytest.raises(Exception):
                    await read_frame(reader)
                writer.close()
                assert server.auth_rejected[reason] == 1
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    run(scenario())


def test_concurrent_calls_use_parallel_streams():
    async def scenario():
        server_p2p, client_p2p, _ = await _pair()
        try:
            client = RpcClient(client_p2p, timeout_s=10)
            replies = await asyncio.gather(
                *(client.call(server_p2p.peer_id, "agora/v1/echo", {"i": i, "sleep": 0.2}) for i in range(8))
            )
            assert [r["echo"]["i"] for r in replies] == list(range(8))
            await client.close()
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    run(scenario())


def test_both_sides_use_the_same_typed_models_and_the_bytes_stay_those_of_hand_built_bodies():
    """The trainer sends the worker's own request models and parses its reply models; a body
    leaves out None fields, as the hand-built dicts of older trainers and workers did."""
    tokens, coords = torch.arange(6), torch.randn(6, 4)
    forward = ForwardRequest(stage=0, sample_id="s", tokens=tokens)
    assert pack(to_body(forward)) == pack({"stage": 0, "sample_id": "s", "tokens": encode_tensor(tokens)})
    backward = BackwardRequest(stage=1, sample_id="s", tokens=tokens, coords=coords, grad_output=coords, step=3)
    assert to_body(backward) == {"stage": 1, "sample_id": "s", "tokens": encode_tensor(tokens),
                                 "coords": encode_tensor(coords), "grad_output": encode_tensor(coords), "step": 3}
    assert to_body(BackwardReply(loss=1.5, step=2)) == {"loss": 1.5, "step": 2}

    async def scenario():
        server_p2p, client_p2p, server = await _pair()

        async def forward_handler(peer_id, body):
            request = parse_model(ForwardRequest, body)
            if request.sample_id == "bad":
                return {"coords": "not a tensor"}
            return ForwardReply(coords=request.tokens.float().unsqueeze(1).repeat(1, 4))

        await server.add_handler("agora/v1/forward", forward_handler)
        client = RpcClient(client_p2p, timeout_s=5)
        try:
            reply = await client.request(server_p2p.peer_id, "agora/v1/forward", forward, ForwardReply)
            assert isinstance(reply, ForwardReply) and torch.equal(reply.coords[:, 0], tokens.float())
            bad = ForwardRequest(stage=0, sample_id="bad", tokens=tokens)
            with pytest.raises(ProtocolError, match="tensor must be a map") as info:
                await client.request(server_p2p.peer_id, "agora/v1/forward", bad, ForwardReply)
            assert not isinstance(info.value, RemoteError), "a bad reply is ours to reject, not the peer's error"
            await client.close()
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    run(scenario())


def test_dialling_a_peer_that_is_gone_is_a_typed_peer_unavailable():
    """A state download dials the replica it loads from; one that died in between must be a
    typed error (the loader resumes on another replica), not the daemon's ControlFailure."""
    from protocol.errors import PeerUnavailable
    from protocol.transport import dial

    async def scenario():
        gone = await P2P.create()
        gone_id, gone_maddrs = gone.peer_id, [str(m) for m in await gone.get_visible_maddrs()]
        await gone.shutdown()
        p2p = await P2P.create()
        try:
            with pytest.raises(PeerUnavailable, match="cannot reach"):
                await dial(p2p, gone_id, gone_maddrs, timeout_s=10.0)
        finally:
            await p2p.shutdown()

    run(scenario())


def test_a_handler_whose_caller_timed_out_is_cancelled_and_serving_goes_on():
    """A caller that gives up closes its stream; the server cancels the handler instead of running
    it for nobody (a worker would compute the forward and hold its stage's gate with it)."""

    async def scenario():
        server_p2p = await P2P.create()
        client_p2p = await P2P.create(initial_peers=await server_p2p.get_visible_maddrs())
        server = RpcServer(server_p2p, max_frame_bytes=1 << 16)
        started, cancelled = asyncio.Event(), asyncio.Event()

        async def slow(peer_id, body):
            started.set()
            try:
                await asyncio.sleep(body["sleep"])
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return {"done": True}

        await server.add_handler("agora/v1/slow", slow)
        client = RpcClient(client_p2p, timeout_s=10)
        try:
            with pytest.raises(PeerTimeout):
                await client.call(server_p2p.peer_id, "agora/v1/slow", {"sleep": 30}, timeout_s=0.5)
            assert started.is_set()
            await asyncio.wait_for(cancelled.wait(), 5)
            assert server.streams_closed["caller_left"] == 1
            assert await client.call(server_p2p.peer_id, "agora/v1/slow", {"sleep": 0.1}) == {"done": True}
        finally:
            await client.close()
            await client_p2p.shutdown()
            await server_p2p.shutdown()

    run(scenario())
