"""What one remote peer may hold of a node serving `agora/v1/*` streams, before and after it
proves who it is.

Every incoming stream costs a file descriptor and, while a frame arrives, the bytes buffered for
it. Without limits a peer with no credential could open a thousand streams and park them, or
announce 60 MiB frames the server reads in full before it learns the sender has no credential.
The server therefore keeps, per remote peer and in total:

- streams still waiting for their hello (unauthenticated): few per peer, a bounded number in
  total, and each must say hello within `hello_timeout_s` in at most HELLO_MAX_BYTES;
- streams per peer, authenticated or not;
- bytes being read per peer (frames announced but not yet complete);
- and it closes a stream with no request in flight after `idle_timeout_s`.

`StreamBudget` is only the bookkeeping: the transport asks it before opening a stream or reading
a frame and answers a refusal with a typed error (`ErrorCode.RATE_LIMITED`) and the reason.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

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
    max_unauthenticated_total: int = 256
    """Streams of all peers that have not completed their hello yet."""
    max_buffered_bytes_per_peer: int = 256 << 20
    """Bytes of frames one peer has announced and not yet delivered in full, over all its streams."""
    min_transfer_rate_bps: float = 64 << 10
    """A frame must arrive at least this fast (after `idle_timeout_s` of grace), or its stream is closed."""

    def frame_deadline_s(self, length: int) -> float:
        """How long reading a frame of `length` bytes may take."""
        return self.idle_timeout_s + length / self.min_transfer_rate_bps


class StreamBudget:
    """Counts streams and buffered bytes per peer against `StreamLimits`. Event-loop only."""

    def __init__(self, limits: StreamLimits):
        self.limits = limits
        self.streams: collections.Counter[str] = collections.Counter()
        self.unauthenticated: collections.Counter[str] = collections.Counter()
        self.unauthenticated_total = 0
        self.buffered: collections.Counter[str] = collections.Counter()

    def open(self, peer: str) -> Optional[str]:
        """Admit a new, unauthenticated stream of `peer`, or return the reason it is refused."""
        if self.streams[peer] >= self.limits.max_streams_per_peer:
            return "too_many_streams"
        if self.unauthenticated[peer] >= self.limits.max_unauthenticated_per_peer:
            return "too_many_unauthenticated"
        if self.unauthenticated_total >= self.limits.max_unauthenticated_total:
            return "too_many_unauthenticated"
        self.streams[peer] += 1
        self.unauthenticated[peer] += 1
        self.unauthenticated_total += 1
        return None

    def authenticated(self, peer: str) -> None:
        """The stream said a valid hello: it no longer counts as unauthenticated."""
        self._drop(self.unauthenticated, peer)
        self.unauthenticated_total -= 1

    def close(self, peer: str, *, authenticated: bool) -> None:
        self._drop(self.streams, peer)
        if not authenticated:
            self._drop(self.unauthenticated, peer)
            self.unauthenticated_total -= 1

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
