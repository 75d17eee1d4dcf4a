"""The worker role: one replica of one pipeline stage, serving forward and backward requests,
stepping with its stage, averaging with its replicas, and announcing itself in the DHT
[report 3.3.1].

Start order matters: hivemind's averager is a forked process, so it is created before the
compute thread (or any other thread of ours) exists (docs/architecture.md, 'Processes and threads'); then the worker joins its stage
(loads state if the stage has moved on, picks its sync phase), and only then serves.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable, Optional

import torch
from hivemind.p2p import P2P

from protocol import version
from protocol.auth import PeerAuthenticator
from protocol.auth_state import SharedAuthState
from protocol.dht import SwarmDHT
from protocol.dht_schema import Phase, ProgressRecord, WorkerRecord, averaging_key, progress_key, workers_key
from protocol.errors import ConfigError, ErrorCode, ProtocolError
from protocol.fragment_evidence import FragmentEvidence
from protocol.identity import Identity
from protocol.messages import InfoReply
from protocol.transport import RpcClient, RpcServer
from roles.announcer import Announcer
from roles.checkpoint_store import CheckpointStore, CheckpointStoreError, resolve_store_url
from roles.periodic import every, wait_any
from roles.resources import device_memory, host_memory_total_bytes, host_rss_bytes
from protocol.run_config import RunConfig
from roles.model.memory_plan import plan_memory
from roles.model.stage import build_stage_model
from roles.worker.averaging.index_sets import SegmentIndexSets
from roles.worker.averaging.rounds import RoundOutcome
from roles.worker.averaging.service import AveragingService
from roles.worker.sparseloco.service import SparseLoCoService
from roles.worker.sparseloco.endpoint import SparseLoCoEndpoint
from roles.worker.serving.chain import ChainHandler, StageDirectory
from roles.worker.state.stage_checkpoint import StageCheckpoints
from roles.worker.config import WorkerConfig
from roles.worker.state.donor_client import load_from_donors
from roles.worker.errors import CheckpointError, StateLoadError, WorkerLeftStage
from roles.worker.health.connectivity import ConnectivityProbe
from roles.worker.health.termination import SelfTermination, averaging_health
from roles.worker.serving.handlers import WorkerHandlers
from roles.worker.layout import FlatLayout
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.health.preemption import PreemptionWatcher, PreemptSwitch
from roles.worker.steps.progress import StageProgress
from roles.worker.serving.queues import TaskQueues
from roles.worker.serving.replicas import StageReplicas
from roles.worker.state.run_checkpoint_io import RunCheckpointWriter, apply_state, load_latest
from roles.worker.serving.runtime import StageRuntime, autocast_dtype
from roles.worker.state.state_donor import StateDonor
from roles.worker.state.state_loader import StateLoader
from roles.worker.state.state_server import StateServer
from roles.worker.steps.step_ledger import StepLedger
from roles.worker.state.sync_phase import SyncPhases

logger = logging.getLogger(__name__)

SERVING_PHASES = (Phase.ACTIVE, Phase.OPTIMIZER_SYNC)
CHECKPOINT_UPLOAD_GRACE_S = 10.0
"""How long a leaving writer waits for its checkpoint upload in progress (an unfinished one is never loaded)."""


class WorkerState(enum.Enum):
    STARTING = "starting"
    ONLINE = "online"
    STOPPING = "stopping"
    STOPPED = "stopped"


class WorkerRole:
    def __init__(self, config: WorkerConfig, run: RunConfig, swarm: SwarmDHT, p2p: P2P, maddrs: list[str],
                 authenticator: Optional[PeerAuthenticator] = None, auth_state: Optional[SharedAuthState] = None,
                 identity: Optional[Identity] = None,
                 report_evidence: Optional[Callable[[FragmentEvidence], Awaitable[str]]] = None):
        """`report_evidence` sends a poisoned SparseLoCo fragment's evidence to the run's authorizer
        and answers the verdict (node/daemon.py; None in an open run)."""
        self.config = config
        self.run_config = run
        self.swarm = swarm
        self.p2p = p2p
        self.maddrs = maddrs
        self.state = WorkerState.STARTING
        self._started_at = time.time()
        """This process's start, announced so trainers tell a restart from the process that failed."""
        self.device = torch.device(config.device)
        init_run = run
        if config.test_init_seed_offset:
            init_run = run.model_copy(update={"seed": run.seed + config.test_init_seed_offset})
        self.model = build_stage_model(init_run, config.stage, device=self.device)
        self.optimizer = StageOptimizer.for_stage(run, config.stage, self.model.trainable_parameters(), self.device,
                                                  payload=[t for _, t in self.model.averaged_payload()])
        self.layout = FlatLayout.of_stage(self.model)
        self.layout.check(self.optimizer.master_params)
        sparseloco = run.averaging.method == "sparseloco"
        # SparseLoCo's joiner loads the consensus anchor with the state and is in step at once: no
        # weight or optimizer sync (which only AsyncSPARTA's weight-0 rounds would end).
        self.sync = SyncPhases(run.sync.model_copy(update={"weight_sync_steps": 0, "optimizer_sync_steps": 0})
                               if sparseloco else run.sync, run.averaging.segments)
        autocast = autocast_dtype(config.compute_dtype, run.dtype, self.device)
        self.ledger = StepLedger(run.target_batch_size, assigns=self.model.kind == "tail",
                                 close_timeout_s=run.staleness.step_close_timeout_s)
        self.runtime = StageRuntime(
            self.model, self.optimizer, TaskQueues(config.max_batch, config.max_pending),
            stage=config.stage, vocab_size=run.model.vocab_size, max_seq_len=run.model.max_seq_len,
            device=self.device, ledger=self.ledger, autocast_dtype=autocast,
            wire_dtype=getattr(torch, run.boundary_dtype),
            max_delayed_per_step=run.staleness.max_delayed_per_step if self.model.kind == "head" else None,
            forward_gate_timeout_s=run.staleness.forward_gate_timeout_s,
            kept_activations_bytes=kept_activations_budget(config, run, self.model.kind),
        )
        self.preempt = PreemptSwitch()  # before the averager forks: it shares the switch
        self.runtime.mid_compute = self.preempt.on_compute
        self.preemption = (None if auth_state is None else  # open runs: nobody may preempt anyone
                           PreemptionWatcher(swarm, run_id=run.run_id, auth_state=auth_state, switch=self.preempt,
                                             reducer=config.reducer))
        self.server = RpcServer(p2p, authenticator=authenticator, limits=config.stream_limits())
        # Self-termination [report 3.3.1.6]: the compute thread reports batch errors and steps to
        # the rules; the run loop samples memory and connectivity (_watch) and leaves when one fires.
        self.termination = SelfTermination(run.termination)
        self.runtime.on_compute_error = self.termination.compute_error
        self.runtime.on_step = self.termination.step_result
        self.handlers = WorkerHandlers(self.runtime, self.info, self._serving_batches,
                                       fail_forwards=config.test_fail_forwards, run_id=run.run_id,
                                       sign=None if identity is None else identity.sign)
        self.chain_client = RpcClient(p2p, timeout_s=run.staleness.forward_gate_timeout_s, authenticator=authenticator)
        """Calls to the next stage's workers for chained samples (routing.path `workers`)."""
        self.chain = ChainHandler(self.handlers, self.chain_client, p2p, StageDirectory(swarm.get, run.run_id),
                                  peer_id=swarm.peer_id, num_stages=run.num_stages)
        self.announcer = Announcer(
            swarm, workers_key(run.run_id, config.stage), self._record, period_s=config.announce_period_s
        )
        self.replicas = StageReplicas(run, config.stage, swarm, p2p, self.runtime)
        self.progress = StageProgress(
            swarm, run.run_id, config.stage, self.optimizer, self.ledger,
            period_s=config.progress_period_s, counts_towards_target=self._counts_towards_target,
            on_peers=self._on_peers, changed=self.runtime.changed, on_read=self._progress_read,
            tagging=lambda: self.replicas.tagging,
        )
        self.replicas.refresh_members = self.progress.read_soon
        self.averaging = AveragingService(
            run.averaging.model_copy(update={"enabled": False}) if sparseloco else run.averaging,
            swarm=swarm, run_id=run.run_id, stage=config.stage, store=self.optimizer,
            index_sets=SegmentIndexSets(self.layout, run.averaging.segments, seed=run.seed, stage=config.stage),
            reducer=config.reducer, local_step=lambda: self.optimizer.local_step, phase=lambda: self.phase,
            samples_processed=lambda: self.runtime.counters["backward_requests"], on_round=self._on_round,
            announce_period_s=config.announce_period_s, stall_s=config.test_averaging_stall_s,
            stepped=self.runtime.stepped, auth_state=auth_state, poison=config.test_averaging_poison,
            preempt=self.preempt, on_divergent=self._resync,
        )
        self.averaging.health = averaging_health(run.termination)  # the averaging rule's thresholds
        self.averaging.gradients_exchanged = self.replicas.exchange is not None
        self.runtime.after_step.append(self.averaging.after_step)
        self.sparseloco: Optional[SparseLoCoService] = None
        if sparseloco:
            if identity is None:
                raise ConfigError("averaging.method sparseloco signs every fragment: the worker needs its identity")
            self.sparseloco = SparseLoCoService(
                run, config.stage, self.layout, self.optimizer, self_id=swarm.peer_id, identity=identity,
                active=lambda: self.phase == Phase.ACTIVE, on_parted=self._sparseloco_parted,
                stopping=lambda: self.runtime.stopping, members=lambda: list(self.ledger.peers.members),
                test_poison=config.test_sparseloco_poison, test_exit=config.test_sparseloco_exit,
                report_evidence=report_evidence)
            self.sparseloco.health = averaging_health(run.termination)
            self.sparseloco_announcer = Announcer(swarm, averaging_key(run.run_id, config.stage),
                                                 lambda: self.sparseloco.record(self.phase),
                                                 period_s=config.announce_period_s)
            self.runtime.after_step.append(self.sparseloco.after_step)
            self.runtime.after_step_unlocked.append(self.sparseloco.after_step_unlocked)
        self._probe_client: Optional[RpcClient] = None
        self.connectivity_probe: Optional[ConnectivityProbe] = None
        self.state_server = StateServer(
            self.optimizer, self.layout, run_id=run.run_id, stage=config.stage,
            step=lambda: self.optimizer.local_step,
            serving=lambda: self.state == WorkerState.ONLINE and self.phase in SERVING_PHASES,
            max_chunk_elements=run.sync.state_chunk_elements, chunk_delay_s=config.test_state_chunk_delay_s,
        )
        self.donor = StateDonor(
            self.optimizer, self.layout, run_id=run.run_id, stage=config.stage,
            serving=lambda: self.state == WorkerState.ONLINE and self.phase in SERVING_PHASES,
            chunk_bytes=run.sync.state_chunk_bytes, upload_mbps=run.sync.donor_upload_mbps,
            max_concurrent_chunks=run.sync.donor_max_concurrent_chunks,
            snapshot_ttl_s=run.sync.donor_snapshot_ttl_s, chunk_delay_s=config.test_state_chunk_delay_s,
        )
        self.checkpoints: Optional[StageCheckpoints] = None
        if config.checkpoint_dir:
            self.checkpoints = StageCheckpoints(config.checkpoint_dir, run_id=run.run_id, stage=config.stage,
                                                layout=self.layout, store=self.optimizer)
        self.run_store = CheckpointStore(resolve_store_url(config.checkpoint_store, run.checkpoints.store),
                                         run.run_id, run.num_stages)
        self.checkpoint_writer: Optional[RunCheckpointWriter] = None
        if config.checkpoint_write:
            self.checkpoint_writer = RunCheckpointWriter(
                self.run_store, stage=config.stage, writer=swarm.peer_id, optimizer=self.optimizer,
                layout=self.layout, every_steps=run.checkpoints.every_steps, keep=run.checkpoints.keep,
                may_write=lambda: self.phase == Phase.ACTIVE, upload_delay_s=config.test_checkpoint_upload_delay_s)
            self.runtime.after_step.append(self.checkpoint_writer.after_step)
        self.joined: dict = {}
        self.joined_download: Optional[dict] = None
        """What the multi-donor download did, for the summary (None: another source gave the state)."""
        self._tasks: list[asyncio.Task] = []
        self._alone_since: Optional[float] = None
        """When this worker, in a sync phase, first saw no active replica of its stage (_check_alone)."""

    @property
    def phase(self) -> Phase:
        return self.sync.phase

    def _counts_towards_target(self) -> bool:
        return self.phase == Phase.ACTIVE

    def _serving_batches(self) -> bool:
        # A worker in weight sync is hidden from trainers; one that still gets a request (a stale
        # routing table) refuses it, so the trainer retries elsewhere [report 3.3.1.1].
        return self.state == WorkerState.ONLINE and self.phase in SERVING_PHASES

    def _record(self) -> WorkerRecord:
        device_used, device_total = device_memory(self.config.device)
        return WorkerRecord(
            stage=self.config.stage, phase=self.phase if self.state != WorkerState.STOPPING else Phase.LEAVING,
            max_batch=self.config.max_batch, throughput=float(self.runtime.throughput),
            maddrs=self.maddrs, client_version=version.client_version(),
            host_rss_bytes=host_rss_bytes(), host_memory_total_bytes=host_memory_total_bytes(),
            device_memory_used_bytes=device_used, device_memory_total_bytes=device_total,
            relayed_bytes=sum(self.server.relayed_bytes), started_at=self._started_at,
            chain=not self.config.test_without_chain, model_digest=self.run_config.model_digest,
            construction=self.run_config.model.construction,
        )

    def _on_peers(self) -> None:
        """After each read of the stage's progress: the step decision may have changed, and so may
        the stage's tagger."""
        self.replicas.on_peers()
        self.runtime.wake()

    def _on_round(self, outcome: RoundOutcome) -> None:
        """Called on the event loop after each averaging round: a round can end weight sync, and
        the stage may have elected this worker a reducer before it."""
        if self.preemption is not None:
            self.preemption.reducer = self.averaging.reducer
        self.sync.record_round(outcome.plan.segment, outcome.status, outcome.delta_sq, outcome.average_sq)
        self._update_phase()

    def info(self) -> InfoReply:
        pending = self.runtime.queues.pending()
        counters = dict(self.runtime.counters)
        counters.update(self.server.counters())
        counters["compute_ms"] = int(self.runtime.compute_s * 1000)
        counters.update(self._step_counters())
        counters.update(self.averaging.counters)
        counters.update(self.state_server.counters)
        counters.update(self.donor.counters)
        counters.update({f"kept_activations_{k}": v for k, v in self.runtime.kept.counters.items()})
        if self.checkpoints is not None:
            counters["checkpoints_written"] = self.checkpoints.written
        if self.checkpoint_writer is not None:
            counters.update(self.checkpoint_writer.counters)
        return InfoReply(
            peer_id=self.swarm.peer_id, role="worker", stage=self.config.stage, phase=self.phase.value,
            max_batch=self.config.max_batch, local_step=self.optimizer.local_step,
            queued={k.value: v for k, v in pending.items()}, counters=counters, version=version.client_version(),
        )

    def _step_counters(self) -> dict[str, int]:
        """Step boundaries and staleness as `agora/v1/info` counters: over `staleness_samples`
        backwards, forward-to-backward version gaps sum to `staleness_gap_total` and gradient delays
        (the step applied minus the version the gradient was taken at) to
        `staleness_delay_total`."""
        ledger, stale = self.ledger, self.runtime.staleness
        return {
            "steps_taken": len(ledger.step_sizes),
            "step_samples_total": sum(ledger.step_sizes),
            "steps_short": sum(1 for n in ledger.step_sizes if n < ledger.target),
            "late_samples": ledger.late_samples,
            "abandoned_samples": ledger.abandoned_total,
            "staleness_samples": sum(stale.gaps.values()),
            "staleness_gap_total": sum(g * n for g, n in stale.gaps.items()),
            "staleness_delay_total": sum(d * n for d, n in stale.delays.items()),
            "staleness_delayed": sum(n for d, n in stale.delays.items() if d > 0),
            "staleness_pinned": stale.pinned_samples,
        }

    def summary(self) -> dict:
        """What this worker did, printed as its last stdout line on exit."""
        stats = self.runtime.queues.stats
        return {
            "stage": self.config.stage,
            "local_step": self.optimizer.local_step,
            "phase": self.phase.value,
            "counters": {**self.runtime.counters, "requests_superseded": self.runtime.queues.superseded},
            "requests": {f"{kind}_{outcome}": n for (kind, outcome), n in sorted(self.handlers.outcomes.items())},
            "rejected": dict(self.server.rejected),
            "rejected_calls": dict(self.server.rejected_calls),
            "auth_rejected": dict(self.server.auth_rejected),
            "streams_refused": dict(self.server.streams_refused),
            "streams_closed": dict(self.server.streams_closed),
            "peers_shunned": self.server.gate.shuns,
            "peers_disconnected": self.server.peers_disconnected,
            "compute_s": round(self.runtime.compute_s, 3),
            "steps": {**self.ledger.summary(),
                      "discarded_at_shutdown": sum(self.runtime.discarded_at_shutdown.values()),
                      "discarded_by_step": {str(k): v for k, v in self.runtime.discarded_at_shutdown.items()}},
            "staleness": self.runtime.staleness.summary(),
            "kept_activations": self.runtime.kept.summary(),
            "chained": dict(self.chain.counters),
            "mean_batch_size": round(stats.mean_batch_size, 3),
            "joined": self.joined,
            "sync_phases": self.sync.summary(),
            "averaging": self.averaging.summary(),
            **({"sparseloco": self.sparseloco.summary()} if self.sparseloco is not None else {}),
            **self.replicas.summary(),
            "state_served": {**self.state_server.counters, **self.donor.counters},
            **({"checkpoints": self.checkpoint_writer.summary()} if self.checkpoint_writer is not None else {}),
            "terminated_by": self.termination.summary(),
        }

    # ---- start ----

    async def start(self) -> None:
        # Fork hivemind's averager before any thread of ours exists (docs/architecture.md, 'Processes and threads').
        self.averaging.start_averager(self.swarm.dht)
        # In authenticated runs only stage peers may pull state, and only trainers route samples.
        await self.server.add_handler(version.STATE, self.state_server.handle, roles=frozenset({"worker"}))
        await self.server.add_handler(version.STATE_MANIFEST, self.donor.manifest, roles=frozenset({"worker"}))
        await self.server.add_handler(version.STATE_CHUNK, self.donor.chunk, roles=frozenset({"worker"}))
        await self._join_stage()
        self.averaging.begin()
        await self.replicas.start(self.server)
        if self.sparseloco is not None:
            await self._start_sparseloco()
        self.runtime.start()
        await self.server.add_handler(version.FORWARD, self.handlers.forward, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.BACKWARD, self.handlers.backward, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.EVALUATE, self.handlers.evaluate, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.ABANDON, self.handlers.abandon, roles=frozenset({"trainer"}))
        # A chained sample comes from a trainer (at the head) or from the previous stage's worker.
        if not self.config.test_without_chain:
            await self.server.add_handler(version.CHAIN, self.chain.chain, roles=frozenset({"trainer", "worker"}))
        await self.server.add_handler(version.INFO, self.handlers.info)
        self.state = WorkerState.ONLINE
        await self.announcer.announce_now()

    async def _join_stage(self) -> None:
        """Load state if the stage has moved past its seeded start, and pick the sync phase from
        how far the loaded state lags [report 3.3.1.1]."""
        progress = await self.swarm.get(progress_key(self.run_config.run_id, self.config.stage), ProgressRecord)
        own = progress.pop(self.swarm.peer_id, None)
        stage_step = max((record.local_step for record in progress.values()), default=0)
        stage_consumed = max((record.samples_consumed for record in progress.values()), default=0)
        if stage_step == 0 and own is not None and own.local_step > 0:
            # This identity's previous process was the stage's last replica: the stage is where it
            # left it, not at the seed. State then comes from a checkpoint or, failing that, the
            # seeded weights with a warning, instead of a silent restart of the stage from step 0.
            stage_step, stage_consumed = own.local_step, own.samples_consumed
        if stage_step == 0 and await self._resume_from_store():
            return
        if stage_step == 0:
            self.sync.begin(Phase.ACTIVE, 0, "the stage has not stepped yet: every replica starts from the seed")
            self.joined = {"stage_step": 0, "loaded_step": 0, "source": "seed", "phase": Phase.ACTIVE.value}
            return
        loaded_step, source = None, "seed"
        if self.config.state_source in ("auto", "peers"):
            try:
                donated = await self._load_from_donors()
                if donated is not None:
                    loaded_step, download = donated.step, donated.result
                    source = (f"{len(donated.donors)} donor(s) in {download.seconds:.1f}s, {download.requeued} "
                              f"re-queued chunk(s)")
                    self.joined_download = download.summary()
            except StateLoadError as exc:
                logger.warning("could not load state from donors: %s; trying agora/v1/state", exc)
            if loaded_step is None:
                try:
                    result = await self._load_from_peers()
                    loaded_step = result.step
                    source = f"{len(result.peers)} peer(s) in {result.seconds:.1f}s, {result.resumes} resume(s)"
                except StateLoadError as exc:
                    logger.warning("could not load state from peers: %s", exc)
        if loaded_step is None and self.checkpoints is not None and self.config.state_source in ("auto", "checkpoint"):
            try:
                loaded_step = await asyncio.to_thread(self.checkpoints.load)
                source = f"checkpoint {self.checkpoints.path}"
            except CheckpointError as exc:
                logger.warning("could not load the checkpoint: %s", exc)
        if loaded_step is None and self.config.state_source in ("auto", "checkpoint"):
            loaded = await self._load_from_store()
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
        if phase != Phase.ACTIVE and not await self._active_peers():
            phase = Phase.ACTIVE
            reason += "; no active replica of the stage is left to sync with, so this one carries it on"
        self.sync.begin(phase, stage_step, reason)
        self.joined = {"stage_step": stage_step, "loaded_step": loaded_step, "source": source, "phase": phase.value}
        if self.joined_download is not None:
            self.joined["download"] = self.joined_download
        logger.info("joined stage %d in %s: %s", self.config.stage, phase.value, reason)

    async def _load_from_store(self):
        """The newest complete run checkpoint's state of this stage, or None (logged) if there is none."""
        workdir = Path(tempfile.gettempdir()) / f"agora-checkpoint-{self.swarm.peer_id[-12:]}"
        try:
            loaded = await asyncio.to_thread(load_latest, self.run_store, self.config.stage, self.layout, workdir)
        except CheckpointStoreError as exc:
            # not an empty store: starting from the seed here could restart a lost run from scratch
            raise ConfigError(f"{exc}; fix the store or its credentials (AWS_* variables for s3://), or start "
                              "without it (no checkpoints.store, no --checkpoint-store)") from exc
        finally:
            shutil.rmtree(workdir, ignore_errors=True)  # a remote object's download, read by now
        if loaded is None:
            logger.info("the checkpoint store %s holds no complete checkpoint yet", self.run_store.describe())
        return loaded

    async def _resume_from_store(self) -> bool:
        """A stage nobody has stepped in this DHT, with a complete checkpoint in the store: the run
        was lost and restarts, so this stage continues from the checkpoint (weights, optimizer
        moments, step and schedule position) instead of from the seed."""
        if self.config.state_source not in ("auto", "checkpoint"):
            return False
        loaded = await self._load_from_store()
        if loaded is None:
            return False
        manifest, state = loaded
        await asyncio.to_thread(apply_state, state, self.optimizer, self.layout, with_optimizer=True)
        step = self.optimizer.local_step
        reason = (f"resumed from the checkpoint at step {manifest.step} in {self.run_store.describe()}: the stage "
                  "had no live replica")
        self.sync.begin(Phase.ACTIVE, step, reason)
        self.runtime.stepped.fire()
        self.joined = {"stage_step": step, "loaded_step": manifest.step, "source": f"checkpoint store "
                       f"{self.run_store.describe()}", "phase": Phase.ACTIVE.value, "resumed": True}
        logger.info("joined stage %d: %s", self.config.stage, reason)
        return True

    async def _active_peers(self) -> list[str]:
        """Other workers of this stage whose DHT record says they are active."""
        workers = await self.swarm.get(workers_key(self.run_config.run_id, self.config.stage), WorkerRecord)
        return [peer for peer, record in workers.items()
                if peer != self.swarm.peer_id and record.phase == Phase.ACTIVE and record.stage == self.config.stage]

    async def _check_alone(self) -> None:
        """In a sync phase, become active once no other replica of the stage has been active for
        `sync.alone_exit_s` (sync_phase.py): the stage steps only on active replicas' samples."""
        if self.phase == Phase.ACTIVE:
            self._alone_since = None
            return
        if await self._active_peers():
            self._alone_since = None
            return
        now = time.monotonic()
        if self._alone_since is None:
            self._alone_since = now
        waited = now - self._alone_since
        if waited < self.run_config.sync.alone_exit_s:
            return
        counters = self.runtime.counters
        transition = self.sync.go_active(
            self.optimizer.local_step, counters["forward_requests"], counters["backward_requests"],
            f"no active replica of the stage for {waited:.0f}s: nobody is left to sync with, so this one carries "
            "the stage on")
        if transition is not None:
            self._log_transition(transition)

    def _resync(self, reason: str) -> None:
        """The averaging found this replica to be its stage's outlier: back to weight sync, hidden
        from trainers and averaging with weight 0, until a full pass replaced its weights."""
        counters = self.runtime.counters
        transition = self.sync.resync(self.optimizer.local_step, counters["forward_requests"],
                                      counters["backward_requests"], reason)
        if transition is not None:
            logger.warning("stage %d: %s; rejoining through weight sync", self.config.stage, reason)
            self._log_transition(transition)

    # ---- SparseLoCo ----

    async def _start_sparseloco(self) -> None:
        endpoint = SparseLoCoEndpoint(self.run_config, self.config.stage, self.sparseloco, self.replicas,
                                      lambda: self.optimizer.local_step)
        self.sparseloco.begin(await endpoint.start(self.server))

    def _sparseloco_parted(self, reason: str) -> None:
        """Compute thread: this replica's anchor is not the stage's. Reload the stage's state (with
        the anchor) from a donor on the event loop; until then it captures nothing."""
        loop = self.replicas.loop
        if loop is not None:
            loop.call_soon_threadsafe(lambda: self._tasks.append(
                asyncio.create_task(self._sparseloco_reload(reason), name="sparseloco-reload")))

    async def _sparseloco_reload(self, reason: str) -> None:
        self.optimizer.loaded_outer = {}
        try:
            donated = await self._load_from_donors()
        except StateLoadError as exc:
            donated = None
            logger.warning("sparseloco: could not reload the stage's state (%s); carrying on from this replica's", exc)
        if donated is None:
            logger.warning("sparseloco: no donor to reload from; this replica takes its own weights as its anchor")
        self.sparseloco.restart_from_loaded()
        self.runtime.counters["sparseloco_reloads"] += 1
        logger.info("sparseloco: %s after %s", "reloaded the stage's state" if donated else "restarted", reason)

    async def _state_candidates(self) -> list[tuple[str, list[str]]]:
        """Other workers of the stage that may serve its state (peer id, maddrs), fastest first."""
        workers = await self.swarm.get(workers_key(self.run_config.run_id, self.config.stage), WorkerRecord)
        candidates = sorted(
            ((peer, record) for peer, record in workers.items()
             if peer != self.swarm.peer_id and record.phase in SERVING_PHASES),
            key=lambda item: -item[1].throughput,
        )
        return [(peer, record.maddrs) for peer, record in candidates]

    async def _load_from_donors(self):
        """Parameters and optimizer state from every donor that publishes the chosen snapshot
        (roles/worker/state/donor_client.py); None when no worker of the stage answers as a donor."""
        candidates = await self._state_candidates()
        if not candidates:
            return None
        client = RpcClient(self.p2p, timeout_s=self.run_config.sync.state_chunk_timeout_s,
                           authenticator=self.server.authenticator)
        try:
            return await load_from_donors(self.p2p, client, candidates, self.optimizer, self.layout,
                                          run_id=self.run_config.run_id, stage=self.config.stage,
                                          sync=self.run_config.sync)
        finally:
            await client.close()

    async def _load_from_peers(self):
        candidates = await self._state_candidates()
        client = RpcClient(self.p2p, timeout_s=self.run_config.sync.state_chunk_timeout_s,
                           authenticator=self.server.authenticator)
        sync = self.run_config.sync
        loader = StateLoader(self.p2p, client, self.optimizer, self.layout, run_id=self.run_config.run_id,
                             stage=self.config.stage, chunk_elements=sync.state_chunk_elements,
                             chunk_timeout_s=sync.state_chunk_timeout_s, total_timeout_s=sync.state_load_timeout_s)
        try:
            return await loader.load(candidates)
        finally:
            await client.close()

    # ---- run ----

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, the compute thread dies or the worker must leave its stage."""
        crashed, left = self.runtime.crashed.listen(), self.averaging.left.listen()
        fired = self.termination.fired.listen()
        waits = [left] if self.sparseloco is None else [left, self.sparseloco.left.listen()]
        rules = self.run_config.termination
        self._probe_client = RpcClient(self.p2p, timeout_s=rules.check_period_s,
                                       authenticator=self.server.authenticator)
        self.connectivity_probe = ConnectivityProbe(
            self.swarm, self.p2p, self._probe_client, run_id=self.run_config.run_id,
            num_stages=self.run_config.num_stages, served=lambda: sum(self.handlers.outcomes.values()),
            timeout_s=min(5.0, rules.check_period_s))
        self._tasks = [
            asyncio.create_task(self.announcer.run(stop), name="announce"),
            asyncio.create_task(self.progress.run(stop), name="progress"),
            asyncio.create_task(self.replicas.run(stop), name="step-counts"),
            asyncio.create_task(self.averaging.run(stop), name="averaging"),
            *([asyncio.create_task(self.sparseloco_announcer.run(stop), name="announce-sparseloco")]
              if self.sparseloco is not None else []),
            asyncio.create_task(every(None, self._update_phase, stop, name="sync phases",
                                      wake=self.runtime.stepped.listen()), name="sync-phases"),
            asyncio.create_task(every(rules.check_period_s, self._watch, stop, name="self-termination rules"),
                                name="self-termination"),
        ]
        # Always: an active replica can go back to weight sync (a resync after it diverged).
        period = min(self.config.announce_period_s, self.run_config.sync.alone_exit_s / 3)
        self._tasks.append(asyncio.create_task(every(period, self._check_alone, stop, name="alone in sync"),
                                               name="alone-in-sync"))
        if self.preemption is not None:
            self._tasks.append(asyncio.create_task(self.preemption.run(stop), name="preempt-orders"))
        if self.checkpoints is not None and self.config.checkpoint_period_s:
            self._tasks.append(asyncio.create_task(
                self.checkpoints.run(stop, self.config.checkpoint_period_s, lambda: self.optimizer.local_step,
                                     may_write=lambda: self.phase == Phase.ACTIVE),
                name="checkpoints"))
        while not stop.is_set():
            if self.runtime.failure is not None and not self.termination.compute_error(self.runtime.failure):
                raise RuntimeError(f"compute thread failed: {self.runtime.failure}") from self.runtime.failure
            reason = self.averaging.leave_reason or (self.sparseloco.leave_reason if self.sparseloco else None)
            if reason:
                self.termination.averaging_left(reason)
                if self.termination.firing is None:  # cannot happen while the rule is on (averaging_health)
                    raise WorkerLeftStage(f"worker left stage {self.config.stage}: {reason}")
            self.termination.raise_if_fired()
            await wait_any(stop, crashed, *waits, fired)

    def _progress_read(self, ok: bool, why: str) -> None:
        self.termination.progress_read(ok, why)
        if not ok:
            self.termination.check()

    async def _watch(self) -> None:
        """Sample what the thresholded and timed rules watch (once a check period)."""
        used, total = device_memory(self.config.device)
        self.termination.memory(host_rss=host_rss_bytes(), host_total=host_memory_total_bytes(),
                                device_used=used, device_total=total)
        if self.termination.firing is None and self.connectivity_probe is not None:
            ok, why = await self.connectivity_probe.probe()
            self.termination.connectivity(ok, why)
        self.termination.check()

    def _update_phase(self) -> None:
        """Advance the sync phase if it is done: called when the step moves and after each round,
        the only two things a phase ends on."""
        counters = self.runtime.counters
        transition = self.sync.update(self.optimizer.local_step, counters["forward_requests"],
                                      counters["backward_requests"])
        if transition is not None:
            self._log_transition(transition)

    def _log_transition(self, transition) -> None:
        counters = self.runtime.counters
        logger.info("sync phase %s -> %s at step %d: %s (served so far: %d forward, %d backward requests)",
                    transition.old.value, transition.new.value, self.optimizer.local_step, transition.reason,
                    counters["forward_requests"], counters["backward_requests"])
        self.announcer.poke()
        self.averaging.announcer.poke()

    # ---- shutdown ----

    async def shutdown(self) -> None:
        """Leave cleanly: withdraw from the DHT first so trainers stop routing here, hand back
        queued requests with a typed error (the trainer retries them elsewhere), finish the batch
        in progress, stop averaging, write a last checkpoint if this node writes them, and stop
        serving. Idempotent."""
        if self.state in (WorkerState.STOPPING, WorkerState.STOPPED):
            return
        self.state = WorkerState.STOPPING
        started = time.monotonic()
        await self.announcer.withdraw()
        leftover = await asyncio.to_thread(self.runtime.stop, self.config.drain_timeout_s)
        for task in leftover:
            task.on_done(None, ProtocolError("worker is shutting down; retry on another worker", ErrorCode.NOT_READY))
        await asyncio.sleep(0.05)  # let the handed-back replies reach their streams
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.progress.withdraw()
        await self.averaging.shutdown()
        if self.sparseloco is not None:
            await self.sparseloco_announcer.withdraw()
        await self.replicas.close()
        self.donor.close()
        if (self.checkpoints is not None and self.config.checkpoint_period_s and not self.averaging.leave_reason
                and self.phase == Phase.ACTIVE):
            await self.checkpoints.save_logged(self.optimizer.local_step)
        if self.checkpoint_writer is not None:
            await asyncio.to_thread(self.checkpoint_writer.close, CHECKPOINT_UPLOAD_GRACE_S)
        if self._probe_client is not None:
            await self._probe_client.close()
        await self.chain_client.close()
        await self.server.shutdown()
        self.state = WorkerState.STOPPED
        discarded = self.runtime.discarded_at_shutdown
        if discarded:
            logger.warning("discarded the gradients of %d sample(s) of unfinished step(s) %s: the stage had "
                           "not completed them", sum(discarded.values()), sorted(discarded))
        logger.info("worker left stage %d in %.1fs after %d steps; %d queued requests handed back",
                    self.config.stage, time.monotonic() - started, self.optimizer.local_step, len(leftover))


def kept_activations_budget(config: WorkerConfig, run: RunConfig, kind: str) -> int:
    """--kept-activations, or half of what the stage's memory plan leaves free on its device (host
    RAM on the CPU). The tail keeps nothing: its forward runs inside its backward."""
    import psutil

    if kind == "tail":
        return 0
    if config.kept_activations is not None:
        budget = config.kept_activations
    elif run.staleness.max_delayed_per_step != 0:
        # Forwards run ahead of the step, so one forward batch holds samples of two steps, whose
        # backwards cannot share its graph: measured slower than recomputing (demo, gate 4).
        logger.info("stage %d recomputes every forward in its backward (staleness.max_delayed_per_step is not 0; "
                    "--kept-activations SIZE keeps them anyway)", config.stage)
        return 0
    else:
        plan = plan_memory(run, config.stage, config.device, config.max_batch)
        device_free = None
        if config.device.startswith("cuda") and torch.cuda.is_available():
            # --gpu-memory on a card that is here: this worker's share of it
            device_free = config.gpu_memory or int(torch.cuda.mem_get_info(torch.device(config.device))[0])
        budget = plan.kept_activations_budget(device_free, int(psutil.virtual_memory().available))
    if budget:
        logger.info("stage %d keeps forward activations for the backward within %.2f GiB (recomputes beyond)",
                    config.stage, budget / 2**30)
    else:
        logger.info("stage %d recomputes every forward in its backward (no memory to keep activations)", config.stage)
    return budget
