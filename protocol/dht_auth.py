"""Credential checks on hivemind's DHT RPCs, through its `DHT(authorizer=...)` hook.

Every DHT request carries the sender's signed credential and the sender's Ed25519 signature
over the whole request, a timestamp and a nonce; every response likewise. A peer without a run
credential (a stock hivemind node, say) gets no answer, so it can neither join the routing
tables nor read or write records. hivemind does not tell the authorizer which peer a request is
for, so DHT requests are not bound to their recipient; a replayed DHT request can only repeat a
store of records that are themselves signed by their owner, and nonces stop replays to the
same peer.
"""

from __future__ import annotations

import os
import time
from typing import Optional

from hivemind.utils.auth import AuthorizerBase

from protocol.auth import FRESHNESS_S, NonceCache
from protocol.auth_state import SharedAuthState
from protocol.credentials import Credential, CredentialError, verify_credential
from protocol.identity import Identity, verify_peer_signature


class CredentialDHTAuthorizer(AuthorizerBase):
    def __init__(self, identity: Identity, auth: SharedAuthState):
        self.identity = identity
        self.auth = auth
        self._nonces = NonceCache(FRESHNESS_S)
        self.rejected = 0

    def _credential(self, data: bytes) -> Optional[Credential]:
        try:
            credential = verify_credential(self.auth.root_public_key, data, now=time.time(), run_id=self.auth.run_id)
        except CredentialError:
            return None
        revocations = self.auth.revocations()
        if revocations is not None and revocations.is_revoked(credential):
            return None
        return credential

    async def sign_request(self, request, service_public_key) -> None:
        auth = request.auth
        auth.client_access_token.public_key = self.auth.credential_bytes() or b""
        auth.time = time.time()
        auth.nonce = os.urandom(16)
        auth.signature = b""
        auth.signature = self.identity.sign(request.SerializeToString())

    async def validate_request(self, request) -> bool:
        auth = request.auth
        credential = self._credential(auth.client_access_token.public_key)
        ok = credential is not None and abs(time.time() - auth.time) <= FRESHNESS_S
        if ok:
            signature = auth.signature
            auth.signature = b""
            ok = verify_peer_signature(credential.peer_id, request.SerializeToString(), signature)
            auth.signature = signature
            ok = ok and self._nonces.check_and_add(credential.peer_id.encode() + auth.nonce, time.time())
        if not ok:
            self.rejected += 1
        return ok

    async def sign_response(self, response, request) -> None:
        auth = response.auth
        auth.service_access_token.public_key = self.auth.credential_bytes() or b""
        auth.nonce = request.auth.nonce
        auth.signature = b""
        auth.signature = self.identity.sign(response.SerializeToString())

    async def validate_response(self, response, request) -> bool:
        auth = response.auth
        credential = self._credential(auth.service_access_token.public_key)
        if credential is None or auth.nonce != request.auth.nonce:
            return False
        signature = auth.signature
        auth.signature = b""
        ok = verify_peer_signature(credential.peer_id, response.SerializeToString(), signature)
        auth.signature = signature
        return ok
