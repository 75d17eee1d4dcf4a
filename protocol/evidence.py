"""Signed results and the evidence built from them: how a lie about a stage's compute becomes
something the authorizer can check by itself, without weights and without trusting the reporter.

Every worker signs what it computes: an attestation is its libp2p key's Ed25519 signature over
`result_signing_bytes` (the run, the stage, the weight version, what was computed, a SHA-256 of
each input and of the result). A worker cannot tell which of its replies will be checked, so a
liar signs its lies.

`Evidence` is a trainer's spot check that a third replica settled (roles/trainer/spot_checks.py):
the input, and three signed results of the same computation at the same version with the same
weights (their fingerprint is signed too: a replica that parted from the others after a step
without some replica's gradients is not a witness against them, nor they against it), the
accused's and two other replicas' (the checker and the arbiter). `check_evidence` verifies it with nothing
but the peer ids (a libp2p Ed25519 peer id holds its public key): every signature over its own
result, the two witnesses within `tolerance` of each other, the accused further than `tolerance`
from both. It then proves that the accused signed a result that two other replicas, given the
same input at the same weights, contradict. It does not prove that the two agree with the truth:
two colluding replicas of a stage can frame a third; the authorizer admits witnesses only from
other accounts (authorizer/evidence.py).

With two replicas in a stage there is no third: the evidence has one witness, and proves only that
the two signed contradicting results for one input at one version with the same weights, so one
of them lied. Which one is the reporter's verdict (a loss measurement the trainer made); the
authorizer acts on it only from an account the run owner trusts or once several reporters of
different accounts agree (authorizer/evidence.py).

The one witness may be the accused itself (`self_contradiction`): asked the same computation
twice, it signed two results further apart than `tolerance`. Honest compute at one version with
the same weights is deterministic to far within the tolerance (replicas agree to the last bit on
the same hardware), so that proves the lie by itself.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import struct
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from pydantic import Field

from protocol.errors import AgoraError, ErrorCode
from protocol.identity import verify_peer_signature
from protocol.messages import Attestation, Fingerprint, PeerIdText, SignedHop, WireModel, WireTensor

RESULT_KINDS = ("output", "gradient", "loss")
EVIDENCE_MAX_BYTES = 64 << 20
"""The largest evidence body accepted (the input and three results, at the largest stage widths)."""
MAX_WITNESSES = 4
"""Witnesses one averaging evidence (a SparseLoCo fragment's, an AsyncSPARTA part's) carries at most."""


def tensor_digest(tensor: Optional[torch.Tensor]) -> bytes:
    """SHA-256 of a tensor as it travels (dtype, shape, little-endian C-order bytes, no copy made
    of a contiguous CPU tensor); 32 zero bytes for none."""
    if tensor is None:
        return bytes(32)
    tensor = tensor.detach().cpu().contiguous()
    digest = hashlib.sha256(str(tensor.dtype).encode())
    digest.update(struct.pack(f"<{tensor.dim()}q", *tensor.shape))
    raw = tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor
    digest.update(memoryview(raw.numpy()).cast("B") if raw.numel() else b"")
    return digest.digest()


def loss_tensor(loss: float) -> torch.Tensor:
    """A reported loss as the result a signature covers (float32: a dtype that travels)."""
    return torch.tensor(float(loss), dtype=torch.float32)


def result_signing_bytes(run_id: str, stage: int, version: int, kind: str, tokens: torch.Tensor,
                         coords: Optional[torch.Tensor], grad_output: Optional[torch.Tensor],
                         result: torch.Tensor, weights: Optional[bytes] = None) -> bytes:
    """What a worker signs for one result: `kind` is `output` (a forward's coordinates),
    `gradient` (a backward's input gradient, given `grad_output`, or at the tail none) or `loss`
    (the tail's loss, `loss_tensor`); `weights`, the fingerprint of the weights it used."""
    return digest_signing_bytes(run_id, stage, version, kind, tensor_digest(tokens), tensor_digest(coords),
                                tensor_digest(grad_output), tensor_digest(result), weights)


def digest_signing_bytes(run_id: str, stage: int, version: int, kind: str, tokens: bytes, coords: bytes,
                         grad_output: bytes, result: bytes, weights: Optional[bytes] = None) -> bytes:
    """`result_signing_bytes` from the tensors' digests: how a neighbour on a chain that holds only
    some of the tensors checks a signature (roles/worker/serving/chain_signatures.py)."""
    if kind not in RESULT_KINDS:
        raise ValueError(f"unknown result kind {kind!r}")
    return b"".join([b"agora-result-v1\0", run_id.encode(), b"\0", struct.pack("<qq", stage, version),
                     kind.encode(), b"\0", (weights or bytes(8)).ljust(8, b"\0")[:8], tokens,
                     coords, grad_output, result])


NO_TENSOR = bytes(32)
"""The digest of no tensor (`tensor_digest(None)`): a head's input, an output's output gradient."""


def sign_hop(sign, run_id: str, peer_id: str, stage: int, version: Optional[int], weights: Optional[bytes],
             kind: str, tokens: torch.Tensor, coords: Optional[torch.Tensor], grad_output: Optional[torch.Tensor],
             result: Optional[torch.Tensor]) -> Optional[SignedHop]:
    """A worker's signature over one result it passes along a chain, with the digests it covers
    (protocol/messages.py SignedHop); None without a result or a version. `sign` is the worker's
    identity key (None: a worker that does not sign, which still says its version)."""
    if version is None or result is None:
        return None
    digests = tensor_digest(tokens), tensor_digest(coords), tensor_digest(grad_output), tensor_digest(result)
    attestation = None if sign is None else sign(digest_signing_bytes(run_id, stage, version, kind, *digests, weights))
    return SignedHop(peer_id=peer_id, stage=stage, version=version, weights=weights, coords_digest=digests[1],
                     grad_output_digest=digests[2], result_digest=digests[3], attestation=attestation)


def hop_holds(run_id: str, kind: str, tokens_digest: bytes, hop: SignedHop) -> bool:
    """Whether `hop`'s signature verifies over what it names (one without a signature holds nothing)."""
    if hop.attestation is None or kind not in RESULT_KINDS:
        return False
    signed = digest_signing_bytes(run_id, hop.stage, hop.version, kind, tokens_digest, hop.coords_digest,
                                  hop.grad_output_digest, hop.result_digest, hop.weights)
    try:
        return verify_peer_signature(hop.peer_id, signed, hop.attestation)
    except Exception:  # noqa: BLE001 - a peer id that names no key verifies nothing
        return False


class SignedResult(WireModel):
    """One replica's result of the evidence's computation, and its signature over it."""

    peer_id: PeerIdText
    result: WireTensor
    attestation: Attestation


class Evidence(WireModel):
    """A spot check's dispute: the accused's signed result against two other replicas' (a third
    replica settled it) or against one (two replicas; the reporter's measurement settled it)."""

    run_id: str = Field(min_length=1, max_length=128)
    stage: int = Field(ge=0, le=4096)
    version: int = Field(ge=0)
    weights: Optional[Fingerprint] = None
    """The fingerprint of the weights all three signed they computed with."""
    kind: Literal["output", "gradient", "loss"]
    tokens: WireTensor
    coords: Optional[WireTensor] = None
    grad_output: Optional[WireTensor] = None
    accused: SignedResult
    witnesses: list[SignedResult] = Field(min_length=1, max_length=2)

    @property
    def self_contradiction(self) -> bool:
        """The accused's own second answer is the witness."""
        return len(self.witnesses) == 1 and self.witnesses[0].peer_id == self.accused.peer_id


class EvidenceRejected(AgoraError):
    """Evidence that does not prove what it claims (`reason`: an EvidenceReason value,
    protocol.authorizer_api: bad_signature, witnesses_disagree, accused_agrees, wrong_run,
    duplicate_party, for fragment evidence also mismatched_fragment, for part evidence also
    mismatched_part)."""

    code = ErrorCode.INVALID_REQUEST

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 distance of `a` from `b` (inf for different shapes or non-finite values)."""
    if a.shape != b.shape:
        return float("inf")
    a, b = a.double(), b.double()
    gap = float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))
    return gap if gap == gap else float("inf")


def check_evidence(evidence: Evidence, *, run_id: str, tolerance: float) -> tuple[float, ...]:
    """Verify `evidence` by itself; the accused's distances from its witnesses (one or two) if it
    holds, else EvidenceRejected. With one witness it holds when the two contradict each other."""
    if evidence.run_id != run_id:
        raise EvidenceRejected("wrong_run", f"the evidence is for run {evidence.run_id!r}, not {run_id!r}")
    parties = [evidence.accused, *evidence.witnesses]
    if len({p.peer_id for p in parties}) != len(parties) and not evidence.self_contradiction:
        raise EvidenceRejected("duplicate_party", "the accused and the witnesses must be different peers")
    for party in parties:
        signed = result_signing_bytes(evidence.run_id, evidence.stage, evidence.version, evidence.kind,
                                      evidence.tokens, evidence.coords, evidence.grad_output, party.result,
                                      evidence.weights)
        if not verify_peer_signature(party.peer_id, signed, party.attestation):
            raise EvidenceRejected("bad_signature", f"{party.peer_id} did not sign this result for this input")
    if len(evidence.witnesses) == 2:
        first, second = evidence.witnesses
        if distance(first.result, second.result) > tolerance:
            raise EvidenceRejected("witnesses_disagree", "the two witnesses' results differ: nothing is proven")
    gaps = tuple(distance(evidence.accused.result, w.result) for w in evidence.witnesses)
    if min(gaps) <= tolerance:
        raise EvidenceRejected("accused_agrees", "the accused's result is within tolerance of a witness's")
    return gaps


def choose_witnesses(norms: dict[str, float], *, ratio: float, own: str, limit: int = MAX_WITNESSES) -> list[str]:
    """The largest group of `norms`' senders within `ratio` of each other (ties: the one with `own`,
    then the one of smaller norms), cut to `own` and those nearest to its norm (or to the group's
    median without it); at most `limit`, maybe fewer than two."""
    finite = sorted((n, p) for p, n in norms.items() if n > 0 and math.isfinite(n))
    best: list[tuple[float, str]] = []
    for i, (low, _) in enumerate(finite):
        group = [entry for entry in finite[i:] if entry[0] <= low * ratio]
        if len(group) > len(best) or (len(group) == len(best) and own in {p for _, p in group}
                                      and own not in {p for _, p in best}):
            best = group
    if not best:
        return []
    centre = next((n for n, p in best if p == own), statistics.median(n for n, _ in best))
    best.sort(key=lambda entry: (entry[1] != own, abs(math.log(entry[0] / centre)), entry[1]))
    return [p for _, p in best[:limit]]


@dataclass(frozen=True)
class EvidenceNorms:
    """What averaging evidence that holds shows (a SparseLoCo fragment's, an AsyncSPARTA part's):
    the accused's norm against its witnesses'."""

    accused: float
    witnesses: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.witnesses)

    @property
    def ratio(self) -> float:
        """The accused's norm over the witnesses' median (inf or nan for non-finite values)."""
        return self.accused / self.median
