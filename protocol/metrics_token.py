"""The bearer token a contributor node pushes its metrics with [report 3.6.3.1].

A contributor cannot be scraped, so it pushes its metrics outward to the run's push front (the
authorizer's `/v1/metrics/push`, authorizer.metrics_push), which forwards them to the operator's
Pushgateway. The front must know who is pushing, so that a node can only ever write its own
series: the token is derived from what the node already holds, its credential and its libp2p key,
and needs no secret of its own.

    <base64url(signed credential bytes)>.<unix seconds>.<base64url(signature)>

The signature is the node's Ed25519 identity key over a domain tag, the timestamp and the SHA-256
of the credential bytes. The front checks, in order: the credential is signed by the run's root
key, of this run and current (protocol.credentials.verify_credential), the signature is made by the
key the credential binds (so a credential read off the DHT is useless without the node's key), the
timestamp is within `max_skew_s` of the front's clock (a captured token is replayable only that
long, and only to push that same node's metrics), and neither the serial nor the peer id is on the
revocation list. A fresh token is made for every push; it costs one signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import time
from typing import Any, Optional, Union

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from protocol.codec import pack
from protocol.credentials import Credential, CredentialError, SignedCredential, verify_credential
from protocol.errors import AuthError
from protocol.identity import Identity, verify_signature

_DOMAIN = "agora/metrics-push/v1"
MAX_TOKEN_CHARS = 16 * 1024
"""A credential is at most 8 KiB of msgpack; base64 and the rest stay well under this."""
DEFAULT_MAX_SKEW_S = 300.0


class PushTokenError(AuthError):
    """A push token did not verify. `reason` is a stable snake_case word, counted by the front:
    `malformed`, `stale`, `bad_signature` (the node's signature), or `credential_<why>` with
    protocol.credentials.CredentialRejection's value (`credential_expired`, `credential_revoked`,
    `credential_bad_signature` for another run's root key, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def push_signing_bytes(timestamp: int, credential_bytes: bytes) -> bytes:
    """What the node's identity key signs for a push token."""
    return pack([_DOMAIN, int(timestamp), hashlib.sha256(credential_bytes).digest()])


def make_push_token(identity: Identity, credential_bytes: bytes, now: Optional[float] = None) -> str:
    """A token for pushing metrics now: `credential_bytes` is the node's SignedCredential.to_bytes()."""
    timestamp = int(time.time() if now is None else now)
    signature = identity.sign(push_signing_bytes(timestamp, credential_bytes))
    return f"{_b64(credential_bytes)}.{timestamp}.{_b64(signature)}"


def verify_push_token(
    token: str,
    *,
    root_public_key: Union[bytes, Ed25519PublicKey],
    run_id: str,
    now: Optional[float] = None,
    revocations: Any = None,
    max_skew_s: float = DEFAULT_MAX_SKEW_S,
) -> Credential:
    """The credential of the node that made `token`; raise PushTokenError if it does not verify.

    `revocations` is anything with `is_revoked(credential)` (a protocol.credentials.RevocationList).
    The credential is checked before the node's signature, so a token without a valid credential
    never reveals whether its signature would have passed.
    """
    credential_bytes, timestamp, signature = _split(token)
    now = time.time() if now is None else now
    try:
        credential = verify_credential(root_public_key, credential_bytes, now=now, run_id=run_id)
    except CredentialError as exc:
        raise PushTokenError(f"credential_{exc.reason.value}", str(exc)) from exc
    if not verify_signature(credential.public_key, push_signing_bytes(timestamp, credential_bytes), signature):
        raise PushTokenError("bad_signature", (
            f"the push token is not signed by the key of {credential.peer_id}; make it with "
            f"protocol.metrics_token.make_push_token and the node's own identity"))
    if abs(now - timestamp) > max_skew_s:
        raise PushTokenError("stale", (
            f"the push token was made {now - timestamp:+.0f} s from the front's clock (at most {max_skew_s:.0f} s "
            f"either way); make a fresh one for every push, and check the clocks of both machines (NTP)"))
    if revocations is not None and revocations.is_revoked(credential):
        raise PushTokenError("credential_revoked", (
            f"the credential of {credential.peer_id} is revoked; this node may no longer push metrics"))
    return credential


def _split(token: str) -> tuple[bytes, int, bytes]:
    """The token's three parts, decoded; anything else is `malformed`."""
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS:
        raise PushTokenError("malformed", f"a push token is a string of at most {MAX_TOKEN_CHARS} characters")
    parts = token.split(".")
    if len(parts) != 3 or not parts[1].isascii() or not parts[1].isdigit() or len(parts[1]) > 12:
        raise PushTokenError("malformed", "a push token is <credential>.<unix seconds>.<signature>")
    try:
        credential_bytes, signature = _unb64(parts[0]), _unb64(parts[2])
    except (binascii.Error, ValueError) as exc:
        raise PushTokenError("malformed", "the push token's credential and signature must be base64url") from exc
    try:
        SignedCredential.from_bytes(credential_bytes)
    except CredentialError as exc:
        raise PushTokenError("malformed", f"the push token's credential does not decode: {exc}") from exc
    return credential_bytes, int(parts[1]), signature


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


def _unb64(text: str) -> bytes:
    if not _BASE64URL.fullmatch(text):
        raise ValueError("not base64url")
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
