"""Operator control orders in the DHT: a signed order that tells one peer to preempt itself
[report 3.5.3.1, failure injection].

An order names its run, its target peer, the moment to die at (`PreemptMoment`), a random order
id, when it was issued and when it expires (at most `MAX_ORDER_TTL_S` later). It lives under the
run's control key (`{run}/control`, next to the revocation list) with one subkey per target,
`preempt:<peer id>`, so a newer order for a peer replaces the older one and no peer's order can sit
under another's subkey.

Who may sign, checked by every node's record validator (protocol/records.py) and again by the
target before it acts:

- `root`: the run's root key itself (the authorizer signs on its admin endpoint);
- `operator`: a node holding a credential for the role `monitor`, which the authorizer grants only
  to the holder of the run owner's admin token, signing with its own libp2p key. The credential
  travels in the record, so a verifier needs nothing but the root public key.

Anything else (a worker's or trainer's credential, an unsigned or altered order, another run's or
another peer's order, an expired one, one that claims to live too long) is refused with a reason
(`OrderRejection`). In an open run (no authorizer, no root key) nobody can sign an order, and
workers do not read them at all: any peer could write one.

The signature covers canonical bytes (a domain tag, then every field in a fixed order), and
decoding refuses anything that does not re-encode to exactly those bytes, as for credentials.
"""

from __future__ import annotations

import enum
import secrets
import time
from typing import Literal, Optional, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.codec import pack, unpack
from protocol.credentials import (
    MAX_CLOCK_SKEW_S, MAX_CREDENTIAL_BYTES, CredentialError, WireBytes, load_root_public_key, verify_credential,
)
from protocol.errors import ProtocolError
from protocol.identity import verify_peer_signature

ORDER_VERSION = 1
PREEMPT_SUBKEY_PREFIX = "preempt:"
MAX_ORDER_TTL_S = 600.0
"""An order lives at most this long (the DHT's own bound on any record, MAX_RECORD_TTL_S)."""
DEFAULT_ORDER_TTL_S = 300.0
OPERATOR_ROLE = "monitor"
"""The credential role an operator signs with: granted only to the run owner's admin token."""
MAX_ORDER_BYTES = MAX_CREDENTIAL_BYTES + 1024

_ORDER_DOMAIN = "agora/control/preempt/v1"
_WIRE = ConfigDict(frozen=True, strict=True, extra="ignore")


class PreemptMoment(str, enum.Enum):
    """When the target dies: the moments the report's failure injection needs [report 3.5.3.1]."""

    NOW = "now"  # as soon as the order is read
    CHUNK_SEND = "chunk_send"  # while sending its parameter chunks to the reducers in an averaging round
    REDUCED_SEND = "reduced_send"  # while sending averaged chunks back, as a reducer
    FORWARD = "forward"  # mid forward compute of a batch
    BACKWARD = "backward"  # mid backward compute of a batch


class OrderRejection(str, enum.Enum):
    """Why an order was refused; `order_<value>` is the reason in the validator's rejection log."""

    MALFORMED = "malformed"  # not decodable, a field out of bounds, or not canonical
    BAD_SIGNATURE = "bad_signature"  # not signed by the root key or by the operator's key, or altered since
    NOT_OPERATOR = "not_operator"  # signed with a credential that is invalid or not an operator's
    WRONG_RUN = "wrong_run"  # issued for another run
    WRONG_PEER = "wrong_peer"  # stored under another peer's subkey
    EXPIRED = "expired"  # past expires_at
    NOT_YET_VALID = "not_yet_valid"  # issued in the future
    TTL_TOO_LONG = "ttl_too_long"  # expires more than MAX_ORDER_TTL_S after it was issued, or the record outlives it
    UNSUPPORTED_VERSION = "unsupported_version"  # a newer order format than this node speaks
    NO_ROOT_KEY = "no_root_key"  # an open run: nobody can sign orders


class OrderRefused(ProtocolError):
    """An order did not verify; `reason` says why, `role` is the signer's credential role if known."""

    def __init__(self, reason: OrderRejection, message: str, role: Optional[str] = None):
        super().__init__(message)
        self.reason, self.role = reason, role


class PreemptOrder(BaseModel):
    """What the operator orders: peer `peer_id` of run `run_id` must preempt itself at `moment`."""

    model_config = _WIRE

    version: int = Field(default=ORDER_VERSION, ge=1, le=1000)
    run_id: str = Field(min_length=1, max_length=64)
    peer_id: str = Field(min_length=1, max_length=128, description="the target's base58 peer id")
    moment: PreemptMoment = Field(strict=False)
    order_id: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    issued_at: float = Field(ge=0, le=1 << 40, description="unix seconds")
    expires_at: float = Field(ge=0, le=1 << 40, description="unix seconds")

    def signing_bytes(self) -> bytes:
        return pack([_ORDER_DOMAIN, self.version, self.run_id, self.peer_id, self.moment.value, self.order_id,
                     float(self.issued_at), float(self.expires_at)])

    @classmethod
    def from_signing_bytes(cls, data: bytes) -> PreemptOrder:
        try:
            fields = unpack(data, max_len=MAX_ORDER_BYTES)
        except ProtocolError:
            raise OrderRefused(OrderRejection.MALFORMED, "order is not valid msgpack") from None
        if not isinstance(fields, list) or len(fields) < 2 or fields[0] != _ORDER_DOMAIN:
            raise OrderRefused(OrderRejection.MALFORMED, "bytes are not an agora preempt order")
        if isinstance(fields[1], int) and not isinstance(fields[1], bool) and fields[1] > ORDER_VERSION:
            raise OrderRefused(OrderRejection.UNSUPPORTED_VERSION,
                               f"order version {fields[1]} is newer than this node understands; upgrade agora-node")
        names = ("version", "run_id", "peer_id", "moment", "order_id", "issued_at", "expires_at")
        if len(fields) != len(names) + 1:
            raise OrderRefused(OrderRejection.MALFORMED, f"order has {len(fields) - 1} fields, expected {len(names)}")
        try:
            order = cls.model_validate(dict(zip(names, fields[1:])))
        except ValidationError:
            raise OrderRefused(OrderRejection.MALFORMED, "an order field is out of bounds") from None
        if order.signing_bytes() != bytes(data):
            raise OrderRefused(OrderRejection.MALFORMED, "order is not in canonical form")
        return order

    @property
    def subkey(self) -> str:
        return preempt_subkey(self.peer_id)


class SignedPreemptOrder(BaseModel):
    """An order, who signed it and the signature over its canonical bytes; `credential` is the
    operator's credential (the credentials module's wire bytes) when `signer` is `operator`."""

    model_config = _WIRE

    order: PreemptOrder
    signer: Literal["root", "operator"]
    signature: WireBytes = Field(min_length=64, max_length=64)
    credential: Optional[WireBytes] = Field(default=None, max_length=MAX_CREDENTIAL_BYTES)

    def to_dht_value(self) -> dict:
        """What is stored under the control key: the signed bytes themselves, not their fields."""
        value = {"order": self.order.signing_bytes(), "signer": self.signer, "signature": self.signature}
        if self.credential is not None:
            value["credential"] = self.credential
        return value

    def to_bytes(self) -> bytes:
        """The DHT value as one msgpack blob (how the authorizer hands an order out)."""
        return pack(self.to_dht_value())

    @classmethod
    def from_dht_value(cls, value: object) -> SignedPreemptOrder:
        """Parse (not verify) an untrusted stored value; anything odd is `OrderRefused(MALFORMED)`."""
        if isinstance(value, (bytes, bytearray)):
            if len(value) > MAX_ORDER_BYTES:
                raise OrderRefused(OrderRejection.MALFORMED, "order record is too large")
            try:
                value = unpack(bytes(value), max_len=MAX_ORDER_BYTES)
            except ProtocolError:
                raise OrderRefused(OrderRejection.MALFORMED, "order record is not valid msgpack") from None
        if not isinstance(value, dict):
            raise OrderRefused(OrderRejection.MALFORMED, "order record must be a map")
        body = value.get("order")
        if not isinstance(body, bytes) or len(body) > MAX_ORDER_BYTES:
            raise OrderRefused(OrderRejection.MALFORMED, "order record has no order bytes")
        order = PreemptOrder.from_signing_bytes(body)
        try:
            return cls(order=order, signer=value.get("signer"), signature=value.get("signature"),
                       credential=value.get("credential"))
        except ValidationError:
            raise OrderRefused(OrderRejection.MALFORMED, "order record's signer, signature or credential is "
                                                         "malformed") from None


def preempt_subkey(peer_id: str) -> str:
    """The control-key subkey of the orders for `peer_id`."""
    return f"{PREEMPT_SUBKEY_PREFIX}{peer_id}"


def new_order(*, run_id: str, peer_id: str, moment: Union[PreemptMoment, str], ttl_s: float = DEFAULT_ORDER_TTL_S,
              now: Optional[float] = None) -> PreemptOrder:
    """An unsigned order with a fresh id; `ttl_s` must lie in (0, MAX_ORDER_TTL_S]."""
    if not 0 < ttl_s <= MAX_ORDER_TTL_S:
        raise ValueError(f"an order's ttl must lie in (0, {MAX_ORDER_TTL_S:.0f}] seconds, got {ttl_s}")
    now = time.time() if now is None else now
    return PreemptOrder(run_id=run_id, peer_id=peer_id, moment=PreemptMoment(moment), order_id=secrets.token_hex(8),
                        issued_at=float(now), expires_at=float(now + ttl_s))


def sign_order_as_root(root_private_key: Ed25519PrivateKey, order: PreemptOrder) -> SignedPreemptOrder:
    return SignedPreemptOrder(order=order, signer="root", signature=root_private_key.sign(order.signing_bytes()))


def sign_order_as_operator(identity, credential: bytes, order: PreemptOrder) -> SignedPreemptOrder:
    """Sign with an operator's libp2p identity (protocol.identity.Identity); `credential` is its
    operator credential's wire bytes."""
    return SignedPreemptOrder(order=order, signer="operator", signature=identity.sign(order.signing_bytes()),
                              credential=credential)


def verify_order(root_public_key: Optional[Union[bytes, Ed25519PublicKey]], value: object, *, run_id: str,
                 subkey: Optional[str] = None, record_expiration: Optional[float] = None,
                 now: Optional[float] = None) -> SignedPreemptOrder:
    """Check a stored order and return it, or raise `OrderRefused`. `subkey` is the control-key
    subkey it was stored under (it must be its target's), `record_expiration` the DHT record's
    expiry (it must not outlive the order). The signature is checked before any claim, so an
    unsigned order never learns which of its claims would have passed."""
    if root_public_key is None:
        raise OrderRefused(OrderRejection.NO_ROOT_KEY, "this run has no root key (an open run): orders are refused")
    signed = SignedPreemptOrder.from_dht_value(value)
    order = signed.order
    data = order.signing_bytes()
    role = None
    if signed.signer == "root":
        try:
            key = root_public_key if isinstance(root_public_key, Ed25519PublicKey) \
                else load_root_public_key(root_public_key)
            key.verify(signed.signature, data)
        except (InvalidSignature, CredentialError):
            raise OrderRefused(OrderRejection.BAD_SIGNATURE, "order is not signed by this run's root key") from None
    else:
        if signed.credential is None:
            raise OrderRefused(OrderRejection.NOT_OPERATOR, "an operator's order must carry its credential")
        try:
            cred = verify_credential(root_public_key, signed.credential, now=now, run_id=run_id)
        except CredentialError:
            raise OrderRefused(OrderRejection.NOT_OPERATOR, "the order's credential does not verify") from None
        role = cred.role
        if cred.role != OPERATOR_ROLE:
            raise OrderRefused(OrderRejection.NOT_OPERATOR,
                               f"a {cred.role}'s credential cannot sign orders; only the run's operator can", role)
        if not verify_peer_signature(cred.peer_id, data, signed.signature):
            raise OrderRefused(OrderRejection.BAD_SIGNATURE, "order is not signed by its operator's key", role)
    now = time.time() if now is None else now
    if order.run_id != run_id:
        raise OrderRefused(OrderRejection.WRONG_RUN, f"order is for run {order.run_id!r}, not {run_id!r}", role)
    if subkey is not None and subkey != order.subkey:
        raise OrderRefused(OrderRejection.WRONG_PEER, f"order for {order.peer_id} stored under {subkey!r}", role)
    if order.expires_at - order.issued_at > MAX_ORDER_TTL_S or order.expires_at <= order.issued_at:
        raise OrderRefused(OrderRejection.TTL_TOO_LONG, f"an order lives at most {MAX_ORDER_TTL_S:.0f}s", role)
    if record_expiration is not None and record_expiration > order.expires_at + MAX_CLOCK_SKEW_S:
        raise OrderRefused(OrderRejection.TTL_TOO_LONG, "the DHT record outlives its order", role)
    if now < order.issued_at - MAX_CLOCK_SKEW_S:
        raise OrderRefused(OrderRejection.NOT_YET_VALID, "order is issued in the future; check the clocks", role)
    if now >= order.expires_at:
        raise OrderRefused(OrderRejection.EXPIRED, f"order {order.order_id} expired", role)
    return signed


# ---- the authorizer's admin endpoint (POST /v1/admin/preempt): one contract for both sides ----


class PreemptRequest(BaseModel):
    """Ask the authorizer to sign an order with the root key."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    peer_id: str = Field(min_length=1, max_length=128, pattern=r"^[1-9A-HJ-NP-Za-km-z]+$",
                         description="the target's base58 peer id")
    moment: PreemptMoment = Field(strict=False)
    ttl_s: float = Field(default=DEFAULT_ORDER_TTL_S, gt=0, le=MAX_ORDER_TTL_S, strict=False)


class PreemptOrderOut(BaseModel):
    """The signed order and where to write it: `subkey` of `key` in the DHT, `record` as the value
    (SignedPreemptOrder.to_bytes, base64 in JSON)."""

    model_config = _WIRE

    order_id: str
    run_id: str
    peer_id: str
    moment: PreemptMoment = Field(strict=False)
    issued_at: float
    expires_at: float
    key: str
    subkey: str
    record: WireBytes
