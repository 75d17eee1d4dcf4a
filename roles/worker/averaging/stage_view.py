"""The stage as the DHT shows it before an averaging round: how many workers it holds, who
reduces, who is active, who may be elected, and who skips the round at their stride; and why a
replica skips a round its stage is in no shape for (alone, no reducer, nobody active).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.dht_schema import AveragingRecord
from roles.worker.averaging.election import Candidate

CADENCE_SKIP = "skips this round at its cadence"
"""The end of the skip reason of a round the others leave out at their stride (logged at DEBUG,
like the rounds this replica's own stride leaves out)."""


@dataclass
class StageView:
    """The stage as the DHT showed it before a round."""

    expected: int = 1
    reducers: set[str] = field(default_factory=set)
    active: set[str] = field(default_factory=set)
    records: dict[str, AveragingRecord] = field(default_factory=dict)
    candidates: list[Candidate] = field(default_factory=list)
    """Active workers that may be elected reducers (this one included), for election.py."""
    off_cadence: set[str] = field(default_factory=set)
    """Workers whose published stride skips this round: nobody waits for them in it."""

    @property
    def running(self) -> int:
        """Workers that run this round (this one included): the group it can form."""
        return self.expected - len(self.off_cadence)


def skip_reason(view: StageView, min_reducers: int) -> str:
    """Why this replica skips the round the stage looks like `view` for; "" when it runs it."""
    if view.expected <= 1:
        return "alone in the stage"
    if not view.reducers:
        why = ("and none could be elected" if min_reducers > 0
               else "and averaging.min_reducers is 0, so none is elected")
        return f"no reducer in the stage {why}: start a worker of the stage with --reducer"
    if not view.active:
        return "no active replica in the stage to average with"
    # Replicas whose rounds ran long average every 2nd, 4th.. round (schedule.py). A round that
    # they all skip would be a matchmaking window spent alone and reported as failed.
    if view.running <= 1:
        return f"every other replica of the stage {CADENCE_SKIP}"
    if not view.reducers - view.off_cadence:
        return f"every reducer of the stage {CADENCE_SKIP}"
    return ""
