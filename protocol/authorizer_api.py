"""The authorizer's HTTP contract with nodes (`/v1`): one set of classes both sides import.

A node sends these models (`AuthorizerClient` in node.admission) and parses the replies into them;
the authorizer (authorizer.routes) validates requests against them, with stricter server-side
checks added in authorizer.models, and answers with them. Every model is frozen and ignores
unknown fields, so an older node keeps understanding a newer authorizer and the other way round.
Never rename or reuse a field; add new ones. Codes that travel as strings (`RejectReason`,
`TicketStatus`) only ever gain values.

Bytes travel as standard base64 with padding; the authorizer refuses anything else.
"""

from __future__ import annotations

import base64
import binascii
import enum
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema

from protocol.credentials import SignedCredential

PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{20,128}$"  # base58
TICKET_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"
ACCOUNT_ID_PATTERN = r"^[0-9a-f]{64}$"
_WIRE = ConfigDict(frozen=True, extra="ignore", str_strict=True, allow_inf_nan=False)


def _decode_base64(max_bytes: int):
    def decode(value: Any) -> bytes:
        if isinstance(value, bytes):  # built in Python, not decoded from JSON
            return value
        if not isinstance(value, str):
            raise ValueError("must be a base64 string")
        if len(value) > 4 * (max_bytes // 3 + 1):
            raise ValueError(f"must decode to at most {max_bytes} bytes")
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("is not valid base64 (standard alphabet, with padding)") from exc
    return decode


def Base64Bytes(max_bytes: int) -> Any:  # noqa: N802 - a type factory
    """Bytes that travel as standard base64 of at most `max_bytes` decoded bytes."""
    return Annotated[
        bytes,
        BeforeValidator(_decode_base64(max_bytes)),
        PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
        WithJsonSchema({"type": "string", "format": "byte", "maxLength": 4 * (max_bytes // 3 + 1)}),
    ]


class RejectReason(str, enum.Enum):
    """Why a join was refused. Never rename a value; add new ones."""

    ACCELERATOR_NOT_ALLOWED = "accelerator_not_allowed"  # device not on the run's allow-list
    INSUFFICIENT_VRAM = "insufficient_vram"  # accelerator memory below every stage's floor
    INSUFFICIENT_RAM = "insufficient_ram"  # host memory below the floor
    INSUFFICIENT_BANDWIDTH = "insufficient_bandwidth"  # measured bandwidth below the floor
    LATENCY_TOO_HIGH = "latency_too_high"  # measured latency above the ceiling
    CLIENT_VERSION_NOT_ACCEPTED = "client_version_not_accepted"  # build the run does not accept
    PACKAGE_DIGEST_NOT_ACCEPTED = "package_digest_not_accepted"  # modified or unknown package
    UNREACHABLE = "unreachable"  # the authorizer could not dial any announced address
    NO_DIALABLE_ADDRESS = "no_dialable_address"  # no announced address the authorizer may dial
    ACCOUNT_REQUIRED = "account_required"  # no account token given
    ACCOUNT_LIMIT = "account_limit"  # the account already runs its maximum of nodes
    BANNED_ACCOUNT = "banned_account"  # the operator banned the account
    BANNED_PEER = "banned_peer"  # the operator banned this peer id
    RUN_FULL = "run_full"  # every stage this node may serve is at capacity
    QUEUE_FULL = "queue_full"  # the admission queue is at its maximum length
    UNKNOWN_ACCOUNT = "unknown_account"  # the token was never issued by this run's owner
    REVOKED_ACCOUNT = "revoked_account"  # the owner revoked the account token
    REPLACED = "replaced"  # the same peer joined again (a restart): this ticket was superseded
    MONITOR_NOT_AUTHORIZED = "monitor_not_authorized"  # a monitor must present the run owner's admin token


class TicketStatus(str, enum.Enum):
    QUEUED = "queued"  # placed on a stage, waiting for the join rate or a free slot
    ADMITTED = "admitted"  # credential issued
    REJECTED = "rejected"  # see rejection
    LEFT = "left"  # the node left
    EXPIRED = "expired"  # the node stopped renewing; rejoin
    BANNED = "banned"  # the operator banned the peer or its account
    ABANDONED = "abandoned"  # the node stopped polling while queued; rejoin
    REPLACED = "replaced"  # the same peer joined again; its newer ticket is the live one


LIVE_TICKET_STATUSES = (TicketStatus.QUEUED, TicketStatus.ADMITTED)


# -- errors -----------------------------------------------------------------------------------

RATE_LIMITED = "rate_limited"
"""The error code of a 429 answer: this source or node sent more than its share; send again after
the `Retry-After` header's seconds (join, poll, renew and leave are limited)."""
MAX_RETRY_AFTER_S = 60.0
"""The longest wait a client takes from one `Retry-After` (a larger or garbled value is capped)."""


def retry_after_s(header: Optional[str], default_s: float = 1.0) -> float:
    """The seconds a 429 answer's `Retry-After` header asks a client to wait, within
    0..MAX_RETRY_AFTER_S; `default_s` when it is missing or not a number of seconds (the
    authorizer always sends whole seconds, never an HTTP date)."""
    try:
        seconds = float((header or "").strip())
    except ValueError:
        return default_s
    if seconds != seconds:  # NaN
        return default_s
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)



class ErrorDetail(BaseModel):
    model_config = _WIRE

    code: str = Field(description="stable snake_case error code")
    message: str = Field(description="what went wrong and what to do about it")


class ErrorBody(BaseModel):
    """The body of every 4xx and 5xx answer."""

    model_config = _WIRE

    error: ErrorDetail


# -- requests ---------------------------------------------------------------------------------


class Hardware(BaseModel):
    """What the node measured about itself."""

    model_config = _WIRE

    device_name: str = Field(min_length=1, max_length=128, pattern=r"^[\x20-\x7e]+$",
                             description="e.g. 'NVIDIA RTX 4090' or 'cpu'")
    vram_bytes: int = Field(ge=0, le=1 << 50, description="accelerator memory; 0 if none")
    ram_bytes: int = Field(ge=0, le=1 << 50, description="host memory")
    bandwidth_mbps: float = Field(ge=0, le=1e7, description="measured network bandwidth")
    latency_ms: float = Field(ge=0, le=1e7, description="measured latency to the run")


class JoinRequest(BaseModel):
    """Ask to join. `signed_at` and `signature` prove that the sender holds the key of `peer_id`
    (`protocol.credentials.proof_bytes('join', ...)`); only a proven join may replace a live ticket
    of the same peer (a node restarted after a crash). Without them a join still queues a peer
    that holds no live ticket (clients before the proof existed)."""

    model_config = _WIRE

    peer_id: str = Field(pattern=PEER_ID_PATTERN, description="base58 libp2p peer id")
    public_key: Base64Bytes(256) = Field(  # type: ignore[valid-type]
        description="Ed25519 public key: 32 raw bytes or the libp2p protobuf, base64")
    role: Literal["worker", "trainer", "monitor", "relay"] = Field(
        description="monitor: the run's health monitor; relay: one of the run's relays (protocol/relays.py); both "
                    "are the run owner's own nodes, admitted only with the admin token as their account token, "
                    "and take no stage and no trainer slot")
    hardware: Hardware
    client_version: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9.+_-]+$")
    package_digest: str = Field(default="", max_length=160, pattern=r"^[A-Za-z0-9:+/=._-]*$")
    announce_maddrs: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=32, description="multiaddrs peers can dial, with or without /p2p/<id>")
    account_token: str = Field(default="", max_length=256, pattern=r"^[\x21-\x7e]*$")
    preferred_stage: Optional[int] = Field(
        default=None, ge=0, le=1_000_000,
        description="the stage a worker asks for (--stage); placed there only if the policy honours "
                    "preferences and the stage has room")
    relay_ok: bool = Field(
        default=False, description="the node can serve through the run's relays: if the authorizer cannot dial it "
                                   "back and the run has a relay, it is admitted as relayed instead of refused")
    signed_at: Optional[float] = Field(default=None, ge=0, le=1e11, description="unix seconds of the proof")
    signature: Optional[Base64Bytes(128)] = Field(  # type: ignore[valid-type]
        default=None, description="Ed25519 signature over proof_bytes('join', run_id, peer_id, signed_at), base64")


class Proof(BaseModel):
    """A renew or leave request: signed with the node's libp2p key over
    `protocol.credentials.proof_bytes(action, run_id=..., peer_id=..., signed_at=...)`."""

    model_config = _WIRE

    peer_id: str = Field(pattern=PEER_ID_PATTERN)
    signed_at: float = Field(ge=0, le=1e11, description="unix seconds when the node signed")
    signature: Base64Bytes(128) = Field(  # type: ignore[valid-type]
        description="Ed25519 signature with the node's libp2p key, base64")


# -- replies ----------------------------------------------------------------------------------


class RejectionOut(BaseModel):
    model_config = _WIRE

    reason: str = Field(description="a RejectReason value")
    message: str


class CredentialOut(BaseModel):
    model_config = _WIRE

    credential: SignedCredential = Field(description="the credential, fields in JSON")
    credential_msgpack: str = Field(description="base64 of SignedCredential.to_bytes(): what peers are shown")
    renew_at: float = Field(description="unix seconds; renew then (two thirds of the lifetime)")
    expires_at: int

    def signed(self) -> SignedCredential:
        """The credential exactly as signed (from its msgpack form)."""
        return SignedCredential.from_bytes(base64.b64decode(self.credential_msgpack))


class AdmissionOut(CredentialOut):
    bootstrap_peers: list[str] = Field(description="multiaddrs to join the DHT through")
    relays: list[str] = Field(default_factory=list, description="the run's relays (multiaddrs with /p2p/<id>): a "
                                                                 "relayed node reserves a slot on them")
    authorizer_public_key: str = Field(description="Ed25519 root public key, raw, base64")


class TicketOut(BaseModel):
    """A join's ticket: the answer to join and to every poll."""

    model_config = _WIRE

    ticket: str
    status: TicketStatus
    peer_id: str
    role: str
    run_id: str
    stage: Optional[int] = Field(description="placed stage; known while queued, so stage state can be fetched early")
    reducer: bool = Field(default=False, description="the authorizer designated this worker a reducer of its stage "
                                                     "(policy reducer_accounts)")
    reachability: Optional[Literal["direct", "relayed"]] = Field(
        default=None, description="relayed: the authorizer could not dial the node and admitted it to serve "
                                  "through the run's relays; direct: dialled back (or not checked)")
    queue_position: Optional[int] = Field(default=None, description="0 = released next")
    estimated_wait_s: Optional[float] = None
    rejection: Optional[RejectionOut] = None
    run_config: Optional[dict] = Field(default=None, description="the run's RunConfig (in poll answers)")
    admission: Optional[AdmissionOut] = Field(
        default=None, description="credential and bootstrap peers; only in poll answers of an admitted ticket")


class RenewOut(CredentialOut):
    stage: Optional[int]


class LeaveOut(BaseModel):
    model_config = _WIRE

    peer_id: str
    status: TicketStatus


# -- evidence ---------------------------------------------------------------------------------

EVIDENCE_REJECTED = "evidence_rejected"
"""The error code of a 400 answer to POST /v1/evidence whose evidence proves nothing: the body's
error also carries `reason` (an EvidenceReason value), `evidence_id` and `accused`."""


class EvidenceReason(str, enum.Enum):
    """Why reported evidence was rejected. Never rename a value; add new ones."""

    WRONG_RUN = "wrong_run"  # the evidence is for another run
    DUPLICATE_PARTY = "duplicate_party"  # the accused and the witnesses are not three different peers
    BAD_SIGNATURE = "bad_signature"  # a party did not sign its result for this input (or it was changed)
    WITNESSES_DISAGREE = "witnesses_disagree"  # the two witnesses' results differ: nothing is proven
    ACCUSED_AGREES = "accused_agrees"  # the accused's result is within tolerance of a witness's
    NOT_A_WORKER_OF_THE_STAGE = "not_a_worker_of_the_stage"  # a party was never admitted as a worker of the stage
    SAME_ACCOUNT = "same_account"  # a witness is on the accused's account
    WITNESSES_SAME_ACCOUNT = "witnesses_same_account"  # two witnesses are on one account: one party's word
    MISMATCHED_FRAGMENT = "mismatched_fragment"  # a fragment not of the evidence's round, fragment, layout, chunking
    MISMATCHED_PART = "mismatched_part"  # all-reduce parts not of one shape, or not float32 uncompressed


class EvidenceOut(BaseModel):
    """The answer to POST /v1/evidence that was acted on (rejected evidence is the 400
    `evidence_rejected`, whose error body says why)."""

    model_config = _WIRE

    verdict: Literal["upheld", "already_revoked", "rejected", "pending"] = Field(
        description="upheld: the accused's account is banned now; already_revoked: it was banned or revoked "
                    "before, nothing new is banned; pending: a two-replica contradiction that holds, recorded "
                    "until reporters of enough accounts (the policy's evidence_quorum) agree")
    reason: Optional[str] = Field(default=None, description="an EvidenceReason value, for rejected evidence")
    accused: str = Field(description="the accused worker's peer id")
    evidence_id: int = Field(description="the report's id in GET /v1/admin/evidence")


class EvidenceRejectedDetail(ErrorDetail):
    reason: str = Field(description="an EvidenceReason value")
    evidence_id: int = Field(description="the report's id in GET /v1/admin/evidence, where the reporter is flagged")
    accused: str


class EvidenceRejectedBody(BaseModel):
    """The body of the 400 `evidence_rejected` answer."""

    model_config = _WIRE

    error: EvidenceRejectedDetail


class StageInfo(BaseModel):
    model_config = _WIRE

    index: int
    kind: str
    first_layer: int
    last_layer: int
    admitted: int
    queued: int
    target: int
    capacity: int
    floor: dict[str, Optional[float]] = Field(description="the stage's hardware floor (policy field floors)")


class PoolInfo(BaseModel):
    model_config = _WIRE

    admitted: int
    queued: int
    capacity: int


class RunInfo(BaseModel):
    """Public run facts (GET /v1/run)."""

    model_config = _WIRE

    run_id: str
    stages: list[StageInfo]
    trainers: PoolInfo
    authorizer_public_key: str
    client_versions: list[str]
    join_rate_per_s: float
    credential_ttl_s: int
    checks: dict[str, bool]
    accounts_required: bool = Field(default=False, description="joins need a token issued by the run's owner")
