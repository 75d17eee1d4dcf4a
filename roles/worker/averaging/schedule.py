"""When a replica's next averaging round is due [report 4.2, 5.7].

Rounds follow the stage's step: every `average_every` optimizer steps the replicas average segment
`round mod segments`, round = step // average_every. Stage steps are collective, so every replica
reaches a boundary within one progress period of the others, and the round number (hence the
segment and the group key) is the same everywhere. A replica that jumped to the stage's step
(it joined, or missed steps) did not reach the boundary with the others, so it waits for the
next one instead of looking for a group that formed long ago.

A stage whose step does not move (no trainers; tests) may average on a wall-clock cadence
instead (`idle_period_s`), with the tick number as the round; replicas agree on it as long as
their clocks agree to well within the matchmaking window.
"""

from __future__ import annotations

import time
from typing import Optional


class RoundSchedule:
    def __init__(self, average_every: int, idle_period_s: Optional[float] = None):
        self.average_every = average_every
        self.idle_period_s = idle_period_s
        self.last_step_round = 0
        self.last_clock_tick = 0
        self._seen_step = -1
        self._step_changed_at = time.monotonic()

    def begin(self, step: int) -> None:
        """Count rounds from `step` on (after state loading set it)."""
        self.last_step_round = step // self.average_every
        if self.idle_period_s:
            self.last_clock_tick = int(time.time() // self.idle_period_s)
        self._seen_step, self._step_changed_at = step, time.monotonic()

    def seconds_to_clock_round(self, now: Optional[float] = None) -> Optional[float]:
        """How long until a clock round can fall due if the step does not move; None without an
        idle period (then only a step can make a round due)."""
        period = self.idle_period_s
        if not period:
            return None
        now = time.monotonic() if now is None else now
        wall = time.time()
        next_tick = 0.0 if int(wall // period) > self.last_clock_tick else (self.last_clock_tick + 1) * period - wall
        return max(0.0, period - (now - self._step_changed_at), next_tick)

    def due(self, step: int, now: Optional[float] = None) -> Optional[tuple[str, int]]:
        """("step", round) or ("clock", tick) if a round is due now, else None; each round once."""
        now = time.monotonic() if now is None else now
        if step != self._seen_step:
            self._seen_step, self._step_changed_at = step, now
        k = step // self.average_every
        if k > self.last_step_round:
            self.last_step_round = k
            if step - k * self.average_every <= max(1, self.average_every // 4):
                return "step", k
        period = self.idle_period_s
        if period and now - self._step_changed_at >= period:
            tick = int(time.time() // period)
            if tick > self.last_clock_tick:
                self.last_clock_tick = tick
                return "clock", tick
        return None
