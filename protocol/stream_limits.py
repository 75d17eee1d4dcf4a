"""What one remote peer may hold of a node serving `agora/v1/*` streams, before and after it
proves who it is.

Every incoming stream costs a file descriptor and, while a frame arrives, the bytes buffered for
it. Without limits a peer with no credential could open a thousand streams and park them, or
announce 60 MiB frames the server reads in full before it learns the sender has no credential.
The server therefore keeps, per remote peer and in total:

- streams still waiting for their hello (unauthenticated, "silent"): few per peer, a bounded
  number per source address and in total, and each must say hello within `hello_timeout_s` in at
  most HELLO_MAX_BYTES;
- streams per peer, authenticated or not;
- bytes being read per peer (frames announced but not yet complete);
- and it closes a stream with no request in flight after `idle_timeout_s`.

Peer ids cost nothing, so the allowance of silent streams is not shared per peer id but per
source (`source_key`: the remote IP address, an IPv6 /64, or for a relayed stream the remote peer
id, since every peer behind a relay shares the relay's address). When the server-wide allowance
is full, a new stream is not refused: it evicts the oldest silent stream of the source holding the
most of them. An honest client sends its hello right behind the stream's opening, so its streams
are silent for a round trip and are never the oldest of the busiest source; a flood of throwaway
peer ids from one address evicts its own streams first. A stream that said a valid hello is not
counted against that allowance at all.

`StreamBudget` is only the bookkeeping: the transport asks it before opening a stream or reading
a frame, closes what it says to evict, and answers a refusal with a typed error
(`ErrorCode.RATE_LIMITED`) and the reason.

These limits bound what a peer holds, not how fast its streams come: a flood that re-opens every
evicted stream stays within them while it costs the node a session per round trip. Who may open a
stream at all (strikes, shuns with back-off, one bucket of new streams for every peer without a
valid hello) is protocol/stream_gate.py's, consulted before this budget; its settings are here too.
"""

from __future__ import annotations

import collections
import ipaddress
from dataclasses import dataclass
from typing import Hashable, Optional

HELLO_MAX_BYTES = 4096
"""The largest first frame a stream may start with: a credential (~300 bytes), a nonce, a
timestamp, a recipient and a signature fit with room to spare."""


@dataclass(frozen=True)
class StreamLimits:
    """Per-server limits; defaults suit a worker serving a few dozen trainers."""

    hello_timeout_s: float = 10.0
    """A new stream must send its hello within this long."""
    idle_timeout_s: float = 120.0
    """A stream with no request in flight is closed after this long (clients reuse streams, and
    close theirs earlier, so an honest client never meets this)."""
    max_streams_per_peer: int = 128
    """Open streams one peer may hold at once (a trainer keeps a few per lane and handler)."""
    max_unauthenticated_per_peer: int = 8
    """Streams of one peer that have not completed their hello yet."""
    max_unauthenticated_per_source: int = 64
    """Streams of one source address (`source_key`) that have not completed their hello yet; a
    new one beyond it evicts that source's oldest silent stream."""
    max_unauthenticated_total: int = 256
    """Streams of all peers that have not completed their hello yet; a new one beyond it evicts
    the oldest silent stream of the source holding the most."""
    max_buffered_bytes_per_peer: int = 256 << 20
    """Bytes of frames one peer has announced and not yet delivered in full, over all its streams."""
    min_transfer_rate_bps: float = 64 << 10
    """A frame must arrive at least this fast (after `idle_timeout_s` of grace), or its stream is closed."""
    shun_after_strikes: int = 8
    """Silent streams of a peer that never said a valid hello evicted, timed out or refused before
    it is shunned: its new streams refused on arrival and held unread, those past the allowance
    closed and its connection dropped (protocol/stream_gate.py)."""
    shun_base_s: float = 2.0
    """How long a first shun lasts; each one earned again lasts twice as long."""
    shun_max_s: float = 300.0
    """The longest shun; a peer with no strike for this long starts afresh."""
    shun_disconnect_every_s: float = 1.0
    """A shunned peer's connection is dropped at most this often while its streams keep arriving."""
    new_unauthenticated_per_s: float = 64.0
    """New streams per second of all peers that have not said a valid hello yet, together (a peer
    without strikes passes regardless with its first NEWCOMER_STREAMS silent streams)."""
    new_unauthenticated_burst: int = 256
    """How many such streams may arrive at once above that rate."""

    def frame_deadline_s(self, length: int) -> float:
        """How long reading a frame of `length` bytes may take."""
        return self.idle_timeout_s + length / self.min_transfer_rate_bps


def source_key(addr: Optional[str], peer: str) -> str:
    """What silent streams are counted per: the remote IP of a direct stream (an IPv6 address by
    its /64, which one host gets whole), or the remote peer id of a relayed one (`/p2p-circuit`:
    the address is the relay's, shared by everyone behind it) or of one without an IP address."""
    parts = (addr or "").split("/")
    if "p2p-circuit" in parts or len(parts) < 3:
        return f"peer:{peer}"
    protocol, host = parts[1], parts[2]
    try:
        if protocol == "ip4":
            return f"ip4:{ipaddress.IPv4Address(host)}"
        if protocol == "ip6":
            return f"ip6:{ipaddress.IPv6Network(f'{host}/64', strict=False)}"
    except ValueError:
        pass
    return f"peer:{peer}"


@dataclass(eq=False)
class _Silent:
    peer: str
    source: str


class StreamBudget:
    """Counts streams and buffered bytes per peer, and silent streams per peer and per source,
    against `StreamLimits`. Streams are identified by any hashable the caller chooses (the
    transport passes its session). Event-loop only."""

    def __init__(self, limits: StreamLimits):
        self.limits = limits
        self.streams: collections.Counter[str] = collections.Counter()
        self.unauthenticated: collections.Counter[str] = collections.Counter()
        """Silent streams per peer."""
        self.unauthenticated_by_source: collections.Counter[str] = collections.Counter()
        self.buffered: collections.Counter[str] = collections.Counter()
        self._silent: dict[Hashable, _Silent] = {}
        """Every silent stream, oldest first (dicts keep insertion order)."""
        self._peers: dict[Hashable, str] = {}
        """The peer of every open stream."""

    @property
    def unauthenticated_total(self) -> int:
        return len(self._silent)

    def open(self, stream: Hashable, peer: str, source: str) -> tuple[Optional[str], list[Hashable]]:
        """Admit a new, silent `stream` of `peer` from `source`: returns the reason it is refused
        (None if admitted) and the silent streams it evicted, which the caller must close (they
        no longer count). Only the peer's own limits refuse; a full allowance evicts instead."""
        if self.streams[peer] >= self.limits.max_streams_per_peer:
            return "too_many_streams", []
        if self.unauthenticated[peer] >= self.limits.max_unauthenticated_per_peer:
            return "too_many_unauthenticated", []
        evicted = []
        if self.unauthenticated_by_source[source] >= self.limits.max_unauthenticated_per_source:
            evicted.append(self._evict(source))
        if len(self._silent) >= self.limits.max_unauthenticated_total:
            evicted.append(self._evict(self._busiest_source()))
        self.streams[peer] += 1
        self._peers[stream] = peer
        self._silent[stream] = _Silent(peer, source)
        self.unauthenticated[peer] += 1
        self.unauthenticated_by_source[source] += 1
        return None, evicted

    def authenticated(self, stream: Hashable) -> None:
        """The stream said a valid hello: it no longer counts as silent."""
        self._unsilence(stream)

    def close(self, stream: Hashable) -> None:
        """The stream ended (a no-op for one already closed or evicted)."""
        self._unsilence(stream)
        peer = self._peers.pop(stream, None)
        if peer is not None:
            self._drop(self.streams, peer)

    def _busiest_source(self) -> str:
        most = max(self.unauthenticated_by_source.values())
        # of sources holding as many, the one whose silent stream is the oldest (this scans in age order)
        return next(s.source for s in self._silent.values() if self.unauthenticated_by_source[s.source] == most)

    def _evict(self, source: str) -> Hashable:
        victim = next(stream for stream, silent in self._silent.items() if silent.source == source)
        self.close(victim)
        return victim

    def _unsilence(self, stream: Hashable) -> None:
        silent = self._silent.pop(stream, None)
        if silent is not None:
            self._drop(self.unauthenticated, silent.peer)
            self._drop(self.unauthenticated_by_source, silent.source)

    def reserve(self, peer: str, length: int) -> bool:
        """Reserve `length` bytes for a frame `peer` announced; False if over its budget."""
        if self.buffered[peer] + length > self.limits.max_buffered_bytes_per_peer:
            return False
        self.buffered[peer] += length
        return True

    def release(self, peer: str, length: int) -> None:
        self.buffered[peer] -= length
        if self.buffered[peer] <= 0:
            del self.buffered[peer]

    @staticmethod
    def _drop(counter: collections.Counter[str], peer: str) -> None:
        counter[peer] -= 1
        if counter[peer] <= 0:
            del counter[peer]
