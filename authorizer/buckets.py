"""Token buckets kept per key in a table of bounded size: the arithmetic behind the rate limits.

A bucket holds up to `burst` tokens and gains `rate_per_s` a second; each request spends one, and a
request that finds less than one is refused with the time until one is there (the `Retry-After`).
A table keeps one bucket per key (a source address, a node) and holds at most `max_entries`: when
full, the least recently used key is forgotten. Forgetting a bucket only ever hands that key a
fresh burst, so the bound costs an attacker who rotates through more keys than the table holds
nothing it could not get from as many addresses anyway, and memory stays flat under any flood.

Plain Python on the event loop: no locks (callers that share a table across threads lock it).
A bucket is two floats, an entry about 200 bytes with its key.
"""

from __future__ import annotations

import collections
from typing import Callable, Generic, Hashable, Optional, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Bucket:
    """`tokens` as of `stamp` (monotonic seconds); the rate and burst are the table's."""

    __slots__ = ("tokens", "stamp")

    def __init__(self, burst: float, now: float):
        self.tokens = float(burst)
        self.stamp = now

    def take(self, now: float, rate_per_s: float, burst: float) -> float:
        """Spend a token and return 0.0, or spend nothing and return the seconds until one accrues."""
        tokens = self.tokens + (now - self.stamp) * rate_per_s
        self.tokens = tokens if tokens < burst else float(burst)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / rate_per_s


class LruTable(Generic[K, V]):
    """A mapping of at most `max_entries` keys; reading or writing a key makes it the newest, and a
    new key beyond the bound pushes out the oldest."""

    def __init__(self, max_entries: int):
        if max_entries < 1:
            raise ValueError("an LruTable needs room for at least one entry")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[K, V] = collections.OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> Optional[V]:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        self._entries[key] = value
        self._entries.move_to_end(key)
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
            self.evicted += 1

    def setdefault(self, key: K, make: Callable[[], V]) -> V:
        """The value under `key`, made and stored first if there is none."""
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value

    def pop(self, key: K) -> Optional[V]:
        return self._entries.pop(key, None)


class BucketTable:
    """One token bucket per key, `rate_per_s` and `burst` alike, at most `max_entries` keys."""

    def __init__(self, *, rate_per_s: float, burst: int, max_entries: int):
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("a bucket needs a positive rate and a burst of at least one")
        self.rate_per_s = float(rate_per_s)
        self.burst = float(burst)
        self._buckets: LruTable[Hashable, Bucket] = LruTable(max_entries)

    def __len__(self) -> int:
        return len(self._buckets)

    @property
    def evicted(self) -> int:
        return self._buckets.evicted

    def take(self, key: Hashable, now: float) -> float:
        """Spend one of `key`'s tokens: 0.0 if there was one, else the seconds until there is."""
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = Bucket(self.burst, now)
            self._buckets.put(key, bucket)
        return bucket.take(now, self.rate_per_s, self.burst)
