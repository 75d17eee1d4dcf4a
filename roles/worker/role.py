"""The worker role: one replica of one pipeline stage, serving forward and backward requests,
stepping with its stage, averaging with its replicas, and announcing itself in the DHT
[report 3.3.1].

Start order matters: hivemind's averager is a forked process, so it is created before the
compute thread (or any other thread of ours) exists (docs/architecture.md, 'Processes and
threads'); then the worker joins its stage (state/joining.py: loads state if the stage has moved
on, picks its sync phase), and only then serves. The parts live in the worker's rooms
(roles/worker/__init__.py); this module builds them, runs the supervisor loop and shuts down.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Awaitable, Callable, Optional

import torch
from hivemind.p2p import P2P

from protocol import version
from protocol.auth import PeerAuthenticator
from protocol.auth_state import SharedAuthState
from protocol.dht import SwarmDHT
from protocol.dht_schema import Phase, WorkerRecord, workers_key
from protocol.errors import ErrorCode, ProtocolError
from protocol.evidence_report import AnyEvidence
from protocol.identity import Identity
from protocol.messages import InfoReply
from protocol.run_config import RunConfig
from protocol.transport import RpcClient, RpcServer
from roles.announcer import Announcer
from roles.checkpoint_store import CheckpointStore, resolve_store_url
from roles.model.stage import build_stage_model
from roles.periodic import every, wait_any
from roles.resources import device_memory, host_memory_total_bytes, host_rss_bytes
from roles.worker.averaging.index_sets import SegmentIndexSets
from roles.worker.averaging.rounds import RoundOutcome
from roles.worker.averaging.service import AveragingService
from roles.worker.config import WorkerConfig
from roles.worker.errors import WorkerLeftStage
from roles.worker.health.connectivity import ConnectivityProbe
from roles.worker.health.preemption import PreemptionWatcher, PreemptSwitch
from roles.worker.health.termination import SelfTermination, averaging_health
from roles.worker.layout import FlatLayout
from roles.worker.serving.chain import ChainHandler, StageDirectory
from roles.worker.serving.compute_stats import step_counters
from roles.worker.serving.handlers import WorkerHandlers
from roles.worker.serving.kept_activations import kept_activations_budget
from roles.worker.serving.queues import TaskQueues
from roles.worker.serving.replicas import StageReplicas
from roles.worker.serving.runtime import StageRuntime, autocast_dtype
from roles.worker.serving.weights_server import WeightsServer
from roles.worker.sparseloco.lifecycle import SparseLoCoLifecycle
from roles.worker.sparseloco.service import SparseLoCoService
from roles.worker.state.joining import StageJoin
from roles.worker.state.run_checkpoint_io import RunCheckpointWriter
from roles.worker.state.stage_checkpoint import StageCheckpoints
from roles.worker.state.state_donor import StateDonor
from roles.worker.state.state_server import StateServer
from roles.worker.state.sync_phase import SERVING_PHASES, SyncPhases
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.steps.progress import StageProgress
from roles.worker.steps.step_ledger import StepLedger

logger = logging.getLogger(__name__)

CHECKPOINT_UPLOAD_GRACE_S = 10.0
"""How long a leaving writer waits for its checkpoint upload in progress (an unfinished one is never loaded)."""


class WorkerState(enum.Enum):
    STARTING = "starting"
    ONLINE = "online"
    STOPPING = "stopping"
    STOPPED = "stopped"


class WorkerRole:
    """One worker: its parts are built by the `_build_*` helpers below, in the order the start
    needs (the preemption switch before the averager forks, the runtime before what hooks into it)."""

    def __init__(self, config: WorkerConfig, run: RunConfig, swarm: SwarmDHT, p2p: P2P, maddrs: list[str],
                 authenticator: Optional[PeerAuthenticator] = None, auth_state: Optional[SharedAuthState] = None,
                 identity: Optional[Identity] = None,
                 report_evidence: Optional[Callable[[AnyEvidence], Awaitable[str]]] = None):
        """`report_evidence` sends a poisoned SparseLoCo fragment's or AsyncSPARTA part's evidence
        to the run's authorizer and answers the verdict (node/daemon.py; None in an open run)."""
        self.config = config
        self.run_config = run
        self.swarm = swarm
        self.p2p = p2p
        self.maddrs = maddrs
        self.state = WorkerState.STARTING
        self._started_at = time.time()
        """This process's start, announced so trainers tell a restart from the process that failed."""
        self.device = torch.device(config.device)
        self._tasks: list[asyncio.Task] = []
        self._build_compute()
        self._build_serving(authenticator, auth_state, identity)
        self._build_averaging(auth_state, identity, report_evidence)
        self._build_sparseloco(identity, report_evidence)
        self._build_state(authenticator)
        self._probe_client: Optional[RpcClient] = None
        self.connectivity_probe: Optional[ConnectivityProbe] = None

    def _build_compute(self) -> None:
        """The stage model, its optimizer and layout, the sync phases, the step ledger and the runtime."""
        config, run = self.config, self.run_config
        self.model = build_stage_model(run, config.stage, device=self.device)
        self.optimizer = StageOptimizer.for_stage(run, config.stage, self.model.trainable_parameters(), self.device,
                                                  payload=[t for _, t in self.model.averaged_payload()])
        self.layout = FlatLayout.of_stage(self.model)
        self.layout.check(self.optimizer.master_params)
        # SparseLoCo's joiner loads the consensus anchor with the state and is in step at once: no
        # weight or optimizer sync (which only AsyncSPARTA's weight-0 rounds would end).
        self.sync = SyncPhases(run.sync.model_copy(update={"weight_sync_steps": 0, "optimizer_sync_steps": 0})
                               if run.averaging.method == "sparseloco" else run.sync, run.averaging.segments)
        self.ledger = StepLedger(run.target_batch_size, assigns=self.model.kind == "tail",
                                 close_timeout_s=run.staleness.step_close_timeout_s)
        self.runtime = StageRuntime(
            self.model, self.optimizer, TaskQueues(config.max_batch, config.max_pending),
            stage=config.stage, vocab_size=run.model.vocab_size, max_seq_len=run.model.max_seq_len,
            device=self.device, ledger=self.ledger,
            autocast_dtype=autocast_dtype(config.compute_dtype, run.dtype, self.device),
            wire_dtype=getattr(torch, run.boundary_dtype),
            max_delayed_per_step=run.staleness.max_delayed_per_step if self.model.kind == "head" else None,
            forward_gate_timeout_s=run.staleness.forward_gate_timeout_s,
            kept_activations_bytes=kept_activations_budget(config, run, self.model.kind),
        )

    def _build_serving(self, authenticator: Optional[PeerAuthenticator], auth_state: Optional[SharedAuthState],
                       identity: Optional[Identity]) -> None:
        """The preemption switch and the self-termination rules the compute thread reports to, the
        RPC server and its handlers, the chain handler, the announcer, the replicas and progress."""
        config, run, swarm, p2p = self.config, self.run_config, self.swarm, self.p2p
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
        self.handlers = WorkerHandlers(self.runtime, self.info, self._serving_batches, run_id=run.run_id,
                                       sign=None if identity is None else identity.sign)
        self.chain_client = RpcClient(p2p, timeout_s=run.staleness.forward_gate_timeout_s, authenticator=authenticator)
        """Calls to the next stage's workers for chained samples (routing.path `workers`)."""
        self.chain = ChainHandler(self.handlers, self.chain_client, p2p, StageDirectory(swarm.get, run.run_id),
                                  peer_id=swarm.peer_id, num_stages=run.num_stages, run_id=run.run_id,
                                  sign=None if identity is None else identity.sign,
                                  checked=run.verification.spot_check_rate > 0)
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

    def _build_averaging(self, auth_state: Optional[SharedAuthState], identity: Optional[Identity],
                         report_evidence: Optional[Callable[[AnyEvidence], Awaitable[str]]]) -> None:
        """AsyncSPARTA's service (switched off under SparseLoCo, which averages instead); its parts
        are sealed with `identity`, and a poisoned part it refuses goes to `report_evidence`."""
        config, run = self.config, self.run_config
        self.averaging = AveragingService(
            run.averaging.model_copy(update={"enabled": False}) if run.averaging.method == "sparseloco"
            else run.averaging,
            swarm=self.swarm, run_id=run.run_id, stage=config.stage, store=self.optimizer,
            index_sets=SegmentIndexSets(self.layout, run.averaging.segments, seed=run.seed, stage=config.stage),
            reducer=config.reducer, local_step=lambda: self.optimizer.local_step, phase=lambda: self.phase,
            samples_processed=lambda: self.runtime.counters["backward_requests"], on_round=self._on_round,
            announce_period_s=config.announce_period_s, stepped=self.runtime.stepped, auth_state=auth_state,
            preempt=self.preempt, on_divergent=self._resync,
            sign=None if identity is None else identity.sign, report_evidence=report_evidence,
        )
        self.averaging.health = averaging_health(run.termination)  # the averaging rule's thresholds
        self.averaging.gradients_exchanged = self.replicas.exchange is not None
        self.runtime.after_step.append(self.averaging.after_step)

    def _build_sparseloco(self, identity: Optional[Identity],
                          report_evidence: Optional[Callable[[AnyEvidence], Awaitable[str]]]) -> None:
        """SparseLoCo's lifecycle, under `averaging.method: sparseloco` (its step hooks run after
        AsyncSPARTA's and before the run checkpoint writer's)."""
        config, run = self.config, self.run_config
        self.sloco: Optional[SparseLoCoLifecycle] = None
        if run.averaging.method == "sparseloco":
            self.sloco = SparseLoCoLifecycle(
                run, config.stage, swarm=self.swarm, layout=self.layout, runtime=self.runtime,
                replicas=self.replicas, identity=identity, phase=lambda: self.phase,
                announce_period_s=config.announce_period_s, reload_state=lambda: self.join.load_from_donors(),
                track=lambda task: self._tasks.append(task), report_evidence=report_evidence)
        self.sparseloco: Optional[SparseLoCoService] = None if self.sloco is None else self.sloco.service

    def _build_state(self, authenticator: Optional[PeerAuthenticator]) -> None:
        """What serves this stage's state to joiners, the checkpoints it writes, and its own join."""
        config, run = self.config, self.run_config
        self.state_server = StateServer(
            self.optimizer, self.layout, run_id=run.run_id, stage=config.stage,
            step=lambda: self.optimizer.local_step, serving=self._serving_batches,
            max_chunk_elements=run.sync.state_chunk_elements,
        )
        self.weights_server = WeightsServer(self.optimizer, run_id=run.run_id, stage=config.stage,
                                            serving=self._serving_batches)
        self.donor = StateDonor(
            self.optimizer, self.layout, run_id=run.run_id, stage=config.stage, serving=self._serving_batches,
            chunk_bytes=run.sync.state_chunk_bytes, upload_mbps=run.sync.donor_upload_mbps,
            max_concurrent_chunks=run.sync.donor_max_concurrent_chunks,
            snapshot_ttl_s=run.sync.donor_snapshot_ttl_s,
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
                self.run_store, stage=config.stage, writer=self.swarm.peer_id, optimizer=self.optimizer,
                layout=self.layout, every_steps=run.checkpoints.every_steps, keep=run.checkpoints.keep,
                may_write=lambda: self.phase == Phase.ACTIVE)
            self.runtime.after_step.append(self.checkpoint_writer.after_step)
        self.join = StageJoin(
            run=run, stage=config.stage, state_source=config.state_source, swarm=self.swarm, p2p=self.p2p,
            authenticator=authenticator, optimizer=self.optimizer, layout=self.layout, sync=self.sync,
            checkpoints=self.checkpoints, run_store=self.run_store, stepped=self.runtime.stepped,
            served=lambda: (self.runtime.counters["forward_requests"], self.runtime.counters["backward_requests"]),
            on_transition=self._log_transition)

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
            chain=True, model_digest=self.run_config.model_digest,
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
        counters.update(step_counters(self.ledger, self.runtime.staleness))
        counters.update(self.averaging.counters)
        counters.update(self.state_server.counters)
        counters.update(self.donor.counters)
        counters.update(self.weights_server.counters)
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
            "hop_records": dict(self.chain.records.counters),
            "mean_batch_size": round(stats.mean_batch_size, 3),
            "joined": self.join.joined,
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
        await self.join.join()
        self.averaging.begin()
        await self.replicas.start(self.server)
        if self.sloco is not None:
            await self.sloco.start(self.server)
        self.runtime.start()
        await self.server.add_handler(version.FORWARD, self.handlers.forward, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.BACKWARD, self.handlers.backward, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.EVALUATE, self.handlers.evaluate, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.WEIGHTS, self.weights_server.handle, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.ABANDON, self.handlers.abandon, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.RETRACT, self.handlers.retract, roles=frozenset({"trainer"}))
        # A chained sample comes from a trainer (at the head) or from the previous stage's worker.
        await self.server.add_handler(version.CHAIN, self.chain.chain, roles=frozenset({"trainer", "worker"}))
        # What this worker kept of a chained sample goes to the sample's trainer only (hop_records.py).
        await self.server.add_handler(version.HOP_RECORD, self._hop_record, roles=frozenset({"trainer"}))
        await self.server.add_handler(version.INFO, self.handlers.info)
        self.state = WorkerState.ONLINE
        await self.announcer.announce_now()

    async def _hop_record(self, peer_id, body: dict):
        return await self.handlers._counted("hop_record", self.chain.records.handle(
            peer_id, body, stage=self.config.stage, run_id=self.run_config.run_id))

    def _resync(self, reason: str) -> None:
        """The averaging found this replica to be its stage's outlier: back to weight sync, hidden
        from trainers and averaging with weight 0, until a full pass replaced its weights."""
        counters = self.runtime.counters
        transition = self.sync.resync(self.optimizer.local_step, counters["forward_requests"],
                                      counters["backward_requests"], reason)
        if transition is not None:
            logger.warning("stage %d: %s; rejoining through weight sync", self.config.stage, reason)
            self._log_transition(transition)

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
            *([asyncio.create_task(self.sloco.announcer.run(stop), name="announce-sparseloco")]
              if self.sloco is not None else []),
            asyncio.create_task(every(None, self._update_phase, stop, name="sync phases",
                                      wake=self.runtime.stepped.listen()), name="sync-phases"),
            asyncio.create_task(every(rules.check_period_s, self._watch, stop, name="self-termination rules"),
                                name="self-termination"),
        ]
        # Always: an active replica can go back to weight sync (a resync after it diverged).
        period = min(self.config.announce_period_s, self.run_config.sync.alone_exit_s / 3)
        self._tasks.append(asyncio.create_task(every(period, self.join.check_alone, stop, name="alone in sync"),
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
        if self.sloco is not None:
            await self.sloco.announcer.withdraw()
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
