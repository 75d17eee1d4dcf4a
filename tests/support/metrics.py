"""Reading a live node's Prometheus metrics in tests: its URL from the readiness line
(`metrics=http://HOST:PORT`, printed with --metrics-port), a scrape, and sums of samples."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from protocol.readiness import parse_ready_line


def metrics_url(node) -> str:
    for line in node.stdout_lines:
        fields = parse_ready_line(line)
        if fields is not None and "metrics" in fields:
            return fields["metrics"]
    raise AssertionError(f"{node.name} printed no readiness line with metrics=")


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=20) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(node) -> dict:
    """The node's metric families by name (counters without their `_total`)."""
    status, text = http_get(metrics_url(node) + "/metrics")
    assert status == 200, text
    return {family.name: family for family in text_string_to_metric_families(text)}


def metric_value(families: dict, name: str, suffix: str = "", **labels) -> float:
    """Sum of the samples of `name` (+ `suffix`, e.g. _count) whose labels include `labels`."""
    family = families[name]
    return sum(s.value for s in family.samples
               if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()))
