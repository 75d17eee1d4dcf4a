"""Rate limits on the node endpoints: who a request counts against, and whether it may go on.

Measured before this existed: 2,000 junk joins in 10 s from one address were all processed, each
one a database row, while honest traffic waited behind them. Now every join, poll, renewal and
leave spends a token before any body is validated or any database is touched (the RateLimit
middleware in authorizer.app asks this module), and one that finds none is answered 429
`rate_limited` with `Retry-After`.

Who pays, in order:

* a **node that proves its key**: a renewal or leave whose Ed25519 proof verifies against the key
  of a node this process knows to hold a live ticket, and that is newer than the last proof it
  charged, spends from that node's bucket; a poll of a live ticket this process handed out spends
  from its node's bucket too. An honest node's renewals therefore never compete with anything a
  flooding neighbour behind the same address sends, and a forged or replayed proof naming it
  cannot spend its tokens (it is charged to its sender's address instead);
* everything else by **source address**, IPv6 by its /64 (one host usually holds the whole
  prefix): joins from one bucket, and polls, renewals and leaves that prove nothing (an unknown
  ticket, a node this process has not seen, a bad signature) from a second one, so that a join
  flood does not starve the polls and renewals a restarted authorizer does not recognise yet.

Evidence reports (`POST /v1/evidence`, authorizer.evidence) pay twice: their source address before
the body is read, like a request that proves nothing, and once the report's signature shows which
live node sent it, that **reporter's** own bucket (a few reports a minute), before the evidence
itself is checked.

A node becomes known when the store shows it live: its join was queued, it was admitted, a poll
found its ticket live, or a proof checked against the database passed; it is forgotten when it
leaves or a renewal is refused. Behind a reverse proxy every request comes from the proxy's address
unless it forwards the client's: uvicorn takes `X-Forwarded-For` from the addresses in
`FORWARDED_ALLOW_IPS` (default 127.0.0.1 and ::1), so a proxy on the same host works as is.

Every table is bounded (`max_sources` entries, least recently used forgotten; authorizer.buckets),
so a flood from however many addresses costs a fixed amount of memory. The limiter runs only on the
event loop and takes no lock.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import json
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from authorizer.buckets import Bucket, BucketTable, LruTable
from authorizer.errors import RateLimited
from protocol.credentials import proof_bytes
from protocol.identity import verify_signature
from roles.event_log import EventAggregator

logger = logging.getLogger("agora.authorizer.ratelimit")

RATE_LIMITED_REASON = "rate_limited"
"""The reason under which joins answered 429 are counted beside the rejected ones (authorizer.rejections)."""


@dataclass(frozen=True)
class RateLimits:
    """The limits' numbers (AuthorizerConfig holds their defaults and descriptions)."""

    join_rate_per_s: float
    join_burst: int
    request_rate_per_s: float
    request_burst: int
    node_rate_per_s: float
    node_burst: int
    max_sources: int
    evidence_rate_per_s: float = 0.1
    evidence_burst: int = 6


def source_of(host: Optional[str]) -> str:
    """Whom unauthenticated traffic from `host` counts against: the IPv4 address, or the IPv6 /64
    (an IPv4-mapped IPv6 address is its IPv4 address)."""
    if not host:
        return "unknown"
    if ":" not in host:
        return host
    try:
        address = ipaddress.IPv6Address(host.split("%", 1)[0])
    except ValueError:
        return host[:64]
    if address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(ipaddress.IPv6Network((address, 64), strict=False))


class KnownNode:
    """A node this process has seen live: its key, the newest proof charged, its bucket."""

    __slots__ = ("public_key", "last_signed_at", "bucket")

    def __init__(self, public_key: bytes, last_signed_at: float, bucket: Bucket):
        self.public_key = public_key
        self.last_signed_at = last_signed_at
        self.bucket = bucket


class Limiter:
    """The rate limits' state and decisions. Each `check_*` spends a token and returns None, or
    spends nothing and returns the RateLimited error to answer with."""

    def __init__(self, limits: RateLimits, *, run_id: str, proof_window_s: float,
                 on_join_refused: Callable[[str], None] = lambda source: None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: Callable[[], float] = time.time):
        self.limits = limits
        self.run_id = run_id
        self.proof_window_s = proof_window_s
        self.on_join_refused = on_join_refused
        self.clock = clock
        self.wall_clock = wall_clock
        self.joins = BucketTable(rate_per_s=limits.join_rate_per_s, burst=limits.join_burst,
                                 max_entries=limits.max_sources)
        self.requests = BucketTable(rate_per_s=limits.request_rate_per_s, burst=limits.request_burst,
                                    max_entries=limits.max_sources)
        self.reporters = BucketTable(rate_per_s=limits.evidence_rate_per_s, burst=limits.evidence_burst,
                                     max_entries=limits.max_sources)
        self.nodes: LruTable[str, KnownNode] = LruTable(limits.max_sources)
        self.tickets: LruTable[str, str] = LruTable(limits.max_sources)
        self.refused = EventAggregator(logger, "refused", "request", interval_s=10.0)
        """429s by kind (join, poll, renew, leave) and payer (source, node); logged every 10 s."""

    # -- what the store told us ------------------------------------------------------------

    def know(self, peer_id: str, public_key: bytes, *, ticket: Optional[str] = None,
             signed_at: Optional[float] = None) -> None:
        """`peer_id` holds a live ticket (`ticket`) and the key `public_key`; `signed_at` is the
        newest proof the store accepted from it. A node already known keeps its bucket."""
        node = self.nodes.get(peer_id)
        if node is None:
            node = KnownNode(public_key, signed_at or 0.0, Bucket(self.limits.node_burst, self.clock()))
            self.nodes.put(peer_id, node)
        else:
            node.public_key = public_key
            if signed_at is not None and signed_at > node.last_signed_at:
                node.last_signed_at = signed_at
        if ticket is not None:
            self.tickets.put(ticket, peer_id)

    def forget(self, peer_id: str) -> None:
        """`peer_id` holds no live ticket any more: what it sends now proves nothing."""
        self.nodes.pop(peer_id)

    # -- checks ----------------------------------------------------------------------------

    def check_join(self, source: str) -> Optional[RateLimited]:
        wait = self.joins.take(source, self.clock())
        if not wait:
            return None
        self.on_join_refused(source)
        return self._refuse("join", source, wait, (
            f"too many joins from {source} (at most {self.limits.join_burst} at once, then "
            f"{self.limits.join_rate_per_s:g} a second); retry after the Retry-After seconds, or start fewer "
            f"nodes at once from this address"))

    def check_poll(self, source: str, ticket: str) -> Optional[RateLimited]:
        peer_id = self.tickets.get(ticket)
        node = self.nodes.get(peer_id) if peer_id is not None else None
        if node is not None:
            return self._charge_node("poll", peer_id, node)  # type: ignore[arg-type]
        return self._charge_source("poll", source)

    def check_proof(self, source: str, action: str, body: bytes) -> Optional[RateLimited]:
        """A renew or leave request (`action`), given its raw body."""
        proven = self._proven_node(action, body)
        if proven is not None:
            return self._charge_node(action, *proven)
        return self._charge_source(action, source)

    def check_evidence_source(self, source: str) -> Optional[RateLimited]:
        """An evidence report before its body is read: nothing is proven yet, so its source pays."""
        return self._charge_source("evidence", source)

    def check_reporter(self, peer_id: str) -> Optional[RateLimited]:
        """An evidence report whose signature proved it comes from live node `peer_id`, before the
        evidence is checked: from that reporter's own bucket (a forged report cannot spend it)."""
        wait = self.reporters.take(peer_id, self.clock())
        if not wait:
            return None
        limits = self.limits
        return self._refuse("evidence", f"reporter {peer_id[-12:]}", wait, (
            f"too many evidence reports from {peer_id} (at most {limits.evidence_burst} at once, then "
            f"{limits.evidence_rate_per_s * 60:g} a minute); retry after the Retry-After seconds, and report "
            f"a worker once: later evidence against a banned account changes nothing"))

    def _proven_node(self, action: str, body: bytes) -> Optional[tuple[str, KnownNode]]:
        """The known node whose fresh proof `body` carries, or None. Only the node's bucket is at
        stake, so anything short of a verified proof newer than the last one charged is None."""
        try:
            fields = json.loads(body)
            peer_id, signed_at, signature = fields["peer_id"], fields["signed_at"], fields["signature"]
        except Exception:  # hostile bytes of every kind: bad JSON, too deep, not a mapping, missing keys
            return None
        if not isinstance(peer_id, str) or not isinstance(signature, str) or len(signature) > 256:
            return None
        if isinstance(signed_at, bool) or not isinstance(signed_at, (int, float)):
            return None
        node = self.nodes.get(peer_id)
        if node is None or not signed_at > node.last_signed_at:
            return None
        if abs(self.wall_clock() - signed_at) > self.proof_window_s:
            return None
        try:
            raw_signature = base64.b64decode(signature, validate=True)
        except (binascii.Error, ValueError):
            return None
        data = proof_bytes(action, run_id=self.run_id, peer_id=peer_id, signed_at=signed_at)  # type: ignore[arg-type]
        if not verify_signature(node.public_key, data, raw_signature):
            return None
        node.last_signed_at = float(signed_at)  # this proof is charged once; a replay pays as its sender
        return peer_id, node

    def _charge_node(self, kind: str, peer_id: str, node: KnownNode) -> Optional[RateLimited]:
        limits = self.limits
        wait = node.bucket.take(self.clock(), limits.node_rate_per_s, limits.node_burst)
        if not wait:
            return None
        return self._refuse(kind, f"node {peer_id[-12:]}", wait, (
            f"too many requests from node {peer_id} (at most {limits.node_burst} at once, then "
            f"{limits.node_rate_per_s:g} a second); retry after the Retry-After seconds"))

    def _charge_source(self, kind: str, source: str) -> Optional[RateLimited]:
        wait = self.requests.take(source, self.clock())
        if not wait:
            return None
        limits = self.limits
        return self._refuse(kind, source, wait, (
            f"too many {kind} requests from {source} that prove no admitted node (at most "
            f"{limits.request_burst} at once, then {limits.request_rate_per_s:g} a second); retry after the "
            f"Retry-After seconds"))

    def _refuse(self, kind: str, payer: str, wait_s: float, message: str) -> RateLimited:
        self.refused.count(kind, detail=f"from {payer}")
        return RateLimited(message, wait_s)
