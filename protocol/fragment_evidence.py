"""The second kind of evidence: a SparseLoCo replica that signed a poisoned pseudo-gradient fragment.

Every SparseLoCo fragment is signed by its sender's libp2p key over everything it says (run,
stage, round, fragment, the layout's digest, the chunking, the indices, codes and scales:
roles/worker/sparseloco/codec.py), so a replica that sends a poisoned fragment signs its lie.
`FragmentEvidence` carries the accused's fragment exactly as it arrived (its wire bytes) and the
fragments of the same round and fragment from two to four other replicas, the reporter's own among
them, with the stage's layout (its tensors' names and shapes) that the signed layout digest names.
Anyone holding the run config can then decode every fragment, verify every signature with nothing
but the peer ids, and compare norms: the witnesses within the run's `max_norm_ratio` of each
other, the accused outside that ratio of the witnesses' median. The check lives beside the codec
(roles/worker/sparseloco/evidence.py: `check_fragment_evidence`), since only it can decode a
fragment; this module is the wire record both the reporter and the authorizer import.

What it proves: the accused signed, for this round and fragment, an update whose size is far from
what two or more other replicas signed for the same round and fragment. It does not prove the
witnesses honest: colluding replicas can frame a third, so the authorizer admits witnesses only from
accounts other than the accused's and each other's (authorizer/evidence.py). It cannot catch a lie
within the norm ratio (a fragment of the right size pointing the wrong way), nor a stage of two
replicas (one witness is one word against another).

In a report's evidence map this kind is told apart by `kind: "fragment"`; a spot check's evidence
(protocol/evidence.py) has `kind` output, gradient or loss, and parses exactly as before.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from protocol.evidence import EVIDENCE_MAX_BYTES, MAX_WITNESSES
from protocol.messages import PeerIdText, WireModel

FRAGMENT_KIND = "fragment"
"""The value of `kind` in a report's evidence map that says it is a FragmentEvidence."""
FRAGMENT_MAX_BYTES = EVIDENCE_MAX_BYTES // (MAX_WITNESSES + 2)
"""The largest fragment one evidence may carry (five fit one body with room for the rest). A stage
whose fragments are larger (some 300M parameters at the default 64 of 4,096 kept, 2 bits, one
fragment per cycle) cannot be reported; more fragments per cycle make each smaller."""
MAX_LAYOUT_TENSORS = 16384
TensorName = Annotated[str, Field(min_length=1, max_length=256)]
TensorShape = Annotated[list[Annotated[int, Field(ge=0, le=1 << 40)]], Field(max_length=8)]


class SignedFragment(WireModel):
    """One replica's fragment as it travelled: the codec's signed wire form (its signature inside)."""

    peer_id: PeerIdText
    data: bytes = Field(min_length=1, max_length=FRAGMENT_MAX_BYTES)


class FragmentEvidence(WireModel):
    """A SparseLoCo round's dispute: the accused's signed fragment against two to four other
    replicas' of the same round and fragment (the reporter's own counts as one)."""

    kind: Literal["fragment"] = FRAGMENT_KIND
    run_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=4096)
    round: int = Field(ge=0, le=1 << 62)
    """The stage step after which the fragment was captured (the fragments' signed round)."""
    fragment: int = Field(ge=0, le=4096)
    tensor_names: list[TensorName] = Field(min_length=1, max_length=MAX_LAYOUT_TENSORS)
    """The stage's layout (roles/worker/layout.py), whose digest every fragment signs: it says
    where each chunk lies, and so which scale each kept value takes."""
    tensor_shapes: list[TensorShape] = Field(min_length=1, max_length=MAX_LAYOUT_TENSORS)
    accused: SignedFragment
    witnesses: list[SignedFragment] = Field(min_length=2, max_length=MAX_WITNESSES)

    @property
    def self_contradiction(self) -> bool:
        """Never: a fragment is not a deterministic computation the accused could be asked twice."""
        return False
