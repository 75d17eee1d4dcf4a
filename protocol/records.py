"""Signed DHT records: only a peer can write its own subkey, and only values that fit the schema.

Installed into hivemind's DHT as a record validator. A stored value is wrapped as
``{record, signature}``; the subkey is the writer's base58 peer id, whose embedded Ed25519 key
must verify the signature over key, subkey, record and expiry, so neither the record nor its
lifetime can be altered or replayed under another key or peer id. hivemind with no validator lets any
peer overwrite another's subkey and accepts absurd expiries (DESIGN §3): we refuse both.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from pydantic import ValidationError

from protocol.codec import pack, unpack
from protocol.dht_schema import MAX_RECORD_TTL_S, RecordModel, Tombstone
from protocol.errors import ProtocolError
from protocol.identity import Identity, verify_peer_signature

logger = logging.getLogger(__name__)


class SignedRecordValidator(RecordValidatorBase):
    """Signs our node's records and rejects any record under a schema key that does not verify."""

    def __init__(self, identity: Optional[Identity], schema: dict[str, type[RecordModel]]):
        self.identity = identity
        self._local_subkey = (
            MSGPackSerializer.dumps(identity.peer_id.to_base58()) if identity is not None else None
        )
        self._models = {DHTID.generate(source=key).to_bytes(): model for key, model in schema.items()}
        self.rejected = 0

    def validate(self, record: DHTRecord) -> bool:
        model = self._models.get(record.key)
        if model is None:
            return True  # not one of our keys: hivemind's own keys (e.g. averaging) are checked elsewhere
        ok = self._check(record, model)
        if not ok:
            self.rejected += 1
        return ok

    def _check(self, record: DHTRecord, model: type[RecordModel]) -> bool:
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
        if not verify_peer_signature(subkey, self._signed_bytes(record, body), signature):
            return False
        try:
            value = unpack(body)
            if isinstance(value, dict) and value.get("tombstone") is True:
                Tombstone.model_validate(value)
            else:
                model.model_validate(value)
        except (ProtocolError, ValidationError):
            return False
        return True

    @staticmethod
    def _signed_bytes(record: DHTRecord, body: bytes) -> bytes:
        return pack([record.key, record.subkey, body, float(record.expiration_time)])

    def sign_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._models or self.identity is None or record.subkey != self._local_subkey:
            return record.value
        signature = self.identity.sign(self._signed_bytes(record, record.value))
        return pack({"record": record.value, "signature": signature})

    def strip_value(self, record: DHTRecord) -> bytes:
        if record.key not in self._models:
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
