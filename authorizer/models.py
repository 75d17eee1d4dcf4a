"""The HTTP API's request and response bodies (`/v1`), bounded everywhere because every input is
hostile: strings have lengths and patterns, lists have sizes, numbers have ranges, bytes arrive as
strict base64. Requests ignore unknown fields (a newer client keeps working); responses are what
the OpenAPI spec at /openapi.json documents.
"""

from __future__ import annotations

import base64
import binascii
import enum
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from authorizer.admission import RejectReason
from authorizer.policy import Checks, HardwareFloor
from protocol.credentials import SignedCredential

PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{20,128}$"  # base58
TICKET_PATTERN = r"^[A-Za-z0-9_-]{16,64}$"
ACCOUNT_ID_PATTERN = r"^[0-9a-f]{64}$"
_REQUEST = ConfigDict(extra="ignore", str_strict=True, allow_inf_nan=False)
_RESPONSE = ConfigDict(ser_json_bytes="base64")


def _decode_base64(max_bytes: int):
    def decode(value: Any) -> bytes:
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
    return Annotated[
        bytes,
        BeforeValidator(_decode_base64(max_bytes)),
        WithJsonSchema({"type": "string", "format": "byte", "maxLength": 4 * (max_bytes // 3 + 1)}),
    ]


class ErrorDetail(BaseModel):
    code: str = Field(description="stable snake_case error code")
    message: str = Field(description="what went wrong and what to do about it")


class ErrorBody(BaseModel):
    error: ErrorDetail


class Hardware(BaseModel):
    """What the node measured about itself."""

    model_config = _REQUEST

    device_name: str = Field(min_length=1, max_length=128, pattern=r"^[\x20-\x7e]+$", description="e.g. 'NVIDIA RTX 4090' or 'cpu'")
    vram_bytes: int = Field(ge=0, le=1 << 50, description="accelerator memory; 0 if none")
    ram_bytes: int = Field(ge=0, le=1 << 50, description="host memory")
    bandwidth_mbps: float = Field(ge=0, le=1e7, description="measured network bandwidth")
    latency_ms: float = Field(ge=0, le=1e7, description="measured latency to the run")


class JoinRequest(BaseModel):
    model_config = _REQUEST

    peer_id: str = Field(pattern=PEER_ID_PATTERN, description="base58 libp2p peer id")
    public_key: Base64Bytes(256) = Field(description="Ed25519 public key: 32 raw bytes or the libp2p protobuf, base64")  # type: ignore[valid-type]
    role: Literal["worker", "trainer"]
    hardware: Hardware
    client_version: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9.+_-]+$")
    package_digest: str = Field(default="", max_length=160, pattern=r"^[A-Za-z0-9:+/=._-]*$")
    announce_maddrs: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(
        default_factory=list, max_length=32, description="multiaddrs peers can dial, with or without /p2p/<id>")
    account_token: str = Field(default="", max_length=256, pattern=r"^[\x21-\x7e]*$")

    @field_validator("announce_maddrs")
    @classmethod
    def _multiaddrs(cls, values: list[str]) -> list[str]:
        from hivemind.utils.multiaddr import Multiaddr

        for value in values:
            try:
                Multiaddr(value)
            except Exception as exc:  # the multiaddr parser raises several types on bad input
                raise ValueError(f"{value[:80]!r} is not a multiaddr; expected e.g. /ip4/203.0.113.7/tcp/31337") from exc
        return values

    @model_validator(mode="after")
    def _suffixes_match(self) -> JoinRequest:
        from authorizer.reachability import strip_peer_suffix

        for value in self.announce_maddrs:
            _, suffix = strip_peer_suffix(value)
            if suffix is not None and suffix != self.peer_id:
                raise ValueError(f"announce address {value[:80]} names peer {suffix[:60]}, not {self.peer_id}")
        return self


class Proof(BaseModel):
    """A renew or leave request: signed with the node's libp2p key over
    `protocol.credentials.proof_bytes(action, run_id=..., peer_id=..., signed_at=...)`."""

    model_config = _REQUEST

    peer_id: str = Field(pattern=PEER_ID_PATTERN)
    signed_at: float = Field(ge=0, le=1e11, description="unix seconds when the node signed")
    signature: Base64Bytes(128) = Field(description="Ed25519 signature with the node's libp2p key, base64")  # type: ignore[valid-type]


class TicketStatus(str, enum.Enum):
    QUEUED = "queued"  # placed on a stage, waiting for the join rate or a free slot
    ADMITTED = "admitted"  # credential issued
    REJECTED = "rejected"  # see rejection
    LEFT = "left"  # the node left
    EXPIRED = "expired"  # the node stopped renewing; rejoin
    BANNED = "banned"  # the operator banned the peer or its account
    ABANDONED = "abandoned"  # the node stopped polling while queued; rejoin


class RejectionOut(BaseModel):
    reason: RejectReason
    message: str


class CredentialOut(BaseModel):
    model_config = _RESPONSE

    credential: SignedCredential = Field(description="the credential, fields in JSON")
    credential_msgpack: str = Field(description="base64 of SignedCredential.to_bytes(): what peers are shown")
    renew_at: float = Field(description="unix seconds; renew then (two thirds of the lifetime)")
    expires_at: int


class AdmissionOut(CredentialOut):
    bootstrap_peers: list[str] = Field(description="multiaddrs to join the DHT through")
    authorizer_public_key: str = Field(description="Ed25519 root public key, raw, base64")


class TicketOut(BaseModel):
    model_config = _RESPONSE

    ticket: str
    status: TicketStatus
    peer_id: str
    role: str
    run_id: str
    stage: Optional[int] = Field(description="placed stage; known while queued, so stage state can be fetched early")
    queue_position: Optional[int] = Field(default=None, description="0 = released next")
    estimated_wait_s: Optional[float] = None
    rejection: Optional[RejectionOut] = None
    run_config: Optional[dict] = Field(default=None, description="the run's RunConfig (in poll answers)")
    admission: Optional[AdmissionOut] = None


class RenewOut(CredentialOut):
    stage: Optional[int]


class LeaveOut(BaseModel):
    peer_id: str
    status: TicketStatus


class StageInfo(BaseModel):
    index: int
    kind: str
    first_layer: int
    last_layer: int
    admitted: int
    queued: int
    target: int
    capacity: int
    floor: HardwareFloor


class PoolInfo(BaseModel):
    admitted: int
    queued: int
    capacity: int


class RunInfo(BaseModel):
    run_id: str
    stages: list[StageInfo]
    trainers: PoolInfo
    authorizer_public_key: str
    client_versions: list[str]
    join_rate_per_s: float
    credential_ttl_s: int
    checks: Checks


class BanRequest(BaseModel):
    """Exactly one of peer_id, account_id (sha256 hex of the token) or account_token."""

    model_config = ConfigDict(extra="forbid", str_strict=True)

    peer_id: Optional[str] = Field(default=None, pattern=PEER_ID_PATTERN)
    account_id: Optional[str] = Field(default=None, pattern=ACCOUNT_ID_PATTERN)
    account_token: Optional[str] = Field(default=None, min_length=1, max_length=256)
    reason: str = Field(default="", max_length=256)

    @model_validator(mode="after")
    def _one_target(self) -> BanRequest:
        given = [f for f in ("peer_id", "account_id", "account_token") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of peer_id, account_id or account_token")
        return self


class BanOut(BaseModel):
    target: str
    kind: Literal["peer", "account"]
    ended_tickets: int = Field(description="live tickets ended by the ban (credentials revoked)")


class UnbanOut(BaseModel):
    target: str
    kind: Literal["peer", "account"]
    was_banned: bool


class PolicyUpdate(BaseModel):
    """Any subset of the policy; nested floors and checks merge per key."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    stage_capacity: Optional[list[Annotated[int, Field(ge=0, le=1_000_000)]]] = Field(default=None, max_length=1024)
    stage_target: Optional[list[Annotated[int, Field(ge=0, le=1_000_000)]]] = Field(default=None, max_length=1024)
    trainer_capacity: Optional[int] = Field(default=None, ge=0, le=1_000_000)
    join_rate_per_s: Optional[float] = Field(default=None, ge=0.001, le=1e6)
    join_burst: Optional[int] = Field(default=None, ge=1, le=1_000_000)
    floors: Optional[dict[Literal["head", "body", "tail", "trainer"], HardwareFloor]] = None
    accelerators: Optional[list[Annotated[str, Field(min_length=1, max_length=128)]]] = Field(default=None, max_length=256)
    client_versions: Optional[list[Annotated[str, Field(min_length=1, max_length=128)]]] = Field(default=None, max_length=256)
    package_digests: Optional[list[Annotated[str, Field(min_length=1, max_length=128)]]] = Field(default=None, max_length=4096)
    checks: Optional[Checks] = None
    max_nodes_per_account: Optional[int] = Field(default=None, ge=1, le=1_000_000)
    max_queue: Optional[int] = Field(default=None, ge=0, le=1_000_000)
    queue_idle_timeout_s: Optional[float] = Field(default=None, ge=1, le=86400)
    dial_private_addresses: Optional[bool] = None

    def changes(self) -> dict:
        return {k: v for k, v in self.model_dump(exclude_unset=True).items() if v is not None or k == "stage_target"}


class ParticipantOut(BaseModel):
    id: int
    ticket: str
    peer_id: str
    account_id: str
    role: str
    stage: Optional[int]
    status: str
    reason: Optional[str]
    client_version: str
    announce_maddrs: list[str]
    created_at: float
    admitted_at: Optional[float]
    serial: Optional[int]
    expires_at: Optional[int]


class ParticipantsOut(BaseModel):
    participants: list[ParticipantOut]
    next_after_id: Optional[int] = Field(description="pass as after_id for the next page; null at the end")

