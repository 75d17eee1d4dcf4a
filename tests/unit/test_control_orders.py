"""Operator preempt orders (protocol/control_orders.py): who may sign them, and what every node's
record validator refuses under the run's control key, counted with a reason."""

from __future__ import annotations

import os
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer
from hypothesis import HealthCheck, given, settings, strategies as st

from protocol.auth_state import SharedAuthState
from protocol.codec import pack
from protocol.control_orders import (
    MAX_ORDER_TTL_S, OrderRefused, OrderRejection, PreemptMoment, PreemptOrder, SignedPreemptOrder, new_order,
    preempt_subkey, sign_order_as_operator, sign_order_as_root, verify_order,
)
from protocol.credentials import Credential, root_public_key_bytes, sign_credential, sign_revocation_list
from protocol.dht_schema import control_key, schema_for_run
from protocol.identity import load_or_create_identity
from protocol.records import REVOKED_SUBKEY, SignedRecordValidator

RUN = "orders-test"
ROOT = Ed25519PrivateKey.generate()
ROOT_PUB = root_public_key_bytes(ROOT)


@pytest.fixture(scope="module")
def ids(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ids")
    return [load_or_create_identity(str(folder / f"id{i}.key")) for i in range(3)]


def _credential(identity, role: str, stage=None, key=ROOT, run=RUN) -> bytes:
    now = int(time.time())
    cred = Credential(run_id=run, peer_id=identity.peer_id.to_base58(), public_key=identity.public_key, role=role,
                      stage=stage, issued_at=now, expires_at=now + 600, serial=now)
    return sign_credential(key, cred).to_bytes()


def _validator(tmp_path, identity) -> SignedRecordValidator:
    auth = SharedAuthState(str(tmp_path / "trust"), run_id=RUN, root_public_key=ROOT_PUB)
    return SignedRecordValidator(identity, schema_for_run(RUN, 2), run_id=RUN, auth=auth)


def _record(value, subkey: str, expires_in: float = 60.0, run: str = RUN) -> DHTRecord:
    return DHTRecord(key=DHTID.generate(source=control_key(run)).to_bytes(), subkey=MSGPackSerializer.dumps(subkey),
                     value=MSGPackSerializer.dumps(value), expiration_time=time.time() + expires_in)


def _target(ids) -> str:
    return ids[0].peer_id.to_base58()


def test_root_signed_order_round_trips(ids):
    order = new_order(run_id=RUN, peer_id=_target(ids), moment="chunk_send", ttl_s=60)
    signed = sign_order_as_root(ROOT, order)
    got = verify_order(ROOT_PUB, signed.to_dht_value(), run_id=RUN, subkey=preempt_subkey(_target(ids)))
    assert got.order == order and got.order.moment is PreemptMoment.CHUNK_SEND
    # the blob the authorizer hands out decodes to the same order
    assert verify_order(ROOT_PUB, signed.to_bytes(), run_id=RUN).order == order


def test_operator_signed_order_verifies_and_a_worker_credential_does_not(ids):
    order = new_order(run_id=RUN, peer_id=_target(ids), moment="now", ttl_s=60)
    operator = sign_order_as_operator(ids[1], _credential(ids[1], "monitor"), order)
    assert verify_order(ROOT_PUB, operator.to_dht_value(), run_id=RUN).signer == "operator"
    worker = sign_order_as_operator(ids[2], _credential(ids[2], "worker", stage=0), order)
    with pytest.raises(OrderRefused) as refused:
        verify_order(ROOT_PUB, worker.to_dht_value(), run_id=RUN)
    assert refused.value.reason is OrderRejection.NOT_OPERATOR and refused.value.role == "worker"
    # an operator credential signed by another root, and an operator's credential lent to another key
    stranger = sign_order_as_operator(ids[1], _credential(ids[1], "monitor", key=Ed25519PrivateKey.generate()), order)
    lent = sign_order_as_operator(ids[2], _credential(ids[1], "monitor"), order)
    assert _reason(stranger.to_dht_value()) is OrderRejection.NOT_OPERATOR
    assert _reason(lent.to_dht_value()) is OrderRejection.BAD_SIGNATURE


def _reason(value, **kwargs) -> OrderRejection:
    with pytest.raises(OrderRefused) as refused:
        verify_order(ROOT_PUB, value, run_id=kwargs.pop("run_id", RUN), **kwargs)
    return refused.value.reason


def test_expired_wrong_run_other_peer_and_forged_orders_are_refused(ids):
    target = _target(ids)
    expired = sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=target, moment="now", ttl_s=5,
                                                 now=time.time() - 60))
    assert _reason(expired.to_dht_value()) is OrderRejection.EXPIRED
    other_run = sign_order_as_root(ROOT, new_order(run_id="another-run", peer_id=target, moment="now"))
    assert _reason(other_run.to_dht_value()) is OrderRejection.WRONG_RUN
    mine = sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=target, moment="now"))
    other_peer = preempt_subkey(ids[1].peer_id.to_base58())
    assert _reason(mine.to_dht_value(), subkey=other_peer) is OrderRejection.WRONG_PEER
    forged = sign_order_as_root(Ed25519PrivateKey.generate(), mine.order)
    assert _reason(forged.to_dht_value()) is OrderRejection.BAD_SIGNATURE
    assert _reason(mine.to_dht_value(), record_expiration=mine.order.expires_at + 3600) is OrderRejection.TTL_TOO_LONG
    with pytest.raises(OrderRefused) as refused:
        verify_order(None, mine.to_dht_value(), run_id=RUN)
    assert refused.value.reason is OrderRejection.NO_ROOT_KEY
    too_long = mine.order.model_copy(update={"expires_at": mine.order.issued_at + MAX_ORDER_TTL_S + 1})
    assert _reason(sign_order_as_root(ROOT, too_long).to_dht_value()) is OrderRejection.TTL_TOO_LONG
    with pytest.raises(ValueError):
        new_order(run_id=RUN, peer_id=target, moment="now", ttl_s=MAX_ORDER_TTL_S + 1)


def test_altered_order_bytes_are_refused(ids):
    signed = sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=_target(ids), moment="forward"))
    value = signed.to_dht_value()
    altered = signed.order.model_copy(update={"moment": PreemptMoment.NOW})
    assert _reason({**value, "order": altered.signing_bytes()}) is OrderRejection.BAD_SIGNATURE
    assert _reason({**value, "order": value["order"] + b"\x00"}) is OrderRejection.MALFORMED


def test_validator_accepts_root_orders_and_counts_forged_ones(tmp_path, ids):
    validator = _validator(tmp_path, ids[0])
    target = _target(ids)
    subkey = preempt_subkey(target)
    good = sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=target, moment="chunk_send", ttl_s=120))
    assert validator.validate(_record(good.to_dht_value(), subkey))
    assert validator.rejected == 0
    order = new_order(run_id=RUN, peer_id=target, moment="now")
    forged = sign_order_as_operator(ids[2], _credential(ids[2], "trainer"), order)
    assert not validator.validate(_record(forged.to_dht_value(), subkey))
    assert not validator.validate(_record(good.to_dht_value(), preempt_subkey(ids[1].peer_id.to_base58())))
    assert not validator.validate(_record(good.to_dht_value(), subkey, expires_in=MAX_ORDER_TTL_S * 10))
    assert not validator.validate(_record(good.to_dht_value(), "something-else"))
    assert validator.rejected == 4
    reasons = [(r["key"], r["peer_id"], r["reason"], r["role"]) for r in validator.drain()["rejections"]]
    assert reasons[0] == (control_key(RUN), subkey, "order_not_operator", "trainer")
    assert [r[2] for r in reasons[1:]] == ["order_wrong_peer", "expiry_too_far", "unknown_control"]


def test_revocation_list_path_is_intact(tmp_path, ids):
    validator = _validator(tmp_path, ids[0])
    revocations = sign_revocation_list(ROOT, run_id=RUN, peer_ids=[ids[2].peer_id.to_base58()])
    assert validator.validate(_record(revocations.model_dump(), REVOKED_SUBKEY))
    forged = sign_revocation_list(Ed25519PrivateKey.generate(), run_id=RUN)
    assert not validator.validate(_record(forged.model_dump(), REVOKED_SUBKEY))
    assert [r["reason"] for r in validator.drain()["rejections"]] == ["bad_revocations"]


def test_open_run_validator_leaves_the_control_key_alone_and_orders_need_a_root_key(tmp_path, ids):
    """In an open run nobody's record validator checks the control key (any peer may write
    anything there): that is why workers there never read orders (roles/worker/health/preemption.py)."""
    validator = SignedRecordValidator(ids[0], schema_for_run(RUN, 2))
    good = sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=_target(ids), moment="now"))
    assert validator.validate(_record(good.to_dht_value(), preempt_subkey(_target(ids))))
    with pytest.raises(OrderRefused):
        verify_order(None, good.to_dht_value(), run_id=RUN)


HOSTILE = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats(allow_nan=True) | st.text(max_size=40)
    | st.binary(max_size=200),
    lambda children: st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=12), children, max_size=6),
    max_leaves=24,
)


@pytest.fixture(scope="module")
def hostile_validator(tmp_path_factory, ids):
    return _validator(tmp_path_factory.mktemp("v"), ids[0])


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(value=HOSTILE, fields=st.lists(HOSTILE, max_size=10))
def test_hostile_records_are_rejected_without_exceptions(hostile_validator, ids, value, fields):
    validator = hostile_validator
    validator.rejected = 0
    validator.drain()
    subkey = preempt_subkey(_target(ids))
    records = [
        _record(value, subkey),
        _record({"order": pack(fields), "signer": "root", "signature": b"x" * 64}, subkey),
        _record({"order": pack(["agora/control/preempt/v1", *fields]), "signer": "operator",
                 "signature": b"x" * 64, "credential": pack(fields)}, subkey),
        DHTRecord(DHTID.generate(source=control_key(RUN)).to_bytes(), b"\xc1", b"\xc1", time.time() + 10),
    ]
    for record in records:
        assert validator.validate(record) is False
    assert validator.rejected == len(records)
    assert len(validator.drain()["rejections"]) == len(records)


def test_order_models_ignore_unknown_fields_and_parse_from_json(ids):
    signed = sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=_target(ids), moment="backward"))
    again = SignedPreemptOrder.model_validate_json(signed.model_dump_json())
    assert again == signed
    assert PreemptOrder.model_validate({**signed.order.model_dump(), "future_field": 1}) == signed.order


class _Swarm:
    def __init__(self, peer_id: str):
        self.peer_id = peer_id


@pytest.fixture
def watcher(tmp_path, ids, monkeypatch):
    from roles.worker.health import preemption

    kills = []
    monkeypatch.setattr(preemption.os, "kill", lambda pid, sig: kills.append((pid, sig)))
    auth = SharedAuthState(str(tmp_path / "trust"), run_id=RUN, root_public_key=ROOT_PUB)
    switch = preemption.PreemptSwitch()
    made = preemption.PreemptionWatcher(_Swarm(_target(ids)), run_id=RUN, auth_state=auth, switch=switch,
                                        reducer=False, poll_period_s=0.1)
    made.kills = kills
    return made


def _order_value(ids, moment: str, issued_at=None):
    return sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=_target(ids), moment=moment, now=issued_at)
                              ).to_dht_value()


def test_watcher_arms_the_switch_and_fires_at_the_moment(watcher, ids, caplog):
    import signal

    watcher.consider(_order_value(ids, "backward"))
    assert watcher.switch.armed is PreemptMoment.BACKWARD and watcher.kills == []
    watcher.switch.on_compute("forward")
    assert watcher.kills == []
    watcher.switch.on_compute("backward")
    assert watcher.kills == [(os.getpid(), signal.SIGKILL)]
    [order_id] = watcher._seen
    assert caplog.text.count("preempted by operator order") == 1
    assert f"preempted by operator order {order_id} at backward" in caplog.text


def test_watcher_now_fires_at_once_and_reduced_send_falls_back_for_a_sender(watcher, ids):
    watcher.consider(_order_value(ids, "reduced_send"))
    assert watcher.switch.armed is PreemptMoment.CHUNK_SEND and watcher.kills == []
    watcher.consider(_order_value(ids, "now"))
    assert len(watcher.kills) == 1


def test_watcher_ignores_old_forged_and_foreign_orders(watcher, ids):
    # The watcher dates "this process" by its start; a test process older than an order's ttl
    # would see the earlier process's order as expired instead (a pytest worker lives long).
    watcher.started_at = time.time() - 1
    watcher.consider(_order_value(ids, "now", issued_at=watcher.started_at - 5))  # for an earlier process
    forged = sign_order_as_operator(ids[2], _credential(ids[2], "worker", stage=0),
                                    new_order(run_id=RUN, peer_id=_target(ids), moment="now"))
    watcher.consider(forged.to_dht_value())
    other = sign_order_as_root(ROOT, new_order(run_id=RUN, peer_id=ids[1].peer_id.to_base58(), moment="now"))
    watcher.consider(other.to_dht_value())
    assert watcher.kills == [] and watcher.switch.armed is None
    assert watcher.refused == {"not_operator": 1, "wrong_peer": 1}
