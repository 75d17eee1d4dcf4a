"""The node's current credential and the run's revocation list, shared with hivemind's DHT
process through two small files.

hivemind runs the DHT in a forked child, so the record validator and the DHT request authorizer
there cannot see the node's memory; the node renews its credential and refreshes revocations in
its main process. Writes are atomic (temp file + rename) and readers reload only when the file
changed, so the check per DHT message is one stat().
"""

from __future__ import annotations

import os
from typing import Optional

from protocol.credentials import MalformedCredential, RevocationList, SignedCredential, verify_revocation_list
from protocol.files import atomic_write


class _Watched:
    def __init__(self, path: str):
        self.path = path
        self._stamp: Optional[tuple[int, int]] = None
        self.data: Optional[bytes] = None

    def read(self) -> Optional[bytes]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return self.data
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp != self._stamp:
            with open(self.path, "rb") as f:
                self.data = f.read()
            self._stamp = stamp
        return self.data


class SharedAuthState:
    """What an authenticated node knows about the run's trust: root key, its credential, revocations."""

    def __init__(self, directory: str, *, run_id: str, root_public_key: bytes):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory = directory
        self.run_id = run_id
        self.root_public_key = root_public_key
        self._credential = _Watched(os.path.join(directory, "credential.msgpack"))
        self._revocations = _Watched(os.path.join(directory, "revocations.msgpack"))
        self._revocation_list: Optional[RevocationList] = None
        self._revocation_bytes: Optional[bytes] = None

    def publish_credential(self, signed: SignedCredential) -> None:
        atomic_write(self._credential.path, signed.to_bytes())

    def credential_bytes(self) -> Optional[bytes]:
        return self._credential.read()

    def credential(self) -> Optional[SignedCredential]:
        data = self.credential_bytes()
        return SignedCredential.from_bytes(data) if data else None

    def publish_revocations(self, revocations: RevocationList) -> bool:
        """Keep `revocations` if it verifies and is newer than what we hold."""
        verify_revocation_list(self.root_public_key, revocations, run_id=self.run_id)
        current = self.revocations()
        if current is not None and current.issued_at >= revocations.issued_at:
            return False
        atomic_write(self._revocations.path, revocations.to_bytes())
        return True

    def revocations(self) -> Optional[RevocationList]:
        data = self._revocations.read()
        if data is None:
            return None
        if data is not self._revocation_bytes:
            try:
                self._revocation_list = verify_revocation_list(self.root_public_key, data, run_id=self.run_id)
            except MalformedCredential:
                self._revocation_list = None
            except Exception:
                self._revocation_list = None
            self._revocation_bytes = data
        return self._revocation_list
