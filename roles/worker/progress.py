"""The stage-collective optimizer step [report 3.2, 3.3.1]: each worker publishes how many
samples it accumulated at its current step; when the workers at the stage's step together reach
`target_batch_size`, every worker steps its own optimizer on its own gradients.

A worker that sees a peer already past its step steps too (on whatever it has, possibly
nothing), so replicas never drift apart in schedule position.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from protocol.dht import SwarmDHT
from protocol.dht_schema import ProgressRecord, progress_key
from roles.worker.optimizer import NonFiniteGradients, StageOptimizer, StepReport

logger = logging.getLogger(__name__)


class StageProgress:
    """Publishes this worker's progress record, reads the stage's, and steps when it is due."""

    def __init__(self, swarm: SwarmDHT, run_id: str, stage: int, target_batch_size: int,
                 optimizer: StageOptimizer, *, period_s: float = 0.25, ttl_s: float = 30.0,
                 counts_towards_target: Callable[[], bool] = lambda: True,
                 on_step: Optional[Callable[[StepReport], None]] = None):
        self.swarm = swarm
        self.key = progress_key(run_id, stage)
        self.target = target_batch_size
        self.optimizer = optimizer
        self.period_s = period_s
        self.ttl_s = ttl_s
        self.counts_towards_target = counts_towards_target
        self.on_step = on_step
        self.stage_samples = 0  # last seen stage-wide count at our step
        self.peer_samples = 0  # last seen count of the other workers at our step
        self.non_finite_steps = 0
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._wake = asyncio.Event()

    def _own_record(self) -> ProgressRecord:
        return ProgressRecord(
            local_step=self.optimizer.local_step,
            samples_accumulated=self.optimizer.samples_counted,
            counts_towards_target=self.counts_towards_target(),
            time=time.time(),
        )

    async def tick(self) -> Optional[StepReport]:
        """Publish our progress, read the stage's, and step if the stage is due."""
        await self.swarm.store(self.key, self._own_record(), self.ttl_s)
        peers = await self.swarm.get(self.key, ProgressRecord)
        my_step = self.optimizer.local_step
        peers.pop(self.swarm.peer_id, None)
        ahead = max((r.local_step for r in peers.values()), default=my_step)
        # Our own samples count only while they count towards the target (not in a sync phase).
        total = self.optimizer.samples_counted + sum(
            r.samples_accumulated for r in peers.values() if r.local_step == my_step and r.counts_towards_target
        )
        self.stage_samples = total
        self.peer_samples = total - self.optimizer.samples_counted
        if ahead > my_step or total >= self.target:
            report = await asyncio.to_thread(self._step, ahead)
            if report is not None:
                await self.swarm.store(self.key, self._own_record(), self.ttl_s)
            return report
        return None

    def _step(self, stage_step: int) -> Optional[StepReport]:
        try:
            report = self.optimizer.step()
        except NonFiniteGradients:
            self.non_finite_steps += 1
            logger.error("non-finite gradients at step %d; update skipped", self.optimizer.local_step)
            return None
        if stage_step > self.optimizer.local_step:
            self.optimizer.set_step(stage_step)  # we missed steps: jump our schedule to the stage's
        if self.on_step is not None:
            self.on_step(report)
        return report

    def notify_samples(self) -> None:
        """Called from the compute thread after each backward batch: tick at once when the stage
        looks due, instead of overshooting the target until the next period."""
        loop = self._loop
        if loop is not None and self.optimizer.samples_counted + self.peer_samples >= self.target:
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
        while not stop.is_set():
            self._wake.clear()
            try:
                await self.tick()
            except Exception:
                logger.exception("progress tick failed")
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            await asyncio.wait(waiters, timeout=self.period_s, return_when=asyncio.FIRST_COMPLETED)
            for waiter in waiters:
                waiter.cancel()
