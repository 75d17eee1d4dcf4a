"""Pushing a node's metrics outward, for contributor nodes nobody can scrape [report 3.6.3.1].

A contributor already opens one port for libp2p; asking for a second, inbound metrics port is
asking too much, so the node pushes its registry to the run's push front (`--metrics-push`, the
authorizer's `/v1/metrics/push`, authorizer.metrics_push) every `interval_s`, and the front hands
it on to the operator's Pushgateway, which Prometheus scrapes. The grouping key is the job and the
node's peer id (`{"job": "agora-node", "instance": <peer id>}`): a node restarted with the same
identity replaces its own group, and no two nodes ever share one. Each push is a PUT of the
whole registry, so a series the node no longer has disappears with the next push.

Each push carries a fresh bearer token from `token()` (protocol.metrics_token, derived from the
node's credential) when there is one. urllib does the I/O in a worker thread, so the event loop
never waits on the network. A failing push is never raised: the node keeps training, counts the
outcome in `agora_metrics_pushes_total{outcome}` and logs at most one line a minute.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
from typing import Callable, Mapping, Optional

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import default_handler, push_to_gateway

logger = logging.getLogger("agora.metrics.push")

OUTCOMES = ("ok", "refused", "failed")
"""`ok`: the front or gateway took it; `refused`: answered 4xx (token, instance, size); `failed`:
5xx, unreachable or timed out."""
LOG_EVERY_S = 60.0


class MetricsPusher:
    """Pushes `registry` to `url` every `interval_s` until the stop event, then once more.

    `grouping_key` must hold `job` and should hold `instance` (the peer id). `labels` are added to
    the pushes counter, so it carries the same run/role/stage/peer labels as the node's other
    series. `token()` is called on the event loop before every push; None pushes without
    `Authorization` (a bare Pushgateway on the operator's own network).
    """

    def __init__(self, registry: CollectorRegistry, url: str, grouping_key: Mapping[str, str],
                 token: Callable[[], Optional[str]], interval_s: float, *, timeout_s: float = 10.0,
                 labels: Optional[Mapping[str, str]] = None):
        if "job" not in grouping_key:
            raise ValueError("grouping_key must name the job, e.g. {'job': 'agora-node', 'instance': peer_id}")
        self.registry = registry
        self.url = url.rstrip("/")
        self.job = grouping_key["job"]
        self.grouping_key = {k: v for k, v in grouping_key.items() if k != "job"}
        self.token = token
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.labels = dict(labels or {})
        self.pushes = Counter("agora_metrics_pushes", "metrics pushes to the push front, by outcome",
                              [*self.labels, "outcome"], registry=registry)
        for outcome in OUTCOMES:  # every outcome exists from the start, so rate() sees its first increase
            self.pushes.labels(**self.labels, outcome=outcome)
        self._inflight: Optional[asyncio.Future] = None
        self._failures_unlogged = 0
        self._last_logged = float("-inf")
        self._failing = False

    async def run(self, stop: asyncio.Event) -> None:
        """Push now and every `interval_s`; when `stop` is set, push once more and return."""
        while not stop.is_set():
            await self.push_once()
            try:
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)
            except asyncio.TimeoutError:
                pass
        # the last values (a final step count, a clean shutdown) reach the gateway, which keeps them
        await self.push_once(timeout_s=min(self.timeout_s, 5.0))

    async def push_once(self, *, timeout_s: Optional[float] = None) -> str:
        """One push; returns its outcome. Never raises (but cancellation)."""
        token = self.token()
        self._inflight = asyncio.ensure_future(asyncio.to_thread(self._push, token, timeout_s or self.timeout_s))
        try:
            outcome, problem = await asyncio.shield(self._inflight)
        except Exception as exc:  # a bug of ours or prometheus_client's; the node must go on
            outcome, problem = "failed", f"{type(exc).__name__}: {exc}"
        self.pushes.labels(**self.labels, outcome=outcome).inc()
        self._note(outcome, problem)
        return outcome

    def _push(self, token: Optional[str], timeout_s: float) -> tuple[str, str]:
        def handler(url, method, timeout, headers, data):
            if token:
                headers = [*headers, ("Authorization", f"Bearer {token}")]
            return default_handler(url, method, timeout, headers, data)

        try:
            push_to_gateway(self.url, job=self.job, registry=self.registry, grouping_key=self.grouping_key,
                            timeout=timeout_s, handler=handler)
            return "ok", ""
        except urllib.error.HTTPError as exc:
            detail = _body_of(exc)
            outcome = "refused" if 400 <= exc.code < 500 else "failed"
            return outcome, f"answered {exc.code}{': ' + detail if detail else ''}"
        except (OSError, ValueError) as exc:  # URLError, refused connection, timeout, bad URL
            return "failed", str(getattr(exc, "reason", None) or exc) or type(exc).__name__

    def _note(self, outcome: str, problem: str) -> None:
        """At most one line a minute while pushes fail, and one when they work again."""
        if outcome == "ok":
            if self._failing:
                logger.info("metrics push to %s works again", self.url)
            self._failing, self._failures_unlogged = False, 0
            return
        self._failing = True
        self._failures_unlogged += 1
        now = time.monotonic()
        if now - self._last_logged < LOG_EVERY_S:
            return
        hint = ("check the credential and --metrics-push URL" if outcome == "refused"
                else "is the push front up and reachable from this machine?")
        logger.warning("metrics push to %s %s (%d failed push(es) since the last line); %s",
                       self.url, problem, self._failures_unlogged, hint)
        self._last_logged, self._failures_unlogged = now, 0

    async def close(self) -> None:
        """Wait (briefly) for a push still in its thread; idempotent."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None and not inflight.done():
            try:
                await asyncio.wait_for(asyncio.shield(inflight), timeout=self.timeout_s)
            except (asyncio.TimeoutError, Exception):
                pass


def _body_of(exc: urllib.error.HTTPError) -> str:
    """The front's error message, if the answer is its JSON error shape; else the raw start."""
    try:
        raw = exc.read(2048).decode("utf-8", "replace")
    except Exception:
        return ""
    try:
        return str(json.loads(raw)["error"]["message"])[:300]
    except Exception:
        return " ".join(raw.split())[:200]
