"""The stage's progress exchange [report 3.2, 3.3.1]: each worker publishes how many samples it
holds for its open step and the next one, and reads what the other replicas of its stage hold,
so the step ledger can close a step when the stage as a whole has its target batch.

The exchange only informs; the compute thread decides and takes the steps (roles/worker/steps/step_ledger.py).
A worker alone in its stage needs nobody's count, so it publishes on its own steps and on a slow
period (to stay visible to joiners and observers); replicas with peers publish on every change,
at most every `min_interval_s`, because a peer waiting on their count is waiting on the DHT.
A replica whose counts have not moved for a few seconds is idle and reads every 2 s instead of
every quarter second: it only looks for replicas arriving or leaving then.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Optional

from protocol.dht import SwarmDHT
from protocol.dht_schema import ProgressRecord, progress_key
from protocol.errors import PeerTimeout
from roles.periodic import Signal, every
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.steps.step_ledger import PeerView, StepLedger

logger = logging.getLogger(__name__)


IDLE_PERIOD_S = 2.0
"""How often an idle replica reads its stage's records (see StageProgress.current_period_s)."""
IDLE_AFTER_S = 5.0
"""Seconds without a change of this replica's counts after which it is idle."""
MIN_REREAD_S = 0.1
"""The least time between two reads asked for by `read_soon`."""


class StageProgress:
    """Publishes this worker's progress record and feeds the stage's to the step ledger."""

    def __init__(self, swarm: SwarmDHT, run_id: str, stage: int, optimizer: StageOptimizer, ledger: StepLedger,
                 *, period_s: float = 0.25, idle_period_s: float = IDLE_PERIOD_S, ttl_s: float = 30.0,
                 min_interval_s: float = 0.02,
                 counts_towards_target: Callable[[], bool] = lambda: True,
                 on_peers: Callable[[], None] = lambda: None, changed: Optional[Signal] = None,
                 on_read: Callable[[bool, str], None] = lambda ok, why: None,
                 tagging: Callable[[], bool] = lambda: False):
        self.swarm = swarm
        self.key = progress_key(run_id, stage)
        self.optimizer = optimizer
        self.ledger = ledger
        self.period_s = period_s
        self.idle_period_s = max(period_s, idle_period_s)
        self.ttl_s = ttl_s
        self.min_interval_s = min_interval_s
        self.counts_towards_target = counts_towards_target
        self.on_peers = on_peers
        self.changed = changed
        """Fired (by the compute thread) when this worker's counts changed: publish soon."""
        self.on_read = on_read
        """Told whether each read of the stage's records came back (the progress rule)."""
        self.tagging = tagging
        """Whether this replica tags for the stage (published, so the others ask it)."""
        self._published: Optional[tuple] = None
        self._seen: Optional[tuple] = None
        self._last_change = time.monotonic()
        self._last_read = 0.0
        self._last_forced = float("-inf")
        self._reading: Optional[asyncio.Future] = None

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
            tagger=self.tagging(),
        )

    async def tick(self, force: bool = False) -> None:
        """Publish our record if it changed (or `force`), then read the stage's into the ledger.

        Alone in its stage, a worker publishes only new steps and reads once a period (to notice
        a peer arriving); with peers it publishes and reads on every change, since they wait on it.
        """
        record = self._own_record()
        state = (record.local_step, record.samples_accumulated, record.next_samples, record.counts_towards_target,
                 record.tagger)
        if state != self._seen:
            self._seen, self._last_change = state, time.monotonic()
        alone = self.ledger.peers.alone
        published_step = self._published[0] if self._published else None
        published_tagger = self._published[4] if self._published else False
        if force or (state != self._published and (not alone or record.local_step != published_step
                                                   or record.tagger != published_tagger)):
            await self.swarm.store(self.key, record, self.ttl_s)
            self._published = state
        if alone and not force and time.monotonic() - self._last_read < self.current_period_s():
            return
        await self._read()

    async def _read(self) -> None:
        self._last_read = time.monotonic()
        try:
            peers = await self.swarm.get(self.key, ProgressRecord, strict=True)
        except PeerTimeout as exc:  # the stage's progress is unreadable now
            self.on_read(False, str(exc))
            peers = {}  # read as before: no peer counts this time
        except Exception as exc:
            self.on_read(False, f"{type(exc).__name__}: {exc}")
            raise
        else:
            self.on_read(True, "")
        peers.pop(self.swarm.peer_id, None)
        self.ledger.update_peers(peer_view(peers))
        self.on_peers()

    async def read_soon(self) -> None:
        """Read the stage's records now, for a replica that heard from a peer it does not know yet
        (one that found our record before we found its): calls while a read is under way wait for
        that read, and none starts within MIN_REREAD_S of the last one's start (a periodic read may
        be under way then), so unknown callers cannot make this worker hammer the DHT."""
        if self._reading is None:
            if time.monotonic() - self._last_read < MIN_REREAD_S:
                return
            self._reading = asyncio.ensure_future(self._read())
            self._reading.add_done_callback(self._read_done)
        await asyncio.shield(self._reading)

    def _read_done(self, task: asyncio.Future) -> None:
        self._reading = None
        if not task.cancelled():
            task.exception()  # retrieved: the periodic read reports failures

    async def withdraw(self) -> None:
        """Tombstone our record on the way out, so our samples stop counting towards the stage's
        target at once instead of when the record expires."""
        try:
            await self.swarm.withdraw(self.key)
        except Exception:  # noqa: BLE001 - best effort on the way out
            logger.warning("could not withdraw %s", self.key, exc_info=True)

    async def run(self, stop: asyncio.Event) -> None:
        """Tick on every change of our counts (at most every `min_interval_s`) and at least once a
        period; re-publish unchanged records now and then so they do not expire."""
        wake = self.changed.listen() if self.changed is not None else None
        await every(self.current_period_s, self._tick_now, stop, name="progress exchange", wake=wake,
                    min_interval_s=self.min_interval_s)

    def current_period_s(self) -> float:
        """`period_s` while this replica's counts move; `idle_period_s` once they have not for
        IDLE_AFTER_S. Idle, the reads only look for replicas arriving or leaving: at every quarter
        second they were most of an idle swarm's DHT traffic. The first sample after a pause
        changes the counts, which wakes the exchange at once."""
        idle = time.monotonic() - self._last_change >= IDLE_AFTER_S
        return self.idle_period_s if idle else self.period_s

    async def _tick_now(self) -> None:
        started = time.monotonic()
        force = started - self._last_forced >= max(self.period_s * 8, 2.0)
        await self.tick(force=force)
        if force:
            self._last_forced = started


def peer_view(records: dict[str, ProgressRecord]) -> PeerView:
    """Sum what the other replicas (by peer id) hold per step. A syncing replica's samples are in
    the sums too: the tail tagged them into the step, so the step is not complete without them."""
    counts: dict[int, int] = {}
    max_step: Optional[int] = None
    for record in records.values():
        max_step = record.local_step if max_step is None else max(max_step, record.local_step)
        counts[record.local_step] = counts.get(record.local_step, 0) + record.samples_accumulated
        counts[record.local_step + 1] = counts.get(record.local_step + 1, 0) + record.next_samples
    return PeerView(counts=counts, max_step=max_step, members=tuple(sorted(records)),
                    taggers=tuple(sorted(p for p, r in records.items() if r.tagger)),
                    records={p: (r.local_step, r.samples_accumulated, r.next_samples) for p, r in records.items()})
