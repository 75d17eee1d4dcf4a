"""Withdrawing records on the way out does not wait out a full timeout per record when the
DHT has just stopped answering (the whole swarm stopping at once)."""

from __future__ import annotations

import asyncio
import time

from protocol.dht import SwarmDHT
from protocol.dht_schema import Tombstone


class _SilentDHT:
    """A hivemind DHT whose stores never complete (no peer answers), or complete at once."""

    def __init__(self):
        self.answering = False
        self.stored: list[str] = []

    def store(self, key, value, expiration_time, subkey, return_future):
        future = asyncio.get_running_loop().create_future()
        if self.answering:
            self.stored.append(key)
            future.set_result(True)
        return future


def test_withdrawals_after_a_timed_out_store_try_only_briefly():
    async def scenario():
        dht = _SilentDHT()
        swarm = SwarmDHT(dht, "me", timeout_s=3.0)
        started = time.monotonic()
        assert not await swarm.withdraw("run/workers")  # the first waits the full timeout
        first = time.monotonic() - started
        started = time.monotonic()
        assert not await swarm.withdraw("run/progress")
        assert not await swarm.withdraw("run/averaging")
        rest = time.monotonic() - started
        dht.answering = True
        assert await swarm.withdraw("run/again")
        assert await swarm.store("run/record", Tombstone(), 10)
        return first, rest, dht.stored

    first, rest, stored = asyncio.run(scenario())
    assert first >= 3.0
    assert rest < 3.0, "two withdrawals after a timeout took as long as a full timeout"
    assert stored == ["run/again", "run/record"]


def test_a_node_restarted_with_its_identity_supersedes_the_record_it_left(tmp_path):
    """A leaving node's tombstone (and a trainer's final report) lives a minute, longer than the
    records a restarted process announces: DHT nodes keep the value that expires last, so every
    announcement of the new process was refused until the old record lapsed (issue 22, point 6)."""
    from node.swarm import join_swarm
    from protocol.dht_schema import WorkerRecord, workers_key
    from protocol.identity import load_or_create_identity

    run, key = "supersede-test", workers_key("supersede-test", 0)
    seed_id = load_or_create_identity(str(tmp_path / "seed.key"))
    node_id = load_or_create_identity(str(tmp_path / "node.key"))
    peer = node_id.peer_id.to_base58()
    common = dict(run_id=run, num_stages=1, host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[],
                  bootstrap_timeout_s=30)
    seed = join_swarm(identity=seed_id, initial_peers=[], **common)
    try:
        reader = SwarmDHT(seed.dht, seed_id.peer_id.to_base58())

        def incarnation(action):
            membership = join_swarm(identity=node_id, initial_peers=seed.maddrs, **common)
            try:
                return asyncio.run(action(SwarmDHT(membership.dht, peer)))
            finally:
                membership.shutdown()

        async def leave(swarm):
            assert await swarm.store(key, WorkerRecord(stage=0, max_batch=4, throughput=1.0), 15)
            assert await swarm.withdraw(key)  # the tombstone: 60 s

        async def restart(swarm):
            first = await swarm.store(key, WorkerRecord(stage=0, max_batch=8, throughput=1.0), 15)
            again = await swarm.store(key, WorkerRecord(stage=0, max_batch=16, throughput=1.0), 15)
            return first, again

        incarnation(leave)
        assert asyncio.run(reader.get(key, WorkerRecord)) == {}
        assert incarnation(restart) == (True, True)
        seen = asyncio.run(reader.get(key, WorkerRecord))
        assert seen[peer].max_batch == 16
    finally:
        seed.shutdown()


def test_nothing_live_is_announced_under_a_withdrawn_key():
    """A periodic announcement still running while a worker drains stored a live record after its
    tombstone, expiring just past it: the departed worker stayed listed for the tombstone's minute
    (a CI run saw it 30 s after the exit). After a withdrawal only tombstones go under that key."""
    from protocol.dht_schema import WorkerRecord

    async def scenario():
        dht = _SilentDHT()
        dht.answering = True
        swarm = SwarmDHT(dht, "me", timeout_s=3.0)
        record = WorkerRecord(stage=0, max_batch=4, throughput=1.0)
        assert await swarm.store("run/workers", record, 3)
        assert await swarm.withdraw("run/workers")
        assert not await swarm.store("run/workers", record, 3)
        assert await swarm.withdraw("run/workers")
        assert await swarm.store("run/progress", record, 3)
        return dht.stored

    assert asyncio.run(scenario()) == ["run/workers", "run/workers", "run/workers", "run/progress"]


def test_an_announcer_stops_for_good_once_withdrawn():
    from protocol.dht_schema import WorkerRecord
    from roles.announcer import Announcer

    async def scenario():
        dht = _SilentDHT()
        dht.answering = True
        announcer = Announcer(SwarmDHT(dht, "me"), "run/workers",
                              lambda: WorkerRecord(stage=0, max_batch=4, throughput=1.0), period_s=1.0)
        assert await announcer.announce_now()
        await announcer.withdraw()
        assert not await announcer.announce_now()
        return dht.stored

    assert asyncio.run(scenario()) == ["run/workers", "run/workers"]
