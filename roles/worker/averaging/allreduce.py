"""hivemind's butterfly all-reduce [report 3.3.1.8], instrumented so partial rounds are seen.

hivemind finishes a round even when peers fail: a reducer that stops answering has its slice
filled with zeros (the peer keeps its local values there), a sender that misses its timeout is
banned and averaged without, and the caller learns none of it. `InstrumentedRunner`
records, inside the averager process, exactly what the report measures [report 5.7.1.1]:

- averaging success: which reducers' slices came back, and how many values fell back;
- reduce success: for this peer's own slice, how much of it each sender delivered before it
  finished or was banned.

As a reducer it screens each part index's parts before averaging them (screening.py): a sender
whose part is not finite, carries an absurd weight or has a norm far from ours is left out of the
round from that part on, and `telemetry()` names it with the reason. Parts are sealed by their
senders (protocol/part_evidence.py): a signing sender's part without a valid seal is left out the
same way, and a sealed part left out for its norm becomes evidence when enough accepted parts agree
(evidence.py), which `telemetry()` carries out of the averager process for the worker to report.

It also hosts the operator's preemption moments `chunk_send` and `reduced_send`
(roles/worker/health/preemption.py), after a part was sent and after this peer's slice was
reduced (tests/support/faults.py wraps the same two moments to stall a peer mid-round).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional, Sequence

from protocol.control_orders import PreemptMoment
from protocol.hivemind_adapter import AdaptedRunner, HeldPart
from protocol.messages import to_body
from protocol.part_evidence import PartEvidence
from roles.worker.averaging.evidence import ROUND_EVIDENCE_MAX, ROUND_EVIDENCE_MAX_BYTES, evidence_bytes, part_evidence
from roles.worker.averaging.screening import PartScreen
from roles.worker.health.preemption import PreemptSwitch

logger = logging.getLogger(__name__)


class InstrumentedRunner(AdaptedRunner):
    """An all-reduce runner that keeps count of what failed, readable through `telemetry()`."""

    def __init__(self, *, label: str = "", screen: Optional[PartScreen] = None,
                 preempt: Optional[PreemptSwitch] = None, round_id: int = 0, collect_evidence: bool = False,
                 **kwargs):
        self.fell_back: dict[int, int] = {}
        self.screen = screen
        self.preempt = preempt
        self.round_id = round_id
        """The round as this peer numbers it (the evidence's `round`, for the record)."""
        self.collect_evidence = collect_evidence
        self.evidence: list[PartEvidence] = []
        self._evidence_bytes = 0
        super().__init__(**kwargs)
        self.started = time.monotonic()
        self.label = label
        self.sizes = self.slice_sizes()

    def screen_parts(self, part_index: int, held: Sequence[HeldPart]) -> dict[int, str]:
        return {} if self.screen is None else self.screen(held, self.local_sender)

    def parts_screened(self, part_index: int, held: Sequence[HeldPart], rejected: dict[int, str]) -> None:
        if not self.collect_evidence or self.signing is None or self.screen is None:
            return
        if len(self.evidence) >= ROUND_EVIDENCE_MAX:
            return
        signing = self.signing
        try:
            found = part_evidence(
                run_id=signing.run_id, stage=signing.stage, round_id=self.round_id, group_id=self.group_id,
                part_index=part_index, held=held, rejected=rejected,
                senders=[peer.to_base58() for peer in self.sender_peer_ids], own=self.local_sender,
                own_proof=lambda part: self.own_proof(part_index, part.tensor), ratio=self.screen.max_norm_ratio)
        except Exception:  # noqa: BLE001 - evidence is a courtesy to the run; the round goes on
            logger.exception("%s: could not build evidence from part %d", self.label, part_index)
            return
        for evidence in found:
            size = evidence_bytes(evidence)
            if len(self.evidence) >= ROUND_EVIDENCE_MAX or self._evidence_bytes + size > ROUND_EVIDENCE_MAX_BYTES:
                logger.warning("%s: more evidence than one round carries; the rest is not reported", self.label)
                break
            self.evidence.append(evidence)
            self._evidence_bytes += size

    def on_reducer_failed(self, peer_index: int, values: int) -> None:
        self.fell_back[peer_index] = self.fell_back.get(peer_index, 0) + values

    async def after_part_sent(self) -> None:
        if self.preempt is not None:
            self.preempt.fire_if(PreemptMoment.CHUNK_SEND)

    async def after_part_reduced(self) -> None:
        if self.preempt is not None:
            self.preempt.fire_if(PreemptMoment.REDUCED_SEND)

    def telemetry(self) -> dict[str, Any]:
        """What this peer saw of the round: plain data, so it can cross the process boundary."""
        peers = self.peers
        reducer_view: Optional[dict[str, Any]] = None
        if self.sizes[self.index] > 0:
            reducer_view = {"slice": self.sizes[self.index], "received": self.values_received(),
                            "banned": self.banned(), "rejected": self.rejected(),
                            "unsigned": dict(self.unsigned_parts)}
        return {
            "peers": peers,
            "index": self.index,
            "modes": self.mode_names(),
            "slice_sizes": list(self.sizes),
            "fell_back": {peers[index]: count for index, count in self.fell_back.items() if count},
            "reducer": reducer_view,
            "allreduce_s": time.monotonic() - self.started,
            "part_evidence": [to_body(evidence) for evidence in self.evidence],
        }
