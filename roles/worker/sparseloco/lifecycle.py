"""A worker's SparseLoCo from start to stop: the service built beside the runtime (its rounds run
after every step, roles/worker/serving/runtime.py hooks), its record announced in the DHT, its
transport started once the state is loaded, and a reload of the stage's state from a donor when
this replica's anchor parted from the stage's.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Optional

from protocol.dht import SwarmDHT
from protocol.dht_schema import Phase, averaging_key
from protocol.errors import ConfigError
from protocol.fragment_evidence import FragmentEvidence
from protocol.identity import Identity
from protocol.run_config import RunConfig
from protocol.transport import RpcServer
from roles.announcer import Announcer
from roles.worker.errors import StateLoadError
from roles.worker.health.termination import averaging_health
from roles.worker.layout import FlatLayout
from roles.worker.serving.replicas import StageReplicas
from roles.worker.serving.runtime import StageRuntime
from roles.worker.sparseloco.endpoint import SparseLoCoEndpoint
from roles.worker.sparseloco.service import SparseLoCoService

logger = logging.getLogger(__name__)


class SparseLoCoLifecycle:
    """SparseLoCo for one worker (`averaging.method: sparseloco`). `reload_state` loads the stage's
    state from donors (None when no donor answered; StateLoadError when the download failed);
    `track` hands the role a task it cancels at shutdown."""

    def __init__(self, run: RunConfig, stage: int, *, swarm: SwarmDHT, layout: FlatLayout, runtime: StageRuntime,
                 replicas: StageReplicas, identity: Optional[Identity], phase: Callable[[], Phase],
                 announce_period_s: float, reload_state: Callable[[], Awaitable[object]],
                 track: Callable[[asyncio.Task], None],
                 report_evidence: Optional[Callable[[FragmentEvidence], Awaitable[str]]] = None):
        if identity is None:
            raise ConfigError("averaging.method sparseloco signs every fragment: the worker needs its identity")
        self.run = run
        self.stage = stage
        self.runtime = runtime
        self.optimizer = runtime.optimizer
        self.replicas = replicas
        self.reload_state = reload_state
        self.track = track
        self.service = SparseLoCoService(
            run, stage, layout, self.optimizer, self_id=swarm.peer_id, identity=identity,
            active=lambda: phase() == Phase.ACTIVE, on_parted=self._parted,
            stopping=lambda: runtime.stopping, members=lambda: list(runtime.ledger.peers.members),
            report_evidence=report_evidence)
        self.service.health = averaging_health(run.termination)
        self.announcer = Announcer(swarm, averaging_key(run.run_id, stage), lambda: self.service.record(phase()),
                                   period_s=announce_period_s)
        runtime.after_step.append(self.service.after_step)
        runtime.after_step_unlocked.append(self.service.after_step_unlocked)

    async def start(self, server: RpcServer) -> None:
        """Once the state is loaded: serve fragments and begin from the weights held now."""
        endpoint = SparseLoCoEndpoint(self.run, self.stage, self.service, self.replicas,
                                      lambda: self.optimizer.local_step)
        self.service.begin(await endpoint.start(server))

    def _parted(self, reason: str) -> None:
        """Compute thread: this replica's anchor is not the stage's. Reload the stage's state (with
        the anchor) from a donor on the event loop; until then it captures nothing."""
        loop = self.replicas.loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: self.track(
                asyncio.create_task(self._reload(reason), name="sparseloco-reload")))

    async def _reload(self, reason: str) -> None:
        self.optimizer.loaded_outer = {}
        try:
            donated = await self.reload_state()
        except StateLoadError as exc:
            donated = None
            logger.warning("sparseloco: could not reload the stage's state (%s); carrying on from this replica's", exc)
        if donated is None:
            logger.warning("sparseloco: no donor to reload from; this replica takes its own weights as its anchor")
        self.service.restart_from_loaded()
        self.runtime.counters["sparseloco_reloads"] += 1
        logger.info("sparseloco: %s after %s", "reloaded the stage's state" if donated else "restarted", reason)
