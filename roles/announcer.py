"""Re-announces one of this node's DHT records on a fixed period, well before it expires, and
withdraws it with a tombstone on the way out [report 3.3.1.5]."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from protocol.dht import SwarmDHT
from protocol.dht_schema import RecordModel
from roles.periodic import every

logger = logging.getLogger(__name__)


class Announcer:
    def __init__(self, swarm: SwarmDHT, key: str, make_record: Callable[[], RecordModel], *,
                 period_s: float, ttl_s: float | None = None):
        self.swarm = swarm
        self.key = key
        self.make_record = make_record
        self.period_s = period_s
        self.ttl_s = ttl_s if ttl_s is not None else 3 * period_s
        self._wake = asyncio.Event()
        self.announced = False
        """Whether a DHT peer accepted the record at least once (the node's readiness needs it)."""

    async def announce_now(self) -> bool:
        if self.swarm.withdrawn(self.key):  # tombstoned on the way out: never announced again
            return False
        stored = await self.swarm.store(self.key, self.make_record(), self.ttl_s)
        self.announced = self.announced or stored
        return stored

    def poke(self) -> None:
        """Re-announce at once (e.g. after a phase change) instead of at the next period."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.period_s, self._announce, stop, name=f"announcing {self.key}", wake=self._wake)

    async def _announce(self) -> None:
        if not await self.announce_now():
            logger.warning("announcing %s was not accepted by any DHT peer", self.key)

    async def withdraw(self) -> None:
        try:
            await self.swarm.withdraw(self.key)
        except Exception:
            logger.warning("could not withdraw %s", self.key, exc_info=True)
