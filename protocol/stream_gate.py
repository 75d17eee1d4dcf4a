"""Which remote peers may open a stream at all: the refusal a stream flood meets before it costs
a session, a read or a timer.

protocol/stream_limits.py bounds what a peer holds; it does not bound how fast streams arrive.
A flood that re-opens every stream the server evicts (36 throwaway peer ids x 8 silent streams
re-opened at once: 18,110 streams in 25 s) stays within every holding limit, yet each stream costs
the node's daemon a stream and the event loop an accept, a session and an eviction: honest calls
to a worker took up to 5.3 s and its trainer's rate fell from 55 to 3 samples/s. So the gate
remembers, per peer that has not said a valid hello yet:

- strikes: its silent streams evicted, timed out before their hello, or refused for holding
  too many. After `shun_after_strikes` the peer is shunned: its new streams are refused on
  arrival, before a session, a read or a timer. The transport holds them unread until the shun
  ends, within the allowance of silent streams (per peer and in total), and closes the rest at
  once and drops the peer's libp2p connection (at most once per `shun_disconnect_every_s`).
  Holding is what stops a flood that re-opens whatever is closed: closing at once let it cycle a
  stream per round trip, and a dropped connection it re-dials at once. The shun lasts
  `shun_base_s`, doubling each time it is earned again, up to `shun_max_s`; a peer quiet for
  `shun_max_s` starts afresh;
- and, for all such peers together, a token bucket of new streams (`new_unauthenticated_per_s`,
  `new_unauthenticated_burst`), so that peer ids, which cost nothing, cannot multiply the rate.
  A peer without strikes passes even with the bucket empty while it holds fewer than
  NEWCOMER_STREAMS silent streams, as many as a client opens before its first ack: that is how an
  honest newcomer's hellos get in during a flood, and a throwaway peer id gets no more than those
  before its first strike.

A peer that said a valid hello is trusted: never struck, never shunned, never counted against
the bucket. Its credential answers for it, and the holding limits still bound it. Only silent
streams earn strikes, so a stream that sends its hello at once is never refused for others'
floods. Event-loop only; `StreamGate` keeps the bookkeeping and the transport acts on it.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

from protocol.stream_limits import StreamLimits

MAX_TRACKED_PEERS = 4096
"""Peers with strikes or shuns remembered at once, and as many trusted ones (least recently seen
forgotten first): throwaway peer ids must not grow the tables without bound, nor push trusted
peers out."""

NEWCOMER_STREAMS = 4
"""Silent streams a peer without strikes may open past an empty bucket: a client opens this many
at once before its first ack (protocol/transport.py HELLOS_IN_FLIGHT_PER_PEER)."""


@dataclass(eq=False)
class _Standing:
    strikes: int = 0
    shuns: int = 0
    """How many times it was shunned (the back-off's exponent)."""
    shunned_until: float = 0.0
    last_strike: float = 0.0
    last_disconnect: float = float("-inf")


class StreamGate:
    """Strikes, shuns with back-off and the token bucket of new streams from untrusted peers,
    against `StreamLimits`. Times are monotonic seconds passed in by the caller."""

    def __init__(self, limits: StreamLimits, *, now: float = 0.0):
        self.limits = limits
        self._peers: collections.OrderedDict[str, _Standing] = collections.OrderedDict()
        """Untrusted peers with strikes or shuns."""
        self._trusted: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._tokens = float(limits.new_unauthenticated_burst)
        self._refilled = now
        self.shuns = 0
        """Shuns so far, all peers together."""

    def admit(self, peer: str, silent_held: int, now: float) -> Optional[str]:
        """Whether a new stream of `peer` (which holds `silent_held` silent streams) may open: None,
        or the reason it is refused ("shunned", "unauthenticated_rate")."""
        if peer in self._trusted:
            self._trusted.move_to_end(peer)
            return None
        standing = self._peers.get(peer)
        if standing is not None:
            self._peers.move_to_end(peer)
            if now < standing.shunned_until:
                return "shunned"
        self._refill(now)
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return None
        if silent_held < NEWCOMER_STREAMS and (standing is None or standing.strikes == 0):
            return None  # a newcomer's first streams: their hellos are on the way
        self.strike(peer, now)
        return "unauthenticated_rate"

    def strike(self, peer: str, now: float) -> bool:
        """An untrusted `peer`'s silent stream was evicted, timed out or refused. True if this
        shuns it (now): the caller drops its connection."""
        if peer in self._trusted:
            return False
        standing = self._standing(peer)
        if now < standing.shunned_until:
            return False
        if now - standing.last_strike > self.limits.shun_max_s:
            standing.strikes = standing.shuns = 0  # quiet long enough: forgiven
        standing.last_strike = now
        standing.strikes += 1
        if standing.strikes < self.limits.shun_after_strikes:
            return False
        standing.strikes = 0
        standing.shunned_until = now + self.shun_s(standing.shuns)
        standing.shuns += 1
        self.shuns += 1
        return True

    def shun_s(self, shuns: int) -> float:
        """How long the shun after `shuns` earlier ones lasts."""
        return min(self.limits.shun_max_s, self.limits.shun_base_s * 2.0 ** min(shuns, 32))

    def trust(self, peer: str) -> None:
        """`peer` said a valid hello: its strikes and shuns are forgotten."""
        self._peers.pop(peer, None)
        self._trusted[peer] = None
        self._trusted.move_to_end(peer)
        while len(self._trusted) > MAX_TRACKED_PEERS:
            self._trusted.popitem(last=False)

    def should_disconnect(self, peer: str, now: float) -> bool:
        """Whether to drop the connection of shunned `peer`, whose stream just arrived: at most once
        per `shun_disconnect_every_s` (each drop costs the node a call to its daemon)."""
        standing = self._peers.get(peer)
        if standing is None or now >= standing.shunned_until:
            return False
        if now - standing.last_disconnect < self.limits.shun_disconnect_every_s:
            return False
        standing.last_disconnect = now
        return True

    def shunned(self, peer: str, now: float) -> bool:
        standing = self._peers.get(peer)
        return standing is not None and now < standing.shunned_until

    def trusted(self, peer: str) -> bool:
        return peer in self._trusted

    @property
    def tracked(self) -> int:
        """Untrusted peers remembered."""
        return len(self._peers)

    def _standing(self, peer: str) -> _Standing:
        standing = self._peers.get(peer)
        if standing is None:
            standing = self._peers[peer] = _Standing()
            while len(self._peers) > MAX_TRACKED_PEERS:
                self._peers.popitem(last=False)
        else:
            self._peers.move_to_end(peer)
        return standing

    def _refill(self, now: float) -> None:
        elapsed = max(0.0, now - self._refilled)
        self._refilled = now
        self._tokens = min(float(self.limits.new_unauthenticated_burst),
                           self._tokens + elapsed * self.limits.new_unauthenticated_per_s)
