"""Which workers of a stage reduce when too few were started with `--reducer`.

A butterfly all-reduce needs at least one reducer (a peer in hivemind's node mode); a stage whose
workers were all placed as senders would otherwise skip every round and drift apart in silence.
Before each round every replica reads the stage's averaging records and runs `elect` on them; the
rule depends only on what the records say, so every replica that read the same records elects
the same workers, and the elected ones promote themselves before matchmaking while the others
already count them as reducers. A record that arrives late can make two replicas disagree for
one round: then either one extra worker promotes itself (harmless) or the round is skipped (the
next one elects again). Promotion lasts for the life of the process.

The most stable workers are elected: the longest-running first (start times compared to the
minute, so workers that started together tie), then the highest measured averaging bandwidth,
then the peer id, so the order is total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

UPTIME_BUCKET_S = 60.0
"""Start times within the same minute count as equally stable; bandwidth decides between them."""


@dataclass(frozen=True)
class Candidate:
    """An active worker of the stage that can promote itself, as its averaging record shows it."""

    peer: str
    started_at: float
    """Wall-clock time its averaging began (earlier: it has stayed longer)."""
    bandwidth: float
    """All-reduce bytes per second it measured over its rounds; 0 before its first round."""

    def rank(self) -> tuple:
        return math.floor(self.started_at / UPTIME_BUCKET_S), -self.bandwidth, self.peer


def elect(reducers: set[str], candidates: list[Candidate], wanted: int) -> list[str]:
    """The candidates that must reduce so the stage has `wanted` reducers: none if it has enough,
    else the most stable ones that are not reducers yet, best first."""
    missing = wanted - len(reducers)
    if missing <= 0:
        return []
    ranked = sorted((c for c in candidates if c.peer not in reducers), key=Candidate.rank)
    return [c.peer for c in ranked[:missing]]
