"""A node's libp2p identity: an Ed25519 key whose public half is embedded in the peer id.

Because an Ed25519 peer id is the identity multihash of the public key, anyone holding a peer
id can check that peer's signatures without any lookup: the libp2p connection proves who is on
the other end, and the key in that very peer id verifies what it signed (DHT records, requests,
replies). Ed25519 also keeps signing off the hot path (tens of microseconds per message, where
RSA-2048 costs a millisecond). The key is persisted so a restarted node keeps its peer id.
"""

from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass
from typing import Optional

import base58
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from protocol.errors import ConfigError
from protocol.files import atomic_write

_IDENTITY_MULTIHASH = 0x00
_ED25519_PUBLIC_LEN = 32


def _public_key_protobuf(raw_public: bytes) -> bytes:
    return crypto_pb2.PublicKey(key_type=crypto_pb2.Ed25519, data=raw_public).SerializeToString()


def peer_id_from_public_key(raw_public: bytes) -> PeerID:
    """The libp2p peer id of a raw 32-byte Ed25519 public key."""
    proto = _public_key_protobuf(raw_public)
    return PeerID(bytes([_IDENTITY_MULTIHASH, len(proto)]) + proto)


def public_key_from_peer_id(peer_id: PeerID | str) -> Optional[bytes]:
    """The raw Ed25519 public key inside a peer id, or None if it holds no Ed25519 key."""
    return _public_key_from_peer_id(peer_id if isinstance(peer_id, str) else peer_id.to_base58())


@functools.lru_cache(maxsize=8192)
def _public_key_from_peer_id(peer_id: str) -> Optional[bytes]:
    try:
        raw = base58.b58decode(peer_id)
        if len(raw) < 2 or raw[0] != _IDENTITY_MULTIHASH or raw[1] != len(raw) - 2:
            return None
        message = crypto_pb2.PublicKey.FromString(raw[2:])
        if message.key_type != crypto_pb2.Ed25519 or len(message.data) != _ED25519_PUBLIC_LEN:
            return None
        return bytes(message.data)
    except Exception:  # malformed base58 or protobuf: not a key we can use
        return None


_key_cache: dict[bytes, ed25519.Ed25519PublicKey] = {}


def verify_signature(raw_public: bytes, data: bytes, signature: bytes) -> bool:
    """Check an Ed25519 signature. Any malformed key or signature is simply invalid."""
    try:
        key = _key_cache.get(raw_public)
        if key is None:
            key = ed25519.Ed25519PublicKey.from_public_bytes(raw_public)
            if len(_key_cache) > 4096:
                _key_cache.clear()
            _key_cache[raw_public] = key
        key.verify(signature, data)
        return True
    except Exception:  # InvalidSignature, ValueError, TypeError: all mean invalid
        return False


def verify_peer_signature(peer_id: PeerID | str, data: bytes, signature: bytes) -> bool:
    """Check that `peer_id`'s own key signed `data`."""
    raw = public_key_from_peer_id(peer_id)
    return raw is not None and verify_signature(raw, data, signature)


@dataclass(frozen=True)
class Identity:
    """A loaded identity: the private key and the file hivemind's daemon reads it from."""

    private_key: ed25519.Ed25519PrivateKey
    path: str

    @property
    def public_key(self) -> bytes:
        """The raw 32-byte Ed25519 public key."""
        return self.private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)

    @property
    def peer_id(self) -> PeerID:
        return peer_id_from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)

    def __getstate__(self):
        return {"key": _raw_private(self.private_key), "path": self.path}

    def __setstate__(self, state):
        object.__setattr__(self, "private_key", ed25519.Ed25519PrivateKey.from_private_bytes(state["key"]))
        object.__setattr__(self, "path", state["path"])


def _raw_private(key: ed25519.Ed25519PrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption())


def _identity_blob(key: ed25519.Ed25519PrivateKey) -> bytes:
    """libp2p's private key protobuf; for Ed25519 the data is the 32-byte seed then the public key."""
    public = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return crypto_pb2.PrivateKey(key_type=crypto_pb2.Ed25519, data=_raw_private(key) + public).SerializeToString()


def load_or_create_identity(path: str | None) -> Identity:
    """Load the identity file at `path`, creating it (mode 0600, written atomically) if missing.

    With no path, a fresh identity is written to a private temporary file: hivemind's daemon
    reads the key from a file, and the node removes the file when it exits.
    """
    if path is not None and os.path.exists(path):
        try:
            with open(path, "rb") as f:
                message = crypto_pb2.PrivateKey.FromString(f.read())
            if message.key_type != crypto_pb2.Ed25519 or len(message.data) not in (32, 64):
                raise ValueError("not an Ed25519 key")
            key = ed25519.Ed25519PrivateKey.from_private_bytes(bytes(message.data[:32]))
        except Exception as exc:
            raise ConfigError(
                f"identity file {path} is not a libp2p Ed25519 key; move it away to create a new identity"
            ) from exc
        return Identity(key, path)
    key = ed25519.Ed25519PrivateKey.generate()
    blob = _identity_blob(key)
    if path is None:
        fd, path = tempfile.mkstemp(prefix="agora-identity-", suffix=".key")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        return Identity(key, path)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"cannot create identity {path}: directory {directory} does not exist")
    atomic_write(path, blob, mode=0o600)
    return Identity(key, path)
