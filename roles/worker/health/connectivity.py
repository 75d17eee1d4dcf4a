"""Whether any peer still answers this worker: the signal of the connectivity rule
(roles/worker/health/termination.py) [report 3.3.1.6].

A DHT call cannot tell: hivemind answers from its local storage when every peer is gone, and a
store "succeeds" locally. So the probe asks for a reply only a live remote peer can give. A
trainer request that arrived since the last probe is proof enough (the counter is free); when
none did, a few workers of the run, read from the DHT's worker records (remembered when the read
comes back empty), are asked for `agora/v1/info` at once. Any reply counts, a typed refusal
included: that peer was reached. Only timeouts and failed dials count against connectivity.
"""

from __future__ import annotations

import asyncio
import random
from typing import Callable

from hivemind.p2p import P2P, PeerID

from protocol import version
from protocol.dht import SwarmDHT
from protocol.dht_schema import WorkerRecord, workers_key
from protocol.errors import RemoteError
from protocol.transport import RpcClient, dial


class ConnectivityProbe:
    """Probes the run's workers; `probe()` says whether one answered, and why not."""

    def __init__(self, swarm: SwarmDHT, p2p: P2P, client: RpcClient, *, run_id: str, num_stages: int,
                 served: Callable[[], int], timeout_s: float = 5.0, fanout: int = 3):
        self.swarm = swarm
        self.p2p = p2p
        self.client = client
        self.keys = [workers_key(run_id, stage) for stage in range(num_stages)]
        self.served = served
        """Requests this worker has received so far (any arrival proves a trainer reached it)."""
        self.timeout_s = timeout_s
        self.fanout = fanout
        self._served = served()
        self._known: dict[str, list[str]] = {}
        """Other workers and their multiaddrs, from the last read that found any."""

    async def probe(self) -> tuple[bool, str]:
        served = self.served()
        if served != self._served:
            self._served = served
            return True, "requests arrived"
        await self._refresh()
        if not self._known:
            return False, "no other worker of the run is known"
        peers = random.sample(sorted(self._known), min(self.fanout, len(self._known)))
        answers = await asyncio.gather(*(self._ask(peer) for peer in peers))
        if any(ok for ok, _ in answers):
            return True, "a worker answered"
        return False, "; ".join(why for _, why in answers)

    async def _refresh(self) -> None:
        found: dict[str, list[str]] = {}
        for key in self.keys:
            try:
                records = await asyncio.wait_for(self.swarm.get(key, WorkerRecord), self.timeout_s)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - an unreadable DHT is no news
                continue
            found.update({peer: record.maddrs for peer, record in records.items() if peer != self.swarm.peer_id})
        if found:
            self._known = found

    async def _ask(self, peer: str) -> tuple[bool, str]:
        peer_id = PeerID.from_base58(peer)
        try:
            await dial(self.p2p, peer_id, self._known.get(peer, []), timeout_s=self.timeout_s)
            await self.client.call(peer_id, version.INFO, {}, timeout_s=self.timeout_s)
        except RemoteError:
            return True, f"{peer[-8:]} answered with a refusal"
        except Exception as exc:  # noqa: BLE001 - PeerTimeout, PeerUnavailable, a dial error: unreachable
            return False, f"{peer[-8:]}: {type(exc).__name__}: {str(exc)[:120] or 'timed out'}"
        return True, f"{peer[-8:]} answered"
