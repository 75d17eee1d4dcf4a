"""Signed DHT records: only the owner writes its subkey, only schema-valid values, sane expiries."""

from __future__ import annotations

import time

import pytest
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer

from protocol.codec import pack, unpack
from protocol.dht_schema import MAX_RECORD_TTL_S, WorkerRecord, schema_for_run, workers_key
from protocol.identity import load_or_create_identity
from protocol.records import SignedRecordValidator

RUN = "records-test"


@pytest.fixture(scope="module")
def identities(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ids")
    return [load_or_create_identity(str(folder / f"id{i}.key")) for i in range(2)]


def _record(identity, value: dict, *, key=None, expires_in=30.0, subkey=None) -> DHTRecord:
    key = key or workers_key(RUN, 0)
    return DHTRecord(
        key=DHTID.generate(source=key).to_bytes(),
        subkey=MSGPackSerializer.dumps(subkey or identity.peer_id.to_base58()),
        value=MSGPackSerializer.dumps(value),
        expiration_time=time.time() + expires_in,
    )


def _signed(validator, record):
    return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)


def _worker_value(**changes):
    return {**WorkerRecord(stage=0, max_batch=4, throughput=1.0).model_dump(mode="json"), **changes}


def test_owner_record_round_trips(identities):
    mine = SignedRecordValidator(identities[0], schema_for_run(RUN, 2))
    reader = SignedRecordValidator(identities[1], schema_for_run(RUN, 2))
    record = _signed(mine, _record(identities[0], _worker_value()))
    assert reader.validate(record)
    assert MSGPackSerializer.loads(reader.strip_value(record))["max_batch"] == 4


def test_cannot_write_another_peers_subkey(identities):
    attacker = SignedRecordValidator(identities[1], schema_for_run(RUN, 2))
    reader = SignedRecordValidator(identities[0], schema_for_run(RUN, 2))
    forged = _record(identities[1], _worker_value(), subkey=identities[0].peer_id.to_base58())
    # the attacker's validator refuses to sign for a subkey it does not own...
    assert attacker.sign_value(forged) == forged.value
    # ...and a hand-made wrapper signed with the attacker's key is rejected by every reader
    body = forged.value
    wrapper = {"record": body,
               "signature": identities[1].sign(SignedRecordValidator._signed_bytes(forged, body))}
    assert not reader.validate(DHTRecord(forged.key, forged.subkey, pack(wrapper), forged.expiration_time))
    assert reader.rejected == 1


def test_tampered_value_and_expiry_are_rejected(identities):
    mine = SignedRecordValidator(identities[0], schema_for_run(RUN, 2))
    record = _signed(mine, _record(identities[0], _worker_value()))
    wrapper = unpack(record.value)
    wrapper["record"] = MSGPackSerializer.dumps(_worker_value(max_batch=4096))
    assert not mine.validate(DHTRecord(record.key, record.subkey, pack(wrapper), record.expiration_time))
    assert not mine.validate(DHTRecord(record.key, record.subkey, record.value, record.expiration_time + 5))


def test_absurd_expiry_and_bad_schema_are_rejected(identities):
    mine = SignedRecordValidator(identities[0], schema_for_run(RUN, 2))
    far = _signed(mine, _record(identities[0], _worker_value(), expires_in=MAX_RECORD_TTL_S * 10))
    assert not mine.validate(far)
    bad = _signed(mine, _record(identities[0], _worker_value(max_batch=0)))
    assert not mine.validate(bad)
    unsigned = _record(identities[0], _worker_value())
    assert not mine.validate(unsigned)


def test_tombstones_validate(identities):
    mine = SignedRecordValidator(identities[0], schema_for_run(RUN, 2))
    assert mine.validate(_signed(mine, _record(identities[0], {"version": 1, "tombstone": True})))


def test_keys_outside_the_schema_are_left_to_other_validators(identities):
    mine = SignedRecordValidator(identities[0], schema_for_run(RUN, 2))
    other = _record(identities[0], {"anything": 1}, key="someone-else/key")
    assert mine.sign_value(other) == other.value
    assert mine.validate(other)


def test_identity_file_is_private_and_stable(tmp_path):
    path = tmp_path / "node.key"
    first = load_or_create_identity(str(path))
    assert (path.stat().st_mode & 0o777) == 0o600
    assert load_or_create_identity(str(path)).peer_id == first.peer_id


def test_peer_id_embeds_the_signing_key(identities):
    from protocol.identity import public_key_from_peer_id, verify_peer_signature

    identity = identities[0]
    assert public_key_from_peer_id(identity.peer_id) == identity.public_key
    assert public_key_from_peer_id("QmWihdSgzh9sCzbtjdDf4TqjjArhWeqKoiPTMdcvjpf56J") is None  # RSA-style id
    assert public_key_from_peer_id("not base58 !") is None
    signature = identity.sign(b"payload")
    assert verify_peer_signature(identity.peer_id, b"payload", signature)
    assert not verify_peer_signature(identities[1].peer_id, b"payload", signature)
    assert not verify_peer_signature(identity.peer_id, b"payloaD", signature)
