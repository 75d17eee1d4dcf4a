"""The relay's Prometheus metrics: what its gate did, and p2pd's own relay service metrics
(`libp2p_relaysvc_*`: reservations, circuits, relayed bytes), re-exported under their own names."""

from __future__ import annotations

from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families


class RelayCollector:
    """Read at scrape time (prometheus_client's scrape thread); the gate's tables are only read."""

    def __init__(self, service):
        self.service = service

    def collect(self) -> Iterator[Metric]:
        gate = self.service.gate
        connected = list(getattr(self.service, "connected", {}))
        peers = GaugeMetricFamily("agora_relay_peers", "Peers connected to the relay, by whether they showed a "
                                  "credential", labels=["state"])
        peers.add_metric(["passed"], gate.holders(connected))
        peers.add_metric(["pending"], gate.pending())
        yield peers
        passes = CounterMetricFamily("agora_relay_passes", "Credentials shown to the relay and accepted")
        passes.add_metric([], gate.counts.passes)
        yield passes
        dropped = CounterMetricFamily("agora_relay_dropped", "Connections the relay closed for want of a "
                                      "credential, by reason", labels=["reason"])
        for reason in ("no_pass", "shunned", "address_crowded"):
            dropped.add_metric([reason], gate.counts.dropped.get(reason, 0))
        yield dropped
        text = self.service.p2pd_metrics()
        for family in text_string_to_metric_families(text):
            if family.name.startswith("libp2p_relaysvc_"):
                yield family
