"""Step boundaries of a stage: which global step each sample belongs to, and when the stage's
open step is complete [report 3.2, 3.3.1].

A sample belongs to one global step in every stage it passes through. The tail, the first stage
whose gradients a sample touches, tags it: the first `target_batch_size` samples it accumulates
after a step belong to that step, the rest to the next. The trainer carries the tag back through
the bodies and the head, which accumulate each sample into the step it names (the open step, or
the one after it while the open one waits for its last samples). So every stage steps on exactly
the same samples, `target_batch_size` of them, and every stage takes the same number of steps.

A replica alone in its stage closes its open step the moment the step is complete, in the compute
thread; replicas of one stage also count what their peers published (`PeerView`, refreshed by
the progress exchange on every change), so the overshoot of a multi-replica tail is bounded by
the samples that arrive while a peer's count is in transit. A step whose last samples never come
(their trainer reported them dropped, or they died with a replica or a trainer) is closed short:
at once on an abandon notice or when samples two steps ahead arrive, else after
`close_timeout_s` once later samples wait; the shortfall is counted.

A step is the set of samples tagged with it, whichever replica processed them: a replica in
optimizer sync [report 3.3.1.1] serves tagged samples too, and they complete the step at its
stage even though its gradients only warm its own optimizer. So the active replicas of a stage
step on the step's samples that they processed, and no stage waits for samples that a syncing
replica already took.

All methods run on the compute thread, except `update_peers` (the progress task), which replaces
one immutable snapshot.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class PeerView:
    """What the other replicas of the stage published: samples they hold per step and the
    furthest step any of them reached."""

    counts: dict[int, int] = field(default_factory=dict)
    max_step: Optional[int] = None
    members: tuple[str, ...] = ()
    """Peer ids of the other replicas with a live progress record."""
    taggers: tuple[str, ...] = ()
    """Those of them that say they tag for the stage (the tail's tagger, roles/worker/steps/step_tagger.py)."""
    records: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Per peer: (its open step, samples it holds for it, samples for the next one)."""

    @property
    def alone(self) -> bool:
        return self.max_step is None


@dataclass(frozen=True)
class StepDue:
    """A step the stage must take now: `stage_samples` consumed by the stage in it, and why."""

    stage_samples: int
    reason: str  # "complete", "peer_ahead", "peer_due", "overtaken", "timeout", "replica_lost"


class StepLedger:
    """Per replica: the step boundaries and the per-step statistics the worker reports."""

    def __init__(self, target: int, *, assigns: bool, close_timeout_s: float = 30.0):
        if target < 1:
            raise ValueError(f"target must be at least 1, got {target}")
        self.target = target
        self.assigns = assigns
        """True for the tail: it tags untagged samples itself."""
        self.close_timeout_s = close_timeout_s
        self.peers = PeerView()
        self.step_sizes: list[int] = []
        """Samples the stage consumed in each step this replica took (its view)."""
        self.reasons: collections.Counter[str] = collections.Counter()
        self.late_samples = 0
        """Samples tagged for a step this stage had already closed: computed, gradient discarded."""
        self.abandoned_total = 0
        """Samples trainers reported dropped before reaching this stage: their steps closed without them."""
        self.retracted_total = 0
        """Samples whose gradients a trainer retracted (roles/worker/serving/retractions.py): they
        still count towards their step, like abandoned ones, without a gradient."""
        self.steps_skipped = 0
        self._abandoned: dict[int, int] = {}
        self._abandoned_lock = threading.Lock()
        self._peer_due: set[int] = set()
        self._published_view = PeerView()
        self._direct: dict[str, tuple[int, int, int]] = {}
        """Counts the other replicas pushed straight to us (roles/worker/serving/replicas.py): fresher than
        their DHT records, which lag by a DHT round trip, so a step is found complete at once."""
        """Steps a replica already pushed its gradients for (roles/worker/steps/gradient_exchange.py)."""
        self._open_since = time.monotonic()
        """When a sample of the open step last arrived, or the step opened."""
        self._waiting_since: Optional[float] = None
        """When samples of later steps began to wait on the open one (None: none wait). The
        abandonment clock starts at the later of the two: a replica that only ever got samples of
        the next step (the other replica took the open one's, say at the run's start) must not
        find the open step silent since the worker started."""

    # ---- peers ----

    def update_peers(self, view: PeerView) -> None:
        with self._abandoned_lock:
            self._published_view = view
            self.peers = self._merged()

    def update_direct(self, peer: str, local_step: int, open_samples: int, next_samples: int) -> None:
        """A replica pushed its counts (called on the event loop)."""
        with self._abandoned_lock:
            self._direct[peer] = (local_step, open_samples, next_samples)
            self.peers = self._merged()

    def _merged(self) -> PeerView:
        """The published view with each peer's freshest counts: a pushed step later than its record
        wins; within one step counts only grow, so the larger of each wins."""
        view = self._published_view
        self._direct = {p: d for p, d in self._direct.items() if p in view.records}
        if not self._direct:
            return view
        counts: dict[int, int] = {}
        max_step: Optional[int] = None
        records = {}
        for peer, (step, held, ahead) in view.records.items():
            pushed = self._direct.get(peer)
            if pushed is not None and pushed[0] > step:
                step, held, ahead = pushed
            elif pushed is not None and pushed[0] == step:
                held, ahead = max(held, pushed[1]), max(ahead, pushed[2])
            records[peer] = (step, held, ahead)
            max_step = step if max_step is None else max(max_step, step)
            counts[step] = counts.get(step, 0) + held
            counts[step + 1] = counts.get(step + 1, 0) + ahead
        return dataclasses.replace(view, counts=counts, max_step=max_step, records=records)

    # ---- tagging ----

    def capacity(self, open_step: int, open_samples: int, next_samples: int, max_batch: int) -> tuple[int, int]:
        """How many untagged samples this replica may tag now, and for which offset (0 or 1).

        (0, 0) means hold them: both the open and the next step are full stage-wide.
        """
        peers = self.peers.counts
        open_left = self.target - open_samples - peers.get(open_step, 0)
        if open_left > 0:
            return min(open_left, max_batch), 0
        next_left = self.target - next_samples - peers.get(open_step + 1, 0)
        if next_left > 0:
            return min(next_left, max_batch), 1
        return 0, 0

    def note_late(self, n: int) -> None:
        self.late_samples += n

    def abandon(self, step: int, open_step: int) -> bool:
        """A trainer dropped a sample tagged `step` before it reached us (called on the event loop).
        It completes its step like an arrived sample that brings no gradient. False if that step
        is already closed or implausibly far ahead."""
        if not open_step <= step <= open_step + 1:
            return False
        with self._abandoned_lock:
            self._abandoned[step] = self._abandoned.get(step, 0) + 1
            self.abandoned_total += 1
        return True

    def retracted(self, step: int) -> None:
        """A sample accumulated here for `step` had its gradient subtracted again (a retraction, on
        the compute thread). It keeps counting towards its step, as an abandoned sample does, so
        that the step closes on schedule one gradient short instead of waiting for a replacement."""
        with self._abandoned_lock:
            self._abandoned[step] = self._abandoned.get(step, 0) + 1
            self.retracted_total += 1

    def abandoned(self, step: int) -> int:
        with self._abandoned_lock:
            return self._abandoned.get(step, 0)

    def peer_due(self, step: int) -> None:
        """A replica pushed its gradients for `step` (called on the event loop): it found the step
        due, so it is due here too, and it waits for our gradients."""
        with self._abandoned_lock:
            self._peer_due.add(step)

    def may_jump_to(self, step: int) -> bool:
        """Whether this replica, holding nothing of the steps before `step`, may skip them without
        stepping with its stage's other replicas (called with gradient exchange on). Only when no
        replica can still close one of them: none pushed its gradients for one, and every replica
        with a live record has reached `step`. Otherwise a replica with samples of a skipped step
        would push them to a replica that has moved on, be refused, and step on them alone while
        this one did not: the replicas' weights would part."""
        with self._abandoned_lock:
            if any(s < step for s in self._peer_due):
                return False
        return all(open_step >= step for open_step, _, _ in self.peers.records.values())

    # ---- closing ----

    def due(self, open_step: int, open_samples: int, later_waiting: bool, overtaken: bool = False) -> Optional[StepDue]:
        """Whether the open step must be taken now.

        `later_waiting`: samples of later steps are accumulated or held here, which is what
        makes a silent open step look abandoned rather than merely slow. `overtaken`: a sample
        tagged two steps ahead arrived, so the tail has closed the step after the open one too;
        whatever of the open step has not come by now was lost with a replica or a trainer (a
        straggler that still comes is counted late), and holding on would stall the pipeline.
        """
        view = self.peers
        total = open_samples + view.counts.get(open_step, 0)
        if total >= self.target:
            return StepDue(total, "complete")
        if view.max_step is not None and view.max_step > open_step:
            return StepDue(max(total, self.target), "peer_ahead")
        with self._abandoned_lock:
            pushed = open_step in self._peer_due
        if pushed:
            return StepDue(total, "peer_due")
        if overtaken:
            return StepDue(total, "overtaken")
        if not later_waiting:
            self._waiting_since = None
            return None
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - max(self._open_since, self._waiting_since) > self.close_timeout_s:
            return StepDue(total, "timeout")
        return None

    def arrived(self) -> None:
        """A sample of the open step arrived: restarts the abandonment clock."""
        self._open_since = time.monotonic()

    def stepped(self, step: int, due: StepDue) -> None:
        self.step_sizes.append(due.stage_samples)
        self.reasons[due.reason] += 1
        self._open_since = time.monotonic()
        self._waiting_since = None
        with self._abandoned_lock:
            self._abandoned = {s: n for s, n in self._abandoned.items() if s > step}
            self._peer_due = {s for s in self._peer_due if s > step}

    def skipped(self, steps: int) -> None:
        """The worker jumped `steps` steps it held no sample of (the run had moved on without it)."""
        self.steps_skipped += steps
        self._open_since = time.monotonic()
        self._waiting_since = None

    def summary(self) -> dict:
        sizes = self.step_sizes
        return {
            "taken": len(sizes),
            "samples_per_step_mean": round(sum(sizes) / len(sizes), 3) if sizes else None,
            "samples_per_step_max": max(sizes, default=None),
            "samples_per_step_min": min(sizes, default=None),
            "short_steps": sum(1 for n in sizes if n < self.target),
            "long_steps": sum(1 for n in sizes if n > self.target),
            "closed_by": dict(self.reasons),
            "late_samples": self.late_samples,
            "abandoned_samples": self.abandoned_total,
            "retracted_samples": self.retracted_total,
            "steps_skipped": self.steps_skipped,
        }
