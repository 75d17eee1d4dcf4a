"""Is this replica the stage's outlier?

Every averaging round publishes, per replica, how far that replica's slice sat from the stage's
average (`relative_distance`, rounds.py). Replicas that train on different samples between
rounds stay within a few percent of the average; one that loaded the wrong state, ran a bad
optimizer step or trained apart for long sits far off. The judgement is local, like every other
self-protection rule: after each round this replica compares its own distance with what the
other members of the same round published. It is the outlier when its distance is at least
`max_divergence` and at least `OUTLIER_RATIO` times every other member's, for
`divergence_rounds` judged rounds in a row; it then rejoins through weight sync (sync_phase.py:
hidden from trainers, averaging with weight 0, so a full pass of rounds replaces its weights with
the others' average). Two replicas are always symmetric (each is as far from their average as
the other), so between two the newcomer is the outlier: the replica whose averaging began later,
which has trained with the stage the shorter time. A stage of three or more whose members are
all far apart has no outlier; it is reported, not acted on.

A round is judged at the next round, when the other members' records for it have been announced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

from protocol.dht_schema import AveragingRecord, RoundStatus

OUTLIER_RATIO = 1.5
"""With n equal-weight replicas, one at distance D from the others sits (n-1)/n D from their
average and each of the others D/n: 2x with three replicas, more with more."""


@dataclass(frozen=True)
class Judgement:
    kind: str
    round: int
    distance: float
    others: list[float]
    outlier: bool
    """This replica is far off and the others are not."""
    diverged: bool
    """This replica is at least `max_divergence` from the average (outlier or not)."""


class DivergenceWatch:
    def __init__(self, max_divergence: Optional[float], rounds: int):
        self.max_divergence = max_divergence
        self.rounds = rounds
        self.pending: Optional[tuple[str, int, float]] = None
        """This replica's last round that averaged something, waiting for the others' reports."""
        self.outlier_streak = 0
        self.last: Optional[Judgement] = None
        self.judged = 0
        self.diverged_rounds = 0

    def observe(self, kind: str, round_id: int, status: RoundStatus, distance: Optional[float],
                group_size: int) -> None:
        """Remember a round this replica took part in, to judge once the others reported it."""
        if self.max_divergence is None:
            return
        if status in (RoundStatus.COMPLETE, RoundStatus.PARTIAL) and distance is not None and group_size > 1:
            self.pending = (kind, round_id, distance)

    def judge(self, records: Iterable[AveragingRecord], started_at: Optional[float] = None,
              stage_size: Optional[int] = None) -> Optional[Judgement]:
        """Judge the pending round against the other members' reports of it; None if there is
        nothing to judge (no pending round, or nobody else reported it). `started_at`: when this
        replica's averaging began, which settles a pair; `stage_size`: the stage's live replicas,
        this one included (a round of two in a larger stage is no pair: the others may disagree)."""
        if self.pending is None or self.max_divergence is None:
            return None
        kind, round_id, distance = self.pending
        members = [(s.relative_distance, record.started_at) for record in records for s in record.recent
                   if s.kind == kind and s.round == round_id and s.relative_distance is not None
                   and s.status in (RoundStatus.COMPLETE, RoundStatus.PARTIAL)]
        others = [d for d, _ in members]
        if not others:
            return None
        self.pending = None
        diverged = distance >= self.max_divergence
        outlier = diverged and distance >= OUTLIER_RATIO * max(others)
        pair = len(members) == 1 and stage_size == 2
        if diverged and pair and started_at is not None and members[0][0] >= self.max_divergence:
            outlier = started_at > members[0][1]  # a pair: the newcomer gives way
        self.outlier_streak = self.outlier_streak + 1 if outlier else 0
        self.judged += 1
        self.diverged_rounds += diverged
        self.last = Judgement(kind, round_id, distance, sorted(others), outlier, diverged)
        return self.last

    def must_resync(self) -> bool:
        return self.outlier_streak >= self.rounds

    def reset(self) -> None:
        """After a resync began: judge afresh."""
        self.outlier_streak = 0
        self.pending = None
