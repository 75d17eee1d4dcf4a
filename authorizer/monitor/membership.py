"""Who is in the run, and since and until when [report 3.6.2.2].

The DHT keeps only the present: a node refreshes its records, and once it stops they lapse. A
record that is still there is not proof of life, though: a SIGKILLed worker's announcement lives
out its TTL. So a node counts as present while its newest record keeps being refreshed. Our
announcers store each record for three periods and refresh it every period (roles/announcer.py);
a record whose expiration has not moved for two periods (plus a second of slack) missed two
refreshes, and its node is gone. The TTL is learnt per node as the longest remaining life any of
its records showed; at first sight a record is never stale.

What the DHT forgets, `monitor_nodes` keeps: first and last seen, when a node was found gone, and
its last phase, step and throughput, after its records have expired.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from authorizer.monitor.observation import Observation, Sighting
from protocol.relays import is_relayed

STALE_SLACK_S = 1.0


@dataclass
class Placement:
    """A live admission: what the authorizer placed the peer as."""

    role: str
    stage: Optional[int]


@dataclass
class NodeState:
    """One row of `monitor_nodes`."""

    peer_id: str
    role: str
    stage: Optional[int]
    first_seen: float
    last_seen: float
    state: str = "present"
    phase: Optional[str] = None
    gone_at: Optional[float] = None
    admitted: bool = True
    throughput: Optional[float] = None
    step: Optional[int] = None
    samples: Optional[int] = None
    rss_bytes: Optional[int] = None
    last_expiration: Optional[float] = None
    ttl_s: Optional[float] = None
    rounds: list = field(default_factory=list)
    host_memory_total_bytes: Optional[int] = None
    device_memory_used_bytes: Optional[int] = None
    device_memory_total_bytes: Optional[int] = None
    rounds_complete: Optional[int] = None
    rounds_partial: Optional[int] = None
    rounds_failed: Optional[int] = None
    relayed: Optional[bool] = None
    """It announces only addresses through the run's relays (it sits behind NAT)."""
    relayed_bytes: Optional[int] = None

    @property
    def present(self) -> bool:
        return self.state == "present"


def is_stale(expiration: float, ttl_s: float, now: float) -> bool:
    """True if a record stored `ttl_s` before `expiration` has missed two refreshes by `now`."""
    stored_at = expiration - ttl_s
    return now - stored_at > 2 * ttl_s / 3 + STALE_SLACK_S


def _absorb(node: NodeState, seen: Sighting) -> None:
    node.role, node.stage = seen.role, seen.stage
    if seen.worker is not None:
        w = seen.worker
        node.phase, node.throughput = w.phase.value, w.throughput
        node.rss_bytes, node.host_memory_total_bytes = w.host_rss_bytes, w.host_memory_total_bytes
        node.device_memory_used_bytes, node.device_memory_total_bytes = (w.device_memory_used_bytes,
                                                                          w.device_memory_total_bytes)
        node.relayed = bool(w.maddrs) and all(is_relayed(m) for m in w.maddrs)
        node.relayed_bytes = w.relayed_bytes
    if seen.progress is not None:
        node.step, node.samples = seen.progress.local_step, seen.progress.samples_consumed
    if seen.averaging is not None:
        a = seen.averaging
        node.rounds = [r.model_dump(mode="json") for r in a.recent]
        node.rounds_complete, node.rounds_partial, node.rounds_failed = (a.rounds_complete, a.rounds_partial,
                                                                        a.rounds_failed)
    if seen.trainer is not None:
        node.phase, node.samples = "training", seen.trainer.samples_completed


def update_membership(nodes: dict[str, NodeState], obs: Observation,
                      placements: Optional[dict[str, Placement]]) -> tuple[list[NodeState], list[dict]]:
    """Apply one observation to `nodes` (in place): the nodes whose row changed, and one history
    sample per present node. With `placements` None (no admission table to read) the admitted
    flag is left as it was."""
    t = obs.t
    changed: list[NodeState] = []
    samples: list[dict] = []
    for peer, seen in obs.sightings.items():
        node = nodes.get(peer)
        if node is None:
            node = nodes[peer] = NodeState(peer_id=peer, role=seen.role, stage=seen.stage, first_seen=t, last_seen=t)
        _absorb(node, seen)
        node.ttl_s = max(node.ttl_s or 0.0, seen.expiration - t)
        node.last_expiration = seen.expiration
        if placements is not None:
            node.admitted = peer in placements
        if is_stale(seen.expiration, node.ttl_s, t):
            if node.present:
                node.state, node.gone_at = "gone", t
        else:
            # last seen: when its newest record was stored (its refresh), not when we looked
            stored_at = min(t, seen.expiration - node.ttl_s)
            node.state, node.gone_at, node.last_seen = "present", None, max(node.last_seen, stored_at)
            samples.append(dict(peer_id=peer, t=t, phase=node.phase, throughput=node.throughput, step=node.step,
                                samples=node.samples, rss_bytes=node.rss_bytes,
                                rounds_complete=node.rounds_complete, rounds_failed=node.rounds_failed))
        changed.append(node)
    for peer, node in nodes.items():
        if peer in obs.sightings or not node.present:
            continue
        # its records expired or were withdrawn; if a read failed, absence proves nothing
        if obs.complete or peer in obs.tombstoned:
            node.state, node.gone_at = "gone", t
            if peer in obs.tombstoned:
                node.phase = "left"
            changed.append(node)
    return changed, samples
