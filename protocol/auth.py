"""Peers check each other on every message [report 3.6.1.5], with no call to the
authorizer on the training path.

A request envelope carries the sender's signed credential and the sender's Ed25519 signature over
(handler, recipient, nonce, timestamp, body). The receiver checks, in order: the credential is
signed by the run's root key, current and not revoked; it belongs to the libp2p peer on the
other end of the stream; the timestamp is within ±60 s and the nonce unseen (no replay); the
request is addressed to us (no redirection); the signature, made with the key inside the
sender's peer id, covers exactly these bytes (no tampering). Replies are signed by the server
over (handler, requester, request nonce, reply), so a client knows who answered what.

A verified credential is cached per peer until it expires, so the steady-state cost is one
Ed25519 verification per message.
"""

from __future__ import annotations

import collections
import hashlib
import os
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from protocol.codec import pack
from protocol.credentials import (
    Credential, CredentialError, RevocationList, SignedCredential, verify_credential,
)
from protocol.errors import AuthError, ErrorCode
from protocol.identity import Identity, verify_peer_signature

FRESHNESS_S = 60.0
_REQUEST_DOMAIN = b"agora/request/v1"
_REPLY_DOMAIN = b"agora/reply/v1"


class RequestRejected(AuthError):
    """A request failed authentication; `reason` is counted and sent back as the error message."""

    code = ErrorCode.UNAUTHENTICATED

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def request_signing_bytes(handler: str, recipient: str, nonce: bytes, timestamp: float, body: bytes) -> bytes:
    """What a request signature covers. The body enters as its SHA-256 digest: Ed25519 hashes its
    message twice with SHA-512, which for a large activation costs far more than one SHA-256."""
    return pack([_REQUEST_DOMAIN, handler, recipient, nonce, float(timestamp), hashlib.sha256(body).digest()])


def reply_signing_bytes(handler: str, requester: str, nonce: bytes, reply: bytes) -> bytes:
    return pack([_REPLY_DOMAIN, handler, requester, nonce, hashlib.sha256(reply).digest()])


class NonceCache:
    """Nonces seen within the freshness window, per sender; older ones fail the timestamp check."""

    def __init__(self, window_s: float):
        self.window_s = window_s
        self._seen: dict[bytes, float] = {}
        self._order: collections.deque[tuple[float, bytes]] = collections.deque()

    def check_and_add(self, key: bytes, now: float) -> bool:
        while self._order and self._order[0][0] < now - 2 * self.window_s:
            _, old = self._order.popleft()
            self._seen.pop(old, None)
        if key in self._seen:
            return False
        self._seen[key] = now
        self._order.append((now, key))
        return True


@dataclass
class PeerAuthenticator:
    """Signs what this node sends and checks what it receives, for one run and root key."""

    identity: Identity
    run_id: str
    root_public_key: bytes
    credential: Callable[[], Optional[SignedCredential]]
    """This node's current credential (renewed in the background)."""
    clock: Callable[[], float] = time.time
    freshness_s: float = FRESHNESS_S
    revocations: Optional[RevocationList] = None
    _verified: dict[str, tuple[bytes, Credential]] = field(default_factory=dict)
    _nonces: NonceCache = field(default_factory=lambda: NonceCache(FRESHNESS_S))

    def __post_init__(self) -> None:
        self.peer_id = self.identity.peer_id.to_base58()
        self._credential_bytes: Optional[bytes] = None
        self._credential_of: Optional[SignedCredential] = None

    # ---- sending ----

    def _own_credential_bytes(self) -> bytes:
        current = self.credential()
        if current is None:
            raise AuthError("this node holds no credential yet; it must join through the authorizer first")
        if current is not self._credential_of:
            self._credential_of, self._credential_bytes = current, current.to_bytes()
        return self._credential_bytes

    def sign_request(self, handler: str, recipient: str, body: bytes) -> dict:
        """Fields to add to a request envelope carrying `body` (already packed)."""
        nonce = os.urandom(16)
        timestamp = self.clock()
        return {
            "nonce": nonce, "timestamp": timestamp, "recipient": recipient,
            "credential": self._own_credential_bytes(),
            "signature": self.identity.sign(request_signing_bytes(handler, recipient, nonce, timestamp, body)),
        }

    def sign_reply(self, handler: str, requester: str, nonce: bytes, reply: bytes) -> bytes:
        return self.identity.sign(reply_signing_bytes(handler, requester, nonce, reply))

    # ---- receiving ----

    def check_credential(self, peer_id: str, credential_bytes: object) -> Credential:
        """The verified, unrevoked credential of `peer_id`, from the cache when it is unchanged."""
        if not isinstance(credential_bytes, bytes) or not credential_bytes:
            raise RequestRejected("no_credential", "request carries no credential; join through the authorizer")
        now = self.clock()
        cached = self._verified.get(peer_id)
        if cached is not None and cached[0] == credential_bytes and now < cached[1].expires_at:
            credential = cached[1]
        else:
            try:
                credential = verify_credential(self.root_public_key, credential_bytes, now=now, peer_id=peer_id,
                                               run_id=self.run_id)
            except CredentialError as exc:
                raise RequestRejected(exc.reason.value, str(exc)) from exc
            if len(self._verified) > 65536:
                self._verified.clear()
            self._verified[peer_id] = (credential_bytes, credential)
        if self.revocations is not None and self.revocations.is_revoked(credential):
            raise RequestRejected("revoked", f"credential {credential.serial} of {peer_id} was revoked")
        return credential

    def check_request(self, peer_id: str, handler: str, envelope: dict, body: bytes) -> Credential:
        """Authenticate one request from the libp2p peer `peer_id`; raise RequestRejected if it fails."""
        credential = self.check_credential(peer_id, envelope.get("credential"))
        nonce, timestamp = envelope.get("nonce"), envelope.get("timestamp")
        recipient, signature = envelope.get("recipient"), envelope.get("signature")
        if not isinstance(nonce, bytes) or not isinstance(timestamp, (int, float)) or not isinstance(signature, bytes):
            raise RequestRejected("unsigned", "request is not signed; upgrade the sending node")
        now = self.clock()
        if abs(now - timestamp) > self.freshness_s:
            raise RequestRejected("stale", f"request timestamp is {now - timestamp:+.0f} s off; check the clocks (NTP)")
        if recipient != self.peer_id:
            raise RequestRejected("wrong_recipient", "request was addressed to another node")
        if not verify_peer_signature(peer_id, request_signing_bytes(handler, recipient, nonce, timestamp, body),
                                     signature):
            raise RequestRejected("bad_signature", "request signature does not match its sender and contents")
        if not self._nonces.check_and_add(peer_id.encode() + nonce, now):
            raise RequestRejected("replayed", "this request was already received once")
        return credential

    def check_reply(self, peer_id: str, handler: str, nonce: bytes, signature: Optional[bytes], body: bytes) -> None:
        """Check the server's signature over its reply to our request `nonce`."""
        if not isinstance(signature, bytes) or not verify_peer_signature(
                peer_id, reply_signing_bytes(handler, self.peer_id, nonce, body), signature):
            raise RequestRejected("bad_reply_signature", f"reply from {peer_id} is not signed by it")

