"""A poisoned SparseLoCo fragment as evidence the authorizer checks by itself, and the replica that
reports it.

`check_fragment_evidence` is the check of protocol/fragment_evidence.py's record, beside the codec
because only the codec decodes a fragment: the authorizer calls it on every fragment report, and a
reporter calls it before sending. It needs nothing but the run config and the peer ids: every
fragment must decode under the run's chunking, for the evidence's run, stage, round and fragment,
with the layout the evidence carries (whose digest each fragment signed), and its signature must
verify for the peer that presents it; the senders are distinct; the witnesses' norms are within
`max_norm_ratio` of each other (else they do not agree on what size the round's update had) and
the accused's norm is outside that ratio of the witnesses' median. Norms are computed from the
kept values (codec.compressed_norm), never from a dense fragment-length vector.

`FragmentReporter` is the replica's side (service.py hands it every round's screen): when the
screen refused a fragment for its norm alone (it decoded and verified) and the round left at least
two good fragments, this replica's own included, whose norms agree, it builds the evidence, checks
it off the compute thread and reports it through the node's authorizer client, the trainers' one
(node/daemon.py). At most one report per accused per round; a failure to build or send is logged
and counted, never raised. The replica cannot know its peers' accounts: the authorizer rejects
witnesses on the accused's account or on one account twice, and flags this reporter for it.
"""

from __future__ import annotations

import functools
import logging
import statistics
from typing import Awaitable, Callable

from protocol.authorizer_api import EvidenceReason
from protocol.errors import ErrorCode, ProtocolError
from protocol.evidence import EvidenceNorms, EvidenceRejected, choose_witnesses
from protocol.fragment_evidence import FragmentEvidence, SignedFragment
from protocol.run_config import SparseLoCoConfig
from roles.worker.evidence_reports import EvidenceReporter
from roles.worker.layout import FlatLayout
from roles.worker.sparseloco.chunks import plan_fragments
from roles.worker.sparseloco.codec import Envelope, compressed_norm, decode_fragment

logger = logging.getLogger(__name__)

def _rejected(reason: EvidenceReason, message: str) -> EvidenceRejected:
    return EvidenceRejected(reason.value, message)


def check_fragment_evidence(evidence: FragmentEvidence, *, run_id: str, config: SparseLoCoConfig) -> EvidenceNorms:
    """Verify `evidence` by itself against the run's SparseLoCo settings; its norms if it holds,
    else EvidenceRejected with its reason."""
    if evidence.run_id != run_id:
        raise _rejected(EvidenceReason.WRONG_RUN, f"the evidence is for run {evidence.run_id!r}, not {run_id!r}")
    parties = [evidence.accused, *evidence.witnesses]
    if len({p.peer_id for p in parties}) != len(parties):
        raise _rejected(EvidenceReason.DUPLICATE_PARTY, "the accused and the witnesses must be different peers")
    if len(evidence.tensor_names) != len(evidence.tensor_shapes):
        raise _rejected(EvidenceReason.MISMATCHED_FRAGMENT, "the layout needs one shape per tensor name")
    layout = FlatLayout(evidence.tensor_names, evidence.tensor_shapes)
    plan = plan_fragments(layout, chunk_size=config.chunk_size, topk=config.topk_per_chunk, fragments=config.fragments)
    if evidence.fragment >= len(plan):
        raise _rejected(EvidenceReason.MISMATCHED_FRAGMENT,
                        f"this layout has {len(plan)} fragment(s) under the run's chunking; no fragment "
                        f"{evidence.fragment}")
    fragment = plan[evidence.fragment]
    expected = Envelope(run_id, evidence.stage, evidence.round, evidence.fragment, layout.digest, config.chunk_size,
                        config.topk_per_chunk, config.bits)
    norms = []
    for party in parties:
        try:
            envelope, compressed = decode_fragment(party.data, expected, fragment)
        except ProtocolError as exc:
            if exc.code == ErrorCode.UNAUTHENTICATED:
                raise _rejected(EvidenceReason.BAD_SIGNATURE, f"the fragment of {party.peer_id}: {exc}") from exc
            raise _rejected(EvidenceReason.MISMATCHED_FRAGMENT,
                            f"the fragment of {party.peer_id} is not one of stage {evidence.stage} round "
                            f"{evidence.round} fragment {evidence.fragment} of this run: {exc}") from exc
        if envelope.sender != party.peer_id:
            raise _rejected(EvidenceReason.BAD_SIGNATURE,
                            f"the fragment presented as {party.peer_id}'s is signed by {envelope.sender}")
        norms.append(compressed_norm(compressed, fragment))
    accused, witnesses = norms[0], tuple(norms[1:])
    ratio = config.max_norm_ratio
    if not (min(witnesses) > 0 and max(witnesses) <= min(witnesses) * ratio):
        raise _rejected(EvidenceReason.WITNESSES_DISAGREE,
                        f"the witnesses' norms ({', '.join(f'{n:.4g}' for n in witnesses)}) are not within "
                        f"{ratio:g}x of each other: nothing is proven")
    median = statistics.median(witnesses)
    if median / ratio <= accused <= median * ratio:
        raise _rejected(EvidenceReason.ACCUSED_AGREES,
                        f"the accused's norm {accused:.4g} is within {ratio:g}x of the witnesses' median {median:.4g}")
    return EvidenceNorms(accused, witnesses)


class FragmentReporter(EvidenceReporter):
    """One replica's reports of poisoned fragments (roles/worker/evidence_reports.py)."""

    def __init__(self, *, run_id: str, stage: int, layout: FlatLayout, config: SparseLoCoConfig, self_id: str,
                 report: Callable[[FragmentEvidence], Awaitable[str]]):
        super().__init__(check=functools.partial(check_fragment_evidence, run_id=run_id, config=config),
                         report=report)
        self.run_id = run_id
        self.stage = stage
        self.layout = layout
        self.config = config
        self.self_id = self_id

    def describe(self, evidence: FragmentEvidence) -> str:
        return f"sparseloco round {evidence.round} fragment {evidence.fragment}"

    def evidence(self, round_id: int, fragment: int, refused: dict[str, tuple[bytes, float]],
                 good: dict[str, tuple[bytes, float]]) -> list[FragmentEvidence]:
        """The evidence to report for one round's screen (cheap: no decoding): per sender refused
        for its norm and not reported this round, against the agreeing good fragments (this
        replica's own among `good`). Each is remembered as reported."""
        chosen = choose_witnesses({p: n for p, (_, n) in good.items()}, ratio=self.config.max_norm_ratio,
                                  own=self.self_id)
        if len(chosen) < 2:
            return []
        median = statistics.median(good[p][1] for p in chosen)
        ratio = self.config.max_norm_ratio
        out = []
        for accused, (data, norm) in sorted(refused.items()):
            if median / ratio <= norm <= median * ratio or not self.first_report(accused, round_id):
                continue
            try:
                out.append(FragmentEvidence(
                    run_id=self.run_id, stage=self.stage, round=round_id, fragment=fragment,
                    tensor_names=self.layout.names, tensor_shapes=[list(s) for s in self.layout.shapes],
                    accused=SignedFragment(peer_id=accused, data=data),
                    witnesses=[SignedFragment(peer_id=p, data=good[p][0]) for p in chosen]))
            except ValueError as exc:  # pydantic's ValidationError: e.g. a fragment too large to report
                self.counts["invalid"] += 1
                logger.warning("the evidence against replica %s cannot be built: %s", accused[-8:], exc)
        return out
