"""A joiner's way to its stage's state [report 3.3.1.1]: where the state comes from, in order,
and the sync phase the worker starts in.

A stage that has not stepped yet starts from the seed, unless the run checkpoint store holds a
complete checkpoint while no replica is live (the run was lost and restarts from it). A stage that
has stepped is joined from the first source that gives its state, as `state_source` allows:

    1. donors        the multi-donor download of one snapshot (donor_client.py)
    2. peers         `agora/v1/state` from one live replica after another (state_loader.py)
    3. checkpoint    the stage checkpoint in `--checkpoint-dir` (stage_checkpoint.py)
    4. store         the newest complete run checkpoint in the store (run_checkpoint_io.py)

and, failing all four, from the seeded weights counted as step 0, with a warning. How far the
loaded state lags the stage then picks the sync phase (sync_phase.py); a joiner left with no
active replica to sync with carries the stage on (`check_alone`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from hivemind.p2p import P2P

from protocol.auth import PeerAuthenticator
from protocol.dht import SwarmDHT
from protocol.dht_schema import Phase, ProgressRecord, WorkerRecord, progress_key, workers_key
from protocol.errors import ConfigError
from protocol.run_config import RunConfig
from protocol.transport import RpcClient
from roles.checkpoint_store import CheckpointStore, CheckpointStoreError
from roles.periodic import Signal
from roles.worker.errors import CheckpointError, StateLoadError
from roles.worker.layout import FlatLayout
from roles.worker.state.donor_client import load_from_donors
from roles.worker.state.run_checkpoint_io import apply_state, load_latest
from roles.worker.state.stage_checkpoint import StageCheckpoints
from roles.worker.state.state_loader import StateLoader
from roles.worker.state.sync_phase import SERVING_PHASES, SyncPhases, Transition

logger = logging.getLogger(__name__)


class StageJoin:
    """One worker's join of its stage: `join` loads the state and begins the sync phase; the
    loaders stay usable after it (a SparseLoCo replica whose anchor parted reloads from donors).
    `optimizer` is the stage's StageOptimizer; `stepped` fires when a resume moved its step."""

    def __init__(self, *, run: RunConfig, stage: int, state_source: str, swarm: SwarmDHT, p2p: P2P,
                 authenticator: Optional[PeerAuthenticator], optimizer, layout: FlatLayout, sync: SyncPhases,
                 checkpoints: Optional[StageCheckpoints], run_store: CheckpointStore, stepped: Signal,
                 served: Callable[[], tuple[int, int]], on_transition: Callable[[Transition], None]):
        self.run = run
        self.stage = stage
        self.state_source = state_source
        self.swarm = swarm
        self.p2p = p2p
        self.authenticator = authenticator
        self.optimizer = optimizer
        self.layout = layout
        self.sync = sync
        self.checkpoints = checkpoints
        self.run_store = run_store
        self.stepped = stepped
        self.served = served
        """The forward and backward requests this worker served so far (for the phase's log)."""
        self.on_transition = on_transition
        self._alone_since: Optional[float] = None
        """When this worker, in a sync phase, first saw no active replica of its stage (check_alone)."""
        self.joined: dict = {}
        """Where the state came from and the phase joined in, for the worker's summary."""
        self.download: Optional[dict] = None
        """What the multi-donor download did, for the summary (None: another source gave the state)."""

    async def join(self) -> None:
        """Load state if the stage has moved past its seeded start, and pick the sync phase from
        how far the loaded state lags [report 3.3.1.1]."""
        progress = await self.swarm.get(progress_key(self.run.run_id, self.stage), ProgressRecord)
        own = progress.pop(self.swarm.peer_id, None)
        stage_step = max((record.local_step for record in progress.values()), default=0)
        stage_consumed = max((record.samples_consumed for record in progress.values()), default=0)
        if stage_step == 0 and own is not None and own.local_step > 0:
            # This identity's previous process was the stage's last replica: the stage is where it
            # left it, not at the seed. State then comes from a checkpoint or, failing that, the
            # seeded weights with a warning, instead of a silent restart of the stage from step 0.
            stage_step, stage_consumed = own.local_step, own.samples_consumed
        if stage_step == 0 and await self.resume_from_store():
            return
        if stage_step == 0:
            self.sync.begin(Phase.ACTIVE, 0, "the stage has not stepped yet: every replica starts from the seed")
            self.joined = {"stage_step": 0, "loaded_step": 0, "source": "seed", "phase": Phase.ACTIVE.value}
            return
        loaded_step, source = None, "seed"
        if self.state_source in ("auto", "peers"):
            try:
                donated = await self.load_from_donors()
                if donated is not None:
                    loaded_step, download = donated.step, donated.result
                    source = (f"{len(donated.donors)} donor(s) in {download.seconds:.1f}s, {download.requeued} "
                              f"re-queued chunk(s)")
                    self.download = download.summary()
            except StateLoadError as exc:
                logger.warning("could not load state from donors: %s; trying agora/v1/state", exc)
            if loaded_step is None:
                try:
                    result = await self.load_from_peers()
                    loaded_step = result.step
                    source = f"{len(result.peers)} peer(s) in {result.seconds:.1f}s, {result.resumes} resume(s)"
                except StateLoadError as exc:
                    logger.warning("could not load state from peers: %s", exc)
        if loaded_step is None and self.checkpoints is not None and self.state_source in ("auto", "checkpoint"):
            try:
                loaded_step = await asyncio.to_thread(self.checkpoints.load)
                source = f"checkpoint {self.checkpoints.path}"
            except CheckpointError as exc:
                logger.warning("could not load the checkpoint: %s", exc)
        if loaded_step is None and self.state_source in ("auto", "checkpoint"):
            loaded = await self.load_from_store()
            if loaded is not None:
                manifest, state = loaded
                # the moments too: older than the stage's weights, but far better than zeros
                await asyncio.to_thread(apply_state, state, self.optimizer, self.layout,
                                        with_optimizer=True)
                loaded_step, source = manifest.step, f"checkpoint store {self.run_store.describe()}"
        if loaded_step is None:
            hint = ("" if self.checkpoints is not None else "; with --checkpoint-dir DIR --checkpoint-period-s S a "
                    "restarted last replica of a stage resumes from its checkpoint")
            logger.warning("no state loaded: starting from the seeded weights, counted as step 0%s", hint)
            loaded_step = 0
        if loaded_step >= stage_step > 0 and self.optimizer.local_step == loaded_step:
            # The state came from a donor that stepped since the progress records were read: its
            # step and schedule position are the stage's now. Going back to the older step would
            # apply the steps in between a second time.
            stage_step = loaded_step
        else:
            self.optimizer.set_step(stage_step, stage_consumed or None)
        phase = self.sync.join_phase(stage_step, loaded_step)
        reason = f"loaded step {loaded_step} from {source}; the stage is at step {stage_step}"
        if phase != Phase.ACTIVE and not await self.active_peers():
            phase = Phase.ACTIVE
            reason += "; no active replica of the stage is left to sync with, so this one carries it on"
        self.sync.begin(phase, stage_step, reason)
        self.joined = {"stage_step": stage_step, "loaded_step": loaded_step, "source": source, "phase": phase.value}
        if self.download is not None:
            self.joined["download"] = self.download
        logger.info("joined stage %d in %s: %s", self.stage, phase.value, reason)

    async def load_from_store(self):
        """The newest complete run checkpoint's state of this stage, or None (logged) if there is none."""
        workdir = Path(tempfile.gettempdir()) / f"agora-checkpoint-{self.swarm.peer_id[-12:]}"
        try:
            loaded = await asyncio.to_thread(load_latest, self.run_store, self.stage, self.layout, workdir)
        except CheckpointStoreError as exc:
            # not an empty store: starting from the seed here could restart a lost run from scratch
            raise ConfigError(f"{exc}; fix the store or its credentials (AWS_* variables for s3://), or start "
                              "without it (no checkpoints.store, no --checkpoint-store)") from exc
        finally:
            shutil.rmtree(workdir, ignore_errors=True)  # a remote object's download, read by now
        if loaded is None:
            logger.info("the checkpoint store %s holds no complete checkpoint yet", self.run_store.describe())
        return loaded

    async def resume_from_store(self) -> bool:
        """A stage nobody has stepped in this DHT, with a complete checkpoint in the store: the run
        was lost and restarts, so this stage continues from the checkpoint (weights, optimizer
        moments, step and schedule position) instead of from the seed."""
        if self.state_source not in ("auto", "checkpoint"):
            return False
        loaded = await self.load_from_store()
        if loaded is None:
            return False
        manifest, state = loaded
        await asyncio.to_thread(apply_state, state, self.optimizer, self.layout, with_optimizer=True)
        step = self.optimizer.local_step
        reason = (f"resumed from the checkpoint at step {manifest.step} in {self.run_store.describe()}: the stage "
                  "had no live replica")
        self.sync.begin(Phase.ACTIVE, step, reason)
        self.stepped.fire()
        self.joined = {"stage_step": step, "loaded_step": manifest.step, "source": f"checkpoint store "
                       f"{self.run_store.describe()}", "phase": Phase.ACTIVE.value, "resumed": True}
        logger.info("joined stage %d: %s", self.stage, reason)
        return True

    async def active_peers(self) -> list[str]:
        """Other workers of this stage whose DHT record says they are active."""
        workers = await self.swarm.get(workers_key(self.run.run_id, self.stage), WorkerRecord)
        return [peer for peer, record in workers.items()
                if peer != self.swarm.peer_id and record.phase == Phase.ACTIVE and record.stage == self.stage]

    async def state_candidates(self) -> list[tuple[str, list[str]]]:
        """Other workers of the stage that may serve its state (peer id, maddrs), fastest first."""
        workers = await self.swarm.get(workers_key(self.run.run_id, self.stage), WorkerRecord)
        candidates = sorted(
            ((peer, record) for peer, record in workers.items()
             if peer != self.swarm.peer_id and record.phase in SERVING_PHASES),
            key=lambda item: -item[1].throughput,
        )
        return [(peer, record.maddrs) for peer, record in candidates]

    async def load_from_donors(self):
        """Parameters and optimizer state from every donor that publishes the chosen snapshot
        (roles/worker/state/donor_client.py); None when no worker of the stage answers as a donor."""
        candidates = await self.state_candidates()
        if not candidates:
            return None
        client = RpcClient(self.p2p, timeout_s=self.run.sync.state_chunk_timeout_s,
                           authenticator=self.authenticator)
        try:
            return await load_from_donors(self.p2p, client, candidates, self.optimizer, self.layout,
                                          run_id=self.run.run_id, stage=self.stage,
                                          sync=self.run.sync)
        finally:
            await client.close()

    async def load_from_peers(self):
        candidates = await self.state_candidates()
        client = RpcClient(self.p2p, timeout_s=self.run.sync.state_chunk_timeout_s,
                           authenticator=self.authenticator)
        sync = self.run.sync
        loader = StateLoader(self.p2p, client, self.optimizer, self.layout, run_id=self.run.run_id,
                             stage=self.stage, chunk_elements=sync.state_chunk_elements,
                             chunk_timeout_s=sync.state_chunk_timeout_s, total_timeout_s=sync.state_load_timeout_s)
        try:
            return await loader.load(candidates)
        finally:
            await client.close()

    async def check_alone(self) -> None:
        """In a sync phase, become active once no other replica of the stage has been active for
        `sync.alone_exit_s` (sync_phase.py): the stage steps only on active replicas' samples."""
        if self.sync.phase == Phase.ACTIVE:
            self._alone_since = None
            return
        if await self.active_peers():
            self._alone_since = None
            return
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        waited = now - self._alone_since
        if waited < self.run.sync.alone_exit_s:
            return
        forwards, backwards = self.served()
        transition = self.sync.go_active(
            self.optimizer.local_step, forwards, backwards,
            f"no active replica of the stage for {waited:.0f}s: nobody is left to sync with, so this one carries "
            "the stage on")
        if transition is not None:
            self.on_transition(transition)
