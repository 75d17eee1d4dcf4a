"""A joiner's catch-up: weight sync, then optimizer sync, then full participation [report
3.3.1.1, 5.6].

A worker whose loaded state is more than `max_stale_steps` behind its stage would drag the
stage's average backwards if it contributed at once. In weight sync it is hidden from trainers
and averages with weight 0, absorbing the average without pulling it back; the default 400 steps
is one full pass of SPARTA (20 rounds x 20 steps) [report 5.6.0.1]. In optimizer sync it serves batches
and steps its own optimizer on them, warming AdamW's moments (100 steps decay a beta2=0.95
initialisation to 0.6%), but its samples count nothing towards the stage's target and it still
averages with weight 0. Then it is active.

Beyond the report: weight sync may end early once a full pass of rounds (every segment once)
moved this replica by less than `weight_sync_exit_distance` (relative L2 of the deltas the
rounds applied), i.e. once it already sits at the stage's average. And a joiner with no active
replica of its stage to sync with (every replica died, or the last one did while it synced)
becomes active (`go_active`): a stage served only by syncing replicas never steps, so their
phases would never end.

An active replica that the averaging found to be the stage's outlier (averaging/divergence.py)
goes back to weight sync (`resync`); that weight sync ends after one full pass of complete rounds,
each of which replaced a segment of its weights with the others' average (its weight is 0).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass
from typing import Optional

from protocol.dht_schema import Phase, RoundStatus
from protocol.run_config import SyncConfig

logger = logging.getLogger(__name__)

SERVING_PHASES = (Phase.ACTIVE, Phase.OPTIMIZER_SYNC)
"""The phases in which a replica serves batches and may give its state to joiners."""


@dataclass
class PhaseSpan:
    """One phase this worker went through, for the exit summary and the tests."""

    phase: str
    from_step: int
    to_step: Optional[int] = None
    reason: str = ""
    forward_requests: Optional[int] = None
    backward_requests: Optional[int] = None


@dataclass(frozen=True)
class Transition:
    old: Phase
    new: Phase
    reason: str


class SyncPhases:
    """The phase state machine; `phase` is read by the runtime, the handlers, the averager and
    the announcer."""

    def __init__(self, config: SyncConfig, segments: int):
        self.config = config
        self.segments = segments
        self.phase = Phase.ACTIVE
        self.started_step = 0
        self.spans: list[PhaseSpan] = []
        self._moves: dict[int, tuple[float, float]] = {}
        self._converged: Optional[float] = None
        self._resyncing = False
        self._replaced: set[int] = set()
        """Segments a complete round replaced since a resync began."""

    def join_phase(self, stage_step: int, loaded_step: int) -> Phase:
        """The phase a joiner starts in, from how far its state lags the stage."""
        if stage_step - loaded_step <= self.config.max_stale_steps:
            return Phase.ACTIVE
        if self.config.weight_sync_steps > 0:
            return Phase.WEIGHT_SYNC
        return Phase.OPTIMIZER_SYNC if self.config.optimizer_sync_steps > 0 else Phase.ACTIVE

    def begin(self, phase: Phase, step: int, reason: str) -> None:
        self.phase, self.started_step = phase, step
        self.spans.append(PhaseSpan(phase.value, step, reason=reason))

    def record_round(self, segment: int, status: RoundStatus, delta_sq: float, average_sq: float) -> None:
        """Remember how far each segment's last round moved this replica (weight sync only)."""
        if self.phase == Phase.WEIGHT_SYNC and self._resyncing and status == RoundStatus.COMPLETE:
            self._replaced.add(segment)
        if self.phase != Phase.WEIGHT_SYNC or self.config.weight_sync_exit_distance is None:
            return
        if status not in (RoundStatus.COMPLETE, RoundStatus.PARTIAL) or average_sq <= 0:
            return
        self._moves[segment] = (delta_sq, average_sq)
        if len(self._moves) == self.segments:
            distance = math.sqrt(sum(d for d, _ in self._moves.values()) / sum(a for _, a in self._moves.values()))
            if distance < self.config.weight_sync_exit_distance:
                self._converged = distance

    def update(self, step: int, forward_requests: int, backward_requests: int) -> Optional[Transition]:
        """Advance the phase if its steps are done (or weight sync converged)."""
        elapsed = step - self.started_step
        transition = None
        if self.phase == Phase.WEIGHT_SYNC:
            if self._resyncing and len(self._replaced) >= self.segments:
                transition = (f"a full pass of complete rounds replaced the diverged weights with the stage's average "
                              f"after {elapsed} steps")
            elif self._converged is not None:
                transition = (f"a full pass of rounds moved this replica by {self._converged:.2e} "
                              f"< {self.config.weight_sync_exit_distance:g} after {elapsed} steps")
            elif elapsed >= self.config.weight_sync_steps:
                transition = f"{elapsed} steps of weight sync done"
            new = Phase.OPTIMIZER_SYNC if self.config.optimizer_sync_steps > 0 else Phase.ACTIVE
        elif self.phase == Phase.OPTIMIZER_SYNC and elapsed >= self.config.optimizer_sync_steps:
            transition, new = f"{elapsed} steps of optimizer sync done", Phase.ACTIVE
        if transition is None:
            return None
        return self._move(new, step, forward_requests, backward_requests, transition)

    def _move(self, new: Phase, step: int, forward_requests: int, backward_requests: int, reason: str) -> Transition:
        old = self.phase
        span = self.spans[-1] if self.spans else PhaseSpan(old.value, self.started_step)
        span.to_step, span.forward_requests, span.backward_requests = step, forward_requests, backward_requests
        self.begin(new, step, reason)
        self._moves.clear()
        self._converged = None
        self._resyncing = False
        self._replaced.clear()
        return Transition(old, new, reason)

    def resync(self, step: int, forward_requests: int, backward_requests: int, reason: str) -> Optional[Transition]:
        """Go back to weight sync because this replica diverged from its stage; None unless active."""
        if self.phase != Phase.ACTIVE:
            return None
        transition = self._move(Phase.WEIGHT_SYNC, step, forward_requests, backward_requests, reason)
        self._resyncing = True
        return transition

    def go_active(self, step: int, forward_requests: int, backward_requests: int, reason: str) -> Optional[Transition]:
        """End the sync phases now (there is nobody to sync with); None if already active."""
        if self.phase == Phase.ACTIVE:
            return None
        return self._move(Phase.ACTIVE, step, forward_requests, backward_requests, reason)

    def summary(self) -> list[dict]:
        return [asdict(span) for span in self.spans]
