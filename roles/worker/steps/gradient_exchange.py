"""Replicas of a stage add up their gradients before every step.

With several replicas per stage, each replica used to step on the ~1/R of the step's samples it
computed itself and rely on AsyncSPARTA (a few percent of the weights every 20 steps) to pull the
replicas together. At the demo's scale they drifted into nearly independent models, and the
mean of their weights trained worse than either. Where the links allow it (`averaging.gradients`,
decided from the bandwidth plan: roles/model/traffic_plan.py), the replicas instead exchange the
sum of their per-sample gradients for the step that is due and every replica applies the stage's
total: the same update one process makes on the whole batch. Sums are added in peer-id order,
so every replica computes the same bits and replicas that started equal stay equal; AsyncSPARTA
keeps running beside it, for joiners whose state lags.

The exchange is a push: when its step is due, a replica sends its contribution (`agora/v1/
step_gradients`) to every replica of the stage with a live progress record and waits for theirs.
A peer that had already closed that step answers with the sum it applied, and the late replica
applies exactly that sum (its own samples are then lost to the step and counted). A peer that
cannot be reached, or stays silent for `timeout_s`, is left out of the step and the step is
counted as partial. The compute thread waits for the exchange; the event loop runs it.

A contribution may carry corrections on another replica's behalf: a trainer that excluded a
replica X asks one of X's honest peers to take X's samples back out of the step (roles/worker/
serving/retractions.py), and that peer, which never accumulated them, brings each one's negated
gradient, recomputed, with X's name. `add_up` applies a correction only when X's own contribution
is in the sum: if X left the step (revoked, gone, refused), its samples left with it, and
subtracting them again would add their negation to the stage's update.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import torch

from protocol.errors import ErrorCode, ProtocolError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Correction:
    """`samples` samples replica `peer` accumulated, taken back out on its behalf: `grad` is the sum
    of their negated gradients, recomputed by the replica that brings it."""

    peer: str
    samples: int
    grad: torch.Tensor


@dataclass(frozen=True)
class Contribution:
    """What one replica brings to a step: the sum of the gradients of `samples` samples (None when
    it has none) and the samples trainers reported dropped to it (they count, without a gradient)."""

    peer: str
    step: int
    samples: int
    abandoned: int
    grad: Optional[torch.Tensor]
    consumed: int = 0
    """Samples the stage had consumed before this step, as this replica counts them (the schedule's position)."""
    corrections: tuple[Correction, ...] = ()
    """Samples of other replicas this one takes back out of the step on their behalf."""


CORRECTIONS_MAX = 8
"""Corrections one contribution may carry: one per replica excluded in the step; more is hostile."""


class HeldCorrections:
    """The corrections this replica brings to its open step and the next, per replica they are for,
    until the step's contribution takes them (the compute thread, under the optimizer lock)."""

    def __init__(self) -> None:
        self._held: dict[int, dict[str, Correction]] = {}

    def add(self, step: int, peer: str, grad: torch.Tensor) -> None:
        """One more sample of `peer`'s in `step`, its negated gradient `grad` (flat float32)."""
        held = self._held.setdefault(step, {})
        old = held.get(peer)
        held[peer] = Correction(peer, 1, grad) if old is None else Correction(peer, old.samples + 1,
                                                                              old.grad.add_(grad))

    def room_for(self, step: int, peer: str) -> bool:
        """Whether `step` may hold a sample of `peer`'s: a contribution carries at most
        CORRECTIONS_MAX replicas' corrections (its receivers refuse more)."""
        held = self._held.get(step, {})
        return peer in held or len(held) < CORRECTIONS_MAX

    def take(self, step: int) -> tuple[Correction, ...]:
        """`step`'s corrections, removed with those of every earlier step."""
        taken = tuple(self._held.pop(step, {}).values())
        self._held = {s: held for s, held in self._held.items() if s > step}
        return taken

    def samples(self, step: int) -> int:
        return sum(c.samples for c in self._held.get(step, {}).values())


@dataclass(frozen=True)
class StepSum:
    """The stage's total for one step, as every replica applies it."""

    step: int
    grad: Optional[torch.Tensor]
    samples: int
    """Samples whose gradients are in `grad`: what the optimizer divides by."""
    stage_samples: int
    """Samples the step consumed (with the dropped ones): what moves the schedule."""
    members: tuple[str, ...]
    missing: tuple[str, ...] = ()
    consumed: int = 0
    """The furthest schedule position among the members before the step: every replica continues
    from it, so a replica that came late or missed a step does not run its schedule behind."""
    adopted_from: Optional[str] = None
    """Set when this replica came late and applied the sum a peer had already closed the step with."""


Push = Callable[[str, Contribution], Awaitable[Optional[StepSum]]]


def add_up(step: int, contributions: dict[str, Contribution], missing: tuple[str, ...] = ()) -> StepSum:
    """The step's total, added in peer-id order so every replica gets the same bits. A correction
    counts only when the replica it names is in the sum, and never takes more samples from it
    than that replica brought (in the same order, so every replica drops the same excess)."""
    grad: Optional[torch.Tensor] = None
    samples = stage_samples = consumed = 0
    for peer in sorted(contributions):
        c = contributions[peer]
        consumed = max(consumed, c.consumed)
        samples += c.samples
        stage_samples += c.samples + c.abandoned
        if c.grad is not None:
            grad = c.grad.clone() if grad is None else grad.add_(c.grad)
    left = {peer: c.samples for peer, c in contributions.items()}
    for peer in sorted(contributions):
        for fix in sorted(contributions[peer].corrections, key=lambda f: f.peer):
            if fix.peer == peer or left.get(fix.peer, 0) < fix.samples or grad is None:
                continue
            left[fix.peer] -= fix.samples  # still consumed by the step: stage_samples keeps it
            samples -= fix.samples
            grad.add_(fix.grad)
    if samples == 0:
        grad = None
    return StepSum(step=step, grad=grad, samples=samples, stage_samples=stage_samples,
                   members=tuple(sorted(contributions)), missing=missing, consumed=consumed)


class GradientExchange:
    """One replica's side of the per-step exchange."""

    PUSH_RETRIES = 3
    """Pushes again to a replica whose gradients arrived but that did not take ours."""

    def __init__(self, self_id: str, *, numel: int, target: int, timeout_s: float, push: Push,
                 members: Callable[[], list[str]], on_peer_due: Callable[[int], None] = lambda step: None,
                 keep_closed: int = 4):
        self.self_id = self_id
        self.numel = numel
        self.target = target
        self.timeout_s = timeout_s
        self.push = push
        self.members = members
        """The other replicas of the stage with a live progress record, now."""
        self.on_peer_due = on_peer_due
        """Told (on the event loop) that a peer pushed its contribution for a step: that step is due here too."""
        self._inbox: dict[int, dict[str, Contribution]] = collections.defaultdict(dict)
        self._closed: collections.OrderedDict[int, StepSum] = collections.OrderedDict()
        self._keep_closed = keep_closed
        self._changed = asyncio.Event()
        self._refused: dict[int, set[str]] = collections.defaultdict(set)
        """Per step, peers whose contribution was refused as unusable: nobody waits for them."""
        self._unreachable: dict[str, float] = {}
        """Peers a push failed to reach, skipped until they push to us again or `timeout_s` x 3 pass
        (a SIGKILLed replica's progress record outlives it by up to its TTL)."""
        self.counters: collections.Counter[str] = collections.Counter()
        self.wait_s = 0.0

    # ---- receiving (event loop, the handler) ----

    def receive(self, contribution: Contribution, open_step: int) -> Optional[StepSum]:
        """Take a peer's contribution. Returns the step's sum if this replica already closed it
        (the peer applies it as is), None when taken. Raises ProtocolError for one that cannot be
        used: a step closed too long ago or implausibly far ahead, or a gradient of the wrong
        shape or with non-finite values."""
        c = contribution
        closed = self._closed.get(c.step)
        if closed is not None:
            self.counters["late_contributions"] += 1
            return closed
        if c.step < open_step:
            self.counters["refused_stale"] += 1
            raise ProtocolError(f"step {c.step} closed here long ago (open step {open_step})", ErrorCode.INVALID_REQUEST)
        if c.step > open_step + 2:
            self.counters["refused_ahead"] += 1
            raise ProtocolError(f"step {c.step} is too far ahead of this replica's open step {open_step}",
                                ErrorCode.INVALID_REQUEST)
        try:
            self._check_content(c)
        except ProtocolError:
            self.counters["refused_invalid"] += 1
            self._refused[c.step].add(c.peer)  # the step goes on without it, at once
            self._changed.set()
            raise
        self._inbox[c.step][c.peer] = c
        self._unreachable.pop(c.peer, None)
        self.counters["contributions_received"] += 1
        self._changed.set()
        self.on_peer_due(c.step)
        return None

    def _check_content(self, c: Contribution) -> None:
        """Raise ProtocolError for counts or a gradient this stage cannot use."""
        if not 0 <= c.samples <= 4 * self.target or not 0 <= c.abandoned <= 4 * self.target:
            raise ProtocolError(f"{c.samples} samples and {c.abandoned} dropped do not fit a step of "
                                f"{self.target}", ErrorCode.INVALID_REQUEST)
        if (c.grad is None) != (c.samples == 0):
            raise ProtocolError("a contribution has a gradient exactly when it has samples", ErrorCode.INVALID_REQUEST)
        if c.grad is not None:
            self._check_gradient(c.grad, "gradient")
        if len(c.corrections) > CORRECTIONS_MAX or len({f.peer for f in c.corrections}) != len(c.corrections):
            raise ProtocolError(f"at most {CORRECTIONS_MAX} corrections, one per replica", ErrorCode.INVALID_REQUEST)
        for fix in c.corrections:
            if not 1 <= fix.samples <= self.target // 2 or fix.peer == c.peer:
                raise ProtocolError(f"a correction takes 1 to {self.target // 2} samples of another replica",
                                    ErrorCode.INVALID_REQUEST)
            self._check_gradient(fix.grad, "correction")

    def _check_gradient(self, grad: torch.Tensor, what: str) -> None:
        if grad.dtype != torch.float32 or grad.dim() != 1 or grad.numel() != self.numel:
            raise ProtocolError(f"{what} must be float32 of shape [{self.numel}]; got {grad.dtype} "
                                f"{list(grad.shape)}", ErrorCode.INVALID_TENSOR)
        if not bool(torch.isfinite(grad).all()):
            raise ProtocolError(f"{what} contains non-finite values", ErrorCode.INVALID_TENSOR)

    def pushed(self, step: int) -> bool:
        """Whether a peer already pushed its contribution for `step` (so the step is due here)."""
        return bool(self._inbox.get(step))

    # ---- exchanging (event loop, awaited by the compute thread) ----

    async def exchange(self, own: Contribution) -> StepSum:
        """Push `own` to the stage's other replicas, wait for theirs, and return the step's total."""
        step = own.step
        started = time.monotonic()
        self._inbox[step][self.self_id] = own
        now = time.monotonic()
        self._unreachable = {p: t for p, t in self._unreachable.items() if t > now}
        expected = set(self.members()) - {self.self_id} - set(self._unreachable)
        pushes = {peer: asyncio.create_task(self.push(peer, own), name=f"step-gradients-{step}")
                  for peer in sorted(expected)}
        missing: set[str] = set()
        retries: collections.Counter[str] = collections.Counter()
        unreached: set[str] = set()
        adopted: Optional[tuple[str, StepSum]] = None
        deadline = started + self.timeout_s
        try:
            while True:
                for peer, task in list(pushes.items()):
                    if not task.done() or peer in missing:
                        continue
                    exc = task.exception()
                    if exc is not None:
                        if peer not in self._inbox[step]:
                            missing.add(peer)
                            self._unreachable[peer] = time.monotonic() + 3 * self.timeout_s
                            logger.info("step %d: replica %s did not take this replica's gradients (%s); the step "
                                        "goes on without it", step, peer[-8:], exc)
                        elif retries[peer] < self.PUSH_RETRIES and deadline - time.monotonic() > 0:
                            # Its gradients are here but ours did not reach it: it would step
                            # without them while we step with both, and the replicas would part.
                            # Again: it takes them, or answers with the sum it closed the step with.
                            retries[peer] += 1
                            self.counters["pushes_retried"] += 1
                            pushes[peer] = asyncio.create_task(self._push_after(0.2 * retries[peer], peer, own),
                                                               name=f"step-gradients-{step}")
                        elif peer not in unreached:
                            unreached.add(peer)
                            self.counters["pushes_unanswered"] += 1
                            logger.warning("step %d: replica %s sent its gradients but did not take this replica's "
                                           "(%s); it may step without them", step, peer[-8:], exc)
                    elif task.result() is not None and adopted is None:
                        adopted = (peer, task.result())
                if adopted is not None:
                    break
                live = set(self.members())
                # A peer passed over as unreachable that pushed this step after all is back: it
                # sums our contribution, so we must sum its and send it ours.
                for peer in sorted(set(self._inbox[step]) - expected - {self.self_id}):
                    if peer in live:
                        expected.add(peer)
                        pushes[peer] = asyncio.create_task(self.push(peer, own), name=f"step-gradients-{step}")
                missing |= self._refused.get(step, set()) & expected
                waiting = [p for p in expected if p not in self._inbox[step] and p not in missing and p in live]
                # Wait for the pushes' answers too: a peer that closed the step without us answers
                # with the sum it applied, and we must apply the same one.
                unanswered = [p for p, t in pushes.items() if not t.done() and p not in missing and p in live]
                if not waiting and not unanswered:
                    missing |= {p for p in expected if p not in self._inbox[step]}
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing |= {p for p in waiting + unanswered if p not in self._inbox[step]}
                    logger.warning("step %d: no gradients from replica(s) %s within %.0fs; stepping without them",
                                   step, ", ".join(p[-8:] for p in sorted(missing)) or "-", self.timeout_s)
                    break
                self._changed.clear()
                changed = asyncio.ensure_future(self._changed.wait())
                try:
                    await asyncio.wait([changed, *(pushes[p] for p in unanswered)], timeout=min(left, 0.5),
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    changed.cancel()
        finally:
            for task in pushes.values():
                if not task.done():
                    task.cancel()
        if adopted is not None:
            peer, total = adopted
            total = dataclasses.replace(total, step=step, adopted_from=peer)
            self.counters["steps_adopted"] += 1
            self.counters["samples_lost_late"] += own.samples
        else:
            present = {p: c for p, c in self._inbox[step].items() if p == self.self_id or p in expected}
            total = add_up(step, present, tuple(sorted(missing)))
            self.counters["steps_partial" if missing else "steps_complete"] += 1
        self._close(step, total)
        self.wait_s += time.monotonic() - started
        return total

    async def _push_after(self, delay_s: float, peer: str, own: Contribution) -> Optional[StepSum]:
        await asyncio.sleep(delay_s)
        return await self.push(peer, own)

    def _close(self, step: int, total: StepSum) -> None:
        self._closed[step] = total
        while len(self._closed) > self._keep_closed:
            self._closed.popitem(last=False)
        for s in [s for s in self._inbox if s <= step]:
            del self._inbox[s]
        for s in [s for s in self._refused if s <= step]:
            del self._refused[s]

    def summary(self) -> dict:
        return {**dict(self.counters), "wait_s": round(self.wait_s, 3)}
