"""Credentials the authorizer signs and every peer checks, and the signed revocation list.

A credential binds a peer id and its libp2p public key to a run, a role and a stage for a short
time [report 3.6.1.5]. The authorizer signs it with the run's Ed25519 root key; a peer
holding the root public key verifies it locally, with no call to the authorizer, and must then
check that the libp2p connection's remote peer id equals `credential.peer_id`.

The signature covers canonical bytes: msgpack of the fields in a fixed order behind a domain tag,
so a signature over a credential can never pass for one over a revocation list. On the wire a
credential is those signed bytes themselves plus the signature, and decoding refuses anything that
does not re-encode to exactly those bytes: a peer acts on precisely what the root key signed.
Credentials are short-lived (30 min by default) and renewed at two thirds of their life, which is
what makes revocation work: a banned node is refused renewal, and until its credential lapses its
serial and peer id sit in the signed revocation list that peers read.

Pure and cheap: no I/O, and the loaded root public key is cached, so a verification costs one
msgpack pack and one Ed25519 check (peers also cache verified credentials per peer).
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
import time
from typing import Annotated, Any, Literal, Optional, Union

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
)

from protocol.codec import pack, unpack
from protocol.errors import AuthError, ProtocolError
from protocol.identity import peer_id_from_public_key

CREDENTIAL_VERSION = 1
DEFAULT_CREDENTIAL_TTL_S = 30 * 60
MAX_CLOCK_SKEW_S = 30
"""Tolerated disagreement between the authorizer's clock and a verifier's, each way."""
RENEW_FRACTION = 2 / 3
MAX_CREDENTIAL_BYTES = 8192
MAX_REVOKED_ENTRIES = 100_000

_CREDENTIAL_DOMAIN = "agora/credential/v1"
_REVOCATION_DOMAIN = "agora/revocations/v1"
_WIRE = ConfigDict(frozen=True, strict=True, extra="ignore")


def _base64_in_json(value: Any, info: ValidationInfo) -> Any:
    """JSON has no bytes: there they travel as standard base64. Only in JSON: from msgpack a str
    where bytes belong is refused (strict), so no re-typing of a field can reuse a signature."""
    if info.mode == "json" and isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ValueError("must be standard base64") from exc
    return value


WireBytes = Annotated[
    bytes,
    BeforeValidator(_base64_in_json),
    PlainSerializer(lambda b: base64.b64encode(b).decode("ascii"), return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "format": "byte", "description": "standard base64"}),
]

Role = Literal["worker", "trainer", "monitor", "relay"]
"""A monitor (the run's health monitor, report 3.6.2) reads the DHT and serves no handler; a relay
(protocol/relays.py) forwards connections to nodes behind NAT and joins no DHT. Neither takes a
stage or a trainer slot, and handlers that check roles never list them."""


class CredentialRejection(str, enum.Enum):
    """Why a credential or revocation list did not verify; travels in logs and error replies."""

    MALFORMED = "malformed"  # not decodable, or a field out of bounds
    BAD_SIGNATURE = "bad_signature"  # not signed by this run's root key, or altered since
    UNSUPPORTED_VERSION = "unsupported_version"  # issued by a newer authorizer than we speak
    EXPIRED = "expired"  # past expires_at (plus skew): the node must renew
    NOT_YET_VALID = "not_yet_valid"  # issued_at lies in the future (minus skew)
    WRONG_PEER = "wrong_peer"  # presented by, or bound to, another peer id
    WRONG_RUN = "wrong_run"  # issued for another run
    REVOKED = "revoked"  # serial or peer id is on the revocation list


class CredentialError(AuthError):
    """A credential did not verify; `reason` says why in machine-readable form."""

    reason = CredentialRejection.MALFORMED

    def __init__(self, message: str):
        super().__init__(message)


class MalformedCredential(CredentialError):
    reason = CredentialRejection.MALFORMED


class BadSignature(CredentialError):
    reason = CredentialRejection.BAD_SIGNATURE


class UnsupportedCredentialVersion(CredentialError):
    reason = CredentialRejection.UNSUPPORTED_VERSION


class CredentialExpired(CredentialError):
    reason = CredentialRejection.EXPIRED


class CredentialNotYetValid(CredentialError):
    reason = CredentialRejection.NOT_YET_VALID


class WrongPeer(CredentialError):
    reason = CredentialRejection.WRONG_PEER


class WrongRun(CredentialError):
    reason = CredentialRejection.WRONG_RUN


class CredentialRevoked(CredentialError):
    reason = CredentialRejection.REVOKED


class Credential(BaseModel):
    """What the authorizer vouches for: this peer, holding this key, may act in this run."""

    model_config = _WIRE

    version: int = Field(default=CREDENTIAL_VERSION, ge=1, le=1000)
    run_id: str = Field(min_length=1, max_length=64)
    peer_id: str = Field(min_length=1, max_length=128, description="base58 libp2p peer id")
    public_key: WireBytes = Field(min_length=1, max_length=4096, description="the node's raw Ed25519 public key")
    role: Role
    stage: Optional[int] = Field(default=None, ge=0, le=1023, description="None for trainers and monitors")
    issued_at: int = Field(ge=0, le=1 << 40, description="unix seconds")
    expires_at: int = Field(ge=0, le=1 << 40, description="unix seconds")
    serial: int = Field(ge=0, lt=1 << 63, description="unique per issued credential")

    def signing_bytes(self) -> bytes:
        """The canonical bytes the root key signs: domain tag, then every field in fixed order."""
        return pack([_CREDENTIAL_DOMAIN, *(getattr(self, name) for name in _CREDENTIAL_FIELDS)])

    @classmethod
    def from_signing_bytes(cls, data: bytes) -> Credential:
        """Decode canonical bytes; anything that would not re-encode to exactly `data` is refused,
        so the bytes a signature covers and the credential a peer acts on are the same thing."""
        fields = _unpack_list(data, "credential")
        if len(fields) < 2 or fields[0] != _CREDENTIAL_DOMAIN:
            raise MalformedCredential("bytes are not an agora credential")
        if isinstance(fields[1], int) and not isinstance(fields[1], bool) and fields[1] > CREDENTIAL_VERSION:
            raise UnsupportedCredentialVersion(
                f"credential version {fields[1]} is newer than this node understands ({CREDENTIAL_VERSION}); "
                f"upgrade agora-node")
        if len(fields) != len(_CREDENTIAL_FIELDS) + 1:
            raise MalformedCredential(f"credential has {len(fields) - 1} fields, expected {len(_CREDENTIAL_FIELDS)}")
        try:
            cred = cls.model_validate(dict(zip(_CREDENTIAL_FIELDS, fields[1:])))
        except ValidationError as exc:
            raise MalformedCredential(f"credential field {_first_error(exc)}") from exc
        if cred.signing_bytes() != bytes(data):
            raise MalformedCredential("credential is not in canonical form")
        return cred

    @property
    def lifetime_s(self) -> int:
        return self.expires_at - self.issued_at


_CREDENTIAL_FIELDS = (
    "version", "run_id", "peer_id", "public_key", "role", "stage", "issued_at", "expires_at", "serial",
)


class SignedCredential(BaseModel):
    """A credential and the root key's Ed25519 signature over its canonical bytes."""

    model_config = _WIRE

    credential: Credential
    signature: WireBytes = Field(min_length=64, max_length=64)

    def to_bytes(self) -> bytes:
        """The msgpack form peers present in frame envelopes and DHT records: the signed canonical
        bytes themselves and the signature, so a receiver checks exactly what was signed."""
        return pack([self.credential.signing_bytes(), self.signature])

    @classmethod
    def from_bytes(cls, data: bytes) -> SignedCredential:
        """Parse (not verify) untrusted bytes; anything undecodable is `MalformedCredential`."""
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_CREDENTIAL_BYTES:
            raise MalformedCredential("credential must be at most 8 KiB of msgpack bytes")
        outer = _unpack_list(bytes(data), "signed credential")
        if len(outer) != 2 or not all(isinstance(part, bytes) for part in outer):
            raise MalformedCredential("signed credential must be [credential bytes, signature bytes]")
        credential = Credential.from_signing_bytes(outer[0])
        try:
            return cls(credential=credential, signature=outer[1])
        except ValidationError as exc:
            raise MalformedCredential(f"signature {_first_error(exc)}") from exc


@functools.lru_cache(maxsize=64)
def load_root_public_key(root_public_key: bytes) -> Ed25519PublicKey:
    """Load a raw 32-byte Ed25519 public key once; peers verify every message against it."""
    try:
        return Ed25519PublicKey.from_public_bytes(root_public_key)
    except (ValueError, TypeError) as exc:
        raise MalformedCredential("the root public key must be 32 raw Ed25519 bytes") from exc


def root_public_key_bytes(root_private_key: Ed25519PrivateKey) -> bytes:
    """The raw 32-byte public half of a root key, as the authorizer publishes it."""
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return root_private_key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def sign_credential(root_private_key: Ed25519PrivateKey, cred: Credential) -> SignedCredential:
    """Sign `cred` with the run's root key (authorizer side)."""
    return SignedCredential(credential=cred, signature=root_private_key.sign(cred.signing_bytes()))


def verify_credential(
    root_public_key: Union[bytes, Ed25519PublicKey],
    signed: Union[SignedCredential, bytes],
    *,
    now: Optional[float] = None,
    peer_id: Optional[str] = None,
    run_id: Optional[str] = None,
    max_skew_s: float = MAX_CLOCK_SKEW_S,
) -> Credential:
    """Check a credential a peer presented and return it; raise a `CredentialError` if it fails.

    `peer_id` is the remote peer id the libp2p connection authenticated: a credential captured
    from another peer is refused. `run_id` refuses credentials of other runs. Order of checks:
    decoding, version, signature, then the claims, so that an unsigned credential never reveals
    which of its claims would have passed.
    """
    if not isinstance(signed, SignedCredential):
        signed = SignedCredential.from_bytes(signed)
    cred = signed.credential
    if cred.version > CREDENTIAL_VERSION:
        raise UnsupportedCredentialVersion(
            f"credential version {cred.version} is newer than this node understands "
            f"({CREDENTIAL_VERSION}); upgrade agora-node"
        )
    key = root_public_key if isinstance(root_public_key, Ed25519PublicKey) else load_root_public_key(root_public_key)
    try:
        key.verify(signed.signature, cred.signing_bytes())
    except InvalidSignature as exc:
        raise BadSignature(
            f"credential of {cred.peer_id} is not signed by this run's authorizer; "
            f"the peer must rejoin through the authorizer"
        ) from exc
    now = time.time() if now is None else now
    if now < cred.issued_at - max_skew_s:
        raise CredentialNotYetValid(
            f"credential of {cred.peer_id} is issued in the future ({cred.issued_at - now:.0f} s ahead); "
            f"check the clocks of both machines (NTP)"
        )
    if now >= cred.expires_at + max_skew_s:
        raise CredentialExpired(
            f"credential of {cred.peer_id} expired {now - cred.expires_at:.0f} s ago; "
            f"the peer must renew it with the authorizer"
        )
    if run_id is not None and cred.run_id != run_id:
        raise WrongRun(f"credential is for run {cred.run_id!r}, not {run_id!r}; the peer joined another run")
    if peer_id is not None and cred.peer_id != peer_id:
        raise WrongPeer(
            f"credential belongs to {cred.peer_id} but was presented by {peer_id}; "
            f"a credential cannot be lent to another peer"
        )
    if _peer_id_of(cred.public_key) != cred.peer_id:
        raise WrongPeer(f"credential's public key does not hash to its peer id {cred.peer_id}; refuse it")
    return cred


@functools.lru_cache(maxsize=4096)
def _peer_id_of(public_key: bytes) -> str:
    """The peer id a public key hashes to; cached because peers see the same few keys all day."""
    return peer_id_from_public_key(public_key).to_base58()


ProofAction = Literal["join", "renew", "leave"]


def proof_bytes(action: ProofAction, *, run_id: str, peer_id: str, signed_at: float) -> bytes:
    """What a node signs with its libp2p key (protocol.identity) to prove to the authorizer that
    it holds the key of `peer_id` when it renews or leaves. `signed_at` (unix seconds) must be
    recent and newer than the node's previous proof, so a captured proof cannot be replayed."""
    return pack([f"agora/authorizer/{action}/v1", run_id, peer_id, float(signed_at)])


def renew_at(cred: Credential) -> float:
    """When a holder should renew: two thirds into the credential's life, leaving a third of it
    to retry through an authorizer outage."""
    return cred.issued_at + RENEW_FRACTION * cred.lifetime_s


class RevocationList(BaseModel):
    """Serials and peer ids the authorizer revoked, signed by the root key, newest issue wins.

    Only credentials that have not yet expired need listing: an expired one fails on its own.
    """

    model_config = _WIRE

    version: int = Field(default=CREDENTIAL_VERSION, ge=1, le=1000)
    run_id: str = Field(min_length=1, max_length=64)
    serials: tuple[int, ...] = Field(default=(), strict=False, max_length=MAX_REVOKED_ENTRIES)
    peer_ids: tuple[str, ...] = Field(default=(), strict=False, max_length=MAX_REVOKED_ENTRIES)
    issued_at: float = Field(ge=0)
    signature: WireBytes = Field(default=b"", max_length=64)

    def signing_bytes(self) -> bytes:
        return pack([
            _REVOCATION_DOMAIN, self.version, self.run_id, list(self.serials), list(self.peer_ids),
            float(self.issued_at),
        ])

    def is_revoked(self, cred: Credential) -> bool:
        return cred.serial in self._serial_set or cred.peer_id in self._peer_set

    @functools.cached_property
    def _serial_set(self) -> frozenset[int]:
        return frozenset(self.serials)

    @functools.cached_property
    def _peer_set(self) -> frozenset[str]:
        return frozenset(self.peer_ids)

    def to_bytes(self) -> bytes:
        """The signed canonical bytes and the signature, as the DHT carries them."""
        return pack([self.signing_bytes(), self.signature])

    @classmethod
    def from_bytes(cls, data: bytes) -> RevocationList:
        outer = _unpack_list(bytes(data), "revocation list", max_len=1 << 24)
        if len(outer) != 2 or not all(isinstance(part, bytes) for part in outer):
            raise MalformedCredential("revocation list must be [list bytes, signature bytes]")
        fields = _unpack_list(outer[0], "revocation list", max_len=1 << 24)
        if len(fields) != 6 or fields[0] != _REVOCATION_DOMAIN:
            raise MalformedCredential("bytes are not an agora revocation list")
        try:
            revocations = cls.model_validate(dict(
                version=fields[1], run_id=fields[2], serials=fields[3], peer_ids=fields[4], issued_at=fields[5],
                signature=outer[1]))
        except (ValidationError, TypeError) as exc:
            raise MalformedCredential(f"revocation list could not be decoded: {_first_error(exc)}") from exc
        if revocations.signing_bytes() != outer[0]:
            raise MalformedCredential("revocation list is not in canonical form")
        return revocations


def sign_revocation_list(
    root_private_key: Ed25519PrivateKey,
    *,
    run_id: str,
    serials: list[int] | tuple[int, ...] = (),
    peer_ids: list[str] | tuple[str, ...] = (),
    issued_at: Optional[float] = None,
) -> RevocationList:
    """Build and sign a revocation list; entries are sorted so equal lists sign equal bytes."""
    unsigned = RevocationList(
        run_id=run_id, serials=tuple(sorted(set(serials))), peer_ids=tuple(sorted(set(peer_ids))),
        issued_at=float(time.time() if issued_at is None else issued_at),
    )
    return unsigned.model_copy(update={"signature": root_private_key.sign(unsigned.signing_bytes())})


def verify_revocation_list(
    root_public_key: Union[bytes, Ed25519PublicKey],
    revocations: Union[RevocationList, bytes],
    *,
    run_id: Optional[str] = None,
) -> RevocationList:
    """Check the root key's signature over a revocation list (from the DHT or HTTP)."""
    if not isinstance(revocations, RevocationList):
        revocations = RevocationList.from_bytes(revocations)
    key = root_public_key if isinstance(root_public_key, Ed25519PublicKey) else load_root_public_key(root_public_key)
    try:
        key.verify(revocations.signature, revocations.signing_bytes())
    except InvalidSignature as exc:
        raise BadSignature("revocation list is not signed by this run's authorizer; ignore it") from exc
    if run_id is not None and revocations.run_id != run_id:
        raise WrongRun(f"revocation list is for run {revocations.run_id!r}, not {run_id!r}")
    return revocations


def _unpack_list(data: bytes, what: str, *, max_len: int = MAX_CREDENTIAL_BYTES) -> list:
    try:
        value = unpack(data, max_len=max_len)
    except ProtocolError as exc:
        raise MalformedCredential(f"{what} is not valid msgpack") from exc
    if not isinstance(value, list):
        raise MalformedCredential(f"{what} must be a msgpack array")
    return value


def _first_error(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        errors = exc.errors()
        if errors:
            where = ".".join(str(p) for p in errors[0].get("loc", ()))
            return f"{where}: {errors[0].get('msg', 'invalid')}"
    return str(exc)
