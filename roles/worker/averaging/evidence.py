"""A poisoned AsyncSPARTA part as evidence for the authorizer: found by the reducer that refused
it, reported by its worker (protocol/part_evidence.py is the record and its check).

`part_evidence` runs in the averager process, on hivemind's event loop, once a part index was
averaged with something left out (allreduce.py `InstrumentedRunner.parts_screened`): of the parts
it accepted with a weight above 0, a valid seal (its own part is sealed for the purpose) and a
finite norm, it takes the largest group within the screen's `max_norm_ratio` of each other (its own
part first), cut to four; with at least two, every refused part that was sealed and whose norm is
outside that ratio of their median becomes evidence. It is cheap (norms of the held parts, no
decoding), and the round's telemetry carries the evidence out of the averager process as plain
data, at most `ROUND_EVIDENCE_MAX` of them and `ROUND_EVIDENCE_MAX_BYTES` in all.

`PartReporter` is the worker's side (service.py hands it every round's evidence): it checks each
with `check_part_evidence` off the event loop, as the authorizer will, and reports it through the
node's authorizer client in the background, at most once per accused per round. A failure to check
or send is logged and counted, never raised: a report is a courtesy to the run, the round is over.
The reducer cannot know its peers' accounts: the authorizer rejects witnesses on the accused's
account or on one account twice, and flags this reporter for it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import statistics
from typing import Awaitable, Callable, Optional, Sequence

import torch

from protocol.errors import ProtocolError
from protocol.evidence import MAX_WITNESSES, choose_witnesses
from protocol.hivemind_adapter import HeldPart
from protocol.messages import parse_model
from protocol.part_evidence import PartEvidence, PartProof, SignedPart, check_part_evidence
from roles.worker.evidence_reports import EvidenceReporter

logger = logging.getLogger(__name__)

ROUND_EVIDENCE_MAX = 4
"""Evidence one reducer carries out of one round (one per accused; more accused than this in one
round is no lone liar, and the next round may report the rest)."""
ROUND_EVIDENCE_MAX_BYTES = 32 << 20
"""Part bytes of one round's evidence that cross to the worker process."""


def _norm(tensor: torch.Tensor) -> float:
    if not tensor.is_floating_point():
        return float("nan")
    return float(torch.linalg.vector_norm(tensor, dtype=torch.float64))


def part_evidence(*, run_id: str, stage: int, round_id: int, group_id: bytes, part_index: int,
                  held: Sequence[HeldPart], rejected: dict[int, str], senders: Sequence[str], own: Optional[int],
                  own_proof: Callable[[HeldPart], Optional[PartProof]], ratio: float) -> list[PartEvidence]:
    """The evidence one decided part index gives (see module docstring): `senders` are the
    round's base58 sender ids by sender index, `own` this reducer's sender index."""
    accusable = [part for part in held if part.sender in rejected and part.proof is not None]
    if not accusable:
        return []
    norms: dict[str, float] = {}
    for part in held:
        if part.sender in rejected or part.weight <= 0 or not math.isfinite(part.weight):
            continue
        if part.proof is None and part.sender != own:
            continue  # unsigned (an older build): no witness
        norms[senders[part.sender]] = _norm(part.tensor)
    chosen = choose_witnesses(norms, ratio=ratio, own=senders[own] if own is not None else "", limit=MAX_WITNESSES)
    if len(chosen) < 2:
        return []
    by_peer = {senders[part.sender]: part for part in held}
    witnesses = []
    for peer in chosen:
        part = by_peer[peer]
        proof = own_proof(part) if part.sender == own else part.proof
        if proof is None:
            return []
        try:
            witnesses.append(SignedPart.of(peer, proof))
        except ValueError as exc:  # pydantic's ValidationError: a part too large for evidence
            logger.warning("part %d cannot be evidence (part_size_bytes too large?): %s", part_index, exc)
            return []
    median = statistics.median(norms[peer] for peer in chosen)
    shape = witnesses[0].shape
    out = []
    for part in accusable:
        assert part.proof is not None
        norm = _norm(part.tensor)
        if median / ratio <= norm <= median * ratio or list(part.proof.shape) != shape:
            continue
        if part.weight == 0.0 and math.isfinite(norm):
            continue  # never averaged, so its norm is not held against it (screening.py)
        try:
            out.append(PartEvidence(run_id=run_id, stage=stage, round=max(0, round_id), group_id=group_id,
                                    part_index=part_index, accused=SignedPart.of(senders[part.sender], part.proof),
                                    witnesses=witnesses))
        except ValueError as exc:  # pydantic's ValidationError: e.g. a part too large to report
            logger.warning("the evidence against sender %s cannot be built: %s", senders[part.sender][-8:], exc)
    return out


def evidence_bytes(evidence: PartEvidence) -> int:
    return sum(len(p.buffer) for p in (evidence.accused, *evidence.witnesses))


class PartReporter(EvidenceReporter):
    """One worker's reports of poisoned all-reduce parts (roles/worker/evidence_reports.py)."""

    party = "sender"

    def __init__(self, *, run_id: str, max_norm_ratio: float, report: Callable[[PartEvidence], Awaitable[str]]):
        super().__init__(check=functools.partial(check_part_evidence, run_id=run_id, max_norm_ratio=max_norm_ratio),
                         report=report)
        self.run_id = run_id
        self.max_norm_ratio = max_norm_ratio
        self._tasks: set[asyncio.Task] = set()

    def describe(self, evidence: PartEvidence) -> str:
        return f"averaging round {evidence.round} part {evidence.part_index}"

    def submit(self, found: Sequence[PartEvidence]) -> None:
        """Report `found` in the background (event loop), once per accused and round (a round's
        repair, another group, finds the same liar again)."""
        for evidence in found:
            if not self.first_report(evidence.accused.peer_id, evidence.round):
                continue
            task = asyncio.get_running_loop().create_task(self.send(evidence), name="report-part")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def submit_wire(self, found: Sequence[dict]) -> None:
        """`submit` the evidence the averager process carried out as wire maps."""
        parsed = []
        for wire in found:
            try:
                parsed.append(parse_model(PartEvidence, wire))
            except ProtocolError as exc:  # our own averager process built it: a bug, not an attack
                logger.warning("the averager's evidence of a refused part does not parse: %s", exc)
        self.submit(parsed)

    async def close(self) -> None:
        """Wait briefly for the reports in flight, then cancel the rest."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=5.0)
            for task in pending:
                task.cancel()
