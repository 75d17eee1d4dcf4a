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
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from protocol import version
from protocol.dht import SwarmDHT
from protocol.stats import DistributionSnapshot
from roles.resources import device_memory, host_memory_total_bytes

logger = logging.getLogger("agora.metrics")

LABELS = ("run", "role", "stage", "peer")
Source = Callable[["Families"], Iterable["Family"]]


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


@dataclass
class Family:
    """One metric family as a source returns it: rows of (sample suffix, values of the family's own
    labels, value). Lighter than prometheus_client's families, and rendered without re-checking
    names; `to_metric` converts it for prometheus_client (pushes)."""

    name: str
    doc: str
    kind: str
    labels: tuple[str, ...] = ()
    rows: list[tuple[str, tuple[str, ...], float]] = field(default_factory=list)

    @property
    def exposed_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name

    def to_metric(self, node: dict[str, str]) -> Metric:
        metric = Metric(self.name, self.doc, self.kind)
        for suffix, values, value in self.rows:
            labels = {**node, **dict(zip(self.labels, values))}
            if suffix == "_bucket":
                labels["le"] = values[-1]
            metric.add_sample(self.name + suffix, labels, value)
        return metric


class Families:
    """Builds metric families whose samples carry the node's labels, plus any of their own."""

    def gauge(self, name: str, doc: str, value: Optional[float] = None, **extra: str) -> Family:
        family = Family(name, doc, "gauge", tuple(extra))
        if value is not None:
            family.rows.append(("", tuple(extra.values()), float(value)))
        return family

    def gauges(self, name: str, doc: str, label: str, values: dict[str, float]) -> Family:
        return Family(name, doc, "gauge", (label, ), [("", (key, ), float(v)) for key, v in sorted(values.items())])

    def counter(self, name: str, doc: str, value: Optional[float] = None) -> Family:
        family = Family(name.removesuffix("_total"), doc, "counter")
        if value is not None:
            family.rows.append(("_total", (), float(value)))
        return family

    def counters(self, name: str, doc: str, labels: tuple[str, ...],
                 values: dict[tuple[str, ...], float]) -> Family:
        """A counter with labels of its own: `values` maps their values (in order) to a count."""
        return Family(name.removesuffix("_total"), doc, "counter", labels, [("_total", key, float(v)) for key, v in sorted(values.items())])

    def histogram(self, name: str, doc: str, snapshots: dict[tuple[str, ...], DistributionSnapshot],
                  labels: tuple[str, ...] = ()) -> Family:
        family = Family(name, doc, "histogram", labels)
        rows = family.rows
        for key, snap in sorted(snapshots.items()):
            for bound, count in zip(snap.bounds, snap.cumulative):
                rows.append(("_bucket", (*key, _le(bound)), float(count)))
            rows.append(("_bucket", (*key, "+Inf"), float(snap.count)))
            rows.append(("_count", key, float(snap.count)))
            rows.append(("_sum", key, snap.total))
        return family


_LE_CACHE: dict[float, str] = {}


def _le(bound: float) -> str:
    text = _LE_CACHE.get(bound)
    if text is None:
        text = _LE_CACHE[bound] = floatToGoString(bound)
    return text


def _escape(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value)}.0"
    return floatToGoString(value)


def render(families: Iterable[Family], node: NodeLabels) -> str:
    """Prometheus' text format (0.0.4) without prometheus_client's per-sample re-validation of
    every label name (tens of microseconds a sample: a percent of a core at a one-second scrape of
    a worker's few hundred series). Label names are ours and fixed; only values are escaped."""
    base = ",".join(f'{k}="{_escape(v)}"' for k, v in node.as_dict().items())
    out: list[str] = []
    for family in families:
        name = family.exposed_name
        out.append(f"# HELP {name} {family.doc}\n# TYPE {name} {family.kind}\n")
        own = family.labels
        for suffix, values, value in family.rows:
            names = own if suffix != "_bucket" else (*own, "le")
            extra = "".join(f',{k}="{_escape(v)}"' for k, v in zip(names, values))
            out.append(f"{family.name}{suffix}{{{base}{extra}}} {_number(value)}\n")
    return "".join(out)


def _render_prometheus(families: Iterable[Metric]) -> str:
    """Families of other collectors in the registry (the pusher's counter), the generic way."""
    out: list[str] = []
    for family in families:
        name = family.name + "_total" if family.type == "counter" else family.name
        out.append(f"# HELP {name} {family.documentation}\n# TYPE {name} {family.type}\n")
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(sample.labels.items()))
            out.append(f"{sample.name}{{{labels}}} {floatToGoString(sample.value)}\n")
    return "".join(out)


class _Sources(Collector):
    """The node's sources as one prometheus_client collector (what a push serialises); a scrape
    renders them directly instead (`NodeMetrics.exposition`)."""

    def __init__(self, metrics: "NodeMetrics"):
        self.metrics = metrics
        self.failing: set[str] = set()
        self.local = threading.local()

    def families(self) -> list[Family]:
        families = Families()
        found: list[Family] = []
        for name, source in list(self.metrics.sources):
            try:
                found.extend(source(families))
            except Exception:  # noqa: BLE001 - one broken metric must not hide the others
                if name not in self.failing:
                    self.failing.add(name)
                    logger.warning("metrics source %r failed; it is left out until it works again", name,
                                   exc_info=True)
                continue
            self.failing.discard(name)
        return found

    def collect(self) -> Iterable[Metric]:
        if getattr(self.local, "rendering", False):
            return  # exposition() renders ours itself
        node = self.metrics.labels.as_dict()
        for family in self.families():
            yield family.to_metric(node)


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
        self.relayed_bytes: list[Callable[[], tuple[int, int]]] = []
        """Pipeline bytes (sent, received) on streams through the run's relays, per source."""
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
        """The registry in Prometheus' text format (version 0.0.4): our sources rendered directly,
        then whatever else is registered (the pusher's counter)."""
        text = render(self._collector.families(), self.labels)
        self._collector.local.rendering = True
        try:
            text += _render_prometheus(self.registry.collect())
        finally:
            self._collector.local.rendering = False
        return text.encode()

    def watch_dht(self, swarm: SwarmDHT) -> None:
        def dht(f: Families) -> Iterable[Family]:
            yield f.histogram("agora_dht_operation_seconds", "duration of this node's DHT gets and stores, "
                              "timeouts included", {(op, ): d.snapshot() for op, d in swarm.latency.items()},
                              ("op",))
        self.add("dht", dht)

    # ---- common sources ----

    def _node(self, f: Families) -> Iterable[Family]:
        yield f.gauge("agora_node_info", "this node's client and protocol version (always 1)", 1.0,
                      version=self.version, protocol=str(version.PROTOCOL_VERSION))
        yield f.gauge("agora_node_ready", "1 while the node serves: admitted, announced, and (workers) in the "
                      "active sync phase", 1.0 if self.ready_reason() is None else 0.0)
        yield f.gauge("agora_node_start_time_seconds", "when this node process started (unix time)",
                      self.started_at)
        expiry = self.credential_expiry() if self.credential_expiry is not None else None
        yield f.gauge("agora_credential_expiry_timestamp_seconds", "when this node's current credential expires "
                      "(unix time); absent in open runs", expiry)

    def _memory(self, f: Families) -> Iterable[Family]:
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

    def _traffic(self, f: Families) -> Iterable[Family]:
        sent, received = {}, {}
        for channel, read in self.bytes.items():
            sent[(channel, )], received[(channel, )] = read()
        yield f.counters("agora_bytes_sent_total", "bytes this node sent, by channel: pipeline (forward, "
                         "backward and state RPC frames) or averaging (all-reduce tensor payload)",
                         ("channel", ), sent)
        yield f.counters("agora_bytes_received_total", "bytes this node received, by channel",
                         ("channel", ), received)
        relayed = [0, 0]
        for read in self.relayed_bytes:
            for index, count in enumerate(read()):
                relayed[index] += count
        yield f.counters("agora_relayed_bytes_total", "pipeline bytes this node sent or received on streams "
                         "through one of the run's relays (a node behind NAT, or a peer of one), by direction",
                         ("direction", ), {("sent", ): relayed[0], ("received", ): relayed[1]})
        rejected: dict[tuple[str, str], int] = {}
        for channel, read in self.auth_rejections.items():
            for reason, count in read().items():
                rejected[(channel, reason)] = count
        yield f.counters("agora_auth_rejections_total", "requests, streams and averaging groups this node refused "
                         "for their credential, by channel and reason", ("channel", "reason"), rejected)
