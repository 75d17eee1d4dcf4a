"""One AsyncSPARTA round on one replica: snapshot the segment, all-reduce it, apply the delta.

The round runs in the background while the replica keeps training, so by the time the average
comes back the weights have moved on. Writing the average back would erase those steps; the
delta rule adds only the consensus shift instead [report 4.2.2, eq. 8]:

    theta[I] <- theta[I] + (average[I] - snapshot[I])

A step round's snapshot is the segment as it stood right after the boundary step (`capture`,
called by the compute thread at that step), not whenever the round's group happened to form:
replicas that add up their gradients every step hold equal weights at the boundary, so they
average equal snapshots, get back exactly what they sent and stay equal bit for bit. A snapshot
taken later could catch one replica a step further than the other, and the delta would then move
them apart by half that step each. Equal snapshots are also what a step round's gathered metadata
compares (a hash of the values): when every member of the group sent the very values this
replica did, their average is those values, and the round applies nothing. The averager's
weighted mean of equal values need not be equal to them in float32 (weights 213 and 111 moved a
replica by 2e-8), and a delta applied a step apart on two replicas parts them by rounding.

The optimizer's lock is held only to take the snapshot and to apply the delta, never across the
network part. A reducer slice that failed comes back as a zero delta (hivemind keeps local values
there), so the replica keeps its own, advanced weights for it.

The outcome records what the report measures per round and per peer [report 5.7.1.1] (reduce and
averaging success, group size against the stage's workers, duration, why it was not complete),
and names the senders this replica, as a reducer, left out of the average for sending garbage
(screening.py) among the round's banned senders.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from protocol.dht_schema import FailedSliceRecord, RoundStatus, RoundSummaryRecord
from roles.worker.averaging.access import GROUP_REFUSED
from roles.worker.averaging.averager import StageAverager
from roles.worker.averaging.index_sets import IndexSet, SegmentIndexSets
from roles.worker.layout import FlatLayout, ParameterStore


def delta_rule(current: torch.Tensor, snapshot: torch.Tensor, average: torch.Tensor) -> torch.Tensor:
    """Eq. 8 of the report: keep the local progress made since the snapshot, add the consensus
    shift. Exactly what `SegmentRound` applies in place to the master weights."""
    return current + (average - snapshot)


def round_key_bits(kind: str, round_id: int, digest: str) -> str:
    """Group-key bits of a round: peers meet only if they agree on the round and on its index
    set, so a replica with a different index set is never averaged blindly."""
    value = hashlib.blake2b(f"{kind}/{round_id}/{digest}".encode(), digest_size=4).digest()
    return "".join(f"{byte:08b}" for byte in value)


@dataclass(frozen=True)
class RoundPlan:
    """What the service decided before the round: which round, at what weight, with whom."""

    kind: str
    round: int
    segment: int
    weight: float
    expected_group_size: int
    phase: str
    due_at: Optional[float] = None
    """Unix time the round fell due here (None: now); a reducer that starts it late shortens the
    window it declares as a leader to end with the others' (StageAverager.leader_window_s)."""


@dataclass
class RoundOutcome:
    plan: RoundPlan
    digest: str
    status: RoundStatus
    duration_s: float = 0.0
    group: list[str] = field(default_factory=list)
    reduce_success: Optional[float] = None
    averaging_success: Optional[float] = None
    failure_reason: str = ""
    failed_slices: list[FailedSliceRecord] = field(default_factory=list)
    banned_senders: list[str] = field(default_factory=list)
    """Senders this reducer averaged without: banned by hivemind (too slow, gone) or rejected."""
    rejected_senders: dict[str, str] = field(default_factory=dict)
    """Of those, the ones whose parts were rejected (not finite, absurd weight or norm), with why."""
    mismatched_peers: list[str] = field(default_factory=list)
    delivered_senders: list[str] = field(default_factory=list)
    """Senders whose whole part of this reducer's slice arrived: alive and in the round, even if
    their own slice did not come back here in time (the repair counts them in)."""
    group_refused: bool = False
    """This replica refused the group its leader assembled (a member was no credentialed worker of
    the stage, access.py): the round failed, but not through any fault of this replica's."""
    allreduce_began: bool = False
    """The round found its group and its all-reduce started (False: no group formed, or the round
    failed before it looked for one)."""
    delta_sq: float = 0.0
    average_sq: float = 0.0
    allreduce_s: Optional[float] = None
    """Time inside hivemind's all-reduce (after matchmaking), as the averager process measured it."""
    boundary_snapshot: bool = False
    """The snapshot was the segment at the boundary step (SegmentRound.capture), not the weights
    when the group formed."""
    identical: bool = False
    """Every member of the group sent the values this replica sent (a step round's boundary
    snapshot, as replicas that add up their gradients hold it): nothing was applied."""
    timings: dict[str, float] = field(default_factory=dict)
    """Where this replica's round time went: prepare, snapshot, step (matchmaking + all-reduce), apply."""
    bytes_sent: int = 0
    bytes_received: int = 0
    """Tensor payload this replica sent and received in the all-reduce, from the slice sizes and
    what came back (4 bytes a value: the round buffer is float32, uncompressed); hivemind's own
    framing is not counted."""
    unsigned_parts: int = 0
    """Parts this reducer averaged unchecked from senders that do not seal theirs (older builds)."""
    part_evidence: list[dict] = field(default_factory=list)
    """Evidence of poisoned parts this reducer refused (protocol/part_evidence.py wire maps, from
    the averager process); the service takes it for reporting, the outcome does not keep it."""
    finished_at: float = field(default_factory=time.time)

    @property
    def relative_distance(self) -> Optional[float]:
        """||average - snapshot|| / ||average|| over the segment: how far this replica was from
        the stage's average on it (None if nothing was averaged)."""
        if self.status not in (RoundStatus.COMPLETE, RoundStatus.PARTIAL) or self.average_sq <= 0:
            return None
        return math.sqrt(self.delta_sq / self.average_sq)

    def to_record(self) -> RoundSummaryRecord:
        return RoundSummaryRecord(
            kind=self.plan.kind, round=self.plan.round, segment=self.plan.segment, digest=self.digest,
            status=self.status, group_size=len(self.group), expected_group_size=self.plan.expected_group_size,
            reduce_success=self.reduce_success, averaging_success=self.averaging_success,
            duration_s=max(0.0, self.duration_s), weight=float(self.plan.weight),
            failure_reason=self.failure_reason[:512], failed_slices=self.failed_slices[:16],
            banned_senders=self.banned_senders[:16], mismatched_peers=self.mismatched_peers[:16],
            relative_distance=self.relative_distance, finished_at=self.finished_at,
        )

    def describe(self) -> str:
        """One log line."""
        head = (f"{self.plan.kind} round {self.plan.round} (segment {self.plan.segment}, weight {self.plan.weight:g}): "
                f"{self.status.value}")
        if self.status == RoundStatus.SKIPPED:
            return f"{head}: {self.failure_reason}"
        parts = [f"group {len(self.group)}/{self.plan.expected_group_size}"]
        if self.reduce_success is not None:
            parts.append(f"reduce {100 * self.reduce_success:.1f}%")
        if self.averaging_success is not None:
            parts.append(f"averaging {100 * self.averaging_success:.1f}%")
        distance = self.relative_distance
        if self.identical:
            parts.append("replicas identical")
        elif distance is not None:
            parts.append(f"moved {distance:.2e}")
        parts.append(f"{self.duration_s:.2f}s")
        line = f"{head}, {', '.join(parts)}"
        return f"{line}; {self.failure_reason}" if self.failure_reason else line


def _values_hash(values: torch.Tensor) -> str:
    return hashlib.blake2b(values.numpy().data, digest_size=16).hexdigest()


def _all_sent(report: dict[str, Any], values: str) -> bool:
    """Whether every member of the round's group reported sending `values` (their hash)."""
    gathered, peers = report.get("gathered", {}), report["telemetry"]["peers"]
    return len(gathered) >= len(peers) and all(
        isinstance(data, dict) and data.get("values") == values for data in gathered.values())


def _short(peer: str) -> str:
    return f"...{peer[-6:]}"


class SegmentRound:
    """Runs rounds for one replica against its averager process (blocking; call off the loop)."""

    def __init__(self, store: ParameterStore, index_sets: SegmentIndexSets, averager: StageAverager, *,
                 lock_timeout_s: float = 60.0):
        self.store = store
        self.index_sets = index_sets
        self.averager = averager
        self.lock_timeout_s = lock_timeout_s
        self._control = None
        """The running round's step, from when it looks for its group until it ends."""
        self._boundary: Optional[tuple[int, str, torch.Tensor]] = None
        """(round, index-set digest, segment values) taken at the last boundary step (`capture`)."""

    def capture(self, round_id: int, segment: int) -> bool:
        """Compute thread, store lock held, right after the step that makes `round_id` due: keep the
        segment's values for that round's snapshot. Only from an index set already computed (the
        service prefetches it): building one takes seconds the compute thread must not spend.
        Returns whether it was kept."""
        index_set = self.index_sets.cached(segment)
        if index_set is None:
            self._boundary = None
            return False
        values = torch.empty(len(index_set), dtype=torch.float32)
        FlatLayout.gather(self.store.master_params, index_set.pieces, values)
        self._boundary = (round_id, index_set.digest, values)
        return True

    def _boundary_values(self, plan: RoundPlan, digest: str) -> Optional[torch.Tensor]:
        boundary = self._boundary
        if plan.kind != "step" or boundary is None or boundary[0] != plan.round or boundary[1] != digest:
            return None
        return boundary[2]

    @property
    def in_allreduce(self) -> bool:
        """Whether a round is running its all-reduce now (not still preparing or looking for its
        group); read from the event loop while the round runs on its thread."""
        control = self._control
        return control is not None and self.averager.began_allreduce(control)

    def run(self, plan: RoundPlan) -> RoundOutcome:
        index_set = self.index_sets.get(plan.segment)
        n = len(index_set)
        started = time.monotonic()
        timings: dict[str, float] = {}

        def lap(name: str, since: float) -> float:
            now = time.monotonic()
            timings[name] = now - since
            return now

        boundary = self._boundary_values(plan, index_set.digest)
        values = _values_hash(boundary) if boundary is not None else ""
        gather = {"kind": plan.kind, "round": plan.round, "segment": plan.segment, "digest": index_set.digest,
                  "weight": float(plan.weight), "phase": plan.phase, "values": values}
        control = None
        try:
            window = self.averager.leader_window_s(plan.due_at)
            prepared = self.averager.prepare_round(round_key_bits(plan.kind, plan.round, index_set.digest),
                                                   plan.expected_group_size, window)
            # The group forms while the snapshot is taken; the all-reduce starts once it is in the buffer.
            control = self.averager.begin_step(plan.weight, gather, window)
            prepared.result(self.lock_timeout_s)
            mark = lap("prepare_s", started)
            with self.averager.locked_buffer(self.lock_timeout_s) as buffer, self.store.lock:
                if boundary is not None:
                    buffer[:n].copy_(boundary)
                else:  # a clock round, or a replica that jumped past the boundary: the weights now
                    FlatLayout.gather(self.store.master_params, index_set.pieces, buffer[:n])
                buffer[n:].zero_()
                snapshot = buffer[:n].clone()
            mark = lap("snapshot_s", mark)
        except Exception as exc:  # noqa: BLE001 - becomes the round's failure reason
            if control is not None:
                control.cancel()
            return RoundOutcome(plan, index_set.digest, RoundStatus.FAILED, time.monotonic() - started,
                                failure_reason=f"could not prepare the round: {_reason(exc)}")
        report: Optional[dict[str, Any]] = None
        error: Optional[BaseException] = None
        self._control = control
        try:
            report = self.averager.finish_step(control)
        except Exception as exc:  # noqa: BLE001 - hivemind raises several unrelated types
            error = exc
        finally:
            self._control = None
        began = self.averager.began_allreduce(control)
        mark = lap("step_s", mark)
        # Read back even after a failure: whatever the averager applied must reach the weights.
        try:
            with self.averager.locked_buffer(self.lock_timeout_s) as buffer:
                average_sq = float(torch.linalg.vector_norm(buffer[:n])) ** 2
                delta = torch.sub(buffer[:n], snapshot, out=snapshot)  # the snapshot is not needed any more
        except Exception as exc:  # noqa: BLE001
            return RoundOutcome(plan, index_set.digest, RoundStatus.FAILED, time.monotonic() - started,
                                failure_reason=f"the round's result could not be read and was dropped: {_reason(exc)}")
        identical = bool(values) and report is not None and _all_sent(report, values)
        if identical:
            delta.zero_()  # the exact average of equal values: nothing moves
        delta_sq = float(torch.linalg.vector_norm(delta)) ** 2
        if not math.isfinite(delta_sq):
            return RoundOutcome(plan, index_set.digest, RoundStatus.FAILED, time.monotonic() - started,
                                failure_reason="the average is not finite (did every group member have weight 0?); "
                                               "it was not applied")
        if delta_sq > 0:
            self._apply(index_set, delta)
        lap("apply_s", mark)
        outcome = self._describe(plan, index_set, report, error, time.monotonic() - started)
        outcome.delta_sq, outcome.average_sq, outcome.timings = delta_sq, average_sq, timings
        outcome.boundary_snapshot = boundary is not None
        outcome.identical = identical
        outcome.allreduce_began = began or report is not None
        return outcome

    def _apply(self, index_set: IndexSet, delta: torch.Tensor) -> None:
        with self.store.lock:
            FlatLayout.add_(self.store.master_params, index_set.pieces, delta)
            self.store.push_master_to_device()

    def _describe(self, plan: RoundPlan, index_set: IndexSet, report: Optional[dict], error: Optional[BaseException],
                  duration_s: float) -> RoundOutcome:
        if error is not None or report is None:
            reason = _reason(error)
            return RoundOutcome(plan, index_set.digest, RoundStatus.FAILED, duration_s, failure_reason=reason,
                                group_refused=GROUP_REFUSED in reason)
        telemetry, gathered = report["telemetry"], report.get("gathered", {})
        peers: list[str] = list(telemetry["peers"])
        sizes: list[int] = list(telemetry["slice_sizes"])
        buffer_size = max(1, sum(sizes))
        reasons: list[str] = []

        failed_slices, failed_total, start = [], 0, 0
        for peer, size in zip(peers, sizes):
            lost = int(telemetry["fell_back"].get(peer, 0))
            if lost:
                failed_slices.append(FailedSliceRecord(reducer=peer, start=start, end=start + size, failed_elements=lost))
                failed_total += lost
                reasons.append(f"reducer {_short(peer)} slice [{start}, {start + size}) did not come back: "
                               f"{lost} values kept local")
            start += size
        averaging_success = max(0.0, 1.0 - failed_total / buffer_size)

        reduce_success, banned, rejected, delivered = None, [], {}, []
        view = telemetry.get("reducer")
        if view is not None and view["received"]:
            expected = view["slice"] * len(view["received"])
            reduce_success = sum(view["received"].values()) / expected if expected else 1.0
            rejected = dict(view.get("rejected") or {})
            banned = sorted(set(view["banned"]) | set(rejected))
            index = telemetry.get("index")
            me = peers[index] if isinstance(index, int) and 0 <= index < len(peers) else None
            delivered = sorted(peer for peer, n in view["received"].items()
                               if n >= view["slice"] and peer not in banned and peer != me)
            if rejected:
                named = ", ".join(f"{_short(peer)} ({why})" for peer, why in sorted(rejected.items()))
                reasons.append(f"rejected sender(s) {named}")
            others = [p for p in banned if p not in rejected]
            if others:
                reasons.append(f"banned sender(s) {', '.join(_short(p) for p in others)}")
            elif reduce_success < 1.0 and not rejected:
                reasons.append(f"received {100 * reduce_success:.1f}% of this reducer's slice")
        mismatched = [peer for peer, data in gathered.items()
                      if not isinstance(data, dict) or data.get("digest") != index_set.digest]
        if mismatched:
            reasons.append(f"{len(mismatched)} group member(s) reported another index set")
        if len(peers) < plan.expected_group_size:
            reasons.append(f"group of {len(peers)}, {plan.expected_group_size} stage workers expected")

        # Not one slice came back whole: this replica did not take part (the reducers banned it,
        # e.g. it stalled mid-send), though it got a few parts back before the ban.
        came_back = any(size and not telemetry["fell_back"].get(peer, 0) for peer, size in zip(peers, sizes))
        if len(index_set) and (averaging_success == 0.0 or not came_back):
            status = RoundStatus.FAILED
        elif reasons:
            status = RoundStatus.PARTIAL
        else:
            status = RoundStatus.COMPLETE
        sent, received = _payload_bytes(telemetry, peers, sizes, failed_total)
        return RoundOutcome(
            plan, index_set.digest, status, duration_s, group=peers, reduce_success=reduce_success,
            averaging_success=averaging_success, failure_reason="; ".join(reasons), failed_slices=failed_slices,
            banned_senders=banned, rejected_senders=rejected, mismatched_peers=mismatched, delivered_senders=delivered,
            allreduce_s=telemetry.get("allreduce_s"), bytes_sent=sent, bytes_received=received,
            part_evidence=list(telemetry.get("part_evidence") or []),
            unsigned_parts=sum((view or {}).get("unsigned", {}).values()),
        )


VALUE_BYTES = 4


def _payload_bytes(telemetry: dict[str, Any], peers: list[str], sizes: list[int], failed_total: int) -> tuple[int, int]:
    """Bytes sent and received in a butterfly all-reduce: this replica sends each other reducer
    its part of their slice and gets the averaged slice back (less what did not come back); as a
    reducer it receives each other sender's part of its own slice and sends each the average."""
    index = telemetry.get("index")
    if index is None or not 0 <= index < len(sizes):
        return 0, 0
    others = sum(sizes) - sizes[index]
    sent, received = others, max(0, others - failed_total)
    view = telemetry.get("reducer")
    if view is not None:
        from_others = {peer: n for peer, n in view["received"].items() if peer != peers[index]}
        received += sum(from_others.values())
        sent += sizes[index] * sum(1 for n in from_others.values() if n)
    return VALUE_BYTES * sent, VALUE_BYTES * received


def _reason(error: Optional[BaseException]) -> str:
    if error is None:
        return "the averager returned nothing"
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    if "could not find a group" in text:
        return "no group formed within the matchmaking window"
    if isinstance(error, TimeoutError) or type(error).__name__ == "TimeoutError":
        return "the round timed out"
    return f"{type(error).__name__}: {text}"[:400]
