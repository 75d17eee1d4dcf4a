"""Typed access to the run's DHT records (docs/architecture.md, 'DHT schema') on top of a hivemind DHT.

Roles store and read pydantic records through this class and never touch raw DHT values:
values are dumped from the record model on the way in and validated again on the way out, so
a record that got past another node's validator but not ours is dropped, not trusted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Optional, TypeVar

import hivemind
from hivemind.utils import get_dht_time
from pydantic import ValidationError

from protocol.dht_schema import MAX_RECORD_TTL_S, RecordModel, Tombstone
from protocol.errors import PeerTimeout
from protocol.stats import Distribution

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=RecordModel)

SUPERSEDE_MARGIN_S = 0.01
"""How much later than the record it replaces a superseding record expires."""


class SwarmDHT:
    """Stores this node's own subkeys and reads everyone's, with timeouts on every call."""

    def __init__(self, dht: hivemind.DHT, peer_id: str, *, timeout_s: float = 10.0):
        self.dht = dht
        self.peer_id = peer_id
        self.timeout_s = timeout_s
        self.latency: dict[str, Distribution] = {"get": Distribution(), "store": Distribution()}
        """Seconds each get and store took, timeouts included (for the node's metrics)."""
        self._store_timed_out_at: float | None = None
        """When our last store timed out; None once one succeeded since."""
        self._expires: dict[str, float] = {}
        """When the last record we stored under each key expires: the next must expire later."""
        self._withdrawn: set[str] = set()
        """Keys we tombstoned on the way out: no live record goes under them again (see withdraw)."""

    async def store(self, key: str, record: RecordModel, ttl_s: float, *, timeout_s: float | None = None) -> bool:
        """Announce `record` under our own subkey of `key` for `ttl_s` seconds, or longer when an
        earlier record of ours outlives that.

        A DHT node keeps a subkey's value with the latest expiration and refuses any other. The
        record a node leaves behind (a worker's tombstone, a trainer's final report: a minute)
        outlives the records a process restarted with the same identity announces (three announce
        periods), so every announcement of the new process was refused until it lapsed: a trainer
        restarted right after a clean exit logged 'not accepted by any DHT peer' for about 40 s
        and the dashboard showed no trainer. A refused store therefore reads
        our subkey's expiration and stores again just past it; later stores keep expiring after
        it until `ttl_s` reaches past it by itself."""
        tombstone = isinstance(record, Tombstone)
        if key in self._withdrawn and not tombstone:  # see withdraw
            logger.debug("not announcing %s: withdrawn on the way out", key)
            return False
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        value = record.model_dump(mode="json")
        expiration = max(get_dht_time() + ttl_s, self._expires.get(key, 0.0) + SUPERSEDE_MARGIN_S)
        stored = await self._store(key, value, expiration, timeout_s)
        # (checked again: a store that began before a withdrawal must not chase the tombstone)
        if not stored and self._store_timed_out_at is None and (tombstone or key not in self._withdrawn):
            outlived = await self._own_expiration(key)
            if outlived is not None and expiration <= outlived < get_dht_time() + MAX_RECORD_TTL_S - 1.0:
                logger.info("our earlier record under %s expires in %.0fs; announcing past it", key,
                            outlived - get_dht_time())
                expiration = outlived + SUPERSEDE_MARGIN_S
                stored = await self._store(key, value, expiration, timeout_s)
        if stored:
            self._expires[key] = expiration
        return stored

    async def _store(self, key: str, value: dict, expiration: float, timeout_s: float) -> bool:
        started = time.perf_counter()
        future = self.dht.store(key, value, expiration_time=expiration, subkey=self.peer_id, return_future=True)
        try:
            stored = bool(await asyncio.wait_for(future, timeout_s))
            self._store_timed_out_at = None
            return stored
        except asyncio.TimeoutError:
            future.cancel()
            self._store_timed_out_at = time.monotonic()
            logger.warning("DHT store of %s timed out after %.1fs", key, timeout_s)
            return False
        finally:
            self.latency["store"].observe(time.perf_counter() - started)

    async def _own_expiration(self, key: str) -> Optional[float]:
        """When the record under our own subkey of `key` that the DHT holds expires; None if it
        holds none or does not answer."""
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            found = await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            future.cancel()
            return None
        if found is None or not isinstance(found.value, dict) or self.peer_id not in found.value:
            return None
        return float(found.value[self.peer_id].expiration_time)

    async def dht_store_raw(self, key: str, subkey: str, value: dict, ttl_s: float) -> bool:
        """Store a value under a subkey that is not our peer id: only for records that carry
        their own authority (the root-signed revocation list), which validators check."""
        future = self.dht.store(key, value, expiration_time=get_dht_time() + ttl_s, subkey=subkey, return_future=True)
        try:
            return bool(await asyncio.wait_for(future, self.timeout_s))
        except asyncio.TimeoutError:
            future.cancel()
            return False

    def withdrawn(self, key: str) -> bool:
        """Whether we tombstoned `key` on the way out (no live record goes under it again)."""
        return key in self._withdrawn

    async def withdraw(self, key: str, ttl_s: float = 60.0) -> bool:
        """Overwrite our subkey with a tombstone: hivemind has no delete. Right after a store timed
        out (no peer answered: typically the whole swarm is stopping with us), try only briefly:
        the record lapses by itself, and a node leaving with three records to withdraw would
        otherwise wait out three full timeouts.

        Later live stores under `key` are refused: a periodic announcement still running while the
        node drains would otherwise land after the tombstone and, expiring just past it (see
        store), keep a departed node listed for the tombstone's whole minute."""
        self._withdrawn.add(key)
        recent = self._store_timed_out_at is not None and time.monotonic() - self._store_timed_out_at < 60.0
        return await self.store(key, Tombstone(), ttl_s, timeout_s=min(self.timeout_s, 1.0) if recent else None)

    async def get(self, key: str, model: type[R], *, latest: bool = True, strict: bool = False) -> dict[str, R]:
        """Every live, valid, non-tombstoned record under `key`, by peer id. A timeout reads as
        no records, or raises PeerTimeout with `strict` (for callers that must tell the two apart)."""
        started = time.perf_counter()
        future = self.dht.get(key, latest=latest, return_future=True)
        try:
            found = await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError as exc:
            future.cancel()
            logger.warning("DHT get of %s timed out after %.1fs", key, self.timeout_s)
            if strict:
                raise PeerTimeout(f"DHT get of {key} timed out after {self.timeout_s:.1f}s") from exc
            return {}
        finally:
            self.latency["get"].observe(time.perf_counter() - started)
        if found is None or not isinstance(found.value, dict):
            return {}
        now = get_dht_time()
        records: dict[str, R] = {}
        for subkey, item in found.value.items():
            if not isinstance(subkey, str) or item.expiration_time < now:
                continue
            value = item.value
            if isinstance(value, dict) and value.get("tombstone") is True:
                continue
            try:
                records[subkey] = model.model_validate(value)
            except ValidationError:
                logger.debug("dropping invalid record under %s/%s", key, subkey)
        return records

    async def get_one(self, key: str, model: type[R], peer_id: Optional[str] = None) -> Optional[R]:
        return (await self.get(key, model)).get(peer_id or self.peer_id)
