"""Screening: every reply a trainer gets is held against the recent replies of the same stage's
other workers, at the cost of one norm per reply, so that a worker whose outputs, input gradients
or losses have moved away from its replicas' is spot-checked far more often.

Screening accuses nobody. Honest workers of a stage see different samples, and a worker's numbers
drift as the run trains, so a difference in size is a reason to look, not a verdict: a suspect's
hops are drawn for spot checks at `verification.suspect_check_rate` instead of
`spot_check_rate` (roles/trainer/spot_checks.py), and only a re-execution that disagrees, decided
by a third replica or the loss, strikes anyone. With two replicas in a stage each is the other's
only reference, and both become suspects; that costs checks, not strikes.

What is compared, per stage and kind (`output`, `gradient`, `loss`): the log of each reply's RMS
(of the loss itself at the tail), against the other workers' replies at the same weight version:
sizes move fast while a run trains (by half within seconds early on), but replicas at one version
hold the same weights and differ only by their samples. A worker is a suspect when the median of
its last `RECENT` differences from its replicas (at the versions it answered at) is more than
`THRESHOLD` robust deviations of one reply from the median of its sender's replies at that version
(1.4826 x the median absolute deviation, at least `SCALE_FLOOR`). A liar that keeps its sizes (a
flipped gradient, another sample's output, a replay) passes the screen and is left to the base
rate of spot checks. An excluded worker's replies are forgotten, so its replicas are no longer
held against them.

A second pair of kinds catches what keeps its size: `output_coherence` and `gradient_coherence`,
the cosine between what a body stage was given and what it answered (its input coordinates and
its output; the gradient it was sent and the input gradient it returned), each flattened. A stage
adds to a residual stream, so an honest reply points where its input does: on the tiny preset
0.84 +- 0.02 for outputs and 0.81 +- 0.05 for gradients after training (0.98 and 0.99 at the
start). Another sample's output sits near 0 (-0.02 +- 0.07), a flipped gradient near -0.8, a
zeroed one at 0; a replay on old weights or a scaled output keeps it. It is compared with the
replicas' at the same versions like the sizes, so a construction whose boundaries share no basis
(near 0 for everyone) flags nobody.

The median hides a worker that lies on one sample in ten. So each reply is also held, by itself,
against the replicas' replies at its version (at the version before, while its own has fewer than
two): one further than `REPLY_THRESHOLD` robust deviations from their median, its size and its
direction taken together, stands out (`stands_out`), and the trainer checks that very hop
(roles/trainer/spot_checks.py). The deviation is that of such distances on the stage, but never
more than `WITHIN_FACTOR` times a sender's own spread: a liar that lies on every reply would
otherwise set the yardstick itself. Until the stage has that spread (its first `2 * RECENT`
distances) the kind's floor stands in: a liar from a run's first replies, when a step moves the
weights most, is checked from its first. Standing out is a reason to check one sample, never a suspicion:
honest replies do it now and then, and their checks agree.
"""

from __future__ import annotations

import collections
import logging
import math
import statistics
from typing import Optional

import torch

logger = logging.getLogger(__name__)

RECENT = 8
"""A worker's own values the screen looks at: one odd sample is no verdict."""
RESCORE_EVERY = 4
"""A worker is rescored every this many of its replies of a kind (at once for a non-finite one)."""
RESCALE_EVERY = 32
"""A stage's yardstick (`Screening._scale`) is recomputed every this many of its replies of a kind."""
HISTORY = 256
"""Values kept per stage and kind, all workers together: the replicas' answers at recent versions."""
THRESHOLD = 6.0
"""Robust deviations a worker's median difference from its replicas may reach before it is a suspect."""
SCALE_FLOOR = {"output": 0.03, "loss": 0.03, "gradient": 0.25, "output_coherence": 0.05,
               "gradient_coherence": 0.1}
"""The smallest deviation assumed, by kind (of a log: 3%, 25%; of a cosine: 0.05, 0.1). A worker's
input gradients depend on the later stages' versions too, not only its own, and honest replicas'
differ by 10-20% at one version of theirs; an output or a loss depends on its own version alone
(and the input's)."""
REPLY_THRESHOLD = 5.0
"""Robust deviations one reply may stand from its replicas' median at its version, its kinds taken
together (`Screening.stands_out`), before that hop is checked."""
WITHIN_FACTOR = 2.0
"""The per-reply yardstick is at most this many robust deviations of one reply from its own
sender's replies at its version (`Screening._scale`). The spread of replies' distances from their
replicas' median alone is set by whoever lies: with two replicas, a liar that lies on every reply
is as far from its replica as the replica is from it, and widened the yardstick to its own offset.
A sender's own spread is immune to its offset; honest distances measure about 1.1-1.3 of it (the
median of the others is noisy too, and versions move)."""
VERSIONS_KEPT = 8
"""Versions whose replies are kept by version, per stage and kind, for the per-reply test."""
TINY = 1e-30


def reply_size(tensor: torch.Tensor) -> float:
    """The log of a reply's RMS: scale-free, and a zeroed tensor is far from everything."""
    rms = float(torch.linalg.vector_norm(tensor.float())) / math.sqrt(max(tensor.numel(), 1))
    return math.log(max(rms, TINY)) if math.isfinite(rms) else math.inf


def coherence(given: Optional[torch.Tensor], answer: Optional[torch.Tensor]) -> Optional[float]:
    """The cosine between what a stage was given and what it answered, flattened; None when there
    is nothing to compare (a head's input, a tail's gradient, boundaries of other widths)."""
    if given is None or answer is None or given.shape != answer.shape:
        return None
    a, b = given.float().flatten(), answer.float().flatten()
    norms = float(torch.linalg.vector_norm(a)) * float(torch.linalg.vector_norm(b))
    if not math.isfinite(norms):
        return math.inf
    return float(torch.dot(a, b)) / norms if norms > 0 else 0.0


def loss_size(loss: float) -> float:
    """The log of a loss, as `reply_size` is of a tensor."""
    return math.log(max(loss, TINY)) if math.isfinite(loss) else math.inf


class Screening:
    """Recent values per (stage, kind); `suspect(stage, worker)` says whether to look closer."""

    def __init__(self, threshold: float = THRESHOLD, reply_threshold: float = REPLY_THRESHOLD):
        self.threshold = threshold
        self._stream: dict[tuple[int, str], collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=HISTORY))
        """(stage, kind) -> the latest (version, worker, value) of all its workers, oldest first."""
        self._scores: dict[tuple[int, str], dict[str, float]] = collections.defaultdict(dict)
        """(stage, worker) -> kind -> its latest score, for every kind it was scored on."""
        self._since_scored: collections.Counter = collections.Counter()
        self._appended: collections.Counter = collections.Counter()
        self._forgotten: set[tuple[int, str]] = set()
        self._scales: dict[tuple[int, str], tuple[float, int]] = {}
        """(stage, kind) -> (scale, replies appended when it was computed)."""
        self._by_version: dict[tuple[int, str], dict[Optional[int], list[tuple[str, float]]]] = (
            collections.defaultdict(dict))
        """(stage, kind) -> version -> (worker, value) of the last `VERSIONS_KEPT` versions."""
        self._reply_distances: dict[tuple[int, str], collections.deque] = collections.defaultdict(
            lambda: collections.deque(maxlen=HISTORY))
        """(stage, kind) -> recent replies' distances from their replicas' median (`_reply_score`)."""
        self._reply_scales: dict[tuple[int, str], tuple[float, int]] = {}
        self._reply_seen: collections.Counter = collections.Counter()
        self.reply_threshold = reply_threshold
        self.outliers: collections.Counter = collections.Counter()
        """Worker -> replies that stood out by themselves (`stands_out`)."""
        self.flagged: collections.Counter = collections.Counter()
        """Worker -> times it turned suspect."""
        self.observed = 0

    def observe(self, stage: int, kind: str, worker: str, value: float, version: Optional[int]) -> float:
        """Note one reply's size (`reply_size`, `loss_size`) at the weight version it was computed
        at, and rescore its sender every `RESCORE_EVERY` of its replies (a score reads the history:
        about 50 microseconds; 14 per reply on average). Returns how far this reply by itself stands
        from its replicas' at its version, in robust deviations (`_reply_score`; 0.0 when there is
        nothing to hold it against yet, inf when it is not finite)."""
        if (stage, worker) in self._forgotten:
            return 0.0  # replies of an excluded worker still in flight
        self.observed += 1
        score = self._reply_score(stage, kind, worker, value, version)
        self._rescore(stage, kind, worker, value, version)
        return score

    def _reply_score(self, stage: int, kind: str, worker: str, value: float, version: Optional[int]) -> float:
        """One reply's distance from the median of the other workers' replies at its version (at
        least two of them), over the robust spread of such distances on this stage and kind; the
        reply is kept for later replies' tests as well."""
        key = (stage, kind)
        by_version = self._by_version[key]
        replies = by_version.setdefault(version, [])
        if len(by_version) > VERSIONS_KEPT:
            del by_version[next(iter(by_version))]
        others = _others(replies, worker)
        if len(others) < 2 and version is not None:  # the version is new: its predecessor's replies
            earlier = [v for v in by_version if v is not None and v < version]
            others += _others(by_version[max(earlier)], worker) if earlier else []
        replies.append((worker, value))
        if not math.isfinite(value):
            return math.inf
        if len(others) < 2:
            return 0.0
        distance = abs(value - statistics.median(others))
        distances = self._reply_distances[key]
        distances.append(distance)
        self._reply_seen[key] += 1
        if len(distances) < 2 * RECENT:  # no spread measured yet: the smallest one assumed
            return distance / SCALE_FLOOR.get(kind, max(SCALE_FLOOR.values()))
        scale, measured_at = self._reply_scales.get(key, (0.0, 0))
        if self._reply_seen[key] - measured_at >= RESCALE_EVERY or not scale:
            between = 1.4826 * statistics.median(distances)
            scale = max(min(between, WITHIN_FACTOR * self._scale(stage, kind)),
                        SCALE_FLOOR.get(kind, max(SCALE_FLOOR.values())))
            self._reply_scales[key] = (scale, self._reply_seen[key])
        return distance / scale

    def stands_out(self, worker: str, *scores: float) -> bool:
        """Whether one reply's scores on its kinds (`observe`'s), taken together (root sum of
        squares), pass `REPLY_THRESHOLD`: noise as large as the output moves its size and its
        direction by about five deviations each."""
        if math.hypot(*scores) <= self.reply_threshold:
            return False
        self.outliers[worker] += 1
        return True

    def _rescore(self, stage: int, kind: str, worker: str, value: float, version: Optional[int]) -> None:
        stream = self._stream[(stage, kind)]
        stream.append((version, worker, value))
        self._appended[(stage, kind)] += 1
        self._since_scored[(stage, kind, worker)] += 1
        if self._since_scored[(stage, kind, worker)] < RESCORE_EVERY and math.isfinite(value):
            return
        self._since_scored[(stage, kind, worker)] = 0
        own = [(v, x) for v, peer, x in stream if peer == worker][-RECENT:]
        if len(own) < RECENT:
            return
        versions = {v for v, _ in own}
        others: dict[Optional[int], list[float]] = collections.defaultdict(list)
        for v, peer, x in stream:
            if v in versions and peer != worker and math.isfinite(x):
                others[v].append(x)
        score = _score(own, others, self._scale(stage, kind))
        if score is None:
            return
        was = self.suspect(stage, worker)
        self._scores[(stage, worker)][kind] = score
        if not was and self.suspect(stage, worker):
            self.flagged[worker] += 1
            logger.info("screen: stage %d worker %s's %s sizes stand out from its replicas' at the same versions "
                        "(score %.1f): checking it more often", stage, worker[-8:], kind, score)

    def _scale(self, stage: int, kind: str) -> float:
        """Robust deviation of one reply from the median of its sender's replies at its version (a
        liar's offset does not widen it), at least the kind's floor; recomputed every
        `RESCALE_EVERY` replies of the stage and kind."""
        key = (stage, kind)
        seen = self._appended[key]
        if key not in self._scales or seen - self._scales[key][1] >= RESCALE_EVERY:
            groups: dict[tuple[Optional[int], str], list[float]] = collections.defaultdict(list)
            for v, peer, x in self._stream[key]:
                if math.isfinite(x):
                    groups[(v, peer)].append(x)
            deviations = [abs(x - statistics.median(xs)) for xs in groups.values() if len(xs) > 1 for x in xs]
            spread = 1.4826 * statistics.median(deviations) if deviations else 0.0
            # too few repeated versions yet: measured again at the next score, not kept
            self._scales[key] = (max(spread, SCALE_FLOOR.get(kind, max(SCALE_FLOOR.values()))),
                                 seen if len(deviations) >= RECENT * 2 else seen - RESCALE_EVERY)
        return self._scales[key][0]

    def forget(self, stage: int, worker: str) -> None:
        """Drop an excluded worker's values: its replicas are no longer held against them. The
        stage's scores are recomputed from what is left as replies come."""
        self._forgotten.add((stage, worker))
        self.drop(stage, worker)

    def drop(self, stage: int, worker: str) -> None:
        """Drop a worker's values and the stage's scores, which were held against them; its later
        replies count again (a worker that left the stage's listing, then came back)."""
        for (s, kind), stream in self._stream.items():
            if s == stage:
                kept = [entry for entry in stream if entry[1] != worker]
                stream.clear()
                stream.extend(kept)
        for (s, kind), by_version in self._by_version.items():
            if s == stage:
                for replies in by_version.values():
                    replies[:] = [entry for entry in replies if entry[0] != worker]
        for key in [key for key in self._scores if key[0] == stage]:
            del self._scores[key]

    def workers(self, stage: int) -> set[str]:
        """The workers with values kept on this stage."""
        return {peer for (s, _), stream in self._stream.items() if s == stage for _, peer, _ in stream}

    def score(self, stage: int, worker: str) -> float:
        """The worker's largest score on this stage (0.0 before it has one)."""
        scores = self._scores.get((stage, worker))
        return max(scores.values()) if scores else 0.0

    def suspect(self, stage: int, worker: str) -> bool:
        return self.score(stage, worker) > self.threshold

    def summary(self) -> dict:
        suspects = {}
        for (stage, worker), scores in self._scores.items():
            if self.suspect(stage, worker):
                kind = max(scores, key=scores.get)
                suspects[worker] = {"stage": stage, "kind": kind, "score": round(scores[kind], 2)}
        return {"observed": self.observed, "flagged": dict(self.flagged), "suspects": suspects,
                "outliers": dict(self.outliers)}


def _others(replies: list[tuple[str, float]], worker: str) -> list[float]:
    return [x for peer, x in replies if peer != worker and math.isfinite(x)]


def _score(own: list[tuple[Optional[int], float]], others: dict[Optional[int], list[float]],
           scale: float) -> Optional[float]:
    """How many `scale`s the worker's median difference from the others at the same versions is;
    None when too few of its values have others' at their version."""
    centers = {v: statistics.median(xs) for v, xs in others.items() if xs}
    differences = [x - centers[v] for v, x in own if v in centers]
    if len(differences) < RECENT // 2:
        return None
    if not all(math.isfinite(d) for d in differences):
        return math.inf
    return abs(statistics.median(differences)) / scale
