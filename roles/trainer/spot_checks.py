"""Spot checks: a trainer re-executes a fraction of the forward hops it routed on another replica
of the same stage, and compares.

A credentialed worker can return any tensor of the right shape. Replicas of a stage that exchange
gradients every step hold the same weights at the same weight version, so another replica given
the same input at the same version must return the same output, up to float rounding. A trainer
draws `verification.spot_check_rate` of its forward hops (the tail's loss too), keeps the input it
sent and the output it got, and asks another replica of the stage for the same computation through
`agora/v1/evaluate` (no queue, nothing counted towards a step). The checked worker cannot tell
which of its samples are checked: the check goes elsewhere, after its reply.

A check whose replica is at another version is `stale` (no verdict); one with no other replica of
the stage is `unchecked`. An output further from the replica's than `verification.tolerance`
(relative L2 distance) is a dispute. A dispute between two replicas does not say which one lied;
deciding that (a third replica, the authorizer re-executing) and what follows from it are the next
layers; this one measures agreement, and the disputes are logged with both parties.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import uuid
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

import torch

from protocol.messages import EvaluateReply, EvaluateRequest

logger = logging.getLogger(__name__)

CHECKS_IN_FLIGHT_MAX = 8
"""Checks waiting for their replica at once; a draw beyond that is not checked (counted `busy`)."""


@dataclass
class Dispute:
    stage: int
    worker: str
    """The worker whose reply was checked."""
    checker: str
    """The replica that re-executed it."""
    version: int
    distance: float
    """Relative L2 distance of the outputs, or of the losses at the tail."""


@dataclass
class SpotCheckStats:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    """agreed, disputed, stale, unchecked, busy, failed."""
    largest_agreed: float = 0.0
    """The largest distance among the agreed checks: how close honest replicas are."""
    disputes: list[Dispute] = field(default_factory=list)

    def summary(self) -> dict:
        return {**{k: self.outcomes.get(k, 0) for k in ("agreed", "disputed", "stale", "unchecked", "busy", "failed")},
                "largest_agreed_distance": self.largest_agreed,
                "disputes": [{"stage": d.stage, "worker": d.worker, "checker": d.checker, "version": d.version,
                              "distance": round(d.distance, 6)} for d in self.disputes[-16:]]}


class SpotChecks:
    """Draws hops to check and runs the checks in background tasks.

    `evaluate(stage, peer, request)` sends one `agora/v1/evaluate` to that worker; `replicas(stage)`
    lists the stage's usable workers."""

    def __init__(self, rate: float, tolerance: float,
                 evaluate: Callable[[int, str, EvaluateRequest], Awaitable[EvaluateReply]],
                 replicas: Callable[[int], list[str]], rng: Optional[random.Random] = None):
        self.rate = rate
        self.tolerance = tolerance
        self._evaluate = evaluate
        self._replicas = replicas
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task] = set()
        self.stats = SpotCheckStats()

    def draw(self) -> bool:
        return self.rate > 0 and self._rng.random() < self.rate

    def check_forward(self, stage: int, worker: str, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                      output: torch.Tensor, version: Optional[int]) -> None:
        """Check a forward hop's output later, on another replica (call only for a drawn hop)."""
        self._start(stage, worker, tokens, coords, version, lambda reply: _distance(output, reply.coords))

    def check_loss(self, stage: int, worker: str, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                   loss: float, version: Optional[int]) -> None:
        """Check the tail's reported loss against another tail replica's evaluation of the same input."""
        self._start(stage, worker, tokens, coords, version,
                    lambda reply: None if reply.loss is None else abs(reply.loss - loss) / max(abs(reply.loss), 1e-6))

    def _start(self, stage, worker, tokens, coords, version, distance) -> None:
        if version is None:
            self.stats.outcomes["unchecked"] += 1  # a worker that does not say its version
            return
        if len(self._tasks) >= CHECKS_IN_FLIGHT_MAX:
            self.stats.outcomes["busy"] += 1
            return
        task = asyncio.ensure_future(self._check(stage, worker, tokens, coords, version, distance))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check(self, stage, worker, tokens, coords, version, distance) -> None:
        others = [peer for peer in self._replicas(stage) if peer != worker]
        if not others:
            self.stats.outcomes["unchecked"] += 1
            return
        checker = self._rng.choice(others)
        request = EvaluateRequest(stage=stage, sample_id=f"check-{uuid.uuid4().hex[:16]}", tokens=tokens,
                                  coords=coords)
        try:
            reply = await self._evaluate(stage, checker, request)
        except Exception as exc:  # noqa: BLE001 - a replica that cannot answer decides nothing
            logger.debug("spot check on stage %d replica %s failed: %s", stage, checker[-8:], exc)
            self.stats.outcomes["failed"] += 1
            return
        if reply.version != version:
            self.stats.outcomes["stale"] += 1
            return
        gap = distance(reply)
        if gap is None:
            self.stats.outcomes["failed"] += 1
        elif gap <= self.tolerance:
            self.stats.outcomes["agreed"] += 1
            self.stats.largest_agreed = max(self.stats.largest_agreed, gap)
        else:
            self.stats.outcomes["disputed"] += 1
            self.stats.disputes.append(Dispute(stage, worker, checker, version, gap))
            logger.warning("spot check: stage %d worker %s and replica %s disagree at version %d (distance %.3g, "
                           "tolerance %.3g)", stage, worker[-8:], checker[-8:], version, gap, self.tolerance)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)


def _distance(claimed: torch.Tensor, recomputed: Optional[torch.Tensor]) -> Optional[float]:
    """Relative L2 distance; None when the replica sent no output or one of another shape."""
    if recomputed is None or recomputed.shape != claimed.shape:
        return None
    a, b = claimed.float(), recomputed.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))
