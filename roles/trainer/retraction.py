"""What a worker this trainer excluded added to the open step is taken back out of it.

A worker the spot checks exclude (roles/trainer/spot_checks.py) has served samples whose steps are
still open: every stage the samples went through holds their gradients in its accumulators, and
would apply them when the step closes. The trainer keeps, for its recent samples, what each stage
needs to recompute a sample's parameter gradient (`KeptSample`: per stage, the input it sent and
the output gradient it sent back, and the worker that accumulated it). When it excludes worker X
of stage k, each kept sample X served is retracted (`agora/v1/retract`, roles/worker/serving/
retractions.py): at every other stage from the worker that accumulated it, and at stage k from
a usable replica other than X, on X's behalf (`accumulated_by`): that replica brings the sample's
negated gradient to the stage's gradient exchange (roles/worker/steps/gradient_exchange.py),
whose sum takes it only if X's gradients are in the sum; if X was gone before the exchange, its
samples went with it. A sample still in flight when X is excluded is retracted as soon as it
completes. Retractions are fire-and-forget, a few at a time, and counted (`summary`, the trainer
summary's `spot_checks.retraction`).

Kept are only samples whose step may still be open: those of the latest three step tags this
trainer has seen (KEPT_STEPS), within KEPT_BYTES_MAX (the oldest go first; both are counted). A
stage that closed the step answers `too_late`: what it applied cannot be undone (docs/operations.md,
"Untrusted workers"). Where replicas do not exchange gradients (they average weights instead), the
replica asked at stage k answers `unsummed`: X's own sum goes into X's weights, and from there
into the averaging only while X is still a member of it. Samples dropped halfway through their
backward are not kept, nor are the samples of the workers path (`routing.path: workers`), where
the trainer never holds the tensors.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import torch

from protocol.errors import ErrorCode, RemoteError
from protocol.messages import RetractReply, RetractRequest

logger = logging.getLogger(__name__)

KEPT_BYTES_MAX = 64 * 2**20
"""What the kept samples' tensors may take at most; beyond it the oldest are forgotten."""
KEPT_STEPS = 3
"""Samples of the latest this many step tags are kept: the steps a stage may still hold open. The
tail tags only its open step and the next, so it holds the latest tag's step and the one before;
a stage upstream may still wait for the last backwards of the step before those."""
RETRACTIONS_AT_ONCE = 4
"""Retraction requests in flight at once."""


@dataclass(frozen=True)
class KeptHop:
    """One stage of a completed sample: who accumulated its gradient there, and from what."""

    stage: int
    worker: str
    """The worker that ran the stage's backward (accumulated the sample's gradient)."""
    forward: str
    """The worker that ran the stage's forward (the same one but for a backward fallback)."""
    coords: Optional[torch.Tensor]
    """The stage's input coordinates as sent (None at the head)."""
    grad_output: Optional[torch.Tensor]
    """The output gradient sent on the backward (None at the tail, which computes its loss)."""
    version: Optional[int] = None
    """The weight version the stage's backward reply named: the weights the gradient was taken at."""


@dataclass
class KeptSample:
    sample_id: str
    """The id the stages saw (with this trainer's prefix)."""
    step: int
    tokens: torch.Tensor
    hops: list[KeptHop]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        tensors = [self.tokens, *(t for h in self.hops for t in (h.coords, h.grad_output) if t is not None)]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def served_by(self, peer: str) -> bool:
        return any(peer in (hop.worker, hop.forward) for hop in self.hops)


class KeptSamples:
    """Recent completed samples, oldest first, bounded by step and bytes."""

    def __init__(self, max_bytes: int = KEPT_BYTES_MAX, steps: int = KEPT_STEPS):
        self.max_bytes = max_bytes
        self.steps = steps
        self._samples: collections.OrderedDict[str, KeptSample] = collections.OrderedDict()
        self.nbytes = 0
        self.latest_step: Optional[int] = None
        self.dropped: collections.Counter[str] = collections.Counter()
        """Samples forgotten: `old_step` (their step closed, or is about to), `bytes` (over the cap)."""

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: KeptSample) -> bool:
        """Keep `sample`; False when its step is already older than the kept ones."""
        if self.latest_step is None or sample.step > self.latest_step:
            self.latest_step = sample.step
            for old in [s for s in self._samples.values() if s.step <= self.latest_step - self.steps]:
                self._drop(old.sample_id, "old_step")
        if sample.step <= self.latest_step - self.steps:
            self.dropped["old_step"] += 1
            return False
        self._samples[sample.sample_id] = sample
        self.nbytes += sample.nbytes
        while self.nbytes > self.max_bytes and self._samples:
            self._drop(next(iter(self._samples)), "bytes")
        return sample.sample_id in self._samples

    def _drop(self, sample_id: str, why: str) -> None:
        self.nbytes -= self._samples.pop(sample_id).nbytes
        self.dropped[why] += 1

    def take_served_by(self, peer: str) -> list[KeptSample]:
        """Remove and return the kept samples `peer` served, at any stage, forward or backward."""
        taken = [s for s in self._samples.values() if s.served_by(peer)]
        for sample in taken:
            self.nbytes -= self._samples.pop(sample.sample_id).nbytes
        return taken


Send = Callable[[int, str, RetractRequest], Awaitable[RetractReply]]


class Retractions:
    """The trainer's side: keeps recent samples, and retracts those an excluded worker served."""

    def __init__(self, send: Send, replicas: Callable[[int], list[str]], *, max_bytes: int = KEPT_BYTES_MAX,
                 at_once: int = RETRACTIONS_AT_ONCE):
        self.send = send
        self.on_applied: Optional[Callable[[str, int], None]] = None
        """(sample id, stage) for each retraction a worker applied: the trainer's sample log."""
        self.replicas = replicas
        """A stage's usable workers, least loaded first (the balancer's `usable`)."""
        self.kept = KeptSamples(max_bytes)
        self.excluded: set[str] = set()
        self.counters: collections.Counter[str] = collections.Counter()
        self._slots = asyncio.Semaphore(at_once)
        self._tasks: set[asyncio.Task] = set()

    def keep(self, sample: KeptSample) -> None:
        """A sample completed: kept, or retracted at once if an excluded worker served it (it was in
        flight when the worker was excluded)."""
        if any(sample.served_by(peer) for peer in self.excluded):
            self._retract(sample)
        else:
            self.kept.add(sample)

    def exclude(self, stage: int, peer: str) -> None:
        """`peer` of `stage` was excluded: retract every kept sample it served."""
        self.excluded.add(peer)
        taken = self.kept.take_served_by(peer)
        for sample in taken:
            self._retract(sample)
        logger.info("retracting %d kept samples that excluded worker %s of stage %d served", len(taken),
                    peer[-8:], stage)

    def targets(self, sample: KeptSample) -> list[tuple[int, list[str]]]:
        """(stage, workers) to retract `sample` from: per stage the worker that accumulated it, or
        for an excluded one, the stage's usable replicas that are not excluded, to be asked in turn
        until one holds a sample of the step to take it from."""
        found = []
        for hop in sample.hops:
            peers = [hop.worker]
            if hop.worker in self.excluded:
                peers = [p for p in self.replicas(hop.stage) if p not in self.excluded]
            if not peers:
                self.counters["no_replica"] += 1
                continue
            found.append((hop.stage, peers))
        return found

    def _retract(self, sample: KeptSample) -> None:
        self.counters["samples"] += 1
        hops = {hop.stage: hop for hop in sample.hops}
        for stage, peers in self.targets(sample):
            hop = hops[stage]
            on_behalf = hop.worker if hop.worker in self.excluded else None
            request = RetractRequest(stage=stage, sample_id=sample.sample_id, step=sample.step, tokens=sample.tokens,
                                     coords=hop.coords, grad_output=hop.grad_output, version=hop.version,
                                     accumulated_by=on_behalf)
            task = asyncio.get_running_loop().create_task(self._send(stage, peers, request),
                                                          name=f"retract-{stage}-{sample.sample_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _send(self, stage: int, peers: list[str], request: RetractRequest) -> None:
        """Ask `peers` in turn: the next one only when a worker refuses (over its budget, or it
        holds no sample of the step: another replica of the stage may)."""
        async with self._slots:
            for peer in peers:
                self.counters["sent"] += 1
                try:
                    reply = await self.send(stage, peer, request)
                except RemoteError as exc:
                    logger.debug("stage %d worker %s refused a retraction: %s", stage, peer[-8:], exc)
                    if exc.code == ErrorCode.RATE_LIMITED:
                        continue
                    self.counters["failed"] += 1
                    return
                except Exception as exc:  # noqa: BLE001 - unreachable, timed out, gone: counted, never raised
                    self.counters["failed"] += 1
                    logger.debug("stage %d worker %s took no retraction: %s", stage, peer[-8:], exc)
                    return
                self.counters[reply.outcome] += 1
                if reply.outcome == "applied" and self.on_applied is not None:
                    self.on_applied(request.sample_id, stage)
                return
            self.counters["refused"] += 1

    def summary(self) -> dict:
        """The trainer summary's `spot_checks.retraction`: samples retracted, requests sent and how
        they were answered (applied, too_late, ahead, unsummed: the stage's replicas do not add up
        gradients; refused: by every worker asked, over its budget or holding no sample of the
        step; failed),
        stages with no replica to ask, and the kept samples."""
        return {**{k: self.counters.get(k, 0) for k in ("samples", "sent", "applied", "too_late", "ahead", "unsummed",
                                                         "refused", "failed", "no_replica")},
                "kept": len(self.kept), "kept_bytes": self.kept.nbytes, "kept_dropped": dict(self.kept.dropped)}

    async def close(self, grace_s: float = 5.0) -> None:
        """Let the retractions in flight finish for up to `grace_s`, then cancel the rest."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
