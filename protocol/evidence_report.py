"""How a node reports evidence to the authorizer (`POST /v1/evidence`): the signed body both
sides build from this module. A trainer reports a spot check's evidence (protocol/evidence.py), a
SparseLoCo replica a poisoned fragment's (protocol/fragment_evidence.py), an AsyncSPARTA reducer a
poisoned all-reduce part's (protocol/part_evidence.py); the evidence map's `kind` tells them apart
(`fragment` for the second, `part` for the third; a spot check's `output`, `gradient` or `loss`
parses exactly as before the other kinds existed).

The body is msgpack, not JSON: evidence carries tensors (the input and three results), signed
fragments or sealed parts, which travel as the one tensor encoding (protocol.codec) or as bytes, and base64 would
add a third to bodies of up to `EVIDENCE_MAX_BYTES`. It is a map
`{evidence, reporter, signed_at, signature}`: the evidence as its wire map (`protocol.messages.to_body`), the reporter's peer id, and the reporter's Ed25519
signature over `report_signing_bytes`. The signature binds the report to the run and to a moment,
so a report captured in transit cannot be replayed at another run's authorizer, nor here once the
freshness window has passed; the evidence itself proves its case without trusting the reporter
(protocol/evidence.py), and the signature only says who to flag when it does not.
"""

from __future__ import annotations

import hashlib
import struct
import time
from typing import Any, Optional, Union

from pydantic import Field

from protocol.codec import pack, unpack
from protocol.errors import ErrorCode, ProtocolError
from protocol.evidence import EVIDENCE_MAX_BYTES, Evidence
from protocol.fragment_evidence import FRAGMENT_KIND, FragmentEvidence
from protocol.identity import Identity
from protocol.part_evidence import PART_KIND, PartEvidence
from protocol.messages import PeerIdText, WireModel, parse_model, to_body

EVIDENCE_PATH = "/v1/evidence"
EVIDENCE_CONTENT_TYPE = "application/msgpack"

__all__ = ["EVIDENCE_CONTENT_TYPE", "EVIDENCE_MAX_BYTES", "EVIDENCE_PATH", "AnyEvidence", "EvidenceReport",
           "evidence_report_body", "parse_evidence", "parse_evidence_report", "report_signing_bytes"]

AnyEvidence = Union[Evidence, FragmentEvidence, PartEvidence]


class EvidenceReport(WireModel):
    """The envelope of a report; `evidence` stays the wire map it arrived as, since the signature
    covers its bytes (parse it with `parse_evidence`)."""

    evidence: dict
    reporter: PeerIdText
    signed_at: float = Field(ge=0, le=1e11)
    signature: bytes = Field(min_length=64, max_length=64)


def evidence_digest(evidence_wire: dict) -> bytes:
    """SHA-256 of the evidence's wire map as msgpack (protocol.codec.pack)."""
    return hashlib.sha256(pack(evidence_wire)).digest()


def report_signing_bytes(run_id: str, evidence_wire: dict, signed_at: float) -> bytes:
    """What the reporter signs: the run, a digest of the evidence's wire map, and when."""
    return b"".join([b"agora-evidence-v1\0", run_id.encode(), b"\0", evidence_digest(evidence_wire),
                     struct.pack("<d", signed_at)])


def evidence_report_body(evidence: AnyEvidence, identity: Identity, *, signed_at: Optional[float] = None) -> bytes:
    """The body of `POST /v1/evidence` reporting `evidence`, signed by `identity` (the reporter's
    libp2p key) for the evidence's run, at `signed_at` (now by default)."""
    wire = to_body(evidence)
    signed_at = time.time() if signed_at is None else float(signed_at)
    signature = identity.sign(report_signing_bytes(evidence.run_id, wire, signed_at))
    return pack({"evidence": wire, "reporter": identity.peer_id.to_base58(), "signed_at": signed_at,
                 "signature": signature})


def parse_evidence(wire: dict) -> AnyEvidence:
    """The evidence of a report's evidence map, of the kind its `kind` names; ProtocolError (naming
    the field) if it is malformed."""
    if wire.get("kind") == FRAGMENT_KIND:
        return parse_model(FragmentEvidence, wire)
    if wire.get("kind") == PART_KIND:
        return parse_model(PartEvidence, wire)
    return parse_model(Evidence, wire)


def parse_evidence_report(body: bytes) -> tuple[EvidenceReport, AnyEvidence]:
    """The envelope and the evidence of a report's body, from untrusted bytes; ProtocolError
    (naming the field) if either is malformed."""
    raw: Any = unpack(body, max_len=EVIDENCE_MAX_BYTES)
    if not isinstance(raw, dict):
        raise ProtocolError("the evidence report must be a msgpack map", ErrorCode.INVALID_REQUEST)
    report = parse_model(EvidenceReport, raw)
    return report, parse_evidence(report.evidence)
