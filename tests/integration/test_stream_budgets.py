"""What an outsider can hold of a live worker: nothing before its hello, a bounded number of
streams after it, and nothing once they go idle, while a trainer keeps training; and throwaway
peer ids cannot fill the allowance of streams without a hello to shut honest peers out, nor stall
a worker by re-opening every stream it closes (their streams are refused on arrival). Real
agora-node processes admitted by a real authorizer; the outsiders are plain libp2p peers."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import time
import types

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


async def _shut_down(p2p, timeout_s: float = 15.0) -> None:
    """`p2p.shutdown()`, which SIGTERMs its daemon and waits for it without a bound, bounded:
    a daemon still there after `timeout_s` is killed."""
    try:
        await asyncio.wait_for(p2p.shutdown(), timeout_s)
    except (asyncio.TimeoutError, ProcessLookupError):
        child = getattr(p2p, "_child", None)
        if child is not None and child.returncode is None:
            child.kill()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(child.wait(), 5.0)  # reaped, not left a zombie


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
        await _shut_down(p2p)
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
        await _shut_down(p2p)


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
    # 2,000 samples: about 20 s here, while parking takes 4-10 s (400 were done before the parking in a CI
    # simulation once)
    trainer = swarm.start("trainer", args=[*_node_args(authorizer, "carol"), "--max-samples", "2000", "--lanes", "2"])
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
    assert summary["samples_completed"] == 2000, summary
    assert report["held_while_training"], "the trainer finished before the streams were parked; train longer"


SYBILS = 36
SILENT_PER_SYBIL = 8
REOPEN_S = 10.0
"""The probe of issue 22: throwaway peer ids, each holding eight streams that never say hello,
re-opened every ten seconds (the worker's hello timeout)."""
WINDOW_S = 15.0


class _Sybils:
    """`SYBILS` stock libp2p peers spread over `addresses`, each holding `SILENT_PER_SYBIL`
    streams to `worker` that never say hello, re-opened every `REOPEN_S`; `seen` counts what
    became of them."""

    def __init__(self, worker, addresses: list[str]):
        self.worker, self.addresses = worker, addresses
        self.seen: dict[str, int] = {"opened": 0, "evicted": 0, "refused": 0, "held": 0}
        self._p2ps, self._holders = [], []
        self._stopping = False
        self.daemons: list[psutil.Process] = []
        """The sybils' libp2p daemons, whose CPU the slowloris test reports."""

    async def __aenter__(self):
        from hivemind.p2p import P2P, PeerID

        from protocol.transport import dial

        self.peer = PeerID.from_base58(self.worker.peer_id)
        started = time.monotonic()

        async def create(address: str) -> P2P:
            p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"], startup_timeout=90)
            self._p2ps.append(p2p)
            return p2p

        ours = {p.pid for p in psutil.Process().children(recursive=True)}
        try:
            # All at once: a daemon's start mostly waits for it to answer. One by one, 36 starts took
            # minutes on a loaded machine (the CI run where this test ran out its 720 s); on the
            # idle 2-core machine, 18.5 s six at a time and 9.9 s all at once.
            await asyncio.gather(*(create(self.addresses[i % len(self.addresses)]) for i in range(SYBILS)))
            await asyncio.gather(*(dial(p2p, self.peer, self.worker.maddrs, 60) for p2p in self._p2ps))
            self.daemons = [p for p in psutil.Process().children(recursive=True) if p.pid not in ours]
            print(f"{SYBILS} sybils from {len(self.addresses)} address(es) up in {time.monotonic() - started:.0f}s")
        except BaseException:
            await self.__aexit__()
            raise
        self._holders = [asyncio.create_task(self._hold(p2p)) for p2p in self._p2ps for _ in range(SILENT_PER_SYBIL)]
        return self

    async def __aexit__(self, *_):
        # Python 3.11's wait_for can swallow a cancellation that lands as its read completes (a
        # CI run's holder then looped on until the test's 720 s ran out): the holders also stop at
        # their next turn, and whatever still waits after a few seconds ends with its daemon.
        self._stopping = True
        for task in self._holders:
            task.cancel()
        if self._holders:
            await asyncio.wait(self._holders, timeout=5.0)
        await asyncio.gather(*(_shut_down(p2p) for p2p in self._p2ps), return_exceptions=True)
        if self._holders:
            await asyncio.wait(self._holders, timeout=5.0)

    async def _hold(self, p2p):
        from protocol import version
        from protocol.codec import unpack
        from protocol.errors import PeerUnavailable
        from protocol.framing import read_frame

        while not self._stopping:
            opened = time.monotonic()
            try:
                reader, writer = await _open(p2p, self.peer, version.FORWARD)
            except Exception:  # noqa: BLE001 - the daemon refused or the worker reset it; try at the next tick
                reader = writer = None
            if writer is not None:
                self.seen["opened"] += 1
                try:
                    reply = unpack(await asyncio.wait_for(read_frame(reader), REOPEN_S))
                    self.seen["evicted" if "evicted" in reply["error"]["message"] else "refused"] += 1
                except (asyncio.TimeoutError, PeerUnavailable):
                    self.seen["held"] += 1  # until we closed it, or the hello timeout did
                writer.close()
            await asyncio.sleep(max(0.0, opened + REOPEN_S - time.monotonic()))


class _HonestProbe:
    """An admitted peer that opens a fresh stream to `worker` every second (a new client each
    time) and reads the worker's completed backwards, for the trainer's rate."""

    def __init__(self, worker, authorizer_url, key_path):
        self.worker, self.authorizer_url, self.key_path = worker, authorizer_url, key_path

    async def __aenter__(self):
        from hivemind.p2p import PeerID

        from protocol.auth import PeerAuthenticator
        from protocol.transport import dial

        identity, self.p2p, admission = await _admitted_identity(self.authorizer_url, self.key_path, "dave")
        self.auth = PeerAuthenticator(identity=identity, run_id=admission.credential.credential.run_id,
                                      root_public_key=admission.root_public_key,
                                      credential=lambda: admission.credential)
        self.peer = PeerID.from_base58(self.worker.peer_id)
        await dial(self.p2p, self.peer, self.worker.maddrs)
        return self

    async def __aexit__(self, *_):
        await _shut_down(self.p2p)

    async def info(self) -> dict:
        from protocol import version
        from protocol.transport import RpcClient

        client = RpcClient(self.p2p, authenticator=self.auth, timeout_s=10)
        try:
            return await client.call(self.peer, version.INFO, {})
        finally:
            await client.close()

    async def window(self, window_s: float = WINDOW_S) -> dict:
        served, failed, samples = 0, [], []
        deadline = time.monotonic() + window_s
        while True:
            try:
                info = await self.info()
                served += 1
                samples.append((time.monotonic(), info["counters"].get("backward_requests", 0), info["counters"]))
            except Exception as exc:  # noqa: BLE001 - what the issue saw: refused honest streams
                failed.append(f"{type(exc).__name__}: {exc}")
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(1.0)
        (t0, n0, _), (t1, n1, counters) = samples[0], samples[-1]
        return {"served": served, "failed": failed, "rate": (n1 - n0) / (t1 - t0), "counters": counters}


async def _slowloris_scenario(worker, authorizer_url, tmp_path) -> list[tuple[str, dict, dict]]:
    """Quiet, attacked from one address, quiet, attacked from six, quiet: each window's report."""
    windows = []
    async with _HonestProbe(worker, authorizer_url, str(tmp_path / "probe.key")) as probe:
        while (await probe.info())["counters"].get("backward_requests", 0) < 20:  # the trainer is training
            await asyncio.sleep(1.0)
        windows.append(("quiet", await probe.window(), {}))
        for label, addresses in (("one address", ["127.0.0.2"]),
                                 ("six addresses", [f"127.0.0.{n}" for n in range(3, 9)])):
            async with _Sybils(worker, addresses) as sybils:
                await asyncio.sleep(REOPEN_S / 2)  # the allowance fills
                before, t0 = _cpu_s({"sybils": sybils.daemons}), time.monotonic()
                report = await probe.window()
                report["sybils_cores"] = (_cpu_s({"sybils": sybils.daemons})["sybils"] - before["sybils"]) / (
                    time.monotonic() - t0)
                windows.append((label, report, dict(sybils.seen)))
            windows.append(("quiet", await probe.window(), {}))
    return windows


@pytest.mark.solo
@pytest.mark.timeout(900)
def test_throwaway_peer_ids_cannot_shut_a_trainer_out(make_swarm, authorizer, tmp_path):  # noqa: F811
    """36 peer ids x 8 silent streams, re-opened every 10 s, from one address and then from six:
    every new stream of an honest peer is served, and the trainer keeps more than half its rate
    without the attack (the quiet windows either side). It prints how busy the sybils' own daemons
    kept the two cores they share with the swarm (about one core from six addresses)."""
    swarm = make_swarm(None)
    head = swarm.start("worker", args=_node_args(authorizer, "alice"))
    tail = swarm.start("worker", args=_node_args(authorizer, "bob"))
    if head.stage != 0:
        head, tail = tail, head
    trainer = swarm.start("trainer", args=[*_node_args(authorizer, "carol"), "--max-samples", "1000000",
                                           "--lanes", "2"])
    windows = asyncio.run(asyncio.wait_for(_slowloris_scenario(head, authorizer.url, tmp_path), 720))
    for label, report, seen in windows:
        streams = {k: v for k, v in report["counters"].items() if k.startswith("streams_")}
        print(f"{label}: trainer {report['rate']:.2f} samples/s; honest new streams {report['served']} served, "
              f"{len(report['failed'])} failed; attackers {seen} (their daemons "
              f"{report.get('sybils_cores', 0.0):.2f} cores busy); worker {streams}")
    assert trainer.proc.poll() is None, trainer.log_tail()
    for i in (1, 3):
        label, report, seen = windows[i]
        quiet = (windows[i - 1][1]["rate"] + windows[i + 1][1]["rate"]) / 2
        assert not report["failed"], (label, report["failed"][:3])
        assert seen["evicted"] > 0, (label, seen)  # the attack did fill the allowance
        assert report["rate"] > 0.5 * quiet, (label, report["rate"], quiet)
    swarm.stop(trainer)
    summary = trainer.summary()
    assert summary is not None and summary["samples_dropped"] == 0, summary


THREE_STAGES = [{"first_layer": 0, "last_layer": 1}, {"first_layer": 1, "last_layer": 2},
                {"first_layer": 2, "last_layer": 3}]
FLOOD_S = 15.0
QUIET_S = 10.0
PROBE_EVERY_S = 0.2


@pytest.fixture
def authorizer3(tmp_path, run_config_path):
    from tests.integration.test_auth_swarm import started_authorizer

    process = started_authorizer(tmp_path, run_config_path, THREE_STAGES, "flood")
    yield process
    process.stop()


class _Flood(_Sybils):
    """`SYBILS` stock libp2p peers, each holding `SILENT_PER_SYBIL` streams to `worker` that never
    say hello and opening another as soon as one is closed (evicted, refused or disconnected):
    the stream flood that stalled a worker before streams were refused on arrival."""

    def __init__(self, worker, addresses: list[str]):
        super().__init__(worker, addresses)
        self.seen = {"opened": 0, "open_failed": 0}
        self.flooding = asyncio.Event()

    async def _hold(self, p2p):
        from protocol import version

        await self.flooding.wait()
        while not self._stopping:
            try:
                reader, writer = await asyncio.wait_for(_open(p2p, self.peer, version.FORWARD), 10)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - refused or disconnected: the flood tries again at once
                self.seen["open_failed"] += 1
                await asyncio.sleep(0.01)
                continue
            self.seen["opened"] += 1
            with contextlib.suppress(Exception):
                while await reader.read(4096):
                    pass
            writer.close()


def _flood_process(peer_id: str, maddrs: list[str], addresses: list[str], conn) -> None:
    """The flood, in a process of its own (so that its event loop is not the honest probe's):
    starts its daemons, says "up", floods from "go" to "stop", then sends what it saw."""
    async def main():
        loop = asyncio.get_running_loop()
        async with _Flood(types.SimpleNamespace(peer_id=peer_id, maddrs=maddrs), addresses) as flood:
            conn.send("up")
            while True:
                while not await loop.run_in_executor(None, conn.poll, 1.0):
                    pass
                if conn.recv() != "go":
                    break  # "stop", whenever it comes
                flood.flooding.set()
            seen = dict(flood.seen)
        conn.send(seen)

    asyncio.run(main())


class _FloodChild:
    """`_flood_process` in a forked child, its daemons killed whatever becomes of it."""

    def __init__(self, worker):
        parent, child = multiprocessing.Pipe()
        self.conn = parent
        self.proc = multiprocessing.Process(target=_flood_process, daemon=True, args=(
            worker.peer_id, worker.maddrs, [f"127.0.0.{n}" for n in range(2, 8)], child))
        self.proc.start()
        self.descendants: list[psutil.Process] = []

    def wait_up(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            raise TimeoutError("the flood's daemons did not come up")
        assert self.conn.recv() == "up"
        self.descendants = psutil.Process(self.proc.pid).children(recursive=True)

    async def go(self) -> None:
        self.conn.send("go")

    async def stop(self) -> dict:
        self.conn.send("stop")
        loop = asyncio.get_running_loop()
        if not await loop.run_in_executor(None, self.conn.poll, 60):
            return {}
        return self.conn.recv()

    def close(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send("stop")  # its daemons shut down in order
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        for process in self.descendants:
            with contextlib.suppress(psutil.Error):
                process.kill()


async def _honest_calls(probe: "_HonestProbe", until: float) -> list[float]:
    """Fresh-stream INFO calls to the worker every PROBE_EVERY_S until `until` (a new client each
    time, so each call opens a stream and says its hello): their latencies, a failure as infinite."""
    latencies = []
    while time.monotonic() < until:
        started = time.monotonic()
        try:
            await probe.info()
            latencies.append(time.monotonic() - started)
        except Exception:  # noqa: BLE001 - a refused or timed-out honest call
            latencies.append(float("inf"))
        await asyncio.sleep(max(0.0, started + PROBE_EVERY_S - time.monotonic()))
    return latencies


async def _window(probe: "_HonestProbe", window_s: float) -> dict:
    """The trainer's rate through the worker (backward samples/s) and honest call latencies."""
    first = await probe.info()
    t0 = time.monotonic()
    latencies = await _honest_calls(probe, t0 + window_s)
    last = await probe.info()
    rate = (last["counters"]["backward_requests"] - first["counters"]["backward_requests"]) / (time.monotonic() - t0)
    return {"rate": rate, "latencies": latencies, "counters": last["counters"]}


def _cpu_s(processes: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """CPU seconds (user and system) each group of processes has used so far."""
    used = {}
    for label, group in processes.items():
        used[label] = 0.0
        for process in group:
            with contextlib.suppress(psutil.Error):
                times = process.cpu_times()
                used[label] += times.user + times.system
    return used


async def _flood_scenario(worker, authorizer_url, tmp_path, flood: _FloodChild) -> dict:
    head = psutil.Process(worker.pid)
    processes = {"worker": [head], "worker's children": head.children(recursive=True),
                 "flood": [psutil.Process(flood.proc.pid)], "flood's daemons": flood.descendants}
    async with _HonestProbe(worker, authorizer_url, str(tmp_path / "probe.key")) as probe:
        while (await probe.info())["counters"].get("backward_requests", 0) < 20:  # the trainer is training
            await asyncio.sleep(1.0)
        before, t0 = _cpu_s(processes), time.monotonic()
        quiet = await _window(probe, QUIET_S)
        during, t1 = _cpu_s(processes), time.monotonic()
        await flood.go()
        await asyncio.sleep(2.0)  # the flood is on
        started, t2 = _cpu_s(processes), time.monotonic()
        flooded = await _window(probe, FLOOD_S - 2.0)
        after, t3 = _cpu_s(processes), time.monotonic()
        seen = await flood.stop()
    # CPU used per second of the window: 1.0 is one core busy
    quiet["cpu"] = {k: (during[k] - before[k]) / (t1 - t0) for k in before}
    flooded["cpu"] = {k: (after[k] - started[k]) / (t3 - t2) for k in after}
    return {"quiet": quiet, "flood": flooded, "seen": seen}


def _p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


@pytest.mark.solo
@pytest.mark.timeout(300)
def test_a_stream_flood_does_not_stall_a_worker(make_swarm, authorizer3, tmp_path):
    """36 throwaway peer ids x 8 silent streams, each re-opened as soon as the worker closes it,
    for 15 s against the head worker of a 3-stage swarm: honest calls to it stay under 1 s and
    the trainer keeps at least half its rate without the flood."""
    swarm = make_swarm(None)
    workers = [swarm.start("worker", args=_node_args(authorizer3, name)) for name in ("alice", "bob", "erin")]
    head = next(w for w in workers if w.stage == 0)
    flood = _FloodChild(head)  # its daemons start while the trainer does
    try:
        trainer = swarm.start("trainer", args=[*_node_args(authorizer3, "carol"), "--max-samples", "1000000",
                                               "--lanes", "2"])
        flood.wait_up(150)
        report = asyncio.run(asyncio.wait_for(_flood_scenario(head, authorizer3.url, tmp_path, flood), 150))
    finally:
        flood.close()
    lines = []
    for label in ("quiet", "flood"):
        window = report[label]
        latencies = window["latencies"]
        streams = {k: v for k, v in window["counters"].items() if k.startswith(("streams_", "peers_"))}
        lines.append(f"{label}: trainer {window['rate']:.1f} samples/s; honest calls max {max(latencies):.3f} s, "
                     f"p95 {_p95(latencies):.3f} s ({len(latencies)} calls); worker {streams}; cores busy "
                     f"{ {k: round(v, 2) for k, v in window['cpu'].items()} }")
    print("\n".join(lines), f"\nattackers {report['seen']}")
    quiet, flooded = report["quiet"], report["flood"]
    assert trainer.proc.poll() is None, trainer.log_tail()
    # the flood did fill the allowance of silent streams, and its peer ids were shunned for it
    assert flooded["counters"]["streams_closed_evicted"] > 0 and flooded["counters"]["peers_shunned"] >= SYBILS, \
        flooded["counters"]
    assert max(flooded["latencies"]) < 1.0, sorted(flooded["latencies"])[-5:]
    assert flooded["rate"] >= 0.5 * quiet["rate"], (flooded["rate"], quiet["rate"])
