"""The fast paths on every sample's way (issue 23, a thin hot path) decide exactly as the full
validation does: envelopes, record bodies, tensors over the frame's bytes, the finiteness check."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import messages
from protocol.codec import decode_tensor, encode_tensor, pack, unpack
from protocol.errors import ProtocolError
from protocol.messages import (
    BackwardReply, BackwardRequest, ErrorBody, EvaluateReply, ForwardReply, ForwardRequest, HelloAck, InfoReply,
    ReplyFrame, RequestFrame, StepGradientsReply, TagReply, parse_frame, parse_reply_frame, parse_request_frame,
    to_body,
)
from roles.worker.serving.request_checks import all_finite

scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats() | st.text(max_size=8) \
    | st.binary(max_size=8)
values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4), c, max_size=3),
                      max_leaves=8)
envelope_keys = st.sampled_from(["seq", "body", "ok", "error", "version", "other"])
envelopes = st.dictionaries(envelope_keys, values | st.dictionaries(st.text(max_size=4), values, max_size=2),
                            max_size=5) | values


def _decided(parse, frame: bytes):
    try:
        return ("ok", tuple(parse(frame)))
    except ProtocolError as exc:
        return ("error", exc.code)


def _fields(model):
    return lambda frame: tuple(getattr(parse_frame(model, frame), name) for name in model.model_fields)


@given(raw=envelopes)
@settings(max_examples=400, deadline=None)
def test_the_envelope_fast_paths_accept_and_refuse_as_the_full_validation_does(raw):
    frame = pack(raw)
    assert _decided(parse_request_frame, frame) == _decided(_fields(RequestFrame), frame)
    assert _decided(parse_reply_frame, frame) == _decided(_fields(ReplyFrame), frame)


def test_the_envelope_fast_paths_take_the_usual_frames_without_pydantic(monkeypatch):
    def refuse(*_):
        raise AssertionError("the full validation ran")

    monkeypatch.setattr(messages, "parse_frame", refuse)
    assert parse_request_frame(pack({"seq": 3, "body": {"a": 1}})).body == {"a": 1}
    reply = parse_reply_frame(pack({"seq": 3, "ok": True, "body": {"b": 2}}))
    assert (reply.seq, reply.ok, reply.body, reply.error) == (3, True, {"b": 2}, None)
    with pytest.raises(AssertionError):  # an error reply is validated in full
        parse_reply_frame(pack({"seq": 3, "ok": False, "error": {"code": 1, "message": "no"}}))


RECORDS = [
    ForwardRequest(stage=1, sample_id="s", tokens=torch.arange(4), coords=torch.randn(4, 2)),
    ForwardRequest(stage=0, sample_id="s", tokens=torch.arange(4)),
    ForwardReply(coords=torch.randn(3, 2).bfloat16()),
    BackwardRequest(stage=2, sample_id="s", tokens=torch.arange(4), coords=torch.randn(4, 2), step=7),
    BackwardReply(grad_input=torch.randn(4, 2), loss=1.5, step=3, version=2),
    BackwardReply(loss=0.25),
    EvaluateReply(loss=2.0, version=0),
    TagReply(tagger=True, steps=[1, 2], counts=[3, 4]),
    InfoReply(peer_id="p", role="worker", counters={"a": 1}),
    HelloAck(version=2, ok=False, error=ErrorBody(code=3, message="no")),
    StepGradientsReply(closed=True, grad=torch.randn(5), members=["a"]),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_to_body_writes_what_model_dump_writes(record):
    assert pack(to_body(record)) == pack(record.model_dump(exclude_none=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
def test_a_decoded_tensor_lies_over_its_frames_bytes_and_only_those(dtype):
    source = (torch.randn(6, 3) * 10).to(dtype)
    frame = pack({"t": encode_tensor(source)})
    first, second = decode_tensor(unpack(frame)["t"]), decode_tensor(unpack(frame)["t"])
    assert torch.equal(first, source) and torch.equal(second, source)
    assert first.untyped_storage().nbytes() == source.numel() * source.element_size()  # no copy of its own
    first.add_(1)  # in place, as a caller may: it writes into its own frame's buffer only
    assert torch.equal(second, source) and not torch.equal(first, source)


@given(values=st.lists(st.floats(width=32) | st.sampled_from([math.nan, math.inf, -math.inf]), min_size=1,
                       max_size=40),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
@settings(max_examples=200, deadline=None)
def test_the_finiteness_check_agrees_with_torch(values, dtype):
    tensor = torch.tensor(values, dtype=torch.float32).to(dtype)
    assert all_finite(tensor) == bool(torch.isfinite(tensor).all())
    assert all_finite(decode_tensor(encode_tensor(tensor))) == bool(np.isfinite(tensor.float().numpy()).all())
