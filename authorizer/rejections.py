"""Rejected joins: which are kept as a ticket row, and counts of the rest per source, reason, minute.

A refused join used to become one `participants` row each, so a flood of junk joins grew the
database by a row per request. Now each source address may leave rejected tickets in detail at a
bounded pace (a token bucket: `detail_burst` at once, then `detail_rate_per_s`); those can be polled
and appear in the admin listing as before. Beyond that a rejection is answered in full (the ticket,
the reason and what to do) but not stored on its own: it is counted in memory under (source,
reason, minute) and the counts are added to the `rejection_counts` table every few seconds (the
admission queue's sweep, and at shutdown). Joins answered 429 are counted the same way, under
`rate_limited`. So a flood from one address costs at most `detail_burst` rows, then one row per
reason and minute, and the pending counts in memory are bounded too (`max_pending` keys; beyond
that they are pooled under the source `other`). `GET /v1/admin/rejections` reads the counts.

The ledger is shared between the event loop and the store's writer thread (which decides whether
a rejection made inside the join's transaction is kept), so it holds one leaf lock, taken for a
few lines and never while taking another.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from authorizer.buckets import BucketTable

OVERFLOW_SOURCE = "other"
"""Where counts go when `max_pending` distinct (source, reason, minute) keys are already waiting."""

Count = tuple[str, str, int, int]
"""(source, reason, minute as unix seconds of its start, rejections)."""


class RejectionLedger:
    """Decides which rejected joins are stored in detail and counts the others until flushed."""

    def __init__(self, *, detail_rate_per_s: float, detail_burst: int, max_sources: int,
                 max_pending: int = 10_000, clock: Callable[[], float] = time.monotonic):
        self._details = BucketTable(rate_per_s=detail_rate_per_s, burst=detail_burst, max_entries=max_sources)
        self._pending: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.max_pending = max_pending
        self.clock = clock
        self.counted = 0
        """Rejections counted rather than stored since the start."""
        self._lock = threading.Lock()

    def keep(self, source: str) -> bool:
        """Whether the next rejected join from `source` is stored as a ticket (spends its token)."""
        with self._lock:
            return self._details.take(source, self.clock()) == 0.0

    def count(self, source: str, reason: str, now: float) -> None:
        """One rejected join from `source` at unix time `now`, answered but not stored."""
        key = (source, reason, int(now // 60) * 60)
        with self._lock:
            if key not in self._pending and len(self._pending) >= self.max_pending:
                key = (OVERFLOW_SOURCE, reason, key[2])
            self._pending[key] += 1
            self.counted += 1

    def take(self) -> list[Count]:
        """The counts waiting to be stored, removing them (`restore` puts them back on failure)."""
        with self._lock:
            pending, self._pending = self._pending, collections.Counter()
        return [(source, reason, minute, n) for (source, reason, minute), n in pending.items()]

    def restore(self, counts: list[Count]) -> None:
        with self._lock:
            for source, reason, minute, n in counts:
                key = (source, reason, minute)
                if key not in self._pending and len(self._pending) >= self.max_pending:
                    key = (OVERFLOW_SOURCE, reason, minute)
                self._pending[key] += n

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)
