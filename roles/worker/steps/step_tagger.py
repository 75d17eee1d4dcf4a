"""One tagger per stage step: which tail replica hands out step tags, and its cursor.

The tail decides which global step each sample joins (roles/worker/steps/step_ledger.py). With one tail
replica that count is exact; with several, each used to tag from its own count plus the count its
peers last published, so both filled a step before they saw each other and steps overshot the
target. Now exactly one tail replica, the tagger, owns the count: it tags its own batches
locally, and every other tail replica asks it for tags (`agora/v1/tags`) right before it computes
a batch of untagged samples. A step therefore never holds more than `target_batch_size` samples;
it is short only when a tagged sample was lost.

Who tags (`elect_tagger`): the replica that already tags (it says so in its progress record)
keeps tagging, so a newcomer never splits a step's count; if two claim it, the lowest peer id
wins; if nobody claims it, the lowest peer id among the tail's replicas takes it. A tagger that
cannot be reached is passed over until its record goes away. A new tagger starts its cursor
from what the stage is known to hold for its open step (its own count and its peers' published
counts), which can be stale only at such a handover.

The cursor never runs past the step after the tagger's open one (those samples would be held in
the queues anyway), and with `staleness.max_delayed_per_step: 0` not past the open one: a sample
tagged for the next step would be computed on weights a step old. The asking replica keeps what
got no tag for later. A replica not yet at the tagger's step gets no tags, for the same reason.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional


@dataclass(frozen=True)
class TagGrant:
    """`count` samples of a batch, in order, join `step`."""

    step: int
    count: int


class StepTagger:
    """The cursor of the replica that tags for its stage: the step tags go to and how many it has
    handed out. Called from the compute thread (own batches) and the event loop (peers' asks)."""

    def __init__(self, target: int, ahead: int = 1):
        if target < 1:
            raise ValueError(f"target must be at least 1, got {target}")
        self.target = target
        self.ahead = ahead
        """Steps past the open one the cursor may tag: 1, or 0 when the run lets no gradient run a
        step behind (`staleness.max_delayed_per_step: 0`): a sample tagged for the next step would
        be computed on the open step's weights."""
        self._step: Optional[int] = None
        self._issued = 0
        self._lock = threading.Lock()
        self.tags_issued = 0
        self.tags_issued_to_peers = 0
        self.asks_held = 0
        """Asks answered with fewer tags than requested because the next two steps were full."""

    def take(self, n: int, open_step: int, known: Callable[[int], int], *, for_peer: bool = False) -> list[TagGrant]:
        """Up to `n` tags, in order: the cursor's step first, then the next, never past
        `open_step + ahead`. `known(step)` is what the stage is known to hold for a step; it seeds the
        cursor when it (re)starts at the open step (first use, or the stage stepped past it)."""
        if n < 1:
            return []
        with self._lock:
            if self._step is None or self._step < open_step:
                self._step, self._issued = open_step, min(self.target, max(0, known(open_step)))
            grants: list[TagGrant] = []
            left = n
            while left > 0:
                if self._issued >= self.target:
                    if self._step >= open_step + self.ahead:
                        break
                    self._step, self._issued = self._step + 1, 0
                    continue
                k = min(left, self.target - self._issued)
                grants.append(TagGrant(self._step, k))
                self._issued += k
                left -= k
            given = n - left
            self.tags_issued += given
            if for_peer:
                self.tags_issued_to_peers += given
            if left:
                self.asks_held += 1
            return grants

    def reset(self) -> None:
        """Forget the cursor (this replica stopped tagging; a later takeover re-seeds it)."""
        with self._lock:
            self._step, self._issued = None, 0

    def summary(self) -> dict:
        return {"tags_issued": self.tags_issued, "tags_issued_to_peers": self.tags_issued_to_peers,
                "asks_held": self.asks_held}


def elect_tagger(self_id: str, self_tagging: bool, peers: Iterable[tuple[str, bool]],
                 unreachable: Iterable[str] = ()) -> str:
    """The peer id that tags for the stage. `peers`: (peer id, claims to tag) for the other tail
    replicas with a live progress record; `unreachable`: peers whose tag asks failed lately."""
    skip = set(unreachable)
    live = [(peer, claims) for peer, claims in peers if peer not in skip and peer != self_id]
    claimants = [peer for peer, claims in live if claims] + ([self_id] if self_tagging else [])
    if claimants:
        return min(claimants)
    return min([self_id, *(peer for peer, _ in live)])


class Unreachable:
    """Tail replicas whose tag asks failed, passed over for `hold_s` (or until their record goes)."""

    def __init__(self, hold_s: float = 30.0):
        self.hold_s = hold_s
        self._until: dict[str, float] = {}

    def mark(self, peer: str) -> None:
        self._until[peer] = time.monotonic() + self.hold_s

    def current(self, live: Iterable[str]) -> set[str]:
        now, live = time.monotonic(), set(live)
        self._until = {p: t for p, t in self._until.items() if t > now and p in live}
        return set(self._until)


class AnsweredAsks:
    """The tagger's answers by (asker, ask id), so an ask repeated after its reply was lost gets
    the tags it was given, not new ones: those would leave the first ones unused, and their step
    short until it times out. Holds the newest `keep` answers (an ask is retried within seconds)."""

    def __init__(self, keep: int = 1024):
        self.keep = keep
        self._answers: collections.OrderedDict[tuple[str, int], object] = collections.OrderedDict()
        self.repeated = 0

    def answer(self, asker: str, ask_id: Optional[int], serve: Callable[[], object]) -> object:
        """The answer given before to this ask, or `serve()`'s, kept for a repeat. An ask without an
        id (an older worker) is served every time."""
        if ask_id is None:
            return serve()
        key = (asker, ask_id)
        if key in self._answers:
            self.repeated += 1
            return self._answers[key]
        answer = serve()
        self._answers[key] = answer
        while len(self._answers) > self.keep:
            self._answers.popitem(last=False)
        return answer


class ForwardSlots:
    """The head's forward gate for a stage with several head replicas: the replica that tags for
    the head (elected as the tail's tagger is) counts the forwards the whole stage starts, and
    every head replica asks it before it runs a batch of forwards. It applies the lone head's
    rule (roles/worker/serving/step_decision.py `_forward_allowance`) to the whole stage: the open
    step's missing samples, plus `max_delayed` that may run ahead, minus the forwards still in
    flight, wherever and whenever they were started (one started before the step belongs to it
    too). A per-replica gate fed with the others' published counts let 60-80% of the samples run a
    step ahead.

    In flight: slots whose samples are not yet known to be back. Samples come back roughly in the
    order they went out, so as many of the oldest slots as the stage is known to have taken samples
    back are freed; a slot held longer than `timeout_s` is freed too (its sample was probably lost,
    and waiting for it would stall the stage)."""

    def __init__(self, target: int, max_delayed: int, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.target = target
        self.max_delayed = max_delayed
        self.timeout_s = timeout_s
        self._clock = clock
        self._out: collections.deque[float] = collections.deque()
        self._back_seen: Optional[int] = None
        self._lock = threading.Lock()
        self.slots_issued = 0
        self.slots_to_peers = 0

    def take(self, n: int, *, back_total: int, open_known: int, for_peer: bool = False) -> int:
        """How many of `n` forwards may start now (0..n). `back_total`: samples the stage is known to
        have taken back so far (consumed by its steps and held for the open and the next one);
        `open_known`: those of the open step."""
        with self._lock:
            now = self._clock()
            if self._back_seen is None or back_total < self._back_seen:
                # First call, or a replica left with samples it held: count from here (otherwise
                # no slot would be freed until the stage made up the loss, and the gate stalls).
                self._back_seen = back_total
            for _ in range(min(max(0, back_total - self._back_seen), len(self._out))):
                self._out.popleft()
            self._back_seen = max(self._back_seen, back_total)
            horizon = now - self.timeout_s
            while self._out and self._out[0] < horizon:
                self._out.popleft()
            free = self.target + self.max_delayed - open_known - len(self._out)
            given = max(0, min(n, free))
            self._out.extend([now] * given)
            self.slots_issued += given
            if for_peer:
                self.slots_to_peers += given
            return given

    def reset(self) -> None:
        with self._lock:
            self._out.clear()
            self._back_seen = None

    def summary(self) -> dict:
        # the worker summary's keys (public) keep the old word
        return {"tickets_issued": self.slots_issued, "tickets_to_peers": self.slots_to_peers}
