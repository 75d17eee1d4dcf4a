"""Stage skipping [Crucible notes on stage skipping]: which body stages a trainer routes around
now, how many samples it routed around each, and one log line when a stage's skipping starts and
one when it ends.

A body stage with no worker the trainer can reach would drop every sample of the run. Instead the
sample's boundary coordinates go from the stage before it straight to the stage after it, and
its gradient comes back along the same shortcut. That is sound here because every stage adds to
one residual stream and every boundary carries that stream's coordinates in the same fixed
k-dimensional subspace (roles/model/stage.py: a body reads and returns [B, T, k]): skipping a
stage is running the model without that stage's blocks. The skipped stage never sees the sample,
so it takes no step on it; nobody of the stage waits for it either (it has no reachable worker,
and a worker that joins later jumps to the stage's current step).

A stage is skipped on the forward when the balancer has no usable worker for it, or when every
attempt found its workers unreachable (a SIGKILLed worker whose DHT record has not lapsed yet).
It is skipped on the backward when the worker that ran its forward died before the sample's
backward and no other replica is left to take it: the gradient then passes through as if the
stage were the identity (its blocks' own Jacobian is left out, which for a residual stage is
the part beside the identity), since dropping the sample instead would lose the head's and the
earlier bodies' gradient for a sample the later stages already accumulated. Either way the
skipping ends with the next sample the stage serves; discovery (`discovery_period_s`) brings a
new worker to the balancer.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from protocol.run_config import SkippingConfig

logger = logging.getLogger(__name__)

PASSES = ("forward", "backward")


@dataclass
class _Episode:
    started: float
    samples: int = 0


@dataclass
class StageSkipping:
    """The trainer's view of skipped stages; shared by its lanes (one event loop, plus a lock for
    the metrics scrape)."""

    num_stages: int
    config: SkippingConfig = field(default_factory=SkippingConfig)
    clock: Callable[[], float] = time.monotonic
    counts: collections.Counter = field(default_factory=collections.Counter)
    """(stage, pass) -> samples routed around the stage on that pass, since the start."""
    samples_skipped: int = 0
    """Completed samples that skipped at least one stage."""
    _episodes: dict[int, _Episode] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def is_body(self, stage: int) -> bool:
        return 0 < stage < self.num_stages - 1

    def may_skip(self, stage: int, skipped_before: int) -> bool:
        """Whether `stage` may be routed around, `skipped_before` being how many stages right
        next to it this sample already skips."""
        return self.config.enabled and self.is_body(stage) and skipped_before < self.config.max_consecutive

    def active(self, stage: int) -> bool:
        """True while `stage` is being skipped (from its first skipped sample to its next served one)."""
        with self._lock:
            return stage in self._episodes

    def skipped(self, stage: int, pass_: str, detail: str) -> bool:
        """Count one sample routed around `stage`; True if this starts the stage's skipping."""
        assert pass_ in PASSES
        with self._lock:
            self.counts[(stage, pass_)] += 1
            episode = self._episodes.get(stage)
            starts = episode is None
            if starts:
                episode = self._episodes[stage] = _Episode(started=self.clock())
            episode.samples += 1
        if starts:
            logger.warning("stage %d has no worker this trainer can reach (%s): skipping it, samples go from "
                           "stage %d straight to stage %d until a worker serves it again",
                           stage, detail, stage - 1, stage + 1)
        return starts

    def served(self, stage: int) -> None:
        """The stage served a sample: its skipping, if any, ends here."""
        if stage not in self._episodes:  # the common case, read without the lock
            return
        with self._lock:
            episode = self._episodes.pop(stage, None)
        if episode is not None:
            logger.info("stage %d is served again; it was skipped for %d samples over %.1f s",
                        stage, episode.samples, self.clock() - episode.started)

    def sample_done(self, skipped: list[int]) -> None:
        if skipped:
            with self._lock:
                self.samples_skipped += 1

    def snapshot(self) -> dict[tuple[int, str], int]:
        """A copy of `counts`, safe to read from another thread (the metrics scrape)."""
        with self._lock:
            return dict(self.counts)

    def by_stage(self) -> dict[str, dict[str, int]]:
        """{stage: {"forward": n, "backward": n}} for the stages skipped at least once."""
        with self._lock:
            out: dict[str, dict[str, int]] = {}
            for (stage, pass_), n in sorted(self.counts.items()):
                out.setdefault(str(stage), {p: 0 for p in PASSES})[pass_] = n
            return out

    def summary(self) -> dict:
        with self._lock:
            skipping_now = sorted(self._episodes)
        return {"skipped_stages": self.by_stage(), "samples_skipping_a_stage": self.samples_skipped,
                "stages_skipped_now": skipping_now}


def skippable(reason: str, unreachable: bool) -> bool:
    """Whether a stage's failure means "no worker to be reached" (skip) rather than "a worker
    answered badly or too slowly" (drop): a busy or slow stage must not be skipped as load
    shedding, since its samples would then train a shorter model for no fault."""
    return reason == "no_workers" or unreachable
