"""Signed DHT records: only a peer can write its own subkey, only values that fit the schema,
with sane expiries, and in authenticated runs only peers holding a credential for that key.

Installed into hivemind's DHT as a record validator. A stored value is wrapped as
``{record, signature[, credential]}``; the subkey is the writer's base58 peer id, whose embedded
Ed25519 key must verify the signature over key, subkey, record and expiry, so neither the record
nor its lifetime can be altered or replayed under another key or peer id. hivemind with no
validator lets any peer overwrite another's subkey and accepts absurd expiries.

In an authenticated run the wrapper also carries the writer's credential: it must be signed by
the run's root key, current, unrevoked, issued to the subkey's peer id, and carry the role and
stage the key belongs to (a trainer cannot announce itself as a stage-2 worker). The run's
revocation list lives under `{run}/control`, subkey `revoked`, signed by the root key itself, so
any node may relay it.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from pydantic import ValidationError

from protocol.auth_state import SharedAuthState
from protocol.codec import pack, unpack
from protocol.credentials import CredentialError, RevocationList, verify_credential, verify_revocation_list
from protocol.dht_schema import MAX_RECORD_TTL_S, KeySpec, Tombstone, control_key
from protocol.errors import ProtocolError
from protocol.identity import Identity, verify_peer_signature

logger = logging.getLogger(__name__)

REVOKED_SUBKEY = "revoked"


class SignedRecordValidator(RecordValidatorBase):
    """Signs our node's records and rejects any record under a schema key that does not verify."""

    def __init__(self, identity: Optional[Identity], schema: dict[str, KeySpec], *,
                 run_id: Optional[str] = None, auth: Optional[SharedAuthState] = None):
        self.identity = identity
        self.auth = auth
        self._local_subkey = (
            MSGPackSerializer.dumps(identity.peer_id.to_base58()) if identity is not None else None
        )
        self._specs = {DHTID.generate(source=key).to_bytes(): spec for key, spec in schema.items()}
        self._control = DHTID.generate(source=control_key(run_id)).to_bytes() if run_id and auth else None
        self.rejected = 0

    def validate(self, record: DHTRecord) -> bool:
        if record.key == self._control:
            ok = self._check_control(record)
        else:
            spec = self._specs.get(record.key)
            if spec is None:
                return True  # not one of our keys: hivemind's own keys (e.g. averaging) are checked elsewhere
            ok = self._check(record, spec)
        if not ok:
            self.rejected += 1
        return ok

    def _check(self, record: DHTRecord, spec: KeySpec) -> bool:
        if record.expiration_time > time.time() + MAX_RECORD_TTL_S:
            return False
        try:
            wrapper = unpack(record.value)
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # ProtocolError from our codec, anything from hivemind's
            return False
        if not isinstance(wrapper, dict) or not isinstance(subkey, str):
            return False
        body, signature = wrapper.get("record"), wrapper.get("signature")
        if not isinstance(body, bytes) or not isinstance(signature, bytes):
            return False
        credential = wrapper.get("credential")
        if self.auth is not None and not self._credential_allows(credential, subkey, spec):
            return False
        if not verify_peer_signature(subkey, self._signed_bytes(record, body, credential), signature):
            return False
        try:
            value = unpack(body)
            if isinstance(value, dict) and value.get("tombstone") is True:
                Tombstone.model_validate(value)
            else:
                spec.model.model_validate(value)
        except (ProtocolError, ValidationError):
            return False
        return True

    def _credential_allows(self, credential: object, subkey: str, spec: KeySpec) -> bool:
        if not isinstance(credential, bytes):
            return False
        now = time.time()
        try:
            cred = verify_credential(self.auth.root_public_key, credential, now=now, peer_id=subkey,
                                     run_id=self.auth.run_id)
        except CredentialError:
            return False
        if cred.role != spec.role or (spec.stage is not None and cred.stage != spec.stage):
            return False
        revocations = self.auth.revocations()
        return revocations is None or not revocations.is_revoked(cred)

    def _check_control(self, record: DHTRecord) -> bool:
        try:
            if MSGPackSerializer.loads(record.subkey) != REVOKED_SUBKEY:
                return False
            revocations = RevocationList.model_validate(MSGPackSerializer.loads(record.value))
            verify_revocation_list(self.auth.root_public_key, revocations, run_id=self.auth.run_id)
        except Exception:  # malformed or not signed by the root key
            return False
        return record.expiration_time <= time.time() + MAX_RECORD_TTL_S

    @staticmethod
    def _signed_bytes(record: DHTRecord, body: bytes, credential: object = None) -> bytes:
        return pack([record.key, record.subkey, body, float(record.expiration_time), credential])

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._specs or self.identity is None or record.subkey != self._local_subkey:
            return record.value
        credential = self.auth.credential_bytes() if self.auth is not None else None
        signature = self.identity.sign(self._signed_bytes(record, record.value, credential))
        wrapper = {"record": record.value, "signature": signature}
        if credential is not None:
            wrapper["credential"] = credential
        return pack(wrapper)

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._specs:
            return record.value
        try:
            wrapper = unpack(record.value)
            return wrapper["record"]
        except Exception:
            return record.value

    @property
    def priority(self) -> int:
        return 10

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False
