"""Who may use a relay: the run's admitted nodes, and nobody else.

p2pd's circuit-relay-v2 service takes no access list, so the relay enforces one around it: a node
shows the relay its credential over an authenticated stream (`agora/v1/relay_hello`, checked like
any RPC's: the run's root key, expiry, the revocation list), and the gate polls the daemon's
connections and drops every peer that has not done so within `grace_s` of connecting. A circuit
reservation lives on its holder's connection, so an outsider's goes with it, and a circuit needs
a connection of both ends to the relay, so an outsider can neither be reached through the relay
nor reach anyone. An outsider dropped once is dropped at once when it comes back (for SHUN_S),
and one address may hold at most `max_pending_per_address` connections that have not shown a
credential: throwaway peer ids from one machine cannot crowd the relay for even `grace_s`.

A pass lasts PASS_TTL_S; nodes renew it every minute (node/reachability.py), so a node whose
credential lapsed or was revoked is dropped within PASS_TTL_S.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

logger = logging.getLogger("agora.relay")

PASS_TTL_S = 300.0
SHUN_S = 60.0


@dataclass
class GateCounts:
    dropped: collections.Counter = field(default_factory=collections.Counter)
    """Connections the gate closed, by reason: no_pass, pass_expired, shunned, address_crowded."""
    passes: int = 0
    """Credentials shown and accepted."""


def address_of(maddrs: Iterable) -> Optional[str]:
    """The IP a peer's connection comes from (the first ip4/ip6 component), if any."""
    for maddr in maddrs:
        parts = str(maddr).strip("/").split("/")
        for name, value in zip(parts, parts[1:]):
            if name in ("ip4", "ip6"):
                return value
    return None


class RelayGate:
    """Decides which connected peers to drop; the caller lists peers and disconnects."""

    def __init__(self, *, grace_s: float, max_pending_per_address: int = 8, exempt: Iterable[str] = (),
                 clock: Callable[[], float] = time.monotonic):
        self.grace_s = grace_s
        self.max_pending_per_address = max_pending_per_address
        self.exempt = set(exempt)
        self.clock = clock
        self.passes: dict[str, float] = {}
        """Peer id -> when its pass expires."""
        self.first_seen: dict[str, float] = {}
        """Connected peers without a valid pass -> when the gate first saw them."""
        self.shunned: dict[str, float] = {}
        self.counts = GateCounts()

    def grant(self, peer: str) -> float:
        """`peer` showed a valid credential; returns how long the pass lasts."""
        self.passes[peer] = self.clock() + PASS_TTL_S
        self.first_seen.pop(peer, None)
        self.shunned.pop(peer, None)
        self.counts.passes += 1
        return PASS_TTL_S

    def has_pass(self, peer: str) -> bool:
        return self.passes.get(peer, 0.0) > self.clock()

    def sweep(self, connected: dict[str, Optional[str]]) -> list[tuple[str, str]]:
        """`connected`: peer id -> source address. Returns the (peer, reason) pairs to drop now."""
        now = self.clock()
        for table in (self.passes, self.shunned):
            for peer in [p for p, until in table.items() if until <= now]:
                del table[peer]
        for peer in [p for p in self.first_seen if p not in connected]:
            del self.first_seen[peer]
        drop: list[tuple[str, str]] = []
        pending_by_address: dict[Optional[str], list[str]] = collections.defaultdict(list)
        for peer, address in connected.items():
            if peer in self.exempt or self.has_pass(peer):
                continue
            if peer in self.shunned:
                drop.append((peer, "shunned"))
                continue
            seen = self.first_seen.setdefault(peer, now)
            if now - seen >= self.grace_s:
                drop.append((peer, "no_pass"))
            else:
                pending_by_address[address].append(peer)
        for address, peers in pending_by_address.items():
            if address is None or len(peers) <= self.max_pending_per_address:
                continue
            peers.sort(key=lambda p: self.first_seen[p])  # the newest go; the oldest keep their grace
            drop += [(peer, "address_crowded") for peer in peers[self.max_pending_per_address:]]
        for peer, reason in drop:
            self.counts.dropped[reason] += 1
            self.first_seen.pop(peer, None)
            if reason != "address_crowded":
                self.shunned[peer] = now + SHUN_S
        return drop

    def pending(self) -> int:
        return len(self.first_seen)

    def holders(self, connected: Iterable[str]) -> int:
        """Connected peers with a valid pass."""
        return sum(1 for peer in connected if self.has_pass(peer))
