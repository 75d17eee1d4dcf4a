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
