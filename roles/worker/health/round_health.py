"""Self-protection: a worker that fails two of its last three averaging rounds leaves its stage
[report 3.3.1.6, 5.6.0.2]; a successful round resets the count.

A replica that keeps missing rounds drifts from the stage's consensus and harms convergence. But a
round can also fail for everyone (a reducer died during matchmaking, the stage was not ready):
leaving then would empty the stage for nothing. So a failure counts against this worker only when
the stage averaged without it, i.e. another worker reports that same round as complete or
partial; a failure nobody else survived is neutral. Skipped rounds (alone, no reducer) are not
rounds at all, and neither is a group this worker refused because a member was no credentialed
worker of the stage (averaging/access.py): the service does not report those here.
"""

from __future__ import annotations

import collections
import enum
from typing import Iterable, Optional


class Verdict(enum.Enum):
    SUCCESS = "success"  # took part: complete or partial
    FAILURE = "failure"  # failed while the stage averaged without us
    NEUTRAL = "neutral"  # failed, but so did everyone else


class RoundHealth:
    """The last `window` verdicts; `should_leave` once `max_failures` of them are failures."""

    def __init__(self, *, max_failures: int = 2, window: int = 3):
        if not 0 < max_failures <= window:
            raise ValueError("need 0 < max_failures <= window")
        self.max_failures = max_failures
        self.recent: collections.deque[Verdict] = collections.deque(maxlen=window)
        self.pending: list[tuple[str, int]] = []
        """Failed rounds whose verdict waits for the other workers' reports."""

    def record_success(self) -> None:
        self.recent.clear()  # "successful rounds reset the failure count" [report 3.3.1.6]
        self.recent.append(Verdict.SUCCESS)

    def record_failure(self, kind: str, round_id: int) -> None:
        self.pending.append((kind, round_id))

    def resolve(self, survived_by_others: Iterable[tuple[str, int]]) -> list[tuple[tuple[str, int], Verdict]]:
        """Decide every pending failure, given the rounds other workers report as complete or
        partial; returns what was decided."""
        survived = set(survived_by_others)
        decided = []
        for key in self.pending:
            verdict = Verdict.FAILURE if key in survived else Verdict.NEUTRAL
            self.recent.append(verdict)
            decided.append((key, verdict))
        self.pending.clear()
        return decided

    @property
    def failures(self) -> int:
        return sum(1 for verdict in self.recent if verdict == Verdict.FAILURE)

    def should_leave(self) -> Optional[str]:
        if self.failures >= self.max_failures:
            return (f"failed {self.failures} of its last {len(self.recent)} averaging rounds while the stage averaged "
                    f"without it (the limit is {self.max_failures} of {self.recent.maxlen})")
        return None
