"""The HTTP API's bodies (`/v1`), bounded everywhere because every input is hostile: strings have
lengths and patterns, lists have sizes, numbers have ranges, bytes arrive as strict base64.

The bodies nodes exchange with the authorizer are wire contracts and live in
protocol.authorizer_api, imported by both sides; this module adds the server-side checks that need
the authorizer's own code (multiaddr parsing) and the operator's admin bodies. Requests ignore
unknown fields (a newer client keeps working); responses are what /openapi.json documents.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from authorizer.policy import Checks, HardwareFloor

from protocol.authorizer_api import (  # noqa: F401 - re-exported: the routes and tests use them from here
    ACCOUNT_ID_PATTERN, PEER_ID_PATTERN, TICKET_PATTERN, AdmissionOut, Base64Bytes, CredentialOut, ErrorBody,
    ErrorDetail, Hardware, LeaveOut, PoolInfo, Proof, RejectionOut, RenewOut, RunInfo, StageInfo, TicketOut,
    TicketStatus,
)
from protocol.authorizer_api import JoinRequest as WireJoinRequest

_REQUEST = ConfigDict(extra="ignore", str_strict=True, allow_inf_nan=False)


class JoinRequest(WireJoinRequest):
    """protocol.authorizer_api.JoinRequest, with its addresses checked as multiaddrs of this peer."""

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
        if (self.signed_at is None) != (self.signature is None):
            raise ValueError("give signed_at and signature together (the join proof), or neither")
        return self


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
    honor_stage_preference: Optional[bool] = None
    reducer_accounts: Optional[list[Annotated[str, Field(min_length=1, max_length=128)]]] = Field(default=None, max_length=256)
    evidence_quorum: Optional[int] = Field(default=None, ge=1, le=1000)
    evidence_trusted_accounts: Optional[list[Annotated[str, Field(min_length=1, max_length=128)]]] = Field(
        default=None, max_length=256)
    bandwidth_floor_from_plan: Optional[Literal["off", "bf16", "fp32"]] = None

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


class RejectionCountOut(BaseModel):
    source: str = Field(description="the address the joins came from (IPv6: its /64); 'other' pools overflow")
    reason: str = Field(description="a RejectReason value, or rate_limited for joins answered 429")
    minute: int = Field(description="unix seconds the minute starts")
    refused: int = Field(description="joins refused in that minute and not stored as tickets")


class RejectionCountsOut(BaseModel):
    rejections: list[RejectionCountOut]



class EvidenceRecordOut(BaseModel):
    """One evidence report as stored (authorizer.evidence): the tensors are not kept."""

    id: int = Field(description="the evidence id the reporter was answered with")
    received_at: float
    reporter_peer_id: str
    reporter_account_id: str = Field(description="a rejected report flags its reporter and this account")
    accused_peer_id: str
    accused_account_id: Optional[str] = Field(description="null when the accused is no worker admitted to the stage")
    witness_peer_ids: list[str]
    stage: int
    version: int
    kind: str = Field(description="output, gradient or loss; fragment: a SparseLoCo fragment, whose round is "
                                  "`version`; part: an AsyncSPARTA all-reduce part, whose round (the reporter's "
                                  "word) is `version`")
    verdict: Literal["upheld", "already_revoked", "rejected", "pending"]
    reason: Optional[str] = Field(description="an EvidenceReason value, for rejected evidence")
    distances: Optional[list[Optional[float]]] = Field(
        description="the accused's relative L2 distance from each witness, for evidence that holds (null: "
                    "infinite, different shapes or non-finite values); for a fragment or a part, one number: the "
                    "accused's norm over its witnesses' median")
    message: str = Field(description="what was decided and done")
    body_sha256: str


class EvidenceRecordsOut(BaseModel):
    reports: list[EvidenceRecordOut]


class AccountCreate(BaseModel):
    """A new account; the answer carries its token, once."""

    model_config = ConfigDict(extra="forbid", str_strict=True)

    label: str = Field(default="", max_length=128, pattern=r"^[\x20-\x7e]*$", description="who it is for")


class AccountOut(BaseModel):
    id: str = Field(description="sha256 hex of the token: how the account is named everywhere")
    label: str
    created_at: float
    revoked_at: Optional[float] = None
    banned: bool = False


class AccountCreated(AccountOut):
    token: str = Field(description="the account token: shown only now; give it to the contributor")


class AccountsOut(BaseModel):
    accounts: list[AccountOut]


class AccountRevokeOut(BaseModel):
    id: str
    was_active: bool = Field(description="false if it was revoked already")
    ended_tickets: int = Field(description="live tickets of the account ended (credentials revoked)")
