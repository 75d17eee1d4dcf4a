"""The health monitor's JSON API under /v1/monitor, and the authorizer's Prometheus /metrics.

Public and read-only: what the run's dashboard (/dashboard) and `agora-node status` show. Every
answer comes from the monitor's tables in the authorizer's database (the in-process monitor's, or a
standalone monitor's writing to the same database), cached for `CACHE_S`, so a crowd of readers
costs a few queries a second. When no monitor runs here and none wrote lately, every route
answers 503 `monitor_off` saying how to start one. The shapes are a contract (the dashboard and
`agora-node status` are written against them): fields are only ever added.

    GET /v1/monitor/overview                 run, stages, training, node counts, active alerts
    GET /v1/monitor/progress?since=&limit=   training progress points, oldest first
    GET /v1/monitor/nodes                    every node ever seen, present or gone
    GET /v1/monitor/nodes/{peer_id}          one node, its history and its last averaging rounds
    GET /v1/monitor/alerts?active=           alerts: active=true the active ones, active=false the
                                             resolved ones, no parameter all (newest first)
    GET /metrics                             Prometheus text: stage replicas, alerts, nodes, admissions,
                                             evidence verdicts
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Annotated, Any, Callable, Optional

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from authorizer.errors import NotFound
from authorizer.monitor.errors import MonitorOff
from authorizer.monitor.health import SEVERITY
from protocol.authorizer_api import PEER_ID_PATTERN

monitor_router = APIRouter(tags=["monitor"])

CACHE_S = 1.0
STALE_AFTER_INTERVALS = 10
"""With no monitor in this process, a standalone monitor's data counts as live until this many of
its intervals (at least five minutes) pass without a snapshot."""
MAX_PROGRESS_POINTS = 5000
_PEER_ID = re.compile(PEER_ID_PATTERN)
_OFF_MESSAGE = ("the health monitor is off for this run: restart the authorizer without --no-monitor, or run "
                "`agora-node --role monitor --authorizer URL --account-token ADMIN_TOKEN --db URL` against this "
                "authorizer's database")


def _authorizer(request: Request):
    return request.app.state.authorizer


def _store(request: Request):
    authorizer = _authorizer(request)
    store = getattr(authorizer, "monitor_store", None)
    if store is None:
        from authorizer.monitor.store import MonitorStore

        store = authorizer.monitor_store = MonitorStore(authorizer.store.write_engine, authorizer.store.read_engine)
    return store


async def _cached(request: Request, key: str, compute: Callable[[], Any]) -> Any:
    """`compute()` in a thread, its answer shared for CACHE_S by every request with the same `key`."""
    cache: dict = request.app.state.__dict__.setdefault("_monitor_cache", {})
    now = time.monotonic()
    hit = cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    value = await asyncio.to_thread(compute)
    if len(cache) > 256:
        cache.clear()
    cache[key] = (now + CACHE_S, value)
    return value


async def _overview(request: Request) -> dict:
    """The overview, or MonitorOff."""
    authorizer = _authorizer(request)
    store = _store(request)

    def compute() -> Optional[dict]:
        parts = store.overview()
        if parts is None:
            return None
        counts = authorizer.store.pool_counts()
        from authorizer.admission import MONITOR_POOL

        parts["nodes"]["admitted"] = sum(c.admitted for pool, c in counts.items() if pool != MONITOR_POOL)
        parts["nodes"]["queued"] = sum(c.queued for pool, c in counts.items() if pool != MONITOR_POOL)
        return parts

    parts = await _cached(request, "overview", compute)
    monitor = authorizer.monitor
    if parts is None:
        raise MonitorOff(_OFF_MESSAGE if monitor is None else
                         "the health monitor has not taken its first snapshot yet; retry in a few seconds")
    if monitor is None:
        interval = float(parts.get("interval_s") or 10.0)
        if time.time() - float(parts["updated_at"]) > max(300.0, STALE_AFTER_INTERVALS * interval):
            raise MonitorOff(_OFF_MESSAGE)
    return {"run_id": authorizer.run.run_id, "num_stages": authorizer.run.num_stages,
            **{k: v for k, v in parts.items() if k != "run_id"},
            "stages": [_public_stage(s) for s in parts["stages"]]}


def _public_stage(stage: dict) -> dict:
    averaging = {k: v for k, v in stage["averaging"].items() if k not in ("recent_rounds", "recent_failed")}
    return {**stage, "averaging": averaging}


@monitor_router.get("/v1/monitor/overview")
async def overview(request: Request) -> dict:
    """The run now: stages (replicas, phases, step, throughput, averaging), training progress
    counted once, node counts, and the active alerts."""
    return await _overview(request)


@monitor_router.get("/v1/monitor/progress")
async def progress(request: Request, since: Annotated[Optional[float], Query(ge=0, le=1e11)] = None,
                   limit: Annotated[int, Query(ge=1, le=MAX_PROGRESS_POINTS)] = 500) -> dict:
    """Training progress points (samples and tokens counted once, loss, tokens/s), oldest first:
    after `since` (unix seconds), or the newest `limit` without it."""
    await _overview(request)
    store = _store(request)
    points = await _cached(request, f"progress:{since}:{limit}", lambda: store.progress(since, limit))
    return {"points": points}


@monitor_router.get("/v1/monitor/nodes")
async def nodes(request: Request) -> dict:
    """Every node the monitor has seen: present ones, and gone ones with their last state."""
    await _overview(request)
    store = _store(request)
    return {"nodes": await _cached(request, "nodes", store.nodes)}


@monitor_router.get("/v1/monitor/nodes/{peer_id}")
async def node(request: Request, peer_id: str) -> dict:
    """One node: its row, its history samples (oldest first) and its last averaging rounds."""
    if len(peer_id) > 128 or not _PEER_ID.match(peer_id):
        raise NotFound(f"{peer_id[:64]!r} is not a peer id (base58, 20-128 characters); GET /v1/monitor/nodes "
                       f"lists them")
    await _overview(request)
    store = _store(request)
    found = await _cached(request, f"node:{peer_id}", lambda: store.node(peer_id))
    if found is None:
        raise NotFound(f"the health monitor has never seen peer {peer_id}; GET /v1/monitor/nodes lists the ones it has")
    return found


@monitor_router.get("/v1/monitor/alerts")
async def alerts(request: Request, active: Optional[bool] = None) -> dict:
    """Alerts, newest first: the active ones (active=true), the resolved ones (active=false), or all."""
    await _overview(request)
    store = _store(request)
    return {"alerts": await _cached(request, f"alerts:{active}", lambda: store.alerts(active))}


# ---- Prometheus ------------------------------------------------------------------------------


class _Collector:
    """Builds the metric families from the monitor's last snapshot (or the database's) and the
    admission counts, at each scrape."""

    def __init__(self, authorizer, store):
        self.authorizer, self.store = authorizer, store

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        from authorizer.admission import MONITOR_POOL
        from authorizer.policy import TRAINER_POOL

        run = self.authorizer.run.run_id
        admitted = GaugeMetricFamily("agora_authorizer_admitted", "nodes admitted, per pool", labels=["run", "pool"])
        queued = GaugeMetricFamily("agora_authorizer_queued", "nodes queued for admission, per pool",
                                   labels=["run", "pool"])
        for pool, count in sorted(self.authorizer.store.pool_counts().items()):
            name = {TRAINER_POOL: "trainers", MONITOR_POOL: "monitors"}.get(pool, str(pool))
            admitted.add_metric([run, name], count.admitted)
            queued.add_metric([run, name], count.queued)
        yield admitted
        yield queued
        evidence = CounterMetricFamily("agora_authorizer_evidence", "evidence reports judged since this authorizer "
                                       "started, per verdict (upheld, already_revoked, rejected) and reason of a "
                                       "rejection", labels=["run", "verdict", "reason"])
        counts = {("upheld", ""): 0, ("already_revoked", ""): 0, **self.authorizer.evidence.counts}
        for (verdict, reason), count in sorted(counts.items()):
            evidence.add_metric([run, verdict, reason], count)
        yield evidence
        monitor = self.authorizer.monitor
        snapshot = monitor.latest if monitor is not None else None
        if snapshot is None:
            parts = self.store.overview()
            if parts is None:
                yield GaugeMetricFamily("agora_monitor_up", "1 if a health monitor snapshot is available",
                                        labels=["run"])
                return
            snapshot = {"t": parts["updated_at"], "stages": parts["stages"], "nodes": parts["nodes"],
                        "alerts": parts["alerts"], "progress": {**parts["training"]}}
        up = GaugeMetricFamily("agora_monitor_up", "1 if a health monitor snapshot is available", labels=["run"])
        up.add_metric([run], 1)
        yield up
        last = GaugeMetricFamily("agora_monitor_last_snapshot_timestamp_seconds", "unix time of the last snapshot",
                                 labels=["run"])
        last.add_metric([run], float(snapshot["t"]))
        yield last
        families = {
            "replicas": GaugeMetricFamily("agora_monitor_stage_replicas", "workers present on the stage",
                                          labels=["run", "stage"]),
            "active": GaugeMetricFamily("agora_monitor_stage_active_replicas", "workers active on the stage",
                                        labels=["run", "stage"]),
            "min": GaugeMetricFamily("agora_monitor_stage_min_replicas", "active replicas the stage needs",
                                     labels=["run", "stage"]),
            "step": GaugeMetricFamily("agora_monitor_stage_step", "the stage's optimizer step",
                                      labels=["run", "stage"]),
            "throughput": GaugeMetricFamily("agora_monitor_stage_throughput", "samples/s the stage's workers "
                                            "announce, summed", labels=["run", "stage"]),
            "success": GaugeMetricFamily("agora_monitor_stage_averaging_success_rate", "complete share of the "
                                         "stage's recent averaging rounds", labels=["run", "stage"]),
        }
        for s in snapshot["stages"]:
            labels = [run, str(s["stage"])]
            families["replicas"].add_metric(labels, s["replicas"])
            families["active"].add_metric(labels, s["phases"]["active"])
            families["min"].add_metric(labels, s["min_replicas"])
            families["throughput"].add_metric(labels, s["throughput"])
            if s["step"] is not None:
                families["step"].add_metric(labels, s["step"])
            if s["averaging"].get("success_rate") is not None:
                families["success"].add_metric(labels, s["averaging"]["success_rate"])
        yield from families.values()
        nodes = GaugeMetricFamily("agora_monitor_nodes", "nodes the monitor knows, present or gone",
                                  labels=["run", "state"])
        for state in ("present", "gone"):
            nodes.add_metric([run, state], snapshot["nodes"].get(state, 0))
        yield nodes
        alerts = GaugeMetricFamily("agora_monitor_alerts_active", "active health alerts, per kind",
                                   labels=["run", "kind"])
        for kind in SEVERITY:
            alerts.add_metric([run, kind], sum(1 for a in snapshot["alerts"] if a["kind"] == kind))
        yield alerts
        progress = snapshot["progress"]
        samples = CounterMetricFamily("agora_monitor_samples", "training samples completed in the run, counted once",
                                      labels=["run"])
        samples.add_metric([run], progress["samples"])
        yield samples
        tokens = CounterMetricFamily("agora_monitor_tokens", "training tokens of the completed samples",
                                     labels=["run"])
        tokens.add_metric([run], progress["tokens"])
        yield tokens
        if progress.get("loss") is not None:
            loss = GaugeMetricFamily("agora_monitor_loss", "the run's recent loss (mean over trainers)",
                                     labels=["run"])
            loss.add_metric([run], progress["loss"])
            yield loss
        if progress.get("eval_loss") is not None:
            held_out = GaugeMetricFamily("agora_monitor_eval_loss", "the run's latest held-out loss (its evaluating "
                                         "trainer's)", labels=["run"])
            held_out.add_metric([run], progress["eval_loss"])
            yield held_out


@monitor_router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    """Prometheus text format: the health monitor's figures and the admission counts."""
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

    from authorizer.metrics_push import PUSH_REGISTRY

    state = request.app.state.__dict__
    registry = state.get("_monitor_registry")
    if registry is None:
        registry = state["_monitor_registry"] = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(_authorizer(request), _store(request)))
        registry.register(PUSH_REGISTRY)  # the push front's counts (authorizer/metrics_push.py)
    body = await _cached(request, "metrics", lambda: generate_latest(registry))
    return Response(content=body, media_type=CONTENT_TYPE_LATEST)
