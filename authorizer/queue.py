"""The admission queue's release loop: at most `join_rate_per_s` nodes a second, in join order.

Each admission makes the DHT reorganize; many at once could destabilize a run that is otherwise
progressing, so the authorizer holds joiners in a queue and releases them gradually [report 3.6.1.3].
The queue itself is the participants table (status 'queued', ordered by id), so it survives a
restart; this loop is a token bucket (rate `join_rate_per_s`, up to `join_burst` saved up) that
spends one token per released ticket. It also sweeps out admitted nodes that stopped renewing and
queued ones that stopped polling, freeing their slots, and stores the rejections counted in memory
(authorizer.rejections), once more when it stops.

The policy is re-read on every tick, so an operator's change to the join rate applies at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

from authorizer.service import Authorizer

logger = logging.getLogger("agora.authorizer.queue")

SWEEP_PERIOD_S = 5.0
MAX_RELEASE_BATCH = 32
"""Admissions per writer transaction: larger batches would hold up the joins waiting behind them."""


class TokenBucket:
    """Tokens accrue at `rate` per second up to `burst`; `take(n)` spends what is there."""

    def __init__(self, rate: float, burst: int, now: float):
        self.rate, self.burst = rate, burst
        self.tokens = float(burst)
        self._last = now

    def refill(self, now: float, rate: float, burst: int) -> float:
        self.rate, self.burst = rate, burst
        self.tokens = min(float(burst), self.tokens + (now - self._last) * rate)
        self._last = now
        return self.tokens

    def spend(self, n: int) -> None:
        self.tokens -= n

    def seconds_until(self, n: float) -> float:
        return max(0.0, (n - self.tokens) / self.rate)


class AdmissionQueue:
    """Runs until `stop` is set; never raises (a failed round is logged and retried)."""

    def __init__(self, authorizer: Authorizer):
        self.authorizer = authorizer
        policy = authorizer.policy
        self.bucket = TokenBucket(policy.join_rate_per_s, policy.join_burst, time.monotonic())
        self.released = 0

    async def run(self, stop: asyncio.Event) -> None:
        wakeup = self.authorizer.queue_wakeup
        next_sweep = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + SWEEP_PERIOD_S
                await self._guarded(self._sweep)
            policy = self.authorizer.policy
            tokens = self.bucket.refill(now, policy.join_rate_per_s, policy.join_burst)
            if tokens < 1:  # wait for a token; a policy change (new rate) wakes us earlier
                wakeup.clear()
                until = min(self.bucket.seconds_until(1), next_sweep - now)
                await _wait(wakeup, stop, timeout_s=max(0.001, until))
                continue
            limit = min(int(tokens), MAX_RELEASE_BATCH)
            wakeup.clear()  # before reading the queue: a join committed after the read wakes us
            released = await self._guarded(self._release, limit)
            if released is None or released >= limit:
                continue  # a failed round (already paused), or there may be more waiting
            await _wait(wakeup, stop, timeout_s=max(0.001, next_sweep - time.monotonic()))
        await self._guarded(self.authorizer.flush_rejections)
        self.authorizer.limiter.refused.flush()

    async def _release(self, limit: int) -> int:
        outcomes = await self.authorizer.admit_next(limit)
        self.bucket.spend(len(outcomes))
        self.released += sum(1 for outcome, _ in outcomes if outcome == "admitted")
        return len(outcomes)

    async def _sweep(self) -> int:
        ended = await self.authorizer.sweep()
        if ended:
            logger.info("swept %d lapsed or abandoned ticket(s)", ended)
        await self.authorizer.flush_rejections()
        self.authorizer.limiter.refused.flush_due()
        return ended

    async def _guarded(self, fn, *args):
        try:
            return await fn(*args)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("admission queue round failed; retrying shortly")
            await asyncio.sleep(0.5)
            return None


async def _wait(*events: asyncio.Event, timeout_s: float) -> None:
    """Return when any of `events` is set or after `timeout_s`."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
