"""The run's root signing key and the admin token, kept in files only their owner can read.

The root key is the run's root of trust: every peer holds its public half and checks credentials
against it [report 3.6.1.5], so losing or replacing it strands every admitted node. It is therefore
created once, atomically (a temporary file linked into place, so two starting authorizers can never
each write a different key, and a crash never leaves half a key) with mode 0600, and refused if
anyone else can read it.
"""

from __future__ import annotations

import os
import secrets
import stat
import tempfile

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.errors import ConfigError


def _create_private_file(path: str, data: bytes) -> bool:
    """Write `data` to a new file at `path` (mode 0600) unless one exists; True if we created it."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"cannot create directory {directory} for {path} ({exc}); check permissions") from exc
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".secret")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # fails if the file appeared meanwhile: never overwrite a key
        except FileExistsError:
            return False
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return True
    finally:
        os.unlink(tmp)


def _read_private_file(path: str, what: str) -> bytes:
    try:
        info = os.stat(path)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{what} {path} is readable by other users; run 'chmod 600 {path}'")
        with open(path, "rb") as handle:
            return handle.read()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path} ({exc}); check the path and permissions") from exc


def load_or_create_root_key(path: str) -> tuple[Ed25519PrivateKey, bool]:
    """The Ed25519 root key at `path`, created if missing; returns (key, created)."""
    created = False
    if not os.path.exists(path):
        pem = Ed25519PrivateKey.generate().private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        created = _create_private_file(path, pem)
    data = _read_private_file(path, "root key")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"root key {path} is not a PEM Ed25519 private key; restore it from backup "
            f"(a new key would invalidate every credential peers hold)"
        ) from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"root key {path} is not an Ed25519 key; restore the run's Ed25519 key")
    return key, created


def load_or_create_admin_token(path: str) -> str:
    """The admin bearer token stored in `path`, created with 32 random bytes if missing."""
    if not os.path.exists(path):
        _create_private_file(path, (secrets.token_urlsafe(32) + "\n").encode())
    token = _read_private_file(path, "admin token file").decode("utf-8", "replace").strip()
    if len(token) < 16:
        raise ConfigError(f"admin token in {path} is shorter than 16 characters; put a longer random token there")
    return token

