"""A node's libp2p identity: the RSA key behind its peer id, persisted so a restart keeps the id.

The same key signs the node's DHT records, and a record carries the public key, so any reader
can check that the record's subkey (a peer id) really is the hash of the key that signed it:
one peer cannot write under another's peer id.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass

import multihash
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.p2p import PeerID
from hivemind.proto import crypto_pb2

from protocol.errors import ConfigError

_PADDING = padding.PKCS1v15()
_HASH = hashes.SHA256()


def _public_key_protobuf(public_key: rsa.RSAPublicKey) -> bytes:
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()


def peer_id_from_public_key(public_key_protobuf: bytes) -> PeerID:
    """The libp2p peer id of an RSA public key in its protobuf encoding (sha2-256 multihash)."""
    return PeerID(multihash.encode(hashlib.sha256(public_key_protobuf).digest(), multihash.coerce_code("sha2-256")))


def verify_signature(public_key_protobuf: bytes, data: bytes, signature: bytes) -> bool:
    """Check an identity signature. Any malformed key or signature is simply invalid."""
    try:
        key_message = crypto_pb2.PublicKey.FromString(public_key_protobuf)
        if key_message.key_type != crypto_pb2.RSA:
            return False
        key = serialization.load_der_public_key(key_message.data)
        if not isinstance(key, rsa.RSAPublicKey) or key.key_size > 8192:
            return False
        key.verify(signature, data, _PADDING, _HASH)
        return True
    except Exception:  # InvalidSignature, ValueError, protobuf's DecodeError: all mean invalid
        return False


@dataclass(frozen=True)
class Identity:
    """A loaded identity: the private key, its public key protobuf and peer id, and its file."""

    private_key: rsa.RSAPrivateKey
    path: str
    fresh: bool = False  # created just now, so no other peer can be using it yet

    @property
    def public_key(self) -> bytes:
        return _public_key_protobuf(self.private_key.public_key())

    @property
    def peer_id(self) -> PeerID:
        return peer_id_from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data, _PADDING, _HASH)

    def __getstate__(self):
        return {"key": self.private_key.private_bytes(
            serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        ), "path": self.path, "fresh": self.fresh}

    def __setstate__(self, state):
        object.__setattr__(self, "private_key", serialization.load_der_private_key(state["key"], password=None))
        object.__setattr__(self, "path", state["path"])
        object.__setattr__(self, "fresh", state["fresh"])


def load_or_create_identity(path: str | None) -> Identity:
    """Load the identity file at `path`, creating it (mode 0600, written atomically) if missing.

    With no path, a fresh identity is written to a private temporary file: hivemind's daemon
    reads the key from a file, and the node removes the file when it exits.
    """
    if path is not None and os.path.exists(path):
        try:
            with open(path, "rb") as f:
                message = crypto_pb2.PrivateKey.FromString(f.read())
            key = serialization.load_der_private_key(message.data, password=None)
        except Exception as exc:
            raise ConfigError(
                f"identity file {path} is not a libp2p RSA key; move it away to create a new identity"
            ) from exc
        if not isinstance(key, rsa.RSAPrivateKey):
            raise ConfigError(f"identity file {path} holds a non-RSA key; move it away to create a new identity")
        return Identity(key, path)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.private_bytes(
        serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
    )
    blob = crypto_pb2.PrivateKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    if path is None:
        fd, path = tempfile.mkstemp(prefix="agora-identity-", suffix=".key")
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        return Identity(key, path, fresh=True)
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise ConfigError(f"cannot create identity {path}: directory {directory} does not exist")
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".identity-")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return Identity(key, path, fresh=True)

