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
any node may relay it. Operator orders (protocol/control_orders.py) live under the same key, subkey
`preempt:<peer id>`, signed by the root key or an operator; in an open run nothing under the
control key is checked here, and workers do not read orders there at all.

Every rejection under a schema key is remembered (time, key, subkey, reason, and the role and
stage of the credential it carried) in a bounded log. The validator runs in hivemind's DHT child
process, so the health monitor fetches that log, and the newest trainer reports this node saw pass
through it (`witness=True`), with `dht.run_coroutine(partial(drain_observations, token=...))`:
a report the monitor's reads missed (a trainer's last reports before it left) is still counted.
"""

from __future__ import annotations

import collections
import logging
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Optional

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer
from pydantic import ValidationError

from protocol.auth_state import SharedAuthState
from protocol.codec import pack, unpack
from protocol.control_orders import PREEMPT_SUBKEY_PREFIX, OrderRefused, verify_order
from protocol.credentials import CredentialError, RevocationList, verify_credential, verify_revocation_list
from protocol.dht_schema import MAX_RECORD_TTL_S, KeySpec, Tombstone, TrainerRecord, control_key
from protocol.errors import ProtocolError
from protocol.identity import Identity, verify_peer_signature

logger = logging.getLogger(__name__)

REVOKED_SUBKEY = "revoked"
MAX_REJECTIONS_KEPT = 1024
"""Rejections the log holds between two drains; the oldest are dropped (and counted) beyond it."""
MAX_WITNESSED_PEERS = 10_000

_LIVE: "weakref.WeakValueDictionary[str, SignedRecordValidator]" = weakref.WeakValueDictionary()
"""Validators by token: the DHT child process holds its fork-time copy of this registry, so a
coroutine run there finds the validator hivemind actually uses."""


@dataclass(frozen=True)
class RecordRejection:
    """One record this node's validator refused under a schema key."""

    at: float
    key: str
    peer_id: str
    """The subkey: the peer id the record claims to be from (only proven if the signature held)."""
    reason: str
    """expiry_too_far, malformed, no_credential, bad_credential, wrong_role, wrong_stage, revoked,
    bad_signature or invalid_record; under the control key `order_<OrderRejection>` for a preempt
    order (its subkey, `preempt:<target>`, is `peer_id` then), bad_revocations or unknown_control."""
    role: Optional[str] = None
    """The role of the credential the record carried, once that credential verified."""
    stage: Optional[int] = None


class _Rejected(Exception):
    def __init__(self, reason: str, role: Optional[str] = None, stage: Optional[int] = None):
        super().__init__(reason)
        self.reason, self.role, self.stage = reason, role, stage


class SignedRecordValidator(RecordValidatorBase):
    """Signs our node's records and rejects any record under a schema key that does not verify."""

    def __init__(self, identity: Optional[Identity], schema: dict[str, KeySpec], *,
                 run_id: Optional[str] = None, auth: Optional[SharedAuthState] = None, witness: bool = False):
        self.identity = identity
        self.auth = auth
        self._local_subkey = (
            MSGPackSerializer.dumps(identity.peer_id.to_base58()) if identity is not None else None
        )
        self._specs = {DHTID.generate(source=key).to_bytes(): spec for key, spec in schema.items()}
        self._names = {DHTID.generate(source=key).to_bytes(): key for key in schema}
        self._control = DHTID.generate(source=control_key(run_id)).to_bytes() if run_id and auth else None
        if self._control is not None:
            self._names[self._control] = control_key(run_id)
        self.rejected = 0
        self.rejections: collections.deque[RecordRejection] = collections.deque(maxlen=MAX_REJECTIONS_KEPT)
        self.rejections_dropped = 0
        self.witness = witness
        self.witnessed: dict[str, tuple[float, bytes]] = {}
        """Newest trainer report body seen per peer, with its expiration (only with `witness`)."""
        self.token = uuid.uuid4().hex
        _LIVE[self.token] = self

    def validate(self, record: DHTRecord) -> bool:
        if record.key == self._control:
            ok = self._check_control(record)
        else:
            spec = self._specs.get(record.key)
            if spec is None:
                return True  # not one of our keys: hivemind's own keys (e.g. averaging) are checked elsewhere
            try:
                self._check(record, spec)
                ok = True
            except _Rejected as rejected:
                self._remember(record, rejected)
                ok = False
        if not ok:
            self.rejected += 1
        return ok

    def _remember(self, record: DHTRecord, rejected: _Rejected) -> None:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            subkey = None
        if len(self.rejections) == self.rejections.maxlen:
            self.rejections_dropped += 1
        self.rejections.append(RecordRejection(
            at=time.time(), key=self._names.get(record.key, "?"), peer_id=subkey if isinstance(subkey, str) else "?",
            reason=rejected.reason, role=rejected.role, stage=rejected.stage))

    def _check(self, record: DHTRecord, spec: KeySpec) -> None:
        """Return if `record` may be stored under its key; raise _Rejected with the reason if not."""
        if record.expiration_time > time.time() + MAX_RECORD_TTL_S:
            raise _Rejected("expiry_too_far")
        try:
            wrapper = unpack(record.value)
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:  # ProtocolError from our codec, anything from hivemind's
            raise _Rejected("malformed") from None
        if not isinstance(wrapper, dict) or not isinstance(subkey, str):
            raise _Rejected("malformed")
        body, signature = wrapper.get("record"), wrapper.get("signature")
        if not isinstance(body, bytes) or not isinstance(signature, bytes):
            raise _Rejected("malformed")
        credential = wrapper.get("credential")
        if self.auth is not None:
            self._credential_allows(credential, subkey, spec)
        if not verify_peer_signature(subkey, self._signed_bytes(record, body, credential), signature):
            raise _Rejected("bad_signature")
        try:
            value = unpack(body)
            if isinstance(value, dict) and value.get("tombstone") is True:
                Tombstone.model_validate(value)
            else:
                spec.model.model_validate(value)
        except (ProtocolError, ValidationError):
            raise _Rejected("invalid_record") from None
        if self.witness and spec.model is TrainerRecord and not value.get("tombstone"):
            self._witness(subkey, record.expiration_time, body)

    def _witness(self, peer_id: str, expiration_time: float, body: bytes) -> None:
        seen = self.witnessed.get(peer_id)
        if seen is not None and seen[0] >= expiration_time:
            return
        if seen is None and len(self.witnessed) >= MAX_WITNESSED_PEERS:
            self.witnessed.pop(min(self.witnessed, key=lambda p: self.witnessed[p][0]))
        self.witnessed[peer_id] = (expiration_time, body)

    def _credential_allows(self, credential: object, subkey: str, spec: KeySpec) -> None:
        if not isinstance(credential, bytes):
            raise _Rejected("no_credential")
        now = time.time()
        try:
            cred = verify_credential(self.auth.root_public_key, credential, now=now, peer_id=subkey,
                                     run_id=self.auth.run_id)
        except CredentialError:
            raise _Rejected("bad_credential") from None
        if cred.role != spec.role:
            raise _Rejected("wrong_role", cred.role, cred.stage)
        if spec.stage is not None and cred.stage != spec.stage:
            raise _Rejected("wrong_stage", cred.role, cred.stage)
        revocations = self.auth.revocations()
        if revocations is not None and revocations.is_revoked(cred):
            raise _Rejected("revoked", cred.role, cred.stage)

    def drain(self) -> dict:
        """The rejections since the last drain (oldest first) and the witnessed trainer reports, as
        plain data that crosses the pipe to the parent process."""
        rejections = [r.__dict__ for r in self.rejections]
        self.rejections.clear()
        dropped, self.rejections_dropped = self.rejections_dropped, 0
        return {"rejections": rejections, "dropped": dropped,
                "trainer_reports": {peer: (expiration, body) for peer, (expiration, body) in self.witnessed.items()}}

    def _check_control(self, record: DHTRecord) -> bool:
        try:
            subkey = MSGPackSerializer.loads(record.subkey)
        except Exception:
            subkey = None
        if subkey == REVOKED_SUBKEY:
            try:
                revocations = RevocationList.model_validate(MSGPackSerializer.loads(record.value))
                verify_revocation_list(self.auth.root_public_key, revocations, run_id=self.auth.run_id)
            except Exception:  # malformed or not signed by the root key
                self._remember(record, _Rejected("bad_revocations"))
                return False
            if record.expiration_time > time.time() + MAX_RECORD_TTL_S:
                self._remember(record, _Rejected("expiry_too_far"))
                return False
            return True
        if isinstance(subkey, str) and subkey.startswith(PREEMPT_SUBKEY_PREFIX):
            return self._check_order(record, subkey)
        self._remember(record, _Rejected("unknown_control"))
        return False

    def _check_order(self, record: DHTRecord, subkey: str) -> bool:
        """An operator's preempt order (protocol/control_orders.py): signed by the root key or an
        operator, for this run, under its target's subkey, not outliving itself."""
        if record.expiration_time > time.time() + MAX_RECORD_TTL_S:
            self._remember(record, _Rejected("expiry_too_far"))
            return False
        try:
            verify_order(self.auth.root_public_key, record.value, run_id=self.auth.run_id, subkey=subkey,
                         record_expiration=record.expiration_time)
        except OrderRefused as refused:
            self._remember(record, _Rejected(f"order_{refused.reason.value}", refused.role))
            return False
        except Exception:  # a bug of ours must not let a hostile record through
            logger.debug("order under %s crashed its check", subkey, exc_info=True)
            self._remember(record, _Rejected("order_malformed"))
            return False
        return True

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


async def drain_observations(_dht, _node, *, token: str) -> dict:
    """Run inside the DHT process through `DHT.run_coroutine`: what the validator with `token` saw
    since the last call (SignedRecordValidator.drain); empty if it is not there."""
    validator = _LIVE.get(token)
    if validator is None:
        return {"rejections": [], "dropped": 0, "trainer_reports": {}}
    return validator.drain()
