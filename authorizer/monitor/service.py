"""The health monitor's loop [report 3.6.2]: every interval, one snapshot of the run.

A snapshot reads the DHT (authorizer.monitor.observation), updates membership (membership), counts
new training progress (progress), summarises the stages and checks the run's health (health),
writes all of it in one transaction (store), and only then logs and posts the alerts it raised or
resolved (notify). Snapshots start on a fixed grid (`interval_s` apart, a slow one delays only
itself), so a SIGKILLed node is found gone within two intervals of its last refresh.

The loop runs in the authorizer's event loop (authorizer/main.py) or alone (node/monitor_cli.py);
database work runs in threads. `latest` holds the last snapshot's figures for /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

from authorizer.monitor.health import (
    AlertBook, admission_conditions, averaging_conditions, loss_conditions, memory_conditions,
    rejection_conditions, replica_conditions, stage_summaries, stall_conditions,
)
from authorizer.monitor.membership import NodeState, update_membership
from authorizer.monitor.notify import Notifier
from authorizer.monitor.observation import observe
from authorizer.monitor.progress import Cursor, count_progress, run_eval, run_loss
from authorizer.monitor.seat import MonitorSeat
from authorizer.monitor.store import MonitorStore, SnapshotWrite
from roles.periodic import wait_any

logger = logging.getLogger("agora.monitor")

DEFAULT_MIN_REPLICAS = 1
"""Active replicas a stage needs at least (the policy has no such field yet): below it, the
pipeline has no way through that stage."""
RECENT_LOSSES = 32


class HealthMonitor:
    def __init__(self, *, run_id: str, num_stages: int, interval_s: float, seat: MonitorSeat,
                 store: MonitorStore, notifier: Notifier,
                 before_snapshot: Optional[Callable[[], Awaitable[None]]] = None):
        self.run_id, self.num_stages, self.interval_s = run_id, num_stages, interval_s
        self.seat, self.store, self.notifier = seat, store, notifier
        self.before_snapshot = before_snapshot
        self.min_replicas = [DEFAULT_MIN_REPLICAS] * num_stages
        self.nodes: dict[str, NodeState] = {}
        self.cursors: dict[str, Cursor] = {}
        self.book = AlertBook([])
        self.samples = self.tokens = 0
        self.best_loss: Optional[float] = None
        self.losses: list[float] = []
        self._steps: dict[int, tuple[Optional[int], int, float]] = {}
        """stage -> (last step seen, snapshots since it moved, since when)."""
        self._last_t: Optional[float] = None
        self.snapshots = 0
        self.latest: Optional[dict] = None
        self.loaded = asyncio.Event()

    async def load(self) -> None:
        """Resume from the database: nodes, cursors, totals, active alerts."""
        loaded = await asyncio.to_thread(self.store.load, RECENT_LOSSES)
        self.nodes, self.cursors = loaded.nodes, loaded.cursors
        self.book = AlertBook(loaded.alerts)
        self.samples, self.tokens = loaded.samples, loaded.tokens
        self.best_loss, self.losses = loaded.best_loss, loaded.losses
        self.loaded.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Snapshot every `interval_s` until `stop` is set; a failed snapshot is logged and the
        next one tries again."""
        try:
            if not self.loaded.is_set():
                await self.load()
            next_at = time.monotonic()
            while not stop.is_set():
                try:
                    await self.snapshot()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    logger.exception("health monitor snapshot failed; retrying at the next interval")
                now = time.monotonic()
                next_at += self.interval_s
                if next_at < now:  # a snapshot overran its interval: skip the slots it missed
                    next_at = now
                await wait_any(stop, timeout=next_at - now)
        finally:
            await self.notifier.aclose()

    async def snapshot(self) -> None:
        if self.before_snapshot is not None:
            await self.before_snapshot()
        obs = await observe(self.seat.dht, self.run_id, self.num_stages, validator_token=self.seat.validator.token,
                            timeout_s=min(10.0, max(2.0, self.interval_s)))
        placements = await asyncio.to_thread(self.store.placements)
        t = obs.t
        changed, node_samples = update_membership(self.nodes, obs, placements)

        counted = count_progress(self.cursors, obs.trainer_reports)
        self.samples += counted.samples
        self.tokens += counted.tokens
        trainers = {p for p, n in self.nodes.items() if n.present and n.role == "trainer"}
        loss = run_loss(obs.trainer_reports, trainers)
        eval_loss, eval_step, eval_stderr = run_eval(obs.trainer_reports, trainers)
        if loss is not None:
            self.losses = (self.losses + [loss])[-RECENT_LOSSES:]
            self.best_loss = loss if self.best_loss is None else min(self.best_loss, loss)
        tokens_per_s = (round(counted.tokens / (t - self._last_t), 3)
                        if self._last_t is not None and t > self._last_t else None)
        self._last_t = t

        stages = stage_summaries(self.nodes, self.num_stages, self.min_replicas)
        stalled_for = {}
        for s in stages:  # snapshots and seconds without a step, counted only while trainers report
            last, count, since = self._steps.get(s["stage"], (None, 0, t))
            if s["step"] is None or s["step"] != last or not trainers:
                count, since = 0, t
            else:
                count += 1
            self._steps[s["stage"]] = (s["step"], count, since)
            stalled_for[s["stage"]] = (count, t - since)
        conditions = (rejection_conditions(obs) + admission_conditions(obs, self.nodes, placements)
                      + replica_conditions(stages, started=bool(self.nodes))
                      + stall_conditions(stages, stalled_for, len(trainers))
                      + loss_conditions(self.losses, self.best_loss) + averaging_conditions(stages)
                      + memory_conditions(self.nodes))
        raised, refreshed, resolved = self.book.apply(conditions, t)
        progress = dict(samples=self.samples, tokens=self.tokens, loss=loss, tokens_per_s=tokens_per_s,
                        trainers=len(trainers), eval_loss=eval_loss, eval_step=eval_step, eval_stderr=eval_stderr)
        await asyncio.to_thread(self.store.write, SnapshotWrite(
            t=t, interval_s=self.interval_s, nodes=changed, node_samples=node_samples, stages=stages,
            progress=progress, cursors=counted.cursors, totals=(self.samples, self.tokens), best_loss=self.best_loss,
            raised=raised, refreshed=refreshed, resolved=resolved))
        for alert in raised:
            self.notifier.alert("raised", alert)
        for alert in resolved:
            self.notifier.alert("resolved", alert)
        if obs.rejections_dropped:
            logger.warning("%d rejected records were not looked at (more than the log holds between snapshots)",
                           obs.rejections_dropped)
        self.snapshots += 1
        self.latest = {
            "t": t, "stages": stages, "progress": progress,
            "nodes": {"present": sum(n.present for n in self.nodes.values()),
                      "gone": sum(not n.present for n in self.nodes.values())},
            "alerts": [a.as_json() for a in self.book.active.values()],
        }
        if self.snapshots == 1:
            logger.info("health monitor: first snapshot of run %s: %d node(s) present, %d sample(s) counted",
                        self.run_id, self.latest["nodes"]["present"], self.samples)
