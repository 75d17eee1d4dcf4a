"""A training sample routed worker to worker (run config `routing.path: workers`).

The trainer picks the sample's route as it would pick its calls: per stage, the balancer's choice
first, then up to `routing.candidates - 1` other usable workers of the stage in the order the
balancer would take them; a body stage with no usable worker is left out of the route when the
run skips stages (roles/trainer/skipping.py). It hands the sample to the head with that route and
waits for the outcome (roles/worker/serving/chain.py). The reply names who ran each stage, how long the
sample spent there and which candidates failed: the balancers learn from those as from their own
calls, and ban the failed ones. A head that cannot be reached or is busy is replaced by the
route's next head candidate; anything later is the workers' to retry.

What stays as on the trainer-driven path: exact batches and step tags (the tail tags, each stage
accumulates the tagged sample into that step), backwards on the forward's worker, a dropped sample
named with its reason (SampleDropped), the stages it skipped reported. What differs: a backward
whose forward's worker died is not moved to another replica (the chain through that worker is
broken, so the sample is dropped as `worker_failures` and its step closes without it); and the
trainer sees one call per sample, so `forward_retries` counts the candidates that failed
anywhere in the chain.

Workers older than this routing announce no `chain` in their records. They are kept off every
route (each named once in the log), and while a stage has no other worker, the trainer sends the
sample the trainer-driven way instead (`routing_fallbacks` in its summary): a run whose operators
upgrade one by one keeps training.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch
from hivemind.p2p import PeerID

from protocol import version
from protocol.errors import NoWorkersError, PeerTimeout, PeerUnavailable, ProtocolError, RemoteError
from protocol.messages import ChainHop, ChainReply, ChainRequest, HopRecordReply, HopRecordRequest
from protocol.run_config import RoutingConfig
from roles.trainer.chain_checks import ChainChecks
from roles.trainer.pipeline import _RETRYABLE_CODES, PipelineDriver, SampleDropped, SampleResult, _run_before

logger = logging.getLogger(__name__)

CALL_GRACE_S = 5.0
"""The trainer waits this much longer for the head than the route's budget: the workers end a
sample whose time ran out themselves and say so, which is better than a bare timeout here."""


class ChainedRouting:
    """`train_sample` for `routing.path: workers`, on the driver's balancers, skipping and client."""

    def __init__(self, driver: PipelineDriver, config: RoutingConfig,
                 describe_worker: Optional[Callable[[int, str], Optional[str]]] = None, *, run_id: str = ""):
        self.driver = driver
        self.config = config
        self.checks = ChainChecks(driver.spot_checks, self._hop_record, run_id=run_id, num_stages=driver.num_stages)
        """Spot checks of the chained samples' hops, with what the workers kept (roles/trainer/chain_checks.py)."""
        self.describe_worker = describe_worker or (lambda stage, peer: None)
        """(stage, peer) -> None for a worker that serves chains, else its version for the log."""
        self.fallbacks = 0
        """Samples sent the trainer-driven way: a stage had only workers that cannot chain."""
        self._named: set[str] = set()

    def _legacy(self, stage: int, peers: list[str]) -> list[str]:
        """The workers among `peers` that do not serve chains, each named in the log once."""
        legacy = []
        for peer in peers:
            described = self.describe_worker(stage, peer)
            if described is None:
                continue
            legacy.append(peer)
            if peer not in self._named:
                self._named.add(peer)
                logger.warning("worker %s of stage %d runs %s, which cannot pass samples worker to worker "
                               "(routing.path: workers): it gets samples only when its stage has no other worker, "
                               "through this trainer; upgrade it", peer[-8:], stage, described)
        return legacy

    def _route(self) -> Optional[tuple[list[ChainHop], list[int]]]:
        """Per stage the workers to try, least loaded first (the first is charged as a dispatch);
        and the body stages left out because they have no usable worker. None when a stage has
        workers but none that serves chains: the sample must go the trainer-driven way."""
        driver = self.driver
        hops: list[ChainHop] = []
        skipped: list[int] = []
        for stage, balancer in enumerate(driver.balancers):
            known = balancer.known()
            legacy = self._legacy(stage, known)
            if known and len(legacy) == len(known):
                for hop in hops:
                    driver.balancers[hop.stage].release(hop.workers[0], 1.0)
                return None
            try:
                first = balancer.choose(1.0, exclude=legacy)
            except NoWorkersError as exc:
                if driver.skipping.may_skip(stage, _run_before(skipped, stage)):
                    driver.skipping.skipped(stage, "forward", str(exc))
                    skipped.append(stage)
                    continue
                for hop in hops:
                    driver.balancers[hop.stage].release(hop.workers[0], 1.0)
                if driver.on_no_workers is not None and not driver.skipping.active(stage):
                    driver.on_no_workers()
                raise SampleDropped("no_workers", str(exc)) from exc
            others = [peer for peer in balancer.usable() if peer != first and peer not in legacy]
            others = others[: self.config.candidates - 1]
            skippable = driver.skipping.may_skip(stage, _run_before(skipped, stage))
            hops.append(ChainHop(stage=stage, workers=[first, *others], skippable=skippable))
        return hops, skipped

    async def train_sample(self, sample_id: str, tokens: torch.Tensor) -> SampleResult:
        driver = self.driver
        started = time.perf_counter()
        routed = self._route()
        if routed is None:
            self.fallbacks += 1
            return await driver.train_sample(sample_id, tokens)
        hops, skipped = routed
        sample_id = f"{driver.id_prefix}{sample_id}"
        budget_s = driver.timeout_s * driver.num_stages
        request = ChainRequest(stage=0, sample_id=sample_id, tokens=tokens, route=hops[1:], budget_s=budget_s)
        head = hops[0]
        reply: ChainReply | None = None
        last = "no attempt made"
        failed_heads: list[str] = []
        for peer in head.workers:
            try:
                await driver.connect(peer)
                reply = await driver.client.request(PeerID.from_base58(peer), version.CHAIN, request, ChainReply,
                                                    timeout_s=budget_s + CALL_GRACE_S)
                break
            except RemoteError as exc:
                if exc.code not in _RETRYABLE_CODES:
                    self._settle(hops, failed_heads + [peer])
                    raise SampleDropped("rejected", f"stage 0 worker {peer[-8:]}: {exc}") from exc
                last = f"{peer[-8:]}: {exc}"
            except PeerUnavailable as exc:
                last = f"{peer[-8:]}: {exc}"
            except PeerTimeout as exc:
                self._settle(hops, failed_heads + [peer])
                raise SampleDropped("worker_failures", f"stage 0 worker {peer[-8:]} timed out: {exc}") from exc
            except ProtocolError as exc:
                self._settle(hops, failed_heads)
                raise SampleDropped("bad_reply", f"stage 0 worker {peer[-8:]}: {exc}") from exc
            failed_heads.append(peer)
            driver.stats.forward_retries += 1
            driver.retries.count("chain_head", f"head worker {peer[-8:]}: {last}")
        if reply is None:
            self._settle(hops, failed_heads)
            raise SampleDropped("worker_failures", f"stage 0: none of {len(head.workers)} head worker(s) took it; "
                                f"last: {last}")
        route = self._settle(hops, failed_heads, reply)
        if reply.dropped is not None:
            raise SampleDropped(reply.dropped, reply.detail or "dropped by a worker of the chain")
        ran = [stage for stage in range(driver.num_stages) if route[stage]]
        passed = [done.stage for done in reply.stages if done.skipped and driver.skipping.is_body(done.stage)]
        expected = [hop.stage for hop in hops if hop.stage not in passed]
        if reply.loss is None or reply.step is None or ran != expected:
            raise SampleDropped("bad_reply", f"the chain's reply does not cover the route (stages {ran} of "
                                f"{expected}, loss {reply.loss}, step {reply.step})")
        versions: list[int | None] = [None] * driver.num_stages
        for done in reply.stages:
            if done.stage in passed:
                driver.skipping.skipped(done.stage, "forward", f"none of its workers could be reached "
                                        f"({len(done.failed)} tried by the stage before it)")
                continue
            versions[done.stage] = done.version
            driver.stats.served[(done.stage, done.worker)] += 1
            if driver.skipping.is_body(done.stage):
                driver.skipping.served(done.stage)
        skipped = sorted(skipped + passed)
        driver.skipping.sample_done(skipped)
        self.checks.on_sample(sample_id, tokens, reply)
        return SampleResult(loss=reply.loss, route=route, elapsed_s=time.perf_counter() - started, step=reply.step,
                            versions=versions, skipped=skipped, abandon_to=driver.abandon_targets(skipped))

    async def _hop_record(self, stage: int, peer: str, request: HopRecordRequest) -> HopRecordReply:
        """What a worker kept of one of this trainer's chained samples (no balancer charge: it is
        no sample's work)."""
        await self.driver.connect(peer)
        return await self.driver.client.request(PeerID.from_base58(peer), version.HOP_RECORD, request, HopRecordReply,
                                                timeout_s=self.driver.timeout_s)

    def _settle(self, hops: list[ChainHop], failed_heads: list[str], reply: ChainReply | None = None) -> list[str]:
        """Tell the balancers what the chain saw: each stage's worker and its time, the candidates
        that failed (banned or backed off), and the up-front charge of a first choice that did not
        run the sample refunded. Returns who ran each stage ("" for none)."""
        driver = self.driver
        route = [""] * driver.num_stages
        failed: dict[int, list[str]] = {0: list(failed_heads)}
        if reply is not None:
            for done in reply.stages:
                if not 0 <= done.stage < driver.num_stages:
                    continue
                failed.setdefault(done.stage, []).extend(done.failed)
                if done.worker:
                    route[done.stage] = done.worker
                    driver.balancers[done.stage].report_success(done.worker, 1.0, max(done.elapsed_s, 1e-6))
        for hop in hops:
            balancer = driver.balancers[hop.stage]
            for peer in dict.fromkeys(failed.get(hop.stage, [])):
                if peer in hop.workers:
                    balancer.report_failure(peer)
                    driver.retries.count("chain_next", f"stage {hop.stage} worker {peer[-8:]} did not take a sample")
            if route[hop.stage] != hop.workers[0]:
                balancer.release(hop.workers[0], 1.0)
        driver.stats.forward_retries += sum(len(peers) for stage, peers in failed.items() if stage > 0)
        return route

