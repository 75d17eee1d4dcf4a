"""The trainer role: a CPU process that holds a data shard and no weights, and drives samples
through the swarm on several independent lanes [report 3.3.2, 3.4.4]."""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import math
import os
import time
from typing import IO, Awaitable, Callable, Iterator, Optional

from hivemind.p2p import P2P, PeerID

from protocol.auth import PeerAuthenticator
from protocol.dht import SwarmDHT
from protocol.dht_schema import TrainerRecord, trainers_key
from protocol.evidence import Evidence
from protocol.messages import sample_owner_prefix
from protocol.transport import RpcClient, dial
from roles.announcer import Announcer
from roles.event_log import EventAggregator
from roles.model.traffic_plan import gradient_exchange_on
from protocol.run_config import RunConfig
from roles.periodic import every, wait_any
from roles.trainer.accounting import SampleAccounting
from roles.trainer.balancer import StageBalancer
from roles.trainer.chained import ChainedRouting
from roles.trainer.config import TrainerConfig
from roles.trainer.data import Sample, make_sample_stream, trainer_data
from roles.trainer.discovery import WorkerDiscovery
from roles.trainer.evaluation import HeldOutEvaluator, HeldOutUnavailable, heldout_loader
from roles.trainer.pipeline import PipelineDriver, SampleDropped
from roles.trainer.skipping import StageSkipping

logger = logging.getLogger(__name__)

FINAL_RECORD_TTL_S = 60.0
"""How long a departed trainer's final record stays readable (as long as a tombstone would)."""


def in_flight_cap(lanes: int, ratio: Optional[float], target_batch_size: int, live_trainers: int) -> int:
    """Samples one trainer may have in flight: its lanes, and its share of the run's cap on samples
    in flight against the stage batch, which bounds how stale a sample's weights can get between
    its forward and backward. Never below one, so every trainer makes progress."""
    if ratio is None:
        return lanes
    share = math.floor(ratio * target_batch_size / max(1, live_trainers))
    return max(1, min(lanes, share))


class TrainerState(enum.Enum):
    WAITING = "waiting"  # not every stage has a worker yet
    TRAINING = "training"
    DRAINING = "draining"
    STOPPED = "stopped"


class TrainerRole:
    def __init__(self, config: TrainerConfig, run: RunConfig, swarm: SwarmDHT, p2p: P2P,
                 authenticator: Optional[PeerAuthenticator] = None,
                 report_evidence: Optional[Callable[[Evidence], Awaitable[str]]] = None):
        """`report_evidence` sends a spot check's signed evidence to the run's authorizer and
        returns its verdict (node/daemon.py); None in an open run."""
        self.config = config
        self.run_config = run
        self.swarm = swarm
        self.p2p = p2p
        self.state = TrainerState.WAITING
        self.balancers = [StageBalancer(s, ban_s=config.ban_s) for s in range(run.num_stages)]
        self.discovery = WorkerDiscovery(swarm, run.run_id, self.balancers, period_s=config.discovery_period_s,
                                         model_digest=run.model_digest)
        self.client = RpcClient(p2p, timeout_s=config.request_timeout_s, authenticator=authenticator)
        self.skipping = StageSkipping(run.num_stages, run.skipping)
        """Body stages routed around while they have no reachable worker (run config `skipping:`)."""
        self.driver = PipelineDriver(
            self.client, self.balancers, connect=self._connect, id_prefix=sample_owner_prefix(swarm.peer_id),
            max_attempts=config.max_attempts, timeout_s=config.request_timeout_s,
            on_no_workers=self.discovery.request_refresh, skipping=self.skipping, reconnect=self._reconnect,
            verification=run.verification, exclude=self.discovery.exclude,
            equal_replicas=lambda stage: gradient_exchange_on(run, stage), run_id=run.run_id,
            report_evidence=report_evidence, run=run,
        )
        self.chained = (ChainedRouting(self.driver, run.routing, describe_worker=self._worker_without_chain,
                                       run_id=run.run_id)
                        if run.routing.path == "workers" else None)
        """Worker-to-worker routing (run config `routing.path: workers`); None: the trainer calls each stage."""
        self.stream = make_sample_stream(
            trainer_data(config.data, run), config.tokenizer, run.seq_len, config.shard_index, config.num_shards,
            run.seed, epochs=None, data_dir=config.data_dir,
        )
        self.samples: Iterator[Sample] = iter(self.stream)
        self.accounting = SampleAccounting()
        self.drops = EventAggregator(logger, "dropped", "sample", interval_s=config.progress_log_period_s)
        """Dropped samples, one line per reason per interval: a lost stage drops every sample."""
        self.announcer = Announcer(swarm, trainers_key(run.run_id), self._record, period_s=config.announce_period_s)
        self.evaluator: Optional[HeldOutEvaluator] = self._make_evaluator()
        self._connected: set[str] = set()
        self.live_trainers = 1
        self._slot_freed = asyncio.Event()
        # AGORA_SAMPLE_LOG names a file that gets one JSON line per completed sample (its id, the
        # step it belonged to, its loss, each stage's gradient weight version, the stages it
        # skipped), and one per retraction a worker applied (the sample id, `retracted_at`: the
        # stage): what scripts/bench_fidelity.py and bench_trust.py replay in one process.
        log_path = os.environ.get("AGORA_SAMPLE_LOG")
        self.sample_log: Optional[IO[str]] = open(log_path, "a", encoding="utf-8") if log_path else None
        if self.sample_log is not None:
            self.driver.retractions.on_applied = self._log_retraction
        self.started_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self._tasks: list[asyncio.Task] = []

    def _log_retraction(self, sample_id: str, stage: int) -> None:
        if self.sample_log is not None and not self.sample_log.closed:
            self.sample_log.write(json.dumps({"sample_id": sample_id, "retracted_at": stage}) + "\n")
            self.sample_log.flush()

    def _make_evaluator(self) -> Optional[HeldOutEvaluator]:
        """Trainer 0 (data shard 0 of n) evaluates on the held-out samples, if the data has any
        (roles/trainer/evaluation.py); the others, and every trainer of a run with
        `evaluation.every_steps: 0`, do not."""
        evaluation = self.run_config.evaluation
        if evaluation.every_steps == 0:
            logger.info("held-out evaluation is off (evaluation.every_steps is 0)")
            return None
        if self.config.shard_index != 0:
            return None
        try:
            load, described = heldout_loader(
                trainer_data(self.config.data, self.run_config), tokenizer_path=self.config.tokenizer,
                seq_len=self.run_config.seq_len, seed=self.run_config.seed, count=evaluation.samples,
                data_dir=self.config.data_dir, corpus=getattr(self.stream, "corpus", None))
        except HeldOutUnavailable as exc:
            logger.info("held-out evaluation is off: %s", exc)
            return None
        logger.info("held-out evaluation: this trainer (data shard 0) evaluates every %d steps on %d samples of %s",
                    evaluation.every_steps, evaluation.samples, described)
        return HeldOutEvaluator(evaluation, self.driver, load, on_result=lambda _: self.announcer.poke())

    def _record(self, final: bool = False) -> TrainerRecord:
        a = self.accounting
        latest = self.evaluator.latest if self.evaluator is not None else None
        held_out = ({"eval_loss": latest.loss, "eval_step": latest.step, "eval_stderr": latest.stderr}
                    if latest is not None else {})
        return TrainerRecord(
            samples_completed=a.completed, samples_dropped=a.dropped, tokens=a.tokens, last_loss=a.last_loss,
            first_loss=a.first_loss, recent_loss=a.recent_loss, time=time.time(), final=final,
            **held_out, **self._data_fields(),
        )

    def _data_fields(self) -> dict:
        describe = getattr(self.stream, "describe", None)
        if describe is None:
            return {}
        data = describe()
        return {"data_manifest": data["manifest_sha256"], "data_position": data["position"]}

    def _ended(self, sample: Sample) -> None:
        """The sample completed or was dropped and counted: a restart does not read it again."""
        ended = getattr(self.stream, "ended", None)
        if ended is not None:
            ended(sample.ordinal)

    async def _leave_record(self) -> None:
        """Replace our record with a final one instead of a tombstone: readers drop us at once, and
        the health monitor still counts the samples completed since our last announcement."""
        try:
            if not await self.swarm.store(self.announcer.key, self._record(final=True), FINAL_RECORD_TTL_S):
                logger.warning("the final progress record was not accepted by any DHT peer")
        except Exception:  # noqa: BLE001 - leaving goes on; the record lapses on its own
            logger.warning("could not store the final progress record", exc_info=True)

    def _worker_without_chain(self, stage: int, peer: str) -> Optional[str]:
        """None if the worker's record says it serves chains (or it has none yet), else what it runs."""
        record = self.discovery.records[stage].get(peer)
        if record is None or record.chain:
            return None
        return f"agora-node {record.client_version}" if record.client_version else "an older agora-node"

    async def _connect(self, peer: str) -> None:
        """Dial a worker's announced addresses once, so the first call does not depend on the
        DHT having introduced us already."""
        if peer in self._connected:
            return
        try:
            await dial(self.p2p, PeerID.from_base58(peer), self.discovery.maddrs.get(peer, []))
        except Exception as exc:  # the call itself will report the peer as unavailable
            logger.debug("dialing %s failed: %s", peer[-8:], exc)
            return
        self._connected.add(peer)

    async def _reconnect(self, peer: str) -> None:
        """Dial a worker at its announced addresses again (PeerUnavailable when none answers)."""
        await dial(self.p2p, PeerID.from_base58(peer), self.discovery.maddrs.get(peer, []))

    async def wait_for_workers(self, stop: asyncio.Event) -> bool:
        """Block until every stage has a routable worker; report what is missing meanwhile."""
        last_log = 0.0
        while not stop.is_set():
            await self.discovery.refresh()
            counts = self.discovery.workers_per_stage()
            if all(counts):
                logger.info("every stage has a worker (%s); training starts", counts)
                return True
            if time.monotonic() - last_log > self.config.wait_log_period_s:
                missing = [s for s, c in enumerate(counts) if c == 0]
                other = (f"; {len(self.discovery.other_model)} worker(s) seen train another model and are not counted"
                         if self.discovery.other_model else "")
                logger.info("waiting for workers: stage(s) %s have none yet (workers per stage: %s%s)",
                            missing, counts, other)
                last_log = time.monotonic()
            await wait_any(stop, timeout=1.0)
        return False

    def in_flight_cap(self) -> int:
        return in_flight_cap(self.config.lanes, self.run_config.staleness.max_in_flight_ratio,
                             self.run_config.target_batch_size, self.live_trainers)

    def _take_sample(self) -> Optional[Sample]:
        limit = self.config.max_samples
        if limit is not None and self.accounting.started >= limit:
            return None
        sample = next(self.samples)
        self.accounting.start()
        return sample

    async def _wait_for_slot(self, stop: asyncio.Event) -> bool:
        while self.accounting.in_flight >= self.in_flight_cap():
            self._slot_freed.clear()
            await wait_any(stop, self._slot_freed, timeout=1.0)
            if stop.is_set():
                return False
        return True

    async def _lane(self, lane: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if not await self._wait_for_slot(stop):
                return
            sample = self._take_sample()
            if sample is None:
                return
            try:
                if self.chained is not None:
                    result = await self.chained.train_sample(sample.sample_id, sample.tokens)
                else:
                    result = await self.driver.train_sample(sample.sample_id, sample.tokens)
            except SampleDropped as exc:
                self.accounting.drop(exc.reason)
                self._ended(sample)
                self._slot_freed.set()
                self.drops.count(exc.reason, exc.detail, subject=sample.sample_id)
                if exc.unreached:
                    await self.driver.abandon(sample.sample_id, exc)
                if exc.reason == "no_workers":
                    await wait_any(stop, timeout=1.0)
                continue
            except asyncio.CancelledError:
                self.accounting.drop("shutdown")
                raise
            except Exception as exc:  # a bug must cost one sample, counted, not the lane
                self.accounting.drop("error")
                self._ended(sample)
                self._slot_freed.set()
                logger.exception("lane %d: sample %s failed unexpectedly: %s", lane, sample.sample_id, exc)
                continue
            self.accounting.complete(result.loss, int(sample.tokens.numel()), result.step)
            self._ended(sample)
            self._slot_freed.set()
            if self.evaluator is not None:
                self.evaluator.saw_step(result.step)
            if self.sample_log is not None:
                self.sample_log.write(json.dumps({"sample_id": sample.sample_id, "step": result.step,
                                                  "loss": result.loss, "versions": result.versions,
                                                  "skipped": result.skipped}) + "\n")
                self.sample_log.flush()
            if result.abandon_to:
                await self.driver.abandon_skipped(sample.sample_id, result)

    async def _count_trainers(self, stop: asyncio.Event) -> None:
        """Keep `live_trainers` current: the in-flight cap is shared among the run's trainers."""
        async def count() -> None:
            try:
                records = await self.swarm.get(trainers_key(self.run_config.run_id), TrainerRecord)
                live = {peer for peer, record in records.items() if not record.final}
                self.live_trainers = max(1, len(live) + (self.swarm.peer_id not in live))
            except Exception:  # noqa: BLE001 - keep the last count; the next refresh may work
                logger.debug("could not count trainers", exc_info=True)

        await every(self.config.discovery_period_s, count, stop, name="counting trainers")

    async def _report_progress(self, stop: asyncio.Event) -> None:
        """Log a progress line now and then, so an operator sees the trainer is doing its job."""
        last_tokens, last_time = 0, time.monotonic()

        def report() -> None:
            nonlocal last_tokens, last_time
            self._flush_events()
            a, now = self.accounting, time.monotonic()
            rate = (a.tokens - last_tokens) / max(now - last_time, 1e-9)
            last_tokens, last_time = a.tokens, now
            loss = f"{a.recent_loss:.3f}" if a.recent_loss is not None else "-"
            logger.info("%d samples completed, %d dropped, %d in flight; loss %s; %.0f tokens/s; workers per stage %s",
                        a.completed, a.dropped, a.in_flight, loss, rate, self.discovery.workers_per_stage())

        await every(self.config.progress_log_period_s, report, stop, name="progress log", delay_first=True)

    async def run(self, stop: asyncio.Event) -> None:
        """Train until `stop` is set or `max_samples` samples have ended."""
        self._tasks = [
            asyncio.create_task(self.discovery.run(stop), name="discovery"),
            asyncio.create_task(self.announcer.run(stop), name="announce"),
            asyncio.create_task(self._report_progress(stop), name="progress-log"),
        ]
        if self.run_config.staleness.max_in_flight_ratio is not None:
            self._tasks.append(asyncio.create_task(self._count_trainers(stop), name="count-trainers"))
        if not await self.wait_for_workers(stop):
            return
        self.state = TrainerState.TRAINING
        self.started_at = time.monotonic()
        self.accounting.token_rate.restart()
        lane_stop = asyncio.Event()
        lanes = [asyncio.create_task(self._lane(i, lane_stop), name=f"lane{i}") for i in range(self.config.lanes)]
        stop_waiter = asyncio.create_task(stop.wait())
        await asyncio.wait([stop_waiter, asyncio.gather(*lanes, return_exceptions=True)],
                           return_when=asyncio.FIRST_COMPLETED)
        stop_waiter.cancel()
        if stop.is_set():
            self.state = TrainerState.DRAINING
            if self.evaluator is not None:
                await self.evaluator.close()
            lane_stop.set()  # lanes finish the sample they hold, then exit
            done, pending = await asyncio.wait(lanes, timeout=self.config.drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self.finished_at = time.monotonic()
        if self.state != TrainerState.DRAINING and self.evaluator is not None:
            # --max-samples reached: a last held-out loss at the final weights
            await self.evaluator.conclude(stop, self.config.drain_timeout_s)
        self._flush_events()
        await self.announcer.announce_now()

    def _flush_events(self) -> None:
        self.drops.flush()
        self.driver.retries.flush()

    def summary(self) -> dict:
        wall = (self.finished_at or time.monotonic()) - (self.started_at or time.monotonic())
        served: dict[str, dict[str, int]] = {}
        for (stage, peer), count in self.driver.stats.served.items():
            served.setdefault(str(stage), {})[peer] = count
        return {
            **self.accounting.summary(),
            "wall_s": round(wall, 3),
            "tokens_per_s": round(self.accounting.tokens / wall, 2) if wall > 0 else 0.0,
            "routing": self.run_config.routing.path,
            **({"routing_fallbacks": self.chained.fallbacks} if self.chained is not None else {}),
            **({"workers_other_model": len(self.discovery.other_model)} if self.discovery.other_model else {}),
            **({"discovery_empty_reads": self.discovery.empty_reads} if self.discovery.empty_reads else {}),
            "forward_retries": self.driver.stats.forward_retries,
            "reconnected": self.driver.stats.reconnected,
            "backward_fallbacks": self.driver.stats.backward_fallbacks,
            "spot_checks": {**self.driver.spot_checks.summary(), "retraction": self.driver.retractions.summary(),
                            **({"chain": self.chained.checks.summary()} if self.chained is not None else {})},
            "served": served,
            "eval": self.evaluator.summary() if self.evaluator is not None else [],
            **self.skipping.summary(),
            **({"data": self.stream.describe()} if hasattr(self.stream, "describe") else {}),
        }

    async def shutdown(self) -> None:
        if self.state == TrainerState.STOPPED:
            return
        self.state = TrainerState.STOPPED
        self._flush_events()
        if self.evaluator is not None:
            await self.evaluator.close()
        if self.chained is not None:
            await self.chained.checks.close()
        await self.driver.spot_checks.close()
        await self.driver.retractions.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._leave_record()
        await self.client.close()
        if self.sample_log is not None:
            self.sample_log.close()
        close = getattr(self.stream, "close", None)
        if close is not None:
            close()
