"""Periodic worker discovery [report 3.3.2.2]: read every stage's worker records from the DHT,
hand the routable ones to that stage's balancer, and remember their addresses.

Workers in weight sync or leaving are not routable; a worker whose record lapsed is dropped. A read
that finds no record at all under a stage is taken for a failed read (a DHT lookup on a loaded
host comes back empty, with no timeout) while the stage's workers were found less than a record's
lifetime ago: they stay routable, as their records would have. So
is a worker whose record names another model digest than this trainer's run config: it trains a
different model (another construction, subspace seed or stage cut), and its coordinates would
mean something else to its neighbours. It is named once in the log. And so is a worker this
trainer's spot checks excluded (roles/trainer/spot_checks.py), from the moment it is excluded.
"""

from __future__ import annotations

import asyncio
import logging
import time

from protocol.dht import SwarmDHT
from protocol.dht_schema import Phase, WorkerRecord, workers_key
from roles.periodic import every
from roles.trainer.balancer import StageBalancer, WorkerView

logger = logging.getLogger(__name__)

ROUTABLE_PHASES = (Phase.ACTIVE, Phase.OPTIMIZER_SYNC)
EMPTY_READ_GRACE_S = 30.0
"""How long a stage's workers stay routable through reads that find no record under the stage:
the lifetime of a worker record (roles/worker/steps/progress.py), so none outlives what the DHT keeps."""


class WorkerDiscovery:
    def __init__(self, swarm: SwarmDHT, run_id: str, balancers: list[StageBalancer], *, period_s: float,
                 model_digest: str = ""):
        self.swarm = swarm
        self.run_id = run_id
        self.model_digest = model_digest
        self.other_model: set[str] = set()
        """Workers kept off routes because they train another model (each named once in the log)."""
        self.excluded: dict[str, str] = {}
        """Workers kept off routes because they were caught cheating -> why."""
        self.balancers = balancers
        self.period_s = period_s
        self.maddrs: dict[str, list[str]] = {}
        self.records: list[dict[str, WorkerRecord]] = [{} for _ in balancers]
        self._refreshed = asyncio.Event()
        self._wake = asyncio.Event()
        self._found_at = [float("-inf") for _ in balancers]
        """When each stage's read last found any record (monotonic)."""
        self.empty_reads = 0
        """Reads that found nothing under a stage whose workers were kept (see EMPTY_READ_GRACE_S)."""

    async def refresh(self) -> None:
        results = await asyncio.gather(
            *(self.swarm.get(workers_key(self.run_id, s), WorkerRecord) for s in range(len(self.balancers)))
        )
        now = time.monotonic()
        for stage, records in enumerate(results):
            if records:
                self._found_at[stage] = now
            elif self.records[stage] and now - self._found_at[stage] < EMPTY_READ_GRACE_S:
                self.empty_reads += 1
                logger.debug("the read of stage %d's workers found no record; keeping the %d found %.0f s ago",
                             stage, len(self.records[stage]), now - self._found_at[stage])
                continue
            routable = {
                peer: r for peer, r in records.items() if r.phase in ROUTABLE_PHASES and r.stage == stage
                and not self._other_model(peer, r) and peer not in self.excluded
            }
            self.records[stage] = routable
            for peer, record in routable.items():
                self.maddrs[peer] = record.maddrs
            self._hand_over(stage)
        self._refreshed.set()

    def _hand_over(self, stage: int) -> None:
        self.balancers[stage].update_workers(
            WorkerView(peer_id=peer, throughput=r.throughput, max_batch=r.max_batch, incarnation=r.started_at)
            for peer, r in self.records[stage].items() if peer not in self.excluded
        )

    def exclude(self, stage: int, peer: str, why: str) -> None:
        """Route nothing more to `peer`, starting with the next choice."""
        self.excluded[peer] = why
        self.records[stage].pop(peer, None)
        self._hand_over(stage)

    def _other_model(self, peer: str, record: WorkerRecord) -> bool:
        if not self.model_digest or not record.trains_other_model(self.model_digest):
            return False
        if peer not in self.other_model:
            self.other_model.add(peer)
            logger.warning("worker %s of stage %d trains another model (model digest %s, construction %r; this "
                           "trainer's run config has %s): it is kept off routes; every node of a run must load the "
                           "same run config", peer[-8:], record.stage, record.model_digest,
                           record.construction or "?", self.model_digest)
        return True

    def request_refresh(self) -> None:
        """Ask for a refresh before the next period (a stage just ran out of workers)."""
        self._wake.set()

    def workers_per_stage(self) -> list[int]:
        return [len(b.usable()) for b in self.balancers]

    async def run(self, stop: asyncio.Event) -> None:
        await every(self.period_s, self.refresh, stop, name="worker discovery", wake=self._wake)
