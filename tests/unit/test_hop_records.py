"""What a worker keeps of its chained samples (roles/worker/serving/hop_records.py): bounded by
count, bytes and age, oldest out first; and the `agora/v1/hop_record` handler, which hands one
record to the sample's own trainer and refuses anything else with a typed error."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import AgoraError, ErrorCode, ProtocolError
from protocol.messages import HopRecordReply, HopRecordRequest, SignedHop, parse_model, sample_owner_prefix, to_body
from roles.worker.serving.hop_records import RECORD_OVERHEAD_BYTES, HopRecords

TRAINER = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
OTHER_TRAINER = PeerID.from_base58("QmVhJVRSYHNSHgR9dJNbDxu6G7GPPqJAeiJoVRvcexGNf9")
MINE = sample_owner_prefix(TRAINER.to_base58())
RUN = "run-h"
SIGNED = SignedHop(peer_id="w", stage=0, version=2, coords_digest=bytes(32), grad_output_digest=bytes(32),
                   result_digest=bytes(32), attestation=bytes(64))


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _coords(n: int = 16) -> torch.Tensor:
    return torch.ones(n, 4)


def test_the_oldest_sample_goes_first_once_more_samples_than_the_bound_are_kept():
    records = HopRecords(max_samples=3)
    for i in range(5):
        records.keep(f"s{i}", "coords_sent", _coords(), SIGNED)
        records.keep(f"s{i}", "gradient_received", _coords(), SIGNED)  # a second kind: still one sample
    assert len(records) == 3
    assert records.get("s0", "coords_sent") is None and records.get("s1", "gradient_received") is None
    assert records.get("s4", "gradient_received").signed == SIGNED
    assert records.counters["evicted"] == 4 and records.nbytes == 6 * (16 * 4 * 4 + RECORD_OVERHEAD_BYTES)


def test_kept_bytes_stay_under_the_bound_and_a_record_larger_than_it_is_not_kept():
    one = 16 * 4 * 4 + RECORD_OVERHEAD_BYTES
    records = HopRecords(max_bytes=3 * one)
    for i in range(10):
        records.keep(f"s{i}", "coords_received", _coords(), None)
        assert records.nbytes <= 3 * one
    assert len(records) == 3 and records.get("s9", "coords_received") is not None
    records.keep("huge", "coords_received", _coords(1000), None)
    assert records.get("huge", "coords_received") is None and len(records) == 3


def test_records_older_than_their_age_are_gone_and_a_replaced_record_is_counted_once():
    clock = _Clock()
    records = HopRecords(max_age_s=120.0, clock=clock)
    records.keep("old", "coords_sent", _coords(), None)
    clock.now += 60
    records.keep("new", "coords_sent", _coords(), None)
    records.keep("new", "coords_sent", _coords(), None)  # a retried sample passes the same coords on again
    assert records.nbytes == 2 * (16 * 4 * 4 + RECORD_OVERHEAD_BYTES)
    clock.now += 61
    assert records.get("old", "coords_sent") is None and records.get("new", "coords_sent") is not None
    clock.now += 60
    assert records.get("new", "coords_sent") is None and len(records) == 0 and records.nbytes == 0


def test_a_row_of_a_batch_is_kept_by_its_own_bytes_not_the_batchs():
    batch = torch.zeros(64, 16, 4)
    records = HopRecords()
    records.keep("s", "coords_sent", batch[3], None)
    kept = records.get("s", "coords_sent").tensor
    assert kept.untyped_storage().nbytes() == 16 * 4 * 4
    batch[3] += 1  # and the batch may change under it
    assert float(kept.sum()) == 0.0


def _ask(records: HopRecords, body, peer: PeerID = TRAINER, stage: int = 1) -> HopRecordReply:
    return asyncio.run(records.handle(peer, body, stage=stage, run_id=RUN))


def _body(**fields) -> dict:
    body = to_body(HopRecordRequest(run_id=RUN, stage=1, sample_id=f"{MINE}7", which="coords_received"))
    body.update(fields)
    return body


def test_the_samples_trainer_gets_the_kept_record_and_its_signature():
    records = HopRecords()
    records.keep(f"{MINE}7", "coords_received", _coords(), SIGNED)
    reply = parse_model(HopRecordReply, to_body(_ask(records, _body())))  # as the trainer reads it
    assert torch.equal(reply.tensor, _coords()) and reply.signed == SIGNED
    assert records.counters["served"] == 1


@pytest.mark.parametrize("fields,code", [
    ({"stage": "1"}, ErrorCode.INVALID_REQUEST),  # strict types: no coercion
    ({"stage": 1.0}, ErrorCode.INVALID_REQUEST),
    ({"stage": -1}, ErrorCode.INVALID_REQUEST),
    ({"stage": 1 << 40}, ErrorCode.INVALID_REQUEST),
    ({"sample_id": 7}, ErrorCode.INVALID_REQUEST),
    ({"sample_id": ""}, ErrorCode.INVALID_REQUEST),
    ({"sample_id": "x" * 129}, ErrorCode.INVALID_REQUEST),
    ({"sample_id": "x" * (1 << 20)}, ErrorCode.INVALID_REQUEST),
    ({"which": "coords"}, ErrorCode.INVALID_REQUEST),
    ({"which": 0}, ErrorCode.INVALID_REQUEST),
    ({"which": None}, ErrorCode.INVALID_REQUEST),
    ({"run_id": None}, ErrorCode.INVALID_REQUEST),
    ({"run_id": "another-run"}, ErrorCode.INVALID_REQUEST),  # records of another run
    ({"run_id": "r" * 129}, ErrorCode.INVALID_REQUEST),
    ({"stage": 2}, ErrorCode.WRONG_STAGE),
    ({"which": "gradient_sent"}, ErrorCode.NOT_KEPT),  # a kind this sample has no record of
    ({"sample_id": f"{MINE}8"}, ErrorCode.NOT_KEPT),
])
def test_hostile_or_wrong_requests_are_refused_with_a_typed_error(fields, code):
    records = HopRecords()
    records.keep(f"{MINE}7", "coords_received", _coords(), SIGNED)
    with pytest.raises(ProtocolError) as refused:
        _ask(records, _body(**fields))
    assert refused.value.code == code


@pytest.mark.parametrize("body", [[], "x", None, {"run_id": RUN}])
def test_a_body_that_is_no_request_is_refused(body):
    with pytest.raises(ProtocolError) as refused:
        _ask(HopRecords(), body)
    assert refused.value.code == ErrorCode.INVALID_REQUEST


def test_another_trainers_sample_reads_as_not_kept_even_when_it_is():
    records = HopRecords()
    theirs = f"{sample_owner_prefix(OTHER_TRAINER.to_base58())}7"
    records.keep(theirs, "coords_received", _coords(), SIGNED)
    with pytest.raises(ProtocolError) as refused:
        _ask(records, _body(sample_id=theirs))
    assert refused.value.code == ErrorCode.NOT_KEPT
    assert _ask(records, _body(sample_id=theirs), peer=OTHER_TRAINER).signed == SIGNED


_KEPT = HopRecords()
_KEPT.keep(f"{MINE}7", "coords_received", _coords(), SIGNED)
_FUZZED = st.fixed_dictionaries({}, optional={
    "run_id": st.one_of(st.just(RUN), st.text(max_size=140), st.integers(), st.none()),
    "stage": st.one_of(st.integers(-3, 5), st.integers(), st.text(max_size=3), st.floats(), st.none()),
    "sample_id": st.one_of(st.just(f"{MINE}7"), st.text(max_size=200), st.binary(max_size=20), st.integers()),
    "which": st.one_of(st.sampled_from(["coords_received", "coords_sent", "gradient_received", "gradient_sent"]),
                       st.text(max_size=20), st.lists(st.integers(), max_size=2)),
})


@given(body=st.one_of(_FUZZED, st.lists(st.integers(), max_size=3), st.text(max_size=5), st.none()))
@settings(max_examples=200, deadline=None)
def test_any_body_gets_a_record_or_a_typed_error(body):
    try:
        reply = _ask(_KEPT, body)
    except AgoraError as exc:
        assert isinstance(exc.code, ErrorCode)
    else:
        assert reply.signed == SIGNED
