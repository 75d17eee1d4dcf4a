"""Per-stage load balancer: which worker of a stage runs the trainer's next forward [report 3.3.2.3].

Each worker carries a virtual runtime, a cumulative, speed-weighted account of the work it has been
given. A dispatch goes to the usable worker with the least runtime and charges it up front
`cost / throughput_estimate`, so concurrent lanes choosing at the same moment spread out instead of
piling onto one worker, and work ends up split in proportion to speed. The estimate starts from the
throughput the worker announced and, once a call completes, follows what this trainer measured
(dispatch to result, network included [3.3.2, fig. 39b]), since announcements cannot be checked.

Placement rules that keep a fresh or recovering worker from being flooded:
- a newly discovered worker enters level with the most-loaded worker already present [report 3.3.2.3];
- a worker whose ban expires keeps its runtime but never falls below the current minimum.

A failure bans a worker only while another worker of the stage stays usable (and when bans still
leave none, the one that ends first is lifted at the next choice): banning the last one
would drop every sample of the stage as `no_workers` for the length of the ban, for what is often
one lost call. The last usable worker is kept and the caller told how long to back off before it
retries there (doubling with consecutive failures, like a ban, but in seconds rather than minutes).
A ban is for the process that failed: a worker that comes back as a new process (its record's
`started_at` changed: it was restarted with the same identity) is usable again at once, keeping
its failure count.

Which workers exist is decided elsewhere (discovery drops workers in a sync phase [report 3.3.2.2]); this
module does no I/O and takes an injectable clock so tests can drive time.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from protocol.errors import ConfigError, NoWorkersError

__all__ = ["StageBalancer", "WorkerView"]


@dataclass(frozen=True)
class WorkerView:
    """What discovery tells the balancer about one worker of the stage."""

    peer_id: str
    throughput: float | None = None
    """Samples per second the worker announced; None, zero or nonsense means unknown."""
    max_batch: int = 1
    incarnation: float | None = None
    """When the worker's process started (its record's `started_at`): a new value is a restart."""


@dataclass(slots=True)
class _WorkerState:
    runtime: float
    announced: float
    max_batch: int
    order: int
    """Discovery order; breaks runtime ties so choices are deterministic."""
    measured: float | None = None
    banned_until: float | None = None
    backoff_until: float | None = None
    """Set instead of a ban on the stage's last usable worker: callers wait until then to retry it."""
    failures: int = 0
    """Consecutive failures, reset by a success; drives the ban backoff."""
    incarnation: float | None = None
    dispatched: int = 0
    completed: int = 0

    @property
    def throughput(self) -> float:
        return self.measured if self.measured is not None else self.announced


class StageBalancer:
    """Least-virtual-runtime worker choice for one pipeline stage; safe to share between lanes."""

    def __init__(
        self,
        stage: int,
        *,
        ban_s: float = 30.0,
        max_ban_s: float = 300.0,
        backoff_s: float = 0.5,
        max_backoff_s: float = 5.0,
        default_throughput: float = 10.0,
        ewma_alpha: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if stage < 0:
            raise ConfigError(f"stage must be >= 0, got {stage}")
        if not ban_s > 0 or not max_ban_s >= ban_s:
            raise ConfigError(f"need 0 < ban_s <= max_ban_s, got ban_s={ban_s}, max_ban_s={max_ban_s}")
        if not backoff_s > 0 or not max_backoff_s >= backoff_s:
            raise ConfigError(f"need 0 < backoff_s <= max_backoff_s, got {backoff_s}, {max_backoff_s}")
        if not (default_throughput > 0 and math.isfinite(default_throughput)):
            raise ConfigError(f"default_throughput must be a positive number, got {default_throughput}")
        if not 0 < ewma_alpha <= 1:
            raise ConfigError(f"ewma_alpha must be in (0, 1], got {ewma_alpha}")
        self.stage = stage
        self._ban_s = ban_s
        self._max_ban_s = max_ban_s
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._default_throughput = default_throughput
        self._alpha = ewma_alpha
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[str, _WorkerState] = {}
        self._next_order = 0
        self._dropped_bans: dict[str, tuple[float, int, float | None]] = {}
        """Bans (until, failures, incarnation) of workers that left discovery while banned, so a quick
        re-announce of the same process cannot dodge them."""

    def update_workers(self, workers: Iterable[WorkerView]) -> None:
        """Replace the known set from a discovery refresh.

        A new worker enters level with the most-loaded worker kept from before, so it does not
        receive every request until it has caught up with runtimes accumulated over hours. A worker
        missing from the refresh is dropped; one that stays keeps its runtime, measured throughput
        and ban, and takes the announced throughput and max batch of the refresh. A ban outlives a
        drop: a failing worker whose record lapsed and came back is still banned until it expires.
        A worker that comes back as a new process (another `incarnation`: it was restarted) has its
        ban lifted, since the ban was for the process that died; its failure count stays, so a
        worker that keeps failing after restarts is banned for longer each time.
        """
        views = {view.peer_id: view for view in workers}
        with self._lock:
            now = self._clock()
            self._dropped_bans = {pid: ban for pid, ban in self._dropped_bans.items() if ban[0] > now}
            for pid, w in self._workers.items():
                if pid not in views and w.banned_until is not None and w.banned_until > now:
                    self._dropped_bans[pid] = (w.banned_until, w.failures, w.incarnation)
            kept = {pid: w for pid, w in self._workers.items() if pid in views}
            level = max((w.runtime for w in kept.values()), default=0.0)
            for pid, view in views.items():
                announced = self._sanitize_throughput(view.throughput)
                state = kept.get(pid)
                if state is None:
                    banned_until, failures, incarnation = self._dropped_bans.pop(pid, (None, 0, None))
                    if _restarted(incarnation, view.incarnation):
                        banned_until = None
                    kept[pid] = _WorkerState(
                        runtime=level,
                        announced=announced,
                        max_batch=max(1, view.max_batch),
                        order=self._next_order,
                        banned_until=banned_until,
                        failures=failures,
                        incarnation=view.incarnation,
                    )
                    self._next_order += 1
                else:
                    state.announced = announced
                    state.max_batch = max(1, view.max_batch)
                    if _restarted(state.incarnation, view.incarnation):
                        state.banned_until = state.backoff_until = None
                    state.incarnation = view.incarnation
            self._workers = kept

    def choose(self, cost: float = 1.0, exclude: Collection[str] = ()) -> str:
        """Take the least-loaded usable worker, charge it `cost` samples of work now, return its id.

        `exclude` names workers this call must avoid (e.g. the one a retry just failed on). When
        every known worker is banned, the ban that ends first is lifted: a stage with a known
        worker is never left without one. Raises NoWorkersError when every known worker is
        excluded (or banned and excluded), or none is known.
        """
        if not cost > 0:
            raise ValueError(f"cost must be positive, got {cost}")
        skip = exclude if isinstance(exclude, (set, frozenset, dict)) else set(exclude)
        with self._lock:
            self._expire_bans(self._clock())
            best_id: str | None = None
            best: _WorkerState | None = None
            for pid, w in self._workers.items():
                if w.banned_until is not None or pid in skip:
                    continue
                if best is None or (w.runtime, w.order) < (best.runtime, best.order):
                    best_id, best = pid, w
            if best is None and not any(w.banned_until is None for w in self._workers.values()):
                # Every worker of the stage is banned (bans outlive a worker's restart): the one
                # whose ban ends first is tried again instead of dropping the sample, keeping its
                # failure count so that a real fault bans it for longer next time.
                banned = [(w.banned_until, w.order, pid) for pid, w in self._workers.items() if pid not in skip]
                if banned:
                    _, _, best_id = min(banned)
                    best = self._workers[best_id]
                    best.banned_until = None
            if best is None or best_id is None:
                raise NoWorkersError(self._no_workers_message(skip))
            best.runtime += cost / best.throughput
            best.dispatched += 1
            return best_id

    def report_success(self, peer_id: str, cost: float, elapsed_s: float) -> None:
        """Fold a completed call's speed (`cost / elapsed_s`) into the worker's throughput estimate.

        The first measurement replaces the announced figure outright; later ones are averaged
        (EWMA) so one slow call does not swing the routing. Unknown workers and impossible timings
        are ignored: the call may have outlived the worker's removal.
        """
        if not (cost > 0 and elapsed_s > 0 and math.isfinite(cost) and math.isfinite(elapsed_s)):
            return
        rate = cost / elapsed_s
        with self._lock:
            w = self._workers.get(peer_id)
            if w is None:
                return
            w.measured = rate if w.measured is None else self._alpha * rate + (1 - self._alpha) * w.measured
            w.failures = 0
            w.backoff_until = None
            w.completed += 1

    def report_failure(self, peer_id: str) -> float:
        """Ban the worker for `ban_s`, doubling with each consecutive failure up to `max_ban_s`;
        but never the stage's last usable worker: that one is kept, and the seconds to back off
        before retrying it are returned (0.0 after a ban, or for an unknown worker).

        Failures that arrive while the worker is already banned or backed off come from calls
        dispatched before, so they neither extend it nor count towards the backoff: several lanes
        losing one worker at once is one failure, not eight.
        """
        with self._lock:
            now = self._clock()
            self._expire_bans(now)
            w = self._workers.get(peer_id)
            if w is None or w.banned_until is not None:
                return 0.0
            others = any(o.banned_until is None for pid, o in self._workers.items() if pid != peer_id)
            if w.backoff_until is not None and w.backoff_until > now:
                if not others:
                    return w.backoff_until - now
            else:
                w.failures += 1
            if others:
                w.backoff_until = None
                w.banned_until = now + min(self._ban_s * 2.0 ** (w.failures - 1), self._max_ban_s)
                return 0.0
            wait = min(self._backoff_s * 2.0 ** (w.failures - 1), self._max_backoff_s)
            w.backoff_until = now + wait
            return wait

    def release(self, peer_id: str, cost: float) -> None:
        """Refund the up-front charge of a call that was chosen but never sent."""
        if not cost > 0:
            return
        with self._lock:
            w = self._workers.get(peer_id)
            if w is None:
                return
            w.runtime -= cost / w.throughput
            w.dispatched = max(0, w.dispatched - 1)

    def is_banned(self, peer_id: str) -> bool:
        """True while the worker is serving a ban; False for unknown workers."""
        with self._lock:
            self._expire_bans(self._clock())
            w = self._workers.get(peer_id)
            return w is not None and w.banned_until is not None

    def known(self) -> list[str]:
        """Every worker from the last discovery refresh, banned or not, sorted by peer id."""
        with self._lock:
            return sorted(self._workers)

    def usable(self) -> list[str]:
        """Workers that may be chosen now, least loaded first (the order `choose` would take)."""
        with self._lock:
            self._expire_bans(self._clock())
            ready = [(w.runtime, w.order, pid) for pid, w in self._workers.items() if w.banned_until is None]
        return [pid for _, _, pid in sorted(ready)]

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        """Per-worker accounting for status pages and metrics, keyed by peer id."""
        with self._lock:
            now = self._clock()
            self._expire_bans(now)
            return {
                pid: {
                    "runtime": w.runtime,
                    "throughput": w.throughput,
                    "announced_throughput": w.announced,
                    "measured_throughput": w.measured,
                    "banned_until": w.banned_until,
                    "ban_remaining_s": 0.0 if w.banned_until is None else w.banned_until - now,
                    "backoff_remaining_s": 0.0 if w.backoff_until is None else max(0.0, w.backoff_until - now),
                    "failures": w.failures,
                    "dispatched": w.dispatched,
                    "completed": w.completed,
                    "max_batch": w.max_batch,
                }
                for pid, w in sorted(self._workers.items())
            }

    def _sanitize_throughput(self, value: float | None) -> float:
        if value is None or not (value > 0 and math.isfinite(value)):
            return self._default_throughput
        return float(value)

    def _expire_bans(self, now: float) -> None:
        """Lift bans that ran out, lifting the worker's runtime to the current minimum.

        While banned, a worker's runtime stood still as the others' grew; returning at its old value
        would hand it every request until it caught up.
        """
        expired = [w for w in self._workers.values() if w.banned_until is not None and w.banned_until <= now]
        if not expired:
            return
        floor = min((w.runtime for w in self._workers.values() if w.banned_until is None), default=None)
        for w in expired:
            w.banned_until = None
            if floor is not None:
                w.runtime = max(w.runtime, floor)

    def _no_workers_message(self, skip: Collection[str]) -> str:
        if not self._workers:
            return f"stage {self.stage} has no known worker; waiting for discovery to find one"
        banned = sum(1 for w in self._workers.values() if w.banned_until is not None)
        excluded = sum(1 for pid, w in self._workers.items() if w.banned_until is None and pid in skip)
        return (
            f"stage {self.stage}: all {len(self._workers)} known workers are unusable "
            f"({banned} banned after failures, {excluded} excluded by the caller)"
        )


def _restarted(known: float | None, announced: float | None) -> bool:
    """The worker's record names another process start than the one the ban was for."""
    return known is not None and announced is not None and announced != known
