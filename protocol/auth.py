"""Peers check each other once per stream [report 3.6.1.5], with no call to the authorizer on
the training path.

Every `agora/v1/*` stream starts with a hello (protocol/messages.py `Hello`): the caller's signed
credential, a fresh nonce and timestamp, the recipient and the handler, signed with the caller's
Ed25519 key. The server checks, in order: the credential is signed by the run's root key, current
and not revoked; it belongs to the libp2p peer on the other end of the stream; the hello is
signed (`unsigned`), fresh within +-60 s (`stale`), addressed to us (`wrong_recipient`), signed by
the key inside the caller's peer id over exactly these fields (`bad_signature`), and its nonce is
unseen (`replayed`). The server's ack carries its own credential and a signature over the
caller's nonce, so the caller knows who serves it.

After the hello, frames carry no signature: the libp2p channel (Noise) already authenticates and
protects every byte between the two peer ids, so a frame on an authenticated stream can only come
from the peer that said hello; sequence numbers keep replayed or reordered frames out, and the
server re-checks the credential's expiry and the revocation list before each request, closing
the stream when either fails. docs/architecture.md ("Stream sessions") gives the full argument.

A verified credential is cached per peer until it expires, so opening a stream costs two Ed25519
signatures and two verifications, and a request on an open stream costs none.
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
    MAX_CLOCK_SKEW_S, Credential, CredentialError, RevocationList, SignedCredential, verify_credential,
)
from protocol.errors import AuthError, ErrorCode
from protocol.identity import Identity, verify_peer_signature
from protocol.messages import Hello, HelloAck

FRESHNESS_S = 60.0
_HELLO_DOMAIN = b"agora/hello/v2"
_ACK_DOMAIN = b"agora/hello-ack/v2"


class RequestRejected(AuthError):
    """A request failed authentication; `reason` is counted and sent back as the error message."""

    code = ErrorCode.UNAUTHENTICATED

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def hello_signing_bytes(handler: str, recipient: str, nonce: bytes, timestamp: float, credential: bytes) -> bytes:
    """What a hello's signature covers."""
    return pack([_HELLO_DOMAIN, handler, recipient, nonce, float(timestamp), hashlib.sha256(credential).digest()])


def ack_signing_bytes(handler: str, requester: str, nonce: bytes, credential: bytes) -> bytes:
    """What the server's ack signature covers: the caller's nonce binds it to this stream's hello."""
    return pack([_ACK_DOMAIN, handler, requester, nonce, hashlib.sha256(credential).digest()])


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

    def current_credential(self) -> Optional[bytes]:
        """This node's credential as sent, or None before it holds one: a pooled stream opened
        with an older credential is not reused after a renewal."""
        try:
            return self._own_credential_bytes()
        except AuthError:
            return None

    def hello(self, handler: str, recipient: str) -> dict:
        """The authentication fields of a hello opening a stream to `recipient` for `handler`."""
        nonce, timestamp, credential = os.urandom(16), self.clock(), self._own_credential_bytes()
        return {
            "nonce": nonce, "timestamp": timestamp, "recipient": recipient, "credential": credential,
            "signature": self.identity.sign(hello_signing_bytes(handler, recipient, nonce, timestamp, credential)),
        }

    def ack(self, handler: str, requester: str, nonce: bytes) -> dict:
        """The authentication fields of the ack to `requester`'s hello with `nonce`."""
        credential = self._own_credential_bytes()
        return {"credential": credential,
                "signature": self.identity.sign(ack_signing_bytes(handler, requester, nonce, credential))}

    # ---- receiving ----

    def check_credential(self, peer_id: str, credential_bytes: object) -> Credential:
        """The verified, unrevoked credential of `peer_id`, from the cache when it is unchanged."""
        if not isinstance(credential_bytes, bytes) or not credential_bytes:
            raise RequestRejected("no_credential", "the stream's hello carries no credential; join the run through "
                                                   "its authorizer (--authorizer URL)")
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

    def check_hello(self, peer_id: str, hello: Hello) -> Credential:
        """Authenticate the hello of a stream from the libp2p peer `peer_id`; raise RequestRejected."""
        credential = self.check_credential(peer_id, hello.credential)
        if hello.signature is None:
            raise RequestRejected("unsigned", "hello is not signed; upgrade the calling node")
        now = self.clock()
        if abs(now - hello.timestamp) > self.freshness_s:
            raise RequestRejected("stale", f"hello timestamp is {now - hello.timestamp:+.0f} s off; "
                                           f"check the clocks (NTP)")
        if hello.recipient != self.peer_id:
            raise RequestRejected("wrong_recipient", "hello was addressed to another node")
        signed = hello_signing_bytes(hello.handler, hello.recipient, hello.nonce, hello.timestamp, hello.credential)
        if not verify_peer_signature(peer_id, signed, hello.signature):
            raise RequestRejected("bad_signature", "hello signature does not match its sender and contents")
        if not self._nonces.check_and_add(peer_id.encode() + hello.nonce, now):
            raise RequestRejected("replayed", "this hello was already received once")
        return credential

    def check_session(self, credential: Credential) -> None:
        """Before each request on an authenticated stream: the credential it was opened with must
        still be current and unrevoked, or the stream ends."""
        if self.clock() >= credential.expires_at + MAX_CLOCK_SKEW_S:
            raise RequestRejected("expired", f"the credential of {credential.peer_id} expired; the stream is closed")
        if self.revocations is not None and self.revocations.is_revoked(credential):
            raise RequestRejected("revoked", f"credential {credential.serial} of {credential.peer_id} was revoked")

    def check_ack(self, peer_id: str, handler: str, nonce: bytes, ack: HelloAck) -> Credential:
        """Check the server's ack to our hello `nonce`: its credential and its signature."""
        credential = self.check_credential(peer_id, ack.credential)
        if not isinstance(ack.signature, bytes) or not verify_peer_signature(
                peer_id, ack_signing_bytes(handler, self.peer_id, nonce, ack.credential), ack.signature):
            raise RequestRejected("bad_reply_signature", f"{peer_id} did not sign its answer to our hello")
        return credential
