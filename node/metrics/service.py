"""What the daemon runs for --metrics-port and --metrics-push, phase by phase of a node's life:
the port from the start (a port in use is a ConfigError before admission), the run and stage
labels once admitted, DHT latencies once joined, the role's sources once it is built, readiness
while it serves, the pusher once the node's credential is known; everything stopped, within a few
seconds at most, on every way out."""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Optional

from node.metrics.registry import NodeMetrics
from node.metrics.server import MetricsServer
from protocol.dht import SwarmDHT

logger = logging.getLogger("agora.metrics")

CLOSE_TIMEOUT_S = 5.0
"""Longest the last push and the port's closing may hold up the node's exit."""


class MetricsService:
    def __init__(self, metrics: NodeMetrics, server: Optional[MetricsServer], push_url: Optional[str],
                 push_interval_s: float):
        self.metrics = metrics
        self.server = server
        self.push_url = push_url
        self.push_interval_s = push_interval_s
        self._pusher = None
        self._push_task: Optional[asyncio.Task] = None
        self._push_stop: Optional[asyncio.Event] = None

    @classmethod
    def from_settings(cls, settings, peer: str, device: str) -> Optional["MetricsService"]:
        """None when the node neither serves nor pushes metrics."""
        if settings.metrics_port is None and not settings.metrics_push:
            return None
        metrics = NodeMetrics(settings.role, peer, device)
        server = None
        if settings.metrics_port is not None:
            server = MetricsServer(metrics, settings.metrics_host, settings.metrics_port)
        return cls(metrics, server, settings.metrics_push, settings.metrics_push_interval_s)

    @property
    def url(self) -> Optional[str]:
        return self.server.url if self.server is not None else None

    async def start(self) -> None:
        """Open the port (ConfigError if it cannot be)."""
        self.metrics.not_ready = "waiting for admission"
        if self.server is not None:
            await self.server.start()

    def admitted(self, run_id: str, stage: Optional[int], expiry: Optional[Callable[[], Optional[float]]]) -> None:
        labels = self.metrics.labels
        labels.run, labels.stage = run_id, "" if stage is None else str(stage)
        self.metrics.credential_expiry = expiry
        self.metrics.not_ready = "joining the swarm"

    def joined(self, swarm: SwarmDHT) -> None:
        self.metrics.watch_dht(swarm)
        self.metrics.not_ready = "joining the stage" if self.metrics.labels.role == "worker" else "starting"

    def attach(self, role) -> None:
        """Add the role's sources and readiness (a WorkerRole or a TrainerRole)."""
        if self.metrics.labels.role == "worker":
            from node.metrics.worker import attach_worker, worker_readiness

            attach_worker(self.metrics, role)
            self.metrics.readiness = lambda: worker_readiness(role)
        else:
            from node.metrics.trainer import attach_trainer, trainer_readiness

            attach_trainer(self.metrics, role)
            self.metrics.readiness = lambda: trainer_readiness(role)

    def serving(self) -> None:
        self.metrics.not_ready = "serving"

    def draining(self) -> None:
        self.metrics.not_ready = "draining"

    def start_push(self, token: Callable[[], Optional[str]]) -> None:
        """Push every interval from now on, if --metrics-push was given."""
        if not self.push_url or self._push_task is not None:
            return
        try:
            from node.metrics.push import MetricsPusher
        except ImportError:  # noqa: BLE001 - the pusher is optional; the port still works
            logger.warning("--metrics-push is not available in this build; metrics are not pushed")
            return
        labels = self.metrics.labels
        self._pusher = MetricsPusher(self.metrics.registry, self.push_url,
                                     {"job": "agora-node", "instance": labels.peer}, token, self.push_interval_s,
                                     labels=labels.as_dict())
        self._push_stop = asyncio.Event()
        self._push_task = asyncio.create_task(self._pusher.run(self._push_stop), name="metrics-push")
        logger.info("pushing metrics to %s every %.0fs", self.push_url, self.push_interval_s)

    async def close(self) -> None:
        """Push once more, stop pushing and close the port; never raises, never waits long."""
        self.draining()
        if self._push_task is not None:
            self._push_stop.set()
            done, _ = await asyncio.wait({self._push_task}, timeout=CLOSE_TIMEOUT_S)
            if not done:
                self._push_task.cancel()
                await asyncio.gather(self._push_task, return_exceptions=True)
            elif not self._push_task.cancelled() and self._push_task.exception() is not None:
                logger.warning("metrics pusher failed: %s", self._push_task.exception())
            try:
                await asyncio.wait_for(self._pusher.close(), CLOSE_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - the node is leaving anyway
                logger.debug("closing the metrics pusher failed", exc_info=True)
            self._push_task = None
        if self.server is not None:
            await self.server.close()
