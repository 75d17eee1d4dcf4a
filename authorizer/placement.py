"""Stage placement: the authorizer, not the node, decides which stage a worker serves [report 3.6.1.4].

The run is only as fast as its least-provisioned stage, so each worker goes to the stage furthest
below its target, counting the workers already admitted and those placed in the queue. The caller
passes only the stages the node's hardware can serve (authorizer.admission), which is how heavier
stages (head with the embedding, tail with the LM head) get only nodes meeting their higher floor.
Ties go to the most demanding stage the node can serve: a weaker node could not take it later.

Placement happens at join time, before admission, so the node learns its stage at once and can
download that stage's state while it waits in the queue [report 3.6.1.3].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from authorizer.admission import Rejection, queue_full_rejection, run_full_rejection
from authorizer.policy import TRAINER_POOL, Policy
from protocol.run_config import RunConfig


@dataclass(frozen=True)
class PoolCount:
    """Admitted and queued nodes of one pool (a stage, or trainers), as the store counts them."""

    pool: int
    admitted: int
    queued: int

    @property
    def occupied(self) -> int:
        return self.admitted + self.queued


def stage_demand(run: RunConfig, policy: Policy, stage: int) -> int:
    """How demanding a stage's floor is, for breaking ties."""
    floor = policy.floor(run.stage_kind(stage))
    return floor.min_vram_bytes + floor.min_ram_bytes


def choose_pool(
    run: RunConfig,
    policy: Policy,
    role: str,
    eligible_stages: list[int],
    counts: dict[int, PoolCount],
    preferred_stage: Optional[int] = None,
) -> Union[int, Rejection]:
    """The pool to queue a node in, or why it cannot be queued now. A worker's `preferred_stage`
    wins only under `policy.honor_stage_preference`, and only if it may serve it and it has room."""
    total_queued = sum(c.queued for c in counts.values())
    if total_queued >= policy.max_queue:
        return queue_full_rejection(policy.max_queue)
    if role == "trainer":
        count = counts.get(TRAINER_POOL, PoolCount(TRAINER_POOL, 0, 0))
        if count.occupied >= policy.trainer_capacity:
            return run_full_rejection(role, [])
        return TRAINER_POOL
    if policy.honor_stage_preference and preferred_stage in eligible_stages:
        count = counts.get(preferred_stage, PoolCount(preferred_stage, 0, 0))
        if count.occupied < policy.capacity(preferred_stage):
            return preferred_stage
    best: Optional[tuple] = None
    for stage in eligible_stages:
        count = counts.get(stage, PoolCount(stage, 0, 0))
        if count.occupied >= policy.capacity(stage):
            continue
        key = (policy.target(stage) - count.occupied, stage_demand(run, policy, stage), -stage)
        if best is None or key > best[0]:
            best = (key, stage)
    if best is None:
        return run_full_rejection(role, eligible_stages)
    return best[1]
