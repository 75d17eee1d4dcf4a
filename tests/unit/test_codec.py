"""The wire codec and message schemas: round trips, and typed errors for hostile input."""

from __future__ import annotations

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.codec import WIRE_DTYPES, decode_tensor, encode_tensor, pack, unpack
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import BackwardRequest, ForwardRequest, Hello, RequestFrame, parse_frame, parse_model

shapes = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=4)
wire_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4),
    max_leaves=20,
)


@given(shape=shapes, dtype=st.sampled_from(sorted(WIRE_DTYPES)), seed=st.integers(0, 2**16))
@settings(max_examples=200, deadline=None)
def test_tensor_round_trip(shape, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    tensor = (torch.randn(shape, generator=generator) * 100).to(WIRE_DTYPES[dtype])
    decoded = decode_tensor(unpack(pack(encode_tensor(tensor))))
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


@given(value=wire_values)
@settings(max_examples=200, deadline=None)
def test_pack_round_trip(value):
    assert unpack(pack(value)) == value


@given(data=st.binary(max_size=256))
@settings(max_examples=300, deadline=None)
def test_unpack_never_raises_untyped(data):
    try:
        unpack(data)
    except ProtocolError as exc:
        assert exc.code == ErrorCode.MALFORMED_FRAME


@given(value=wire_values)
@settings(max_examples=300, deadline=None)
def test_hostile_tensor_maps_give_typed_errors(value):
    try:
        decode_tensor(value)
    except ProtocolError as exc:
        assert exc.code == ErrorCode.INVALID_TENSOR


@pytest.mark.parametrize("wire", [
    {"dtype": []},  # an unhashable dtype (found by the property test above)
    {"dtype": {"a": 1}, "shape": [1], "data": b"\0" * 4},
    {"dtype": "float64", "shape": [1], "data": b"\0" * 8},
    {"dtype": "float32", "shape": [2], "data": b"\0" * 4},
    {"dtype": "float32", "shape": [-1], "data": b""},
    {"dtype": "float32", "shape": [1 << 20, 1 << 20], "data": b""},
    {"dtype": "float32", "shape": "3", "data": b"\0" * 12},
    {"dtype": "int64", "shape": [True], "data": b"\0" * 8},
    {"dtype": "float32", "shape": [1], "data": "abcd"},
])
def test_bad_tensors_rejected(wire):
    with pytest.raises(ProtocolError) as info:
        decode_tensor(wire)
    assert info.value.code == ErrorCode.INVALID_TENSOR


def test_requests_round_trip_through_the_codec():
    request = ForwardRequest(stage=1, sample_id="s0-1", tokens=torch.arange(8), coords=torch.randn(8, 4))
    decoded = parse_model(ForwardRequest, unpack(pack(request.model_dump())))
    assert decoded.stage == 1 and torch.equal(decoded.tokens, request.tokens)
    assert torch.equal(decoded.coords, request.coords)
    backward = BackwardRequest(stage=0, sample_id="x", tokens=torch.arange(3), grad_output=torch.ones(3, 2))
    again = parse_model(BackwardRequest, unpack(pack(backward.model_dump())))
    assert again.coords is None and torch.equal(again.grad_output, backward.grad_output)


def test_unknown_fields_are_ignored_for_forward_compatibility():
    body = ForwardRequest(stage=0, sample_id="a", tokens=torch.arange(2)).model_dump()
    body["added_in_v2"] = {"anything": 1}
    assert parse_model(ForwardRequest, body).sample_id == "a"


@pytest.mark.parametrize("body, code", [
    ({"stage": "0", "sample_id": "a", "tokens": encode_tensor(torch.arange(2))}, ErrorCode.INVALID_REQUEST),
    ({"stage": 0, "sample_id": "", "tokens": encode_tensor(torch.arange(2))}, ErrorCode.INVALID_REQUEST),
    ({"stage": 0, "sample_id": "a"}, ErrorCode.INVALID_REQUEST),
    ({"stage": 0, "sample_id": "a", "tokens": {"dtype": "int64", "shape": [3], "data": b""}}, ErrorCode.INVALID_TENSOR),
])
def test_bad_bodies_get_typed_errors(body, code):
    with pytest.raises(ProtocolError) as info:
        parse_model(ForwardRequest, body)
    assert info.value.code == code


def test_frames_check_version_and_shape():
    hello = {"version": 2, "handler": "agora/v1/forward", "nonce": b"n" * 16, "timestamp": 1.0}
    assert parse_frame(Hello, pack(hello)).handler == "agora/v1/forward"
    assert parse_frame(RequestFrame, pack({"seq": 1, "body": {"a": 1}})).body == {"a": 1}
    with pytest.raises(ProtocolError) as info:
        parse_frame(Hello, pack({**hello, "version": 99}))
    assert info.value.code == ErrorCode.UNSUPPORTED_VERSION
    for bad in ([1, 2], {"version": 2}, {**hello, "nonce": b"short"}, "text", {**hello, "handler": "h" * 200}):
        with pytest.raises(ProtocolError):
            parse_frame(Hello, pack(bad))
    for bad in ({"seq": 0, "body": {}}, {"seq": 1, "body": [1]}, {"seq": "1", "body": {}}):
        with pytest.raises(ProtocolError):
            parse_frame(RequestFrame, pack(bad))


def test_msgpack_limits_refuse_huge_declared_lengths():
    forged = b"\xdb" + (2**31).to_bytes(4, "big")  # str32 claiming 2 GiB
    with pytest.raises(ProtocolError):
        unpack(forged)
    assert msgpack.packb([]) == pack([])
