"""What the compute thread records as it runs batches: the forwards whose backward has not come
(for the head's gate and staleness), how stale the gradients were, the stage's balance signals
per pass [report 3.4.3], and the fingerprint that names a set of weights in every reply.
"""

from __future__ import annotations

import collections
import hashlib
import threading
import time
from typing import Optional

import torch

from protocol.stats import BusyWindow, Distribution, powers_of_two
from roles.worker.serving.queues import Task, TaskKind
from roles.worker.steps.step_ledger import StepLedger


class RecentSamples:
    """The samples this worker ran forward for and whose backward has not come yet, with the weight
    version (optimizer step) each forward saw: backward requests that were not pinned to us are
    counted (they use gradients from other weights [report 4.2.1]), the version gap measures
    staleness, and the head gates its forwards on how many are in flight. A sample whose backward
    never comes (dropped without a notice) is forgotten after `ttl_s`."""

    def __init__(self, capacity: int = 65536, ttl_s: float = 120.0):
        self._ids: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._lock = threading.Lock()

    def add(self, sample_id: str, version: int = 0) -> None:
        with self._lock:
            self._ids[sample_id] = (version, time.monotonic())
            self._ids.move_to_end(sample_id)
            self._expire()

    def _expire(self) -> None:
        horizon = time.monotonic() - self._ttl_s
        while self._ids and (len(self._ids) > self._capacity or next(iter(self._ids.values()))[1] < horizon):
            self._ids.popitem(last=False)

    def peek(self, sample_id: str) -> Optional[int]:
        with self._lock:
            entry = self._ids.get(sample_id)
            return None if entry is None else entry[0]

    def pop(self, sample_id: str) -> Optional[int]:
        """The version the sample's forward saw here, or None if it did not run here."""
        with self._lock:
            entry = self._ids.pop(sample_id, None)
            return None if entry is None else entry[0]

    def in_flight(self, max_age_s: float) -> int:
        """Forwards younger than `max_age_s` whose backward has not come yet (entries are in the
        order they were added, so the count stops at the first older one)."""
        horizon = time.monotonic() - max_age_s
        count = 0
        with self._lock:
            for _, at in reversed(self._ids.values()):
                if at < horizon:
                    break
                count += 1
        return count


class StalenessStats:
    """How old the weights behind a stage's gradients are, two ways:

    - `gaps`: versions between the weights a sample's forward saw here and the ones its backward
      recomputed on (0 when pinned: the recompute then uses the forward's weights);
    - `delays`: versions between the weights the gradient was taken at and the step it is applied
      in (its tag). One process has 0 for every sample; this is what costs fidelity.
    """

    def __init__(self) -> None:
        self.gaps: collections.Counter[int] = collections.Counter()
        self.delays: collections.Counter[int] = collections.Counter()
        self.pinned_samples = 0
        """Backwards recomputed on the previous weights their forward used."""

    def record(self, gap: int, delay: int) -> None:
        self.gaps[gap] += 1
        self.delays[delay] += 1

    @staticmethod
    def _stats(counts: collections.Counter[int]) -> tuple:
        total = sum(counts.values())
        if not total:
            return None, None, None
        return (round(sum(g * n for g, n in counts.items()) / total, 4), max(counts),
                round(sum(n for g, n in counts.items() if g > 0) / total, 4))

    def summary(self) -> dict:
        mean_gap, max_gap, stale_share = self._stats(self.gaps)
        mean_delay, max_delay, delayed_share = self._stats(self.delays)
        return {
            "samples": sum(self.gaps.values()),
            "mean_gap": mean_gap, "max_gap": max_gap, "stale_share": stale_share,
            "pinned": self.pinned_samples,
            "mean_delay": mean_delay, "max_delay": max_delay, "delayed_share": delayed_share,
            "delays": {str(d): n for d, n in sorted(self.delays.items())},
        }


class BatchStats:
    """The four balance signals the report monitors per stage [report 3.4.3], per pass: how long
    each request waited in the queue for the compute thread (microbatch data-await time), how long
    each coalesced batch computed, how many requests each batch coalesced, and the compute
    thread's busy share of recent wall time. Recorded once per batch by the compute thread."""

    def __init__(self, max_batch: int, window_s: float = 30.0):
        self.queue_wait = {kind: Distribution() for kind in TaskKind}
        self.compute = {kind: Distribution() for kind in TaskKind}
        self.batch_size = {kind: Distribution(powers_of_two(max_batch)) for kind in TaskKind}
        self.busy = BusyWindow(window_s)

    def record(self, batch: list[Task], taken_at: float, started: float, ended: float) -> None:
        """`taken_at` (monotonic) is when the batch left the queue; `started`/`ended` are
        perf_counter times around its compute."""
        kind = batch[0].kind
        waits = self.queue_wait[kind]
        for task in batch:
            waits.observe(max(0.0, taken_at - task.enqueued_at))
        self.compute[kind].observe(ended - started)
        self.batch_size[kind].observe(len(batch))
        self.busy.record(taken_at, taken_at + (ended - started))


FINGERPRINT_SAMPLES = 64
"""Elements of each parameter a weights fingerprint reads (evenly strided): replicas that parted
differ nearly everywhere, so a few of each catch it."""


def weights_fingerprint(tensors) -> bytes:
    """8 bytes that name a set of weights: equal replicas have the same, replicas that stepped
    differently (a step without some replica's gradients) do not. Spot checks compare two
    replicas' results only under the same fingerprint (roles/trainer/spot_checks.py)."""
    picks = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        picks.append(flat[::max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES].float())
    if not picks:
        return bytes(8)
    return hashlib.sha256(torch.cat(picks).cpu().numpy().tobytes()).digest()[:8]


def step_counters(ledger: StepLedger, staleness: StalenessStats) -> dict[str, int]:
    """Step boundaries and staleness as `agora/v1/info` counters: over `staleness_samples`
    backwards, forward-to-backward version gaps sum to `staleness_gap_total` and gradient delays
    (the step applied minus the version the gradient was taken at) to
    `staleness_delay_total`."""
    stale = staleness
    return {
        "steps_taken": len(ledger.step_sizes),
        "step_samples_total": sum(ledger.step_sizes),
        "steps_short": sum(1 for n in ledger.step_sizes if n < ledger.target),
        "late_samples": ledger.late_samples,
        "abandoned_samples": ledger.abandoned_total,
        "staleness_samples": sum(stale.gaps.values()),
        "staleness_gap_total": sum(g * n for g, n in stale.gaps.items()),
        "staleness_delay_total": sum(d * n for d, n in stale.delays.items()),
        "staleness_delayed": sum(n for d, n in stale.delays.items() if d > 0),
        "staleness_pinned": stale.pinned_samples,
    }
