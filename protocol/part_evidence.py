"""The third kind of evidence: an AsyncSPARTA replica that signed a poisoned all-reduce part.

In an AsyncSPARTA round (hivemind's butterfly all-reduce, protocol/hivemind_adapter.py) every
sender streams each reducer its part of that reducer's slice, one `AveragingData` message per part
index. A sender of this build signs every part with its libp2p Ed25519 key (the node's identity)
over `part_signing_bytes`: the run, the stage, the round's group id (hivemind's, random per group),
the part index, the sender's peer id, the weight it sent, and `part_digest`, a SHA-256 of the part
exactly as it travels (hivemind's serialized tensor: compression, dtype, shape, buffer; what the
reducer decodes, so the signature covers the values averaged and nothing a reducer re-encodes).

Where the signature travels: hivemind's `AveragingData` has no spare field, but its `peer_id`
bytes are never read on the part stream (the reducer knows its sender from the libp2p stream), and
both ends of that stream are our overrides (protocol/hivemind_adapter.py `AdaptedRunner`: the
part generator and the part accumulator). So each part message carries its own seal there
(`PartSigning.seal`): one version byte and the 64-byte signature. Sealing every message, rather than sending a trailing
message, keeps each part self-contained (a reducer judges it when it holds it, before it is
averaged; a stream cut short leaves nothing half-signed) and leaves hivemind's message count,
which its runner checks, unchanged. A sender announces that it seals (`PART_SIGNING_KEY` in the
round's gathered metadata); a reducer then refuses any part of it that carries no valid seal, like
a bad part. A peer of an older build announces nothing and sends none: it is averaged as before,
and counted.

`PartEvidence` carries the accused's signed part of one part index of one group, as it arrived,
against two to four other senders' signed parts of the same group and index (the reporter's own
among them), and `check_part_evidence` verifies it with nothing but the peer ids: every seal over
its own part, the parts decoded (float32, uncompressed: what this run's averager sends; a reducer
refuses anything else from a signing peer), the witnesses' norms within the run's `max_norm_ratio`
of each other and the accused's outside that ratio of their median. It proves that the accused
signed, for this group and part index, values whose size is far from what two or more others
signed for the same ones. It cannot catch a lie within the norm ratio (a part of the right size
pointing the wrong way), nor prove anything in a stage of two replicas (one witness is one word
against another), nor tell the authorizer which round of the stage the group was (`round` is the
reporter's word, kept for the record only). Colluding replicas can frame a third: the authorizer
admits witnesses only from accounts other than the accused's and each other's.

In a report's evidence map this kind is told apart by `kind: "part"`; the other kinds parse as
before (protocol/evidence_report.py).
"""

from __future__ import annotations

import hashlib
import math
import statistics
import struct
from dataclasses import dataclass
from typing import Annotated, Callable, Literal, NamedTuple, Optional, Sequence

import torch
from pydantic import Field

from protocol.evidence import EVIDENCE_MAX_BYTES, MAX_WITNESSES, EvidenceNorms, EvidenceRejected
from protocol.identity import verify_peer_signature
from protocol.messages import PeerIdText, WireModel

PART_KIND = "part"
"""The value of `kind` in a report's evidence map that says it is a PartEvidence."""
PART_SIGNING_KEY = "part_signing"
"""The key of a round's gathered metadata by which a sender announces that it seals its parts;
its value is `PART_SEAL_VERSION`."""
PART_SEAL_VERSION = 1
SEAL_BYTES = 65
"""A seal: the version byte, then the Ed25519 signature."""
PART_MAX_BYTES = EVIDENCE_MAX_BYTES // (MAX_WITNESSES + 2)
"""The largest part one evidence may carry (six fit one body with room for the rest); the run
config's part_size_bytes is far below it (hivemind's default is 512 KiB)."""
COMPRESSION_NONE = 0
"""hivemind's runtime_pb2.CompressionType.NONE: the only encoding an evidence part may have."""
PART_DTYPE = "float32"
MAX_GROUP_ID_BYTES = 64


class PartProof(NamedTuple):
    """What a signing sender sent for one part, as the reducer received it."""

    compression: int
    dtype: str
    shape: tuple[int, ...]
    buffer: bytes
    weight: float
    signature: bytes


def part_digest(compression: int, dtype: str, shape: Sequence[int], buffer: bytes) -> bytes:
    """SHA-256 of a part as it travels (hivemind's serialized tensor: what the reducer decodes)."""
    digest = hashlib.sha256(b"agora-part-values-v1\0")
    digest.update(struct.pack("<q", int(compression)))
    digest.update(dtype.encode("utf-8", "replace") + b"\0")
    digest.update(struct.pack(f"<q{len(shape)}q", len(shape), *(int(n) for n in shape)))
    digest.update(buffer)
    return digest.digest()


def part_signing_bytes(run_id: str, stage: int, group_id: bytes, part_index: int, sender: str, weight: float,
                       digest: bytes) -> bytes:
    """What a sender signs for one part it sends a reducer."""
    return b"".join([b"agora-part-v1\0", run_id.encode(), b"\0", struct.pack("<qq", stage, part_index),
                     struct.pack("<q", len(group_id)), group_id, sender.encode(), b"\0", struct.pack("<d", weight),
                     digest])


@dataclass(frozen=True)
class PartSigning:
    """A sender's side: what binds its parts to the run and stage, and its key (`sign`: the node
    identity's Ed25519 signature of bytes)."""

    run_id: str
    stage: int
    sender: str
    sign: Callable[[bytes], bytes]

    def seal(self, group_id: bytes, part_index: int, weight: float, compression: int, dtype: str,
             shape: Sequence[int], buffer: bytes) -> bytes:
        """The seal a part message carries (in `AveragingData.peer_id`)."""
        signed = part_signing_bytes(self.run_id, self.stage, group_id, part_index, self.sender, float(weight),
                                    part_digest(compression, dtype, shape, buffer))
        return bytes([PART_SEAL_VERSION]) + self.sign(signed)


def seal_refusal(seal: bytes, *, run_id: str, stage: int, sender: str, group_id: bytes, part_index: int,
                 weight: float, compression: int, dtype: str, shape: Sequence[int], buffer: bytes) -> Optional[str]:
    """Why `seal` is not `sender`'s valid seal of this part (None: it is)."""
    if len(seal) != SEAL_BYTES or seal[0] != PART_SEAL_VERSION:
        return "a part without a valid signature" if seal else "a part without a signature"
    signed = part_signing_bytes(run_id, stage, group_id, part_index, sender, float(weight),
                                part_digest(compression, dtype, shape, buffer))
    if not verify_peer_signature(sender, signed, seal[1:]):
        return "a part whose signature does not verify"
    return None


def encoding_refusal(compression: int, dtype: str) -> Optional[str]:
    """Why a signing sender's part is refused for how it is encoded (None: float32, uncompressed,
    the only part this run's averager sends and evidence can carry)."""
    if compression != COMPRESSION_NONE or dtype != PART_DTYPE:
        return f"a part encoded as compression {compression}, dtype {dtype[:16]!r} (expected uncompressed float32)"
    return None


Shape = Annotated[list[Annotated[int, Field(ge=0, le=1 << 40)]], Field(max_length=8)]


class SignedPart(WireModel):
    """One sender's part of the evidence's group and part index, as it arrived, and its seal."""

    peer_id: PeerIdText
    weight: float
    compression: int = Field(ge=0, le=64)
    dtype: str = Field(min_length=1, max_length=16)
    shape: Shape
    buffer: bytes = Field(max_length=PART_MAX_BYTES)
    seal: bytes = Field(min_length=SEAL_BYTES, max_length=SEAL_BYTES)

    @classmethod
    def of(cls, peer_id: str, proof: PartProof) -> "SignedPart":
        return cls(peer_id=peer_id, weight=float(proof.weight), compression=int(proof.compression),
                   dtype=proof.dtype, shape=[int(n) for n in proof.shape], buffer=bytes(proof.buffer),
                   seal=bytes(proof.signature))


class PartEvidence(WireModel):
    """An AsyncSPARTA round's dispute: the accused's signed part against two to four other
    senders' of the same group and part index (the reporter's own counts as one)."""

    kind: Literal["part"] = PART_KIND
    run_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=4096)
    round: int = Field(ge=0, le=1 << 62)
    """The reporter's round number (not signed: the group id binds the parts; for the record, whose
    `version` column is a signed 64-bit integer)."""
    group_id: bytes = Field(min_length=1, max_length=MAX_GROUP_ID_BYTES)
    part_index: int = Field(ge=0, le=1 << 32)
    accused: SignedPart
    witnesses: list[SignedPart] = Field(min_length=2, max_length=MAX_WITNESSES)

    @property
    def self_contradiction(self) -> bool:
        """Never: a part is not a computation the accused could be asked twice."""
        return False


def decode_part(part: SignedPart) -> torch.Tensor:
    """The values of an evidence part (ValueError if it is not float32, uncompressed, of its shape)."""
    refusal = encoding_refusal(part.compression, part.dtype)
    if refusal is not None:
        raise ValueError(refusal)
    numel = math.prod(part.shape)
    if numel * 4 != len(part.buffer):
        raise ValueError(f"{len(part.buffer)} bytes do not hold a float32 part of shape {tuple(part.shape)}")
    if numel == 0:
        return torch.empty(0, dtype=torch.float32)
    return torch.frombuffer(bytearray(part.buffer), dtype=torch.float32)


def part_norm(values: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(values, dtype=torch.float64))


def check_part_evidence(evidence: PartEvidence, *, run_id: str, max_norm_ratio: float) -> EvidenceNorms:
    """Verify `evidence` by itself against the run's AsyncSPARTA `max_norm_ratio`; its norms if it
    holds, else EvidenceRejected with its reason (an EvidenceReason value)."""
    if evidence.run_id != run_id:
        raise EvidenceRejected("wrong_run", f"the evidence is for run {evidence.run_id!r}, not {run_id!r}")
    parties = [evidence.accused, *evidence.witnesses]
    if len({p.peer_id for p in parties}) != len(parties):
        raise EvidenceRejected("duplicate_party", "the accused and the witnesses must be different peers")
    if len({tuple(p.shape) for p in parties}) != 1:
        raise EvidenceRejected("mismatched_part", "the parts are of different shapes: they are not one part index")
    norms = []
    for party in parties:
        why = seal_refusal(party.seal, run_id=run_id, stage=evidence.stage, sender=party.peer_id,
                           group_id=evidence.group_id, part_index=evidence.part_index, weight=party.weight,
                           compression=party.compression, dtype=party.dtype, shape=party.shape, buffer=party.buffer)
        if why is not None:
            raise EvidenceRejected("bad_signature", f"the part presented as {party.peer_id}'s: {why} (for stage "
                                                    f"{evidence.stage}, this group and part {evidence.part_index})")
        try:
            norms.append(part_norm(decode_part(party)))
        except ValueError as exc:
            raise EvidenceRejected("mismatched_part", f"the part of {party.peer_id}: {exc}") from exc
    accused, witnesses = norms[0], tuple(norms[1:])
    if not all(math.isfinite(n) for n in witnesses) or not (
            min(witnesses) > 0 and max(witnesses) <= min(witnesses) * max_norm_ratio):
        raise EvidenceRejected("witnesses_disagree",
                               f"the witnesses' norms ({', '.join(f'{n:.4g}' for n in witnesses)}) are not within "
                               f"{max_norm_ratio:g}x of each other: nothing is proven")
    median = statistics.median(witnesses)
    if median / max_norm_ratio <= accused <= median * max_norm_ratio:
        raise EvidenceRejected("accused_agrees", f"the accused's norm {accused:.4g} is within {max_norm_ratio:g}x "
                                                 f"of the witnesses' median {median:.4g}")
    if evidence.accused.weight == 0.0 and math.isfinite(accused):
        # a part of weight 0 adds nothing to the average (a replica in weight sync sends its own
        # stale values so): its norm is not held against it, as the screen does not
        raise EvidenceRejected("accused_agrees", "the accused sent its part with weight 0: it was never averaged")
    return EvidenceNorms(accused, witnesses)
