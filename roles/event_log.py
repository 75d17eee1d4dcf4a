"""Repeated events as one log line per interval instead of one line per event.

A trainer that loses its workers drops every sample it starts; logging each one buried the
one line that mattered under a hundred identical ones. An `EventAggregator` logs the first event
of a quiet period at once, with its detail, so a lone failure is seen when it happens; events
that follow within the interval are counted by reason and logged together when it ends:

    dropped sample 3f2a-17: no_workers (stage 1: no routable worker)
    dropped 109 samples in the last 10 s: 97 no_workers, 12 worker_failures (last: stage 1: ...)

Counting is thread-safe (a worker's compute thread may count); `flush_due()` is called by the
role's periodic task, `flush()` once more at shutdown so nothing counted is lost.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Optional


class EventAggregator:
    """Counts events of one kind by reason and logs them at most once per `interval_s`.

    `noun` names one event and `plural` several ("sample"/"samples"); `verb` is what happened to
    them ("dropped"). Lines read "{verb} {n} {plural} in the last {t}: {n1} {reason1}, ...".
    """

    def __init__(self, logger: logging.Logger, verb: str, noun: str, plural: Optional[str] = None, *,
                 interval_s: float = 10.0, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic):
        self.logger = logger
        self.verb = verb
        self.noun = noun
        self.plural = plural or noun + "s"
        self.interval_s = interval_s
        self.level = level
        self.clock = clock
        self.totals: collections.Counter[str] = collections.Counter()
        """Every event counted since the start, by reason."""
        self._window: collections.Counter[str] = collections.Counter()
        self._last_detail: Optional[str] = None
        self._last_line = float("-inf")
        self._lock = threading.Lock()

    def count(self, reason: str, detail: Optional[str] = None, subject: Optional[str] = None) -> None:
        """One event. `detail` says what exactly went wrong; `subject` names the thing it happened
        to (a sample id); both appear only in an immediate line and as the window's last detail."""
        with self._lock:
            self.totals[reason] += 1
            now = self.clock()
            if not self._window and now - self._last_line >= self.interval_s:
                self._last_line = now
                line = self._single(reason, detail, subject)
            else:
                self._window[reason] += 1
                self._last_detail = detail
                line = self._take_window(now) if now - self._last_line >= self.interval_s else None
        if line is not None:
            self.logger.log(self.level, line)

    def flush_due(self) -> None:
        """Log the counted events if the interval since the last line has passed."""
        with self._lock:
            now = self.clock()
            line = self._take_window(now) if self._window and now - self._last_line >= self.interval_s else None
        if line is not None:
            self.logger.log(self.level, line)

    def flush(self) -> None:
        """Log whatever is counted now (at shutdown)."""
        with self._lock:
            line = self._take_window(self.clock()) if self._window else None
        if line is not None:
            self.logger.log(self.level, line)

    @property
    def pending(self) -> int:
        """Events counted but not logged yet."""
        with self._lock:
            return sum(self._window.values())

    def _single(self, reason: str, detail: Optional[str], subject: Optional[str]) -> str:
        what = f"{self.verb} {self.noun}" + (f" {subject}" if subject else "")
        return f"{what}: {reason}" + (f" ({detail})" if detail else "")

    def _take_window(self, now: float) -> str:
        n = sum(self._window.values())
        reasons = ", ".join(f"{count} {reason}" for reason, count in self._window.most_common())
        line = (f"{self.verb} {n} {self.noun if n == 1 else self.plural} in the last "
                f"{_span(now - self._last_line)}: {reasons}")
        if self._last_detail:
            line += f" (last: {self._last_detail})"
        self._window.clear()
        self._last_detail = None
        self._last_line = now
        return line


def _span(seconds: float) -> str:
    """The window's length: a few to a few tens of seconds. (node/timefmt.py formats durations
    for node/; roles/ may not import it.)"""
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
