"""Sample accounting: every sample a trainer starts ends as completed or dropped with a reason,
and the counts add up (started == completed + dropped + in_flight)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Optional

from protocol.stats import RecentRate

LOSS_WINDOW = 16


@dataclass
class SampleAccounting:
    started: int = 0
    completed: int = 0
    dropped_by_reason: collections.Counter = field(default_factory=collections.Counter)
    tokens: int = 0
    first_losses: list[float] = field(default_factory=list)
    recent_losses: collections.deque = field(default_factory=lambda: collections.deque(maxlen=LOSS_WINDOW))
    last_loss: Optional[float] = None
    last_step: Optional[int] = None
    """The latest global step a completed sample was tagged with."""
    token_rate: RecentRate = field(default_factory=RecentRate)
    """Tokens of completed samples per second over the last 30 s (for the node's metrics)."""

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by_reason.values())

    @property
    def in_flight(self) -> int:
        return self.started - self.completed - self.dropped

    @property
    def ended(self) -> int:
        return self.completed + self.dropped

    def start(self) -> None:
        self.started += 1

    def complete(self, loss: float, tokens: int, step: Optional[int] = None) -> None:
        self.completed += 1
        if step is not None:
            self.last_step = step if self.last_step is None else max(self.last_step, step)
        self.tokens += tokens
        self.token_rate.add(tokens)
        self.last_loss = loss
        self.recent_losses.append(loss)
        if len(self.first_losses) < LOSS_WINDOW:
            self.first_losses.append(loss)

    def drop(self, reason: str) -> None:
        self.dropped_by_reason[reason] += 1

    @property
    def first_loss(self) -> Optional[float]:
        return sum(self.first_losses) / len(self.first_losses) if self.first_losses else None

    @property
    def recent_loss(self) -> Optional[float]:
        return sum(self.recent_losses) / len(self.recent_losses) if self.recent_losses else None

    def summary(self) -> dict:
        return {
            "samples_started": self.started,
            "samples_completed": self.completed,
            "samples_dropped": self.dropped,
            "samples_in_flight": self.in_flight,
            "dropped_by_reason": dict(self.dropped_by_reason),
            "tokens": self.tokens,
            "first_loss": self.first_loss,
            "last_loss": self.recent_loss,
            "last_step": self.last_step,
        }
