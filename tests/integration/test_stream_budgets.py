"""What an outsider can hold of a live worker: nothing before its hello, a bounded number of
streams after it, and nothing once they go idle, while a trainer keeps training. Real
agora-node processes admitted by a real authorizer; the outsiders are plain libp2p peers."""

from __future__ import annotations

import asyncio
import time

import psutil
import pytest

from tests.integration.test_auth_swarm import _admitted_identity, _node_args, authorizer  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

# Longer than parking 1,000 streams takes here; under the full suite's load it took longer still
# (CI saw 144, then 184 accepted), which the test allows for: see the budget's assertions.
IDLE_S = 20.0
FRAME = 60 << 20


async def _open(p2p, peer, handler):
    _, reader, writer = await p2p.call_binary_stream_handler(peer, handler)
    return reader, writer


async def _closed_within(reader, timeout_s: float) -> bool:
    from protocol.framing import read_frame

    try:
        await asyncio.wait_for(read_frame(reader), timeout_s)
    except asyncio.TimeoutError:
        return False
    except Exception:  # noqa: BLE001 - end of stream, in whatever form
        return True
    return False


async def _huge_frames_without_credential(worker, count: int) -> list[dict]:
    """A stock peer announces `count` 60 MiB frames as its first frame and pushes the bytes."""
    from hivemind.p2p import P2P, PeerID

    from protocol import version
    from protocol.codec import unpack
    from protocol.errors import PeerUnavailable
    from protocol.framing import read_frame
    from protocol.transport import dial

    p2p = await P2P.create()
    replies = []
    try:
        peer = PeerID.from_base58(worker.peer_id)
        await dial(p2p, peer, worker.maddrs)
        for _ in range(count):
            reader, writer = await _open(p2p, peer, version.FORWARD)

            async def push():
                writer.write(FRAME.to_bytes(4, "big"))
                chunk = b"\0" * (1 << 20)
                for _ in range(FRAME >> 20):
                    writer.write(chunk)
                    await writer.drain()

            pushing = asyncio.create_task(push())
            # the typed refusal, unless closing the stream under our unread bytes reset it first
            try:
                replies.append(unpack(await asyncio.wait_for(read_frame(reader), 20))["error"]["code"])
                assert await _closed_within(reader, 10), "the worker keeps the stream open after refusing its hello"
            except PeerUnavailable:
                replies.append("disconnected")
            pushing.cancel()
            await asyncio.gather(pushing, return_exceptions=True)
            writer.close()
    finally:
        await p2p.shutdown()
    return replies


async def _park_streams(worker, authorizer_url, tmp_path, trainer_done) -> dict:
    """An admitted peer opens 1,000 streams with valid hellos and leaves them idle."""
    from hivemind.p2p import PeerID

    from protocol import version
    from protocol.auth import PeerAuthenticator
    from protocol.codec import unpack
    from protocol.errors import PeerUnavailable
    from protocol.framing import read_frame, write_frame
    from protocol.transport import RpcClient, dial, hello_frame

    identity, p2p, admission = await _admitted_identity(authorizer_url, str(tmp_path / "parker.key"), "mallory")
    auth = PeerAuthenticator(identity=identity, run_id=admission.credential.credential.run_id,
                             root_public_key=admission.root_public_key, credential=lambda: admission.credential)
    peer = PeerID.from_base58(worker.peer_id)
    accepted, refused = [], []
    try:
        await dial(p2p, peer, worker.maddrs)

        async def park():
            reader, writer = await _open(p2p, peer, version.FORWARD)
            try:
                await write_frame(writer, hello_frame(version.FORWARD, worker.peer_id, auth)[0])
                ack = unpack(await asyncio.wait_for(read_frame(reader), 20))
            except PeerUnavailable:  # refused and closed before our hello was read: libp2p reset it
                ack = {"ok": False, "error": None}
            (accepted if ack["ok"] else refused).append((reader, writer, ack))

        started = time.monotonic()
        for _ in range(1000 // 8):  # eight at a time: as many hellos as one peer may have pending
            await asyncio.gather(*(park() for _ in range(8)))
        parking_s = time.monotonic() - started
        held_while_training = not trainer_done()
        # how many of the accepted streams the worker still holds now (the others it closed idle)
        gone = await asyncio.gather(*(_closed_within(reader, 0.5) for reader, _, _ in accepted))
        open_at_end = len(gone) - sum(gone)
        closed = await asyncio.gather(*(_closed_within(reader, IDLE_S + 15) for (reader, _, _), early
                                        in zip(accepted, gone) if not early))
        closed = [*closed, *(True for early in gone if early)]
        info = await RpcClient(p2p, authenticator=auth, timeout_s=10).call(peer, version.INFO, {})
        return {"accepted": len(accepted), "refusals": [ack["error"] for _, _, ack in refused],
                "closed": sum(closed), "held_while_training": held_while_training, "counters": info["counters"],
                "open_at_end": open_at_end, "parking_s": parking_s}
    finally:
        for _, writer, _ in accepted + refused:
            writer.close()
        await p2p.shutdown()


@pytest.mark.timeout(420)
def test_outsiders_cannot_hold_a_workers_memory_or_streams(make_swarm, authorizer, tmp_path):  # noqa: F811
    from protocol.errors import ErrorCode

    swarm = make_swarm(None)
    extra = ["--stream-idle-timeout-s", str(IDLE_S)]
    head = swarm.start("worker", args=[*_node_args(authorizer, "alice"), *extra])
    tail = swarm.start("worker", args=[*_node_args(authorizer, "bob"), *extra])
    if head.stage != 0:
        head, tail = tail, head

    # 1. no credential, four 60 MiB frames: refused after the 4-byte length, nothing buffered
    process = psutil.Process(head.pid)
    rss_before = process.memory_info().rss
    replies = asyncio.run(asyncio.wait_for(_huge_frames_without_credential(head, 4), 120))
    rss_growth = process.memory_info().rss - rss_before
    print(f"worker RSS growth after four 60 MiB frames without credential: {rss_growth / 2**20:.2f} MiB; {replies}")
    assert all(r in (ErrorCode.FRAME_TOO_LARGE, "disconnected") for r in replies), replies
    assert rss_growth < 10 << 20, f"worker RSS grew by {rss_growth / 2**20:.1f} MiB"

    # 2. a credentialed peer parks 1,000 streams while a trainer trains
    trainer = swarm.start("trainer", args=[*_node_args(authorizer, "carol"), "--max-samples", "400", "--lanes", "2"])
    report = asyncio.run(asyncio.wait_for(
        _park_streams(head, authorizer.url, tmp_path, lambda: trainer.proc.poll() is not None), 240))
    accepted, counters = report["accepted"], report["counters"]
    print(f"1,000 parked streams in {report['parking_s']:.1f} s: {accepted} accepted, {len(report['refusals'])} "
          f"refused, {report['open_at_end']} still held at the end, {report['closed']} closed when idle; worker "
          f"counters { {k: v for k, v in counters.items() if k.startswith('streams_')} }")
    # --max-streams-per-peer's default, 128, at any moment: exactly 128 accepted when parking took
    # less than the idle timeout; on a loaded machine that took longer, streams the worker closed
    # idle free their slots, and never more than 128 are held at once
    assert report["open_at_end"] <= 128, report["open_at_end"]
    if report["parking_s"] < IDLE_S:
        assert accepted == 128, accepted
    else:
        assert 128 <= accepted < 1000, accepted
    assert len(report["refusals"]) == 1000 - accepted
    # each got the typed refusal, or a reset when the refusal raced the hello it did not read
    assert all(e is None or e["code"] == ErrorCode.RATE_LIMITED for e in report["refusals"])
    assert any(e is not None for e in report["refusals"])
    assert report["closed"] == accepted, "idle streams must be closed after --stream-idle-timeout-s"
    assert counters["streams_refused_too_many_streams"] + counters.get("streams_refused_too_many_unauthenticated", 0) \
        == 1000 - accepted, counters
    assert counters["streams_closed_idle_timeout"] >= accepted, counters
    assert counters["streams_refused_hello_too_large"] == 4, counters
    assert swarm.wait(trainer, 240) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] == 400, summary
    assert report["held_while_training"], "the trainer finished before the streams were parked; train longer"
