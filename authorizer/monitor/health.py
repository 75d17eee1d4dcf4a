"""Health checks: what the network reports against what the run requires [report 3.6.2.4].

Each snapshot yields a set of conditions, each a (kind, subject) with a severity and a sentence.
The alert book turns them into alerts: a condition not yet active raises an alert, one that is
gone resolves it. Conditions drawn from rejected records (a forged trainer report, an announcement
under a stage the peer was not placed on) are events, not states: their alert stays active until
`EVENT_HOLD_S` passes without the event happening again.

| kind | severity | raised when |
|---|---|---|
| forged_trainer_report | critical | a record under `{run}/trainers` carried a credential that is not a trainer's |
| unplanned_stage | critical | a peer announced under a stage it was not placed on (its credential's stage, or its admission) |
| not_admitted | critical | a valid record from a peer with no live admission |
| under_replicated | critical | a stage has fewer active replicas than its minimum (once the run has started) |
| stalled | critical | trainers are present and a stage's step has not moved for `STALL_INTERVALS` snapshots and `STALL_MIN_S` |
| diverging_loss | warning | the run's loss is above `DIVERGENCE_RATIO` times its best and rising |
| averaging_failures | warning | more than `AVERAGING_FAILURE_RATE` of a stage's recent rounds failed (at least `AVERAGING_MIN_ROUNDS`) |
| memory_pressure | warning | a node's RSS is above `HOST_MEMORY_RATIO` of its memory, or its device memory above `DEVICE_MEMORY_RATIO` |
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from authorizer.monitor.membership import NodeState, Placement
from authorizer.monitor.observation import Observation

EVENT_HOLD_S = 600.0
STALL_INTERVALS = 6
STALL_MIN_S = 300.0
"""A stage counts as stalled after STALL_INTERVALS snapshots and at least this long without a step:
a small run steps every few seconds, a large one every few minutes."""
DIVERGENCE_RATIO = 1.5
DIVERGENCE_MIN_POINTS = 5
AVERAGING_FAILURE_RATE = 0.5
AVERAGING_MIN_ROUNDS = 4
HOST_MEMORY_RATIO = 0.9
DEVICE_MEMORY_RATIO = 0.95

EVENT_KINDS = frozenset({"forged_trainer_report", "unplanned_stage"})
SEVERITY = {
    "forged_trainer_report": "critical", "unplanned_stage": "critical", "not_admitted": "critical",
    "under_replicated": "critical", "stalled": "critical", "diverging_loss": "warning",
    "averaging_failures": "warning", "memory_pressure": "warning",
}
_STAGE_KEY = re.compile(r"/stage/(\d+)/(workers|progress|averaging)$")


@dataclass(frozen=True)
class Condition:
    kind: str
    subject: str
    message: str

    @property
    def severity(self) -> str:
        return SEVERITY[self.kind]


@dataclass
class Alert:
    """One row of `monitor_alerts`; `id` is None until stored."""

    kind: str
    severity: str
    subject: str
    message: str
    first_at: float
    last_at: float
    resolved_at: Optional[float] = None
    id: Optional[int] = None

    def as_json(self) -> dict:
        return dict(id=self.id, kind=self.kind, severity=self.severity, subject=self.subject, message=self.message,
                    first_at=self.first_at, last_at=self.last_at, resolved_at=self.resolved_at)


# ---- stages -----------------------------------------------------------------------------------


def stage_summaries(nodes: dict[str, NodeState], num_stages: int, min_replicas: list[int]) -> list[dict]:
    """Each stage as GET /v1/monitor/overview shows it, from the present workers."""
    stages = []
    for stage in range(num_stages):
        workers = [n for n in nodes.values() if n.present and n.role == "worker" and n.stage == stage]
        phases = {"active": 0, "weight_sync": 0, "optimizer_sync": 0, "leaving": 0}
        for node in workers:
            if node.phase in phases:
                phases[node.phase] += 1
        steps = [n.step for n in workers if n.step is not None]
        rounds = [r for n in workers for r in n.rounds]
        ran = [r for r in rounds if r.get("status") in ("complete", "partial", "failed")]
        complete = sum(1 for r in ran if r.get("status") == "complete")
        finished = [float(r.get("finished_at") or 0.0) for r in rounds]
        stages.append({
            "stage": stage, "replicas": len(workers), "min_replicas": min_replicas[stage], "phases": phases,
            "step": max(steps) if steps else None,
            "throughput": round(sum(n.throughput or 0.0 for n in workers), 6),
            "averaging": {
                # the rounds say which method keeps the replicas together: SparseLoCo's are kind 'sloco'
                "method": "sparseloco" if any(r.get("kind") == "sloco" for r in rounds) else "asyncsparta",
                "complete": sum(n.rounds_complete or 0 for n in workers),
                "partial": sum(n.rounds_partial or 0 for n in workers),
                "failed": sum(n.rounds_failed or 0 for n in workers),
                "skipped": sum(1 for r in rounds if r.get("status") == "skipped"),
                "success_rate": round(complete / len(ran), 4) if ran else None,
                "last_round_at": max(finished) if finished and max(finished) > 0 else None,
                "recent_rounds": len(ran),
                "recent_failed": sum(1 for r in ran if r.get("status") == "failed"),
            },
        })
    return stages


# ---- conditions -------------------------------------------------------------------------------


def rejection_conditions(obs: Observation) -> list[Condition]:
    """Events from the records our validator refused: forged trainer reports, unplanned stages."""
    found: dict[tuple[str, str], Condition] = {}
    for r in obs.rejections:
        if r.reason not in ("wrong_role", "wrong_stage"):
            continue  # unsigned, expired or malformed records prove nothing about the peer in the subkey
        holder = f"a {r.role}'s credential" + (f" for stage {r.stage}" if r.stage is not None else "")
        if r.key.endswith("/trainers"):
            found[("forged_trainer_report", r.peer_id)] = Condition("forged_trainer_report", r.peer_id, (
                f"peer {r.peer_id} wrote a trainer report under {r.key} with {holder}; it was refused and not "
                f"counted. Exclude the peer: POST /v1/admin/bans {{\"peer_id\": \"{r.peer_id}\"}}"))
            continue
        match = _STAGE_KEY.search(r.key)
        if match is None:
            continue
        placed = f"placed on stage {r.stage}" if r.role == "worker" else f"admitted as a {r.role}"
        found[("unplanned_stage", r.peer_id)] = Condition("unplanned_stage", r.peer_id, (
            f"peer {r.peer_id}, {placed}, announced itself under stage {match.group(1)} ({holder}); the record "
            f"was refused. If it persists, ban the peer: POST /v1/admin/bans"))
    return list(found.values())


def admission_conditions(obs: Observation, nodes: dict[str, NodeState],
                         placements: Optional[dict[str, Placement]]) -> list[Condition]:
    """Valid records checked against the admissions: present without one, or on another stage."""
    if placements is None:
        return []
    found = []
    for peer, seen in obs.sightings.items():
        if not nodes[peer].present:
            continue
        placement = placements.get(peer)
        if placement is None:
            found.append(Condition("not_admitted", peer, (
                f"{seen.role} {peer} is active in the DHT but holds no live admission (it left, expired or was "
                f"replaced, and its credential is still valid); ban it if it should not be there")))
        elif seen.role == "worker" and placement.stage != seen.stage:
            where = f"stage {placement.stage}" if placement.stage is not None else f"the {placement.role}s"
            found.append(Condition("unplanned_stage", peer, (
                f"worker {peer} was placed on {where} but serves stage {seen.stage}")))
    return found


def replica_conditions(stages: list[dict], started: bool) -> list[Condition]:
    if not started:
        return []
    return [Condition("under_replicated", f"stage {s['stage']}", (
        f"stage {s['stage']} has {s['phases']['active']} active replica(s), below its minimum of "
        f"{s['min_replicas']}; the pipeline stalls there. Admit more workers (raise --stage-capacity) or check "
        f"why its workers left")) for s in stages if s["phases"]["active"] < s["min_replicas"]]


def stall_conditions(stages: list[dict], stalled_for: dict[int, tuple[int, float]], trainers: int) -> list[Condition]:
    """`stalled_for[stage]`: (snapshots, seconds) since the stage's step last moved while trainers
    reported (kept by the caller)."""
    if trainers == 0:
        return []
    found = []
    for s in stages:
        count, seconds = stalled_for.get(s["stage"], (0, 0.0))
        if s["step"] is not None and count >= STALL_INTERVALS and seconds >= STALL_MIN_S:
            found.append(Condition("stalled", f"stage {s['stage']}", (
                f"stage {s['stage']} has not stepped for {seconds:.0f} s (step {s['step']}) while {trainers} "
                f"trainer(s) report; check its workers' logs and the averaging health")))
    return found


def loss_conditions(losses: list[float], best: Optional[float]) -> list[Condition]:
    """`losses`: the run's recent losses, oldest first; `best`: the lowest it ever reached."""
    if best is None or best <= 0 or len(losses) < DIVERGENCE_MIN_POINTS:
        return []
    current, earlier = losses[-1], losses[-4:-1]
    if current > DIVERGENCE_RATIO * best and current > sum(earlier) / len(earlier):
        return [Condition("diverging_loss", "run", (
            f"the run's loss is {current:.4g}, {current / best:.2f}x its best of {best:.4g}, and rising; check "
            f"the learning rate, recent admissions and the averaging health"))]
    return []


def averaging_conditions(stages: list[dict]) -> list[Condition]:
    found = []
    for s in stages:
        ran, failed = s["averaging"]["recent_rounds"], s["averaging"]["recent_failed"]
        if ran >= AVERAGING_MIN_ROUNDS and failed / ran > AVERAGING_FAILURE_RATE:
            found.append(Condition("averaging_failures", f"stage {s['stage']}", (
                f"{failed} of stage {s['stage']}'s last {ran} averaging rounds failed; its replicas drift apart. "
                f"Check the workers' network and their averaging logs")))
    return found


def memory_conditions(nodes: dict[str, NodeState]) -> list[Condition]:
    found = []
    for node in nodes.values():
        if not node.present:
            continue
        host = (node.rss_bytes / node.host_memory_total_bytes
                if node.rss_bytes and node.host_memory_total_bytes else 0.0)
        device = (node.device_memory_used_bytes / node.device_memory_total_bytes
                  if node.device_memory_used_bytes and node.device_memory_total_bytes else 0.0)
        if host > HOST_MEMORY_RATIO or device > DEVICE_MEMORY_RATIO:
            what = (f"host memory {host:.0%}" if host > HOST_MEMORY_RATIO else f"device memory {device:.0%}")
            found.append(Condition("memory_pressure", node.peer_id, (
                f"{node.role} {node.peer_id} (stage {node.stage}) uses {what} of its limit; it may be killed "
                f"for memory soon. Lower its --max-batch or give it more memory")))
    return found


# ---- the alert book ---------------------------------------------------------------------------


class AlertBook:
    """The active alerts, keyed by (kind, subject): raises, refreshes and resolves them."""

    def __init__(self, active: list[Alert]):
        self.active = {(a.kind, a.subject): a for a in active}

    def apply(self, conditions: list[Condition], now: float) -> tuple[list[Alert], list[Alert], list[Alert]]:
        """(raised, refreshed, resolved) alerts after this snapshot's conditions."""
        raised, refreshed, resolved = [], [], []
        current = {(c.kind, c.subject): c for c in conditions}
        for key, condition in current.items():
            alert = self.active.get(key)
            if alert is None:
                alert = self.active[key] = Alert(kind=condition.kind, severity=condition.severity,
                                                 subject=condition.subject[:160], message=condition.message,
                                                 first_at=now, last_at=now)
                raised.append(alert)
            else:
                alert.last_at, alert.message = now, condition.message
                refreshed.append(alert)
        for key, alert in list(self.active.items()):
            if key in current:
                continue
            if alert.kind in EVENT_KINDS and now - alert.last_at < EVENT_HOLD_S:
                continue
            alert.resolved_at = now
            del self.active[key]
            resolved.append(alert)
        return raised, refreshed, resolved
