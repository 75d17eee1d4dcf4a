"""The worker role: one replica of one pipeline stage, serving forward and backward requests,
stepping with its stage, and announcing itself in the DHT [report 3.3.1, DESIGN §7]."""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from typing import Optional

import torch
from hivemind.p2p import P2P

from protocol import version
from protocol.dht import SwarmDHT
from protocol.dht_schema import Phase, WorkerRecord, workers_key
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import InfoReply
from protocol.transport import RpcServer
from roles.announcer import Announcer
from roles.model.config import RunConfig
from roles.model.stage import StageModel
from roles.worker.config import WorkerConfig
from roles.worker.handlers import WorkerHandlers
from roles.worker.optimizer import StageOptimizer, StepReport
from roles.worker.progress import StageProgress
from roles.worker.queues import TaskQueues
from roles.worker.runtime import StageRuntime

logger = logging.getLogger(__name__)


class WorkerState(enum.Enum):
    STARTING = "starting"
    ONLINE = "online"
    STOPPING = "stopping"
    STOPPED = "stopped"


class WorkerRole:
    def __init__(self, config: WorkerConfig, run: RunConfig, swarm: SwarmDHT, p2p: P2P, maddrs: list[str]):
        self.config = config
        self.run_config = run
        self.swarm = swarm
        self.p2p = p2p
        self.maddrs = maddrs
        self.state = WorkerState.STARTING
        self.phase = Phase.ACTIVE
        self.device = torch.device(config.device)
        self.model = StageModel(run, config.stage, device=self.device)
        self.optimizer = StageOptimizer(
            self.model.trainable_parameters(),
            lr=run.optimizer.lr, betas=run.optimizer.betas, eps=run.optimizer.eps,
            weight_decay=run.optimizer.weight_decay, warmup_steps=run.optimizer.warmup_steps,
            total_steps=run.optimizer.total_steps, min_lr_ratio=run.optimizer.min_lr_ratio,
            clip_threshold=run.clip_threshold(config.stage), device=self.device,
        )
        autocast = None
        if self.device.type == "cuda" and run.dtype != "float32":
            autocast = getattr(torch, run.dtype)
        self.runtime = StageRuntime(
            self.model, self.optimizer, TaskQueues(config.max_batch, config.max_pending),
            stage=config.stage, vocab_size=run.model.vocab_size, max_seq_len=run.model.max_seq_len,
            device=self.device, autocast_dtype=autocast, counts_towards_target=self._counts_towards_target,
            on_backward=lambda: self.progress.notify_samples(),
        )
        self.server = RpcServer(p2p)
        self.handlers = WorkerHandlers(self.runtime, self.info, lambda: self.state == WorkerState.ONLINE)
        self.announcer = Announcer(
            swarm, workers_key(run.run_id, config.stage), self._record, period_s=config.announce_period_s
        )
        self.progress = StageProgress(
            swarm, run.run_id, config.stage, run.target_batch_size, self.optimizer,
            period_s=config.progress_period_s, counts_towards_target=self._counts_towards_target,
            on_step=self._on_step,
        )
        self.last_step: Optional[StepReport] = None
        self._tasks: list[asyncio.Task] = []

    def _counts_towards_target(self) -> bool:
        return self.phase == Phase.ACTIVE

    def _record(self) -> WorkerRecord:
        return WorkerRecord(
            stage=self.config.stage, phase=self.phase if self.state != WorkerState.STOPPING else Phase.LEAVING,
            max_batch=self.config.max_batch, throughput=float(self.runtime.throughput),
            maddrs=self.maddrs, client_version=version.client_version(),
        )

    def _on_step(self, report: StepReport) -> None:
        self.last_step = report
        logger.info("stage %d step %d: lr %.2e, grad norm %.3f%s, %d local samples",
                    self.config.stage, report.step, report.lr, report.grad_norm,
                    " (clipped)" if report.clipped else "", report.samples)

    def info(self) -> InfoReply:
        pending = self.runtime.queues.pending()
        counters = dict(self.runtime.counters)
        counters.update({f"rejected_{k}": v for k, v in self.server.rejected.items()})
        counters["compute_ms"] = int(self.runtime.compute_s * 1000)
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
            "counters": dict(self.runtime.counters),
            "rejected": dict(self.server.rejected),
            "compute_s": round(self.runtime.compute_s, 3),
            "mean_batch_size": round(stats.mean_batch_size, 3),
        }

    async def start(self) -> None:
        self.runtime.start()
        await self.server.add_handler(version.FORWARD, self.handlers.forward)
        await self.server.add_handler(version.BACKWARD, self.handlers.backward)
        await self.server.add_handler(version.INFO, self.handlers.info)
        self.state = WorkerState.ONLINE
        await self.announcer.announce_now()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set or the compute thread dies."""
        self._tasks = [
            asyncio.create_task(self.announcer.run(stop), name="announce"),
            asyncio.create_task(self.progress.run(stop), name="progress"),
        ]
        while not stop.is_set():
            if self.runtime.failure is not None:
                raise RuntimeError(f"compute thread failed: {self.runtime.failure}") from self.runtime.failure
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def shutdown(self) -> None:
        """Leave cleanly: withdraw from the DHT first so trainers stop routing here, hand back
        queued requests with a typed error (the trainer retries them elsewhere), finish the batch
        in progress, and stop serving. Idempotent."""
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
        await self.server.shutdown()
        self.state = WorkerState.STOPPED
        logger.info("worker left stage %d in %.1fs; %d queued requests handed back",
                    self.config.stage, time.monotonic() - started, len(leftover))
