"""One Prometheus registry per node, filled at scrape time from what the node already counts.

Nothing here sits on the training path. The roles keep plain counters and `protocol.stats`
distributions (a batch, a round or a DHT call records once when it ends); a scrape (or a push)
calls each *source*, a function that reads them and returns metric families. Every series carries
the node's labels `run`, `role`, `stage` (the worker's stage, "" for a trainer) and `peer`
(base58 peer id), read at scrape time because the run and stage are only known after admission.

A source that raises is logged once and left out of that scrape (and the next ones, until it
works again): a metrics bug must never take a node down or hide the other metrics.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from protocol import version
from protocol.dht import SwarmDHT
from protocol.stats import DistributionSnapshot
from roles.resources import device_memory, host_memory_total_bytes

logger = logging.getLogger("agora.metrics")

LABELS = ("run", "role", "stage", "peer")
Source = Callable[["Families"], Iterable[Metric]]


@dataclass
class NodeLabels:
    run: str = ""
    role: str = ""
    stage: str = ""
    peer: str = ""

    def values(self) -> list[str]:
        return [self.run, self.role, self.stage, self.peer]

    def as_dict(self) -> dict[str, str]:
        return dict(zip(LABELS, self.values()))


class Families:
    """Builds metric families whose samples carry the node's labels, plus any of their own."""

    def __init__(self, labels: NodeLabels):
        self._values = labels.values()

    def gauge(self, name: str, doc: str, value: Optional[float] = None, **extra: str) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=[*LABELS, *extra])
        if value is not None:
            family.add_metric([*self._values, *extra.values()], float(value))
        return family

    def gauges(self, name: str, doc: str, label: str, values: dict[str, float]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=[*LABELS, label])
        for key, value in sorted(values.items()):
            family.add_metric([*self._values, key], float(value))
        return family

    def counter(self, name: str, doc: str, value: Optional[float] = None) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(LABELS))
        if value is not None:
            family.add_metric(self._values, float(value))
        return family

    def counters(self, name: str, doc: str, labels: tuple[str, ...],
                 values: dict[tuple[str, ...], float]) -> CounterMetricFamily:
        """A counter with labels of its own: `values` maps their values (in order) to a count."""
        family = CounterMetricFamily(name, doc, labels=[*LABELS, *labels])
        for key, value in sorted(values.items()):
            family.add_metric([*self._values, *key], float(value))
        return family

    def histogram(self, name: str, doc: str, snapshots: dict[tuple[str, ...], DistributionSnapshot],
                  labels: tuple[str, ...] = ()) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, doc, labels=[*LABELS, *labels])
        for key, snap in sorted(snapshots.items()):
            buckets = [(_le(bound), count) for bound, count in zip(snap.bounds, snap.cumulative)]
            buckets.append(("+Inf", snap.count))
            family.add_metric([*self._values, *key], buckets, sum_value=snap.total)
        return family


def _le(bound: float) -> str:
    return str(int(bound)) + ".0" if bound == int(bound) else repr(bound)


class _Sources(Collector):
    def __init__(self, metrics: "NodeMetrics"):
        self.metrics = metrics
        self.failing: set[str] = set()

    def collect(self) -> Iterable[Metric]:
        families = Families(self.metrics.labels)
        for name, source in list(self.metrics.sources):
            try:
                found = list(source(families))
            except Exception:  # noqa: BLE001 - one broken metric must not hide the others
                if name not in self.failing:
                    self.failing.add(name)
                    logger.warning("metrics source %r failed; it is left out until it works again", name,
                                   exc_info=True)
                continue
            self.failing.discard(name)
            yield from found


class NodeMetrics:
    """The node's registry and what fills it. The daemon adds sources as the node comes up
    (the DHT once joined, the role once built) and says whether the node is ready."""

    def __init__(self, role: str, peer: str, device: str = "cpu"):
        self.labels = NodeLabels(role=role, peer=peer)
        self.device = device
        self.registry = CollectorRegistry(auto_describe=False)
        self.sources: list[tuple[str, Source]] = []
        self.started_at = time.time()
        self.version = version.client_version()
        self.readiness: Optional[Callable[[], Optional[str]]] = None
        """None when the node serves, else why not (a few words); set once the role runs."""
        self.not_ready = "starting"
        """Why the node is not ready while it is not running its role (admission, joining, draining)."""
        self.credential_expiry: Optional[Callable[[], Optional[float]]] = None
        self.bytes: dict[str, Callable[[], tuple[int, int]]] = {}
        """Per channel (pipeline, averaging): bytes sent and received so far."""
        self.auth_rejections: dict[str, Callable[[], dict[str, int]]] = {}
        """Per channel: requests, streams or groups refused for their credential, by reason."""
        self._collector = _Sources(self)
        self.registry.register(self._collector)
        self.add("node", self._node)
        self.add("memory", self._memory)
        self.add("traffic", self._traffic)

    def add(self, name: str, source: Source) -> None:
        self.sources.append((name, source))

    def ready_reason(self) -> Optional[str]:
        if self.readiness is None or self.not_ready != "serving":
            return self.not_ready
        return self.readiness()

    def exposition(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    def watch_dht(self, swarm: SwarmDHT) -> None:
        def dht(f: Families) -> Iterable[Metric]:
            yield f.histogram("agora_dht_operation_seconds", "duration of this node's DHT gets and stores, "
                              "timeouts included", {(op, ): d.snapshot() for op, d in swarm.latency.items()},
                              ("op",))
        self.add("dht", dht)

    # ---- common sources ----

    def _node(self, f: Families) -> Iterable[Metric]:
        info = GaugeMetricFamily("agora_node_info", "this node's client and protocol version (always 1)",
                                 labels=[*LABELS, "version", "protocol"])
        info.add_metric([*self.labels.values(), self.version, str(version.PROTOCOL_VERSION)], 1.0)
        yield info
        yield f.gauge("agora_node_ready", "1 while the node serves: admitted, announced, and (workers) in the "
                      "active sync phase", 1.0 if self.ready_reason() is None else 0.0)
        yield f.gauge("agora_node_start_time_seconds", "when this node process started (unix time)",
                      self.started_at)
        expiry = self.credential_expiry() if self.credential_expiry is not None else None
        yield f.gauge("agora_credential_expiry_timestamp_seconds", "when this node's current credential expires "
                      "(unix time); absent in open runs", expiry)

    def _memory(self, f: Families) -> Iterable[Metric]:
        import psutil

        process = psutil.Process()
        yield f.gauge("agora_process_resident_memory_bytes", "resident memory of the agora-node process (not "
                      "its DHT and averager children)", process.memory_info().rss)
        times = process.cpu_times()
        yield f.counter("agora_process_cpu_seconds_total", "user and system CPU time of the agora-node process",
                        times.user + times.system)
        yield f.gauge("agora_host_memory_total_bytes", "the host's memory, or the node's cgroup limit if lower",
                      host_memory_total_bytes())
        used, total = device_memory(self.device)
        yield f.gauge("agora_device_memory_used_bytes", "accelerator memory torch holds (absent on the CPU)", used)
        yield f.gauge("agora_device_memory_total_bytes", "the accelerator's memory (absent on the CPU)", total)

    def _traffic(self, f: Families) -> Iterable[Metric]:
        sent, received = {}, {}
        for channel, read in self.bytes.items():
            sent[(channel, )], received[(channel, )] = read()
        yield f.counters("agora_bytes_sent_total", "bytes this node sent, by channel: pipeline (forward, "
                         "backward and state RPC frames) or averaging (all-reduce tensor payload)",
                         ("channel", ), sent)
        yield f.counters("agora_bytes_received_total", "bytes this node received, by channel",
                         ("channel", ), received)
        rejected: dict[tuple[str, str], int] = {}
        for channel, read in self.auth_rejections.items():
            for reason, count in read().items():
                rejected[(channel, reason)] = count
        yield f.counters("agora_auth_rejections_total", "requests, streams and averaging groups this node refused "
                         "for their credential, by channel and reason", ("channel", "reason"), rejected)
