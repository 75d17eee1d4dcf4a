"""The stage's progress exchange [report 3.2, 3.3.1]: each worker publishes how many samples it
holds for its open step and the next one, and reads what the other replicas of its stage hold,
so the step ledger can close a step when the stage as a whole has its target batch.

The exchange only informs; the compute thread decides and takes the steps (roles/worker/step_ledger.py).
A worker alone in its stage needs nobody's count, so it publishes on its own steps and on a slow
period (to stay visible to joiners and observers); replicas with peers publish on every change,
at most every `min_interval_s`, because a peer waiting on their count is waiting on the DHT.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from protocol.dht import SwarmDHT
from protocol.dht_schema import ProgressRecord, progress_key
from roles.worker.optimizer import StageOptimizer
from roles.worker.step_ledger import PeerView, StepLedger

logger = logging.getLogger(__name__)


class StageProgress:
    """Publishes this worker's progress record and feeds the stage's to the step ledger."""

    def __init__(self, swarm: SwarmDHT, run_id: str, stage: int, optimizer: StageOptimizer, ledger: StepLedger,
                 *, period_s: float = 0.25, ttl_s: float = 30.0, min_interval_s: float = 0.02,
                 counts_towards_target: Callable[[], bool] = lambda: True,
                 on_peers: Callable[[], None] = lambda: None):
        self.swarm = swarm
        self.key = progress_key(run_id, stage)
        self.optimizer = optimizer
        self.ledger = ledger
        self.period_s = period_s
        self.ttl_s = ttl_s
        self.min_interval_s = min_interval_s
        self.counts_towards_target = counts_towards_target
        self.on_peers = on_peers
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wake = asyncio.Event()
        self._published: Optional[tuple] = None
        self._last_read = 0.0

    def _own_record(self) -> ProgressRecord:
        opt, ledger = self.optimizer, self.ledger
        step = opt.local_step
        return ProgressRecord(
            local_step=step,
            samples_accumulated=opt.samples_accumulated + ledger.abandoned(step),
            next_samples=opt.next_accumulated + ledger.abandoned(step + 1),
            counts_towards_target=self.counts_towards_target(),
            samples_consumed=opt.samples_consumed,
            time=time.time(),
        )

    async def tick(self, force: bool = False) -> None:
        """Publish our record if it changed (or `force`), then read the stage's into the ledger.

        Alone in its stage, a worker publishes only new steps and reads once a period (to notice
        a peer arriving); with peers it publishes and reads on every change, since they wait on it.
        """
        record = self._own_record()
        state = (record.local_step, record.samples_accumulated, record.next_samples, record.counts_towards_target)
        alone = self.ledger.peers.alone
        published_step = self._published[0] if self._published else None
        if force or (state != self._published and (not alone or record.local_step != published_step)):
            await self.swarm.store(self.key, record, self.ttl_s)
            self._published = state
        if alone and not force and time.monotonic() - self._last_read < self.period_s:
            return
        self._last_read = time.monotonic()
        peers = await self.swarm.get(self.key, ProgressRecord)
        peers.pop(self.swarm.peer_id, None)
        self.ledger.update_peers(peer_view(peers.values()))
        self.on_peers()

    def notify(self) -> None:
        """Called from the compute thread after each backward batch and step: publish soon."""
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(self._wake.set)

    async def withdraw(self) -> None:
        """Tombstone our record on the way out, so our samples stop counting towards the stage's
        target at once instead of when the record expires."""
        try:
            await self.swarm.withdraw(self.key)
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.warning("could not withdraw %s", self.key, exc_info=True)

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        last_forced = 0.0
        while not stop.is_set():
            self._wake.clear()
            started = time.monotonic()
            force = started - last_forced >= max(self.period_s * 8, 2.0)
            try:
                await self.tick(force=force)
                if force:
                    last_forced = started
            except Exception:
                logger.exception("progress exchange failed")
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            await asyncio.wait(waiters, timeout=self.period_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
            rest = self.min_interval_s - (time.monotonic() - started)
            if rest > 0 and not stop.is_set():
                await asyncio.sleep(rest)


def peer_view(records) -> PeerView:
    """Sum what the other replicas hold per step. A syncing replica's samples are in the sums too:
    the tail tagged them into the step, so the step is not complete without them."""
    counts: dict[int, int] = {}
    max_step: Optional[int] = None
    for record in records:
        max_step = record.local_step if max_step is None else max(max_step, record.local_step)
        counts[record.local_step] = counts.get(record.local_step, 0) + record.samples_accumulated
        counts[record.local_step + 1] = counts.get(record.local_step + 1, 0) + record.next_samples
    return PeerView(counts=counts, max_step=max_step)
