"""Signing credentials and revocation lists with the run's root key (protocol.credentials).

Called inside the store's transactions, so that a credential's serial is allocated and its holder
recorded before anyone sees the credential; a credential that was never recorded cannot exist.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.credentials import (
    Credential,
    RevocationList,
    SignedCredential,
    root_public_key_bytes,
    sign_credential,
    sign_revocation_list,
)


class CredentialIssuer:
    """Signs credentials for one run with its root key."""

    def __init__(self, root_key: Ed25519PrivateKey, run_id: str, ttl_s: int):
        self.root_key = root_key
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.public_key = root_public_key_bytes(root_key)

    def issue(self, *, serial: int, peer_id: str, public_key: bytes, role: str, stage: int | None,
              issued_at: int) -> SignedCredential:
        cred = Credential(
            run_id=self.run_id, peer_id=peer_id, public_key=public_key, role=role,  # type: ignore[arg-type]
            stage=stage, issued_at=issued_at, expires_at=issued_at + self.ttl_s, serial=serial,
        )
        return sign_credential(self.root_key, cred)

    def revocation_list(self, serials: list[int], peer_ids: list[str], issued_at: float) -> RevocationList:
        return sign_revocation_list(
            self.root_key, run_id=self.run_id, serials=serials, peer_ids=peer_ids, issued_at=issued_at
        )
