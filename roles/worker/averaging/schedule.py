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

Rounds that outlast the interval between them (slow links, large stages) would make replicas
skip different rounds ("the previous round is still running") and never meet again. So the
schedule runs only every `stride`-th round, a power of two, doubled when a round fell due while
the previous one still ran its all-reduce, and halved again once half the stride's interval is
1.25x the longest of the last `RECENT` rounds (the longest, not an average: the round that made
the stride double must not make it halve again at once). A round that falls due while the
previous one still looks for its group runs after it instead (service.py), so a replica that
missed its group does not run every later round alone, one behind the others. Replicas of a
stage see nearly the same round durations and step pace, and two replicas with different
strides still meet on every round the larger one runs. `segment_of`
shifts the segment order by one after each pass, so a stride that shares a factor with
`segments` still reaches every segment.
"""

from __future__ import annotations

import collections
import time
from typing import Optional

MAX_STRIDE = 16
"""Run at least every 16th round, however long rounds take (a round alone past that is a
misconfigured stage, which the round reports show)."""
HEADROOM = 1.25
"""A strided interval must exceed the rounds' duration by this factor."""
RECENT = 4
"""Rounds whose longest duration decides whether the stride may halve."""
_EMA = 0.3


def segment_of(round_id: int, segments: int) -> int:
    """The segment a round averages: round order within a pass, shifted by one per pass, so that
    every stride reaches every segment (stride 1 still covers each once per pass)."""
    return (round_id + round_id // segments) % segments


class RoundSchedule:
    def __init__(self, average_every: int, idle_period_s: Optional[float] = None):
        self.average_every = average_every
        self.idle_period_s = idle_period_s
        self.last_step_round = 0
        self.last_clock_tick = 0
        self._seen_step = -1
        self._step_changed_at = time.monotonic()
        self.stride = 1
        """Only rounds whose number is a multiple of this run (see module docstring)."""
        self.round_s: Optional[float] = None
        """Smoothed duration of the rounds that ran."""
        self._recent: collections.deque[float] = collections.deque(maxlen=RECENT)
        self.interval_s: Optional[float] = None
        """Smoothed wall time from one step round falling due to the next."""
        self._last_due: Optional[tuple[int, float]] = None

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
                if self._last_due is not None and k > self._last_due[0]:
                    self.interval_s = _smooth(self.interval_s, (now - self._last_due[1]) / (k - self._last_due[0]))
                self._last_due = (k, now)
                return "step", k
        period = self.idle_period_s
        if period and now - self._step_changed_at >= period:
            tick = int(time.time() // period)
            if tick > self.last_clock_tick:
                self.last_clock_tick = tick
                return "clock", tick
        return None

    def runs(self, round_id: int) -> bool:
        """Whether this due round runs at the current stride."""
        return round_id % self.stride == 0

    def overran(self) -> None:
        """A round fell due while the previous one still ran: run half as often from now on."""
        self.stride = min(MAX_STRIDE, self.stride * 2)

    def finished(self, kind: str, duration_s: float) -> None:
        """A round ran for `duration_s`: run more often again if rounds got short enough."""
        self.round_s = _smooth(self.round_s, max(0.0, duration_s))
        self._recent.append(max(0.0, duration_s))
        interval = self.idle_period_s if kind == "clock" else self.interval_s
        if self.stride > 1 and interval and (self.stride // 2) * interval >= HEADROOM * max(self._recent):
            self.stride //= 2

    def cadence(self) -> str:
        """Why rounds are skipped at this stride, for the skipped rounds' reason."""
        took = f"{self.round_s:.1f}s" if self.round_s is not None else "long"
        between = f"{self.interval_s:.1f}s" if self.interval_s is not None else "less"
        return (f"cadence: rounds take {took} with {between} between them, so the stage averages every "
                f"{self.stride}th round")


def _smooth(previous: Optional[float], value: float) -> float:
    return value if previous is None else (1 - _EMA) * previous + _EMA * value
