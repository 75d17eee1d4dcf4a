"""Measurements kept by the code that measures and read by whoever reports them (the node's
Prometheus collectors, summaries): a bucketed distribution, the busy share of recent wall time,
and a recent rate.

They hold plain numbers, take a leaf lock for a few lines (any thread may record, any thread may
read) and import nothing, so the compute thread, the event loop and the DHT wrapper can record
into them without knowing that Prometheus exists; the node turns them into metric families only
when it is scraped.
"""

from __future__ import annotations

import bisect
import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

SECONDS_BUCKETS: tuple[float, ...] = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                      10.0, 30.0, 60.0, 120.0)
"""Bucket bounds for durations from a millisecond (a DHT hit, a tiny batch) to minutes (a round)."""


def powers_of_two(limit: int) -> tuple[float, ...]:
    """1, 2, 4, ... up to `limit`, and `limit` itself: bucket bounds for coalesced batch sizes."""
    bounds, value = [], 1
    while value < limit:
        bounds.append(float(value))
        value *= 2
    bounds.append(float(max(1, limit)))
    return tuple(bounds)


@dataclass(frozen=True)
class DistributionSnapshot:
    bounds: tuple[float, ...]
    cumulative: tuple[int, ...]
    """Observations <= each bound, then the total (the +Inf bucket)."""
    total: float

    @property
    def count(self) -> int:
        return self.cumulative[-1]


class Distribution:
    """How many observations fell at or below each bound, and their sum (a Prometheus histogram's
    content, without Prometheus)."""

    def __init__(self, bounds: Sequence[float] = SECONDS_BUCKETS):
        self.bounds = tuple(sorted(float(b) for b in bounds))
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self.bounds, value)
        with self._lock:
            self._counts[index] += 1
            self._sum += value

    def snapshot(self) -> DistributionSnapshot:
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, running = [], 0
        for count in counts:
            running += count
            cumulative.append(running)
        return DistributionSnapshot(self.bounds, tuple(cumulative), total)


class BusyWindow:
    """The share of the last `window_s` seconds spent inside recorded intervals (a compute
    thread's batches): its utilisation, as the report monitors it per stage [report 3.4.3]."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._created = clock()
        self._spans: collections.deque[tuple[float, float]] = collections.deque()
        self._lock = threading.Lock()

    def record(self, started: float, ended: float) -> None:
        """One busy interval, in the clock's time (the compute thread's batch)."""
        with self._lock:
            self._spans.append((started, ended))
            horizon = ended - self.window_s
            while self._spans and self._spans[0][1] < horizon:
                self._spans.popleft()

    def ratio(self) -> float:
        now = self.clock()
        start = max(now - self.window_s, self._created)
        if now <= start:
            return 0.0
        with self._lock:
            busy = sum(max(0.0, min(end, now) - max(begin, start)) for begin, end in self._spans)
        return min(1.0, busy / (now - start))


class RecentRate:
    """Amount per second over the last `window_s` seconds (tokens a trainer completed)."""

    def __init__(self, window_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._started = clock()
        self._events: collections.deque[tuple[float, float]] = collections.deque()
        self._lock = threading.Lock()

    def restart(self) -> None:
        """Count the window from now (when the work starts), not from construction."""
        with self._lock:
            self._started = self.clock()
            self._events.clear()

    def add(self, amount: float) -> None:
        now = self.clock()
        with self._lock:
            self._events.append((now, amount))
            while self._events and self._events[0][0] < now - self.window_s:
                self._events.popleft()

    def rate(self) -> float:
        now = self.clock()
        start = max(now - self.window_s, self._started)
        if now <= start:
            return 0.0
        with self._lock:
            total = sum(amount for at, amount in self._events if at >= start)
        return total / (now - start)
