"""A worker's metrics: the four balance signals of each stage [report 3.4.3] (queue wait, compute
time per coalesced batch, batch size, utilisation), its queues and requests, its steps and sync
phase, and its averaging rounds. All read from the role's own counters at scrape time."""

from __future__ import annotations

from typing import Iterable, Optional

from node.metrics.registry import Families, Family, NodeMetrics
from protocol.dht_schema import Phase, RoundStatus
from roles.worker.serving.queues import TaskKind
from roles.worker.role import WorkerRole, WorkerState
from roles.worker.health.termination import RULES

PASSES = tuple(kind.value for kind in TaskKind)
ROUND_OUTCOMES = tuple(status.value for status in RoundStatus)


def worker_readiness(role: WorkerRole) -> Optional[str]:
    """None when the worker serves as a full member of its stage, else why not."""
    if role.state != WorkerState.ONLINE:
        return f"worker is {role.state.value}"
    if not role.announcer.announced:
        return "not announced in the DHT yet"
    if role.phase != Phase.ACTIVE:
        return f"in {role.phase.value}"
    return None


def attach_worker(metrics: NodeMetrics, role: WorkerRole) -> None:
    metrics.bytes["pipeline"] = lambda: (role.server.bytes_sent, role.server.bytes_received)
    metrics.bytes["averaging"] = lambda: (role.averaging.bytes_sent, role.averaging.bytes_received)
    metrics.relayed_bytes.append(lambda: tuple(role.server.relayed_bytes))
    metrics.auth_rejections["pipeline"] = lambda: dict(role.server.auth_rejected)
    metrics.auth_rejections["averaging"] = role.averaging.refusals
    metrics.add("worker", lambda f: _worker(f, role))
    metrics.add("averaging", lambda f: _averaging(f, role))
    if role.sparseloco is not None:
        slc = role.sparseloco
        metrics.bytes["sparseloco"] = lambda: (slc.bytes_sent, slc.bytes_received)
        metrics.add("sparseloco", lambda f: _sparseloco(f, role))


def _worker(f: Families, role: WorkerRole) -> Iterable[Family]:
    stats = role.runtime.batch_stats
    forward, backward = TaskKind.FORWARD, TaskKind.BACKWARD
    yield f.histogram("agora_worker_queue_wait_seconds", "time a request waited in the queue for the compute "
                      "thread (microbatch data-await time)",
                      {(k.value, ): d.snapshot() for k, d in stats.queue_wait.items()}, ("pass", ))
    yield f.histogram("agora_worker_forward_seconds", "compute time of one coalesced forward batch",
                      {(): stats.compute[forward].snapshot()})
    yield f.histogram("agora_worker_backward_seconds", "compute time of one coalesced backward batch "
                      "(recomputed forward included)", {(): stats.compute[backward].snapshot()})
    yield f.histogram("agora_worker_batch_size", "requests coalesced into one batch",
                      {(k.value, ): d.snapshot() for k, d in stats.batch_size.items()}, ("pass", ))
    yield f.gauge("agora_worker_utilization_ratio", "share of the last 30 s the compute thread spent computing "
                  "batches", stats.busy.ratio())
    pending = role.runtime.queues.pending()
    yield f.gauges("agora_worker_queue_length", "requests queued for the compute thread", "pass",
                   {kind.value: n for kind, n in pending.items()})
    outcomes = {(kind, "ok"): 0 for kind in PASSES}
    outcomes.update(role.handlers.outcomes)
    yield f.counters("agora_worker_requests_total", "forward and backward requests answered, by outcome: ok or "
                     "the error code of the reply", ("pass", "outcome"), outcomes)
    yield f.gauge("agora_worker_max_batch", "largest batch this worker coalesces", role.runtime.queues.max_batch)
    yield f.gauge("agora_worker_throughput_samples_per_second", "samples per second of compute, smoothed (what "
                  "the worker announces)", role.runtime.throughput)
    yield f.counter("agora_worker_optimizer_steps_total", "optimizer steps this replica took",
                    len(role.ledger.step_sizes))
    yield f.gauge("agora_worker_stage_step", "the stage step this replica is at", role.optimizer.local_step)
    writer = role.checkpoint_writer
    if writer is not None:
        counts = writer.counters
        yield f.gauge("agora_worker_checkpoint_step", "the step of this writer's last run checkpoint (serialized; "
                      "uploading or uploaded)", writer.last_step)
        yield f.counters("agora_worker_checkpoint_uploads_total", "this writer's run checkpoints by outcome: "
                         "uploaded, failed, or skipped (the previous upload still running, or in weight sync)",
                         ("outcome", ), {("uploaded", ): counts.get("checkpoints_uploaded", 0),
                                         ("failed", ): counts.get("checkpoint_upload_failures", 0),
                                         ("skipped", ): counts.get("checkpoints_skipped_busy", 0)
                                         + counts.get("checkpoints_skipped_syncing", 0)})
    current = Phase.LEAVING if role.state in (WorkerState.STOPPING, WorkerState.STOPPED) else role.phase
    yield f.gauges("agora_worker_sync_phase", "1 for the sync phase the worker is in, 0 for the others", "phase",
                   {phase.value: float(phase == current) for phase in Phase})
    firing = role.termination.firing
    yield f.gauges("agora_worker_self_termination", "1 for the self-termination rule that fired (the worker is "
                   "leaving its stage), 0 for the others", "rule",
                   {rule.name: float(firing is not None and firing.rule is rule) for rule in RULES})


def _averaging(f: Families, role: WorkerRole) -> Iterable[Family]:
    service = role.averaging
    counts = service.counters
    rounds = {(outcome, ): counts.get(f"rounds_{outcome}", 0) for outcome in ROUND_OUTCOMES}
    rounds[(RoundStatus.FAILED.value, )] += counts.get("rounds_crashed", 0)
    yield f.counters("agora_averaging_rounds_total", "averaging rounds by outcome (a crashed round counts as "
                     "failed)", ("outcome", ), rounds)
    yield f.histogram("agora_averaging_round_seconds", "duration of the averaging rounds that ran",
                      {(): service.round_seconds.snapshot()})
    yield f.gauge("agora_averaging_completeness_ratio", "share of the buffer the last round that ran averaged "
                  "(its averaging success)", service.last_completeness)
    yield f.gauges("agora_averaging_reducer", "1 if this replica reduces slices, by how it became a reducer",
                   "how", {"flag": float(service.reducer and not service.elected), "elected": float(service.elected)})
    judged = service.divergence.last
    yield f.gauge("agora_averaging_relative_distance", "how far this replica sat from the average of the last "
                  "round judged for divergence (relative L2)", judged.distance if judged is not None else None)
    yield f.counter("agora_averaging_divergence_resyncs_total", "times this replica was its stage's outlier and "
                    "went back to weight sync", counts.get("divergence_resyncs", 0))


SPARSELOCO_OUTCOMES = ("complete", "partial", "alone", "failed")


def _sparseloco(f: Families, role: WorkerRole) -> Iterable[Family]:
    slc = role.sparseloco
    counts = slc.counters
    yield f.counters("agora_sparseloco_rounds_total", "SparseLoCo fragment rounds by outcome: complete (every "
                     "expected replica's fragment applied), partial, alone (no other replica), failed (none arrived)",
                     ("outcome", ), {(o, ): counts.get(f"rounds_{o}", 0) for o in SPARSELOCO_OUTCOMES})
    yield f.histogram("agora_sparseloco_wait_seconds", "time the compute thread waited for a round's exchange "
                      "(its share of the critical path)", {(): slc.wait_s.snapshot()})
    yield f.gauge("agora_sparseloco_density_ratio", "share of the stage's parameters one cycle sends", slc.density)
    last = slc.recent[-1] if slc.recent else None
    yield f.gauge("agora_sparseloco_round_bytes", "bytes this replica sent each other replica in its last round",
                  last.bytes_sent / max(1, last.expected) if last else None)
    refused = {(k[len("fragments_refused_"):], ): v for k, v in counts.items() if k.startswith("fragments_refused_")}
    yield f.counters("agora_sparseloco_fragments_refused_total", "fragments of other replicas refused, by reason "
                     "(a failed check: the error code)", ("reason", ), refused)
    yield f.counter("agora_sparseloco_anchor_mismatches_total", "rounds in which this replica found its anchor "
                    "was not its stage's consensus (it reloads the stage's state)", counts.get("anchor_mismatches", 0))
