"""SparseLoCo's pieces in one process [issue 25]: the chunk plan, the compressor and its wire form
(against the method's arithmetic and hostile bytes), and the outer step's bookkeeping."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from protocol.codec import pack, unpack
from protocol.errors import ErrorCode, ProtocolError
from protocol.identity import load_or_create_identity
from roles.worker.layout import FlatLayout
from roles.worker.sparseloco.chunks import capture_offset, fragment_due, plan_fragments
from roles.worker.sparseloco.codec import (
    HEADER_BUDGET_BYTES,
    Compressed,
    Envelope,
    compress,
    decode_fragment,
    decompress,
    encode_fragment,
    expected_payload_bytes,
)
from roles.worker.sparseloco.outer import SparseLoCoState

LAYOUT = FlatLayout(["embed", "norm", "w"], [(256, 64), (64,), (64, 192)])


@pytest.fixture(scope="module")
def identity(tmp_path_factory):
    return load_or_create_identity(str(tmp_path_factory.mktemp("id") / "node.key"))


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    return load_or_create_identity(str(tmp_path_factory.mktemp("id2") / "node.key"))


def _envelope(identity, **kw) -> Envelope:
    base = dict(run_id="run", stage=1, round=15, fragment=0, layout=LAYOUT.digest, chunk_size=4096, topk=64, bits=2,
                sender=identity.peer_id.to_base58(), anchor="00ff")
    base.update(kw)
    return Envelope(**base)


# ---- the plan ----

@pytest.mark.parametrize("fragments", [1, 2, 3, 8])
def test_fragments_tile_the_layout_in_whole_chunks_that_never_cross_a_tensor(fragments):
    plan = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=fragments)
    assert plan[0].start == 0 and plan[-1].end == LAYOUT.numel
    assert all(a.end == b.start for a, b in zip(plan, plan[1:]))
    boundaries = set(LAYOUT.offsets)
    for f in plan:
        at = f.start
        for run in f.runs:
            assert f.start + run.start == at
            for j in range(run.count):
                lo, hi = at + j * run.length, at + (j + 1) * run.length
                # a chunk lies inside one tensor
                assert not any(lo < b < hi for b in boundaries)
            at += run.numel
        assert at == f.end
    # the 64-element norm is one short chunk keeping ceil(64 * 64 / 4096) = 1
    assert sum(f.kept for f in plan) == 4 * 64 + 1 + 3 * 64


def test_capture_schedule_spreads_fragments_over_the_cycle():
    assert [capture_offset(f, 3, 15) for f in range(3)] == [5, 10, 15]
    due = {s: fragment_due(s, 3, 15) for s in range(1, 31)}
    assert due[5] == [0] and due[10] == [1] and due[15] == [2] and due[30] == [2]
    assert sum(len(v) for v in due.values()) == 6
    assert fragment_due(0, 1, 5) == [] and fragment_due(5, 1, 5) == [0]


# ---- the compressor ----

def test_compress_keeps_the_largest_per_chunk_with_their_signs():
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    torch.manual_seed(0)
    v = torch.randn(frag.numel)
    c = compress(v, frag, 2)
    assert len(c.indices) == frag.kept and len(c.scales) == frag.chunks
    d = decompress(c, frag)
    kept = d != 0
    assert int(kept.sum()) == frag.kept
    assert torch.equal(torch.sign(d[kept]), torch.sign(v[kept]))
    # per full chunk, the kept ones are exactly the 64 of largest magnitude
    first = v[:4096].abs()
    assert set(torch.nonzero(kept[:4096]).flatten().tolist()) == set(torch.topk(first, 64).indices.tolist())


def test_more_bits_quantise_closer():
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    v = torch.randn(frag.numel, generator=torch.Generator().manual_seed(1))
    errors = []
    for bits in (2, 4, 8):
        d = decompress(compress(v, frag, bits), frag)
        kept = d != 0
        errors.append(float((d - v)[kept].norm() / v[kept].norm()))
    assert errors[0] > errors[1] > errors[2] and errors[0] < 0.2 and errors[2] < 0.01, errors


def test_an_all_zero_chunk_sends_zeros():
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    d = decompress(compress(torch.zeros(frag.numel), frag, 2), frag)
    assert torch.count_nonzero(d) == 0


# ---- the wire ----

def test_wire_bytes_are_the_arithmetic_and_fifty_times_below_dense(identity):
    big = FlatLayout(["w"], [(4096 * 256,)])
    [frag] = plan_fragments(big, chunk_size=4096, topk=64, fragments=1)
    c = compress(torch.randn(frag.numel), frag, 2)
    data = encode_fragment(c, _envelope(identity, layout=big.digest), identity)
    arithmetic = expected_payload_bytes(frag, 2)
    assert arithmetic == 256 * (64 * 2 + 16 + 4)  # 148 bytes per chunk of 4,096
    assert c.payload_bytes() == arithmetic
    assert arithmetic < len(data) <= arithmetic + HEADER_BUDGET_BYTES
    assert len(data) / arithmetic - 1 < 0.01
    assert 4 * frag.numel / len(data) > 100


def test_round_trip_names_the_sender(identity):
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    c = compress(torch.randn(frag.numel), frag, 2)
    env, back = decode_fragment(encode_fragment(c, _envelope(identity), identity), _envelope(identity, sender=""), frag)
    assert env.sender == identity.peer_id.to_base58() and env.anchor == "00ff"
    assert torch.equal(decompress(back, frag), decompress(c, frag))


def _resigned(data: bytes, identity, **changes) -> bytes:
    """The fragment with fields of its signed part changed and signed again by `identity`."""
    import hashlib

    outer = unpack(data)
    fields = unpack(outer["m"])
    fields.update(changes)
    signed = pack(fields)
    return pack({"m": signed, "g": identity.sign(hashlib.sha256(signed).digest())})


@pytest.mark.parametrize("case, code", [
    ("not_msgpack", ErrorCode.MALFORMED_FRAME),
    ("flipped_byte", ErrorCode.UNAUTHENTICATED),
    ("signed_by_another", ErrorCode.UNAUTHENTICATED),
    ("wrong_round", ErrorCode.INVALID_REQUEST),
    ("wrong_layout", ErrorCode.INVALID_REQUEST),
    ("index_outside_chunk", ErrorCode.INVALID_TENSOR),
    ("indices_not_ascending", ErrorCode.INVALID_TENSOR),
    ("nan_scale", ErrorCode.INVALID_TENSOR),
    ("negative_scale", ErrorCode.INVALID_TENSOR),
    ("short_codes", ErrorCode.INVALID_TENSOR),
    ("oversized", ErrorCode.INVALID_REQUEST),
])
def test_hostile_fragments_are_refused_with_a_typed_error(identity, other, case, code):
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    c = compress(torch.randn(frag.numel), frag, 2)
    data = encode_fragment(c, _envelope(identity), identity)
    idx = np.frombuffer(unpack(unpack(data)["m"])["i"], dtype="<u2").copy()
    scales = np.frombuffer(unpack(unpack(data)["m"])["x"], dtype="<f4").copy()
    if case == "not_msgpack":
        data = b"\xc1" * 64
    elif case == "flipped_byte":
        data = data[:100] + bytes([data[100] ^ 1]) + data[101:]
    elif case == "signed_by_another":
        data = _resigned(data, other)  # names `identity` as the sender, signed by `other`
    elif case == "wrong_round":
        data = _resigned(data, identity, n=16)
    elif case == "wrong_layout":
        data = _resigned(data, identity, l="0" * 16)
    elif case == "index_outside_chunk":
        idx[0] = 4096
        data = _resigned(data, identity, i=idx.tobytes())
    elif case == "indices_not_ascending":
        idx[0], idx[1] = idx[1], idx[0]
        data = _resigned(data, identity, i=idx.tobytes())
    elif case == "nan_scale":
        scales[2] = math.nan
        data = _resigned(data, identity, x=scales.tobytes())
    elif case == "negative_scale":
        scales[2] = -1.0
        data = _resigned(data, identity, x=scales.tobytes())
    elif case == "short_codes":
        data = _resigned(data, identity, q=b"\x00")
    elif case == "oversized":
        data = data + b"\x00" * (expected_payload_bytes(frag, 2) + HEADER_BUDGET_BYTES + 1024)
    with pytest.raises(ProtocolError) as raised:
        decode_fragment(data, _envelope(identity, sender=""), frag)
    assert raised.value.code == code, raised.value


# ---- the outer step ----

def test_error_feedback_keeps_what_was_not_sent():
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    g = torch.Generator().manual_seed(2)
    start = torch.randn(frag.numel, generator=g)
    state = SparseLoCoState.starting_at(start)
    state.error.copy_(torch.randn(frag.numel, generator=g) * 0.01)
    before = state.error.clone()
    weights = start - 0.05 * torch.randn(frag.numel, generator=g)
    cap = state.capture(5, frag, weights, beta=0.95, bits=2)
    folded = 0.95 * before + (start - weights)
    sent = decompress(cap.own, frag)
    assert torch.allclose(state.error + sent, folded, atol=1e-6)


def test_replicas_with_one_anchor_and_the_same_fragments_reach_the_same_bits():
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    g = torch.Generator().manual_seed(3)
    start = torch.randn(frag.numel, generator=g)
    a, b = SparseLoCoState.starting_at(start), SparseLoCoState.starting_at(start)
    wa = start - 0.1 * torch.randn(frag.numel, generator=g)
    wb = start - 0.1 * torch.randn(frag.numel, generator=g)
    ca = a.capture(5, frag, wa, beta=0.95, bits=2)
    cb = b.capture(5, frag, wb, beta=0.95, bits=2)
    na, applied_a = a.apply(0, {"A": ca.own, "B": cb.own}, wa, alpha=1.0)
    nb, applied_b = b.apply(0, {"B": cb.own, "A": ca.own}, wb, alpha=1.0)
    assert torch.equal(na, nb) and torch.equal(a.anchor, b.anchor) and applied_a.anchor == applied_b.anchor
    # the consensus moved by the mean of the two sent updates
    mean = (decompress(ca.own, frag) + decompress(cb.own, frag)) / 2
    assert torch.allclose(a.anchor, start - mean, atol=1e-6)


def test_overlapped_steps_keep_their_drift():
    [frag] = plan_fragments(LAYOUT, chunk_size=4096, topk=64, fragments=1)
    start = torch.zeros(frag.numel)
    state = SparseLoCoState.starting_at(start)
    captured = torch.full((frag.numel,), -0.5)
    cap = state.capture(5, frag, captured, beta=0.0, bits=8)
    later = captured + 0.25  # tau steps of local training after the capture
    new, _ = state.apply(0, {"self": cap.own}, later, alpha=1.0)
    assert torch.allclose(new, state.anchor + 0.25)


# ---- the run config ----

@pytest.mark.parametrize("averaging, says", [
    ({"method": "sparseloco", "gradients": "every_step"}, "exclude each other"),
    ({"method": "sparseloco", "sparseloco": {"transport": "store"}}, "no store is named"),
    ({"method": "sparseloco", "sparseloco": {"inner_steps": 5, "overlap_steps": 5}}, "must be below inner_steps"),
    ({"method": "sparseloco", "sparseloco": {"chunk_size": 64, "topk_per_chunk": 65}}, "must not exceed chunk_size"),
    ({"method": "sparseloco", "sparseloco": {"bits": 3}}, "bits"),
    ({"method": "diloco"}, "method"),
])
def test_run_config_refuses_sparseloco_settings_that_cannot_work(averaging, says):
    from protocol.errors import ConfigError
    from protocol.run_config import load_run_config

    with pytest.raises(ConfigError, match=says):
        load_run_config("tiny", {"averaging": averaging})


def test_sparseloco_turns_the_per_step_gradient_exchange_off_and_uses_the_checkpoint_store():
    from protocol.run_config import load_run_config
    from roles.model.traffic_plan import gradient_exchange_on

    run = load_run_config("tiny", {"averaging": {"method": "sparseloco", "sparseloco": {"transport": "store"}},
                                   "checkpoints": {"store": "s3://bucket/run"}})
    assert not any(gradient_exchange_on(run, s) for s in range(run.num_stages))
    assert run.sparseloco_store == "s3://bucket/run"
    assert load_run_config("tiny").averaging.method == "asyncsparta"


# ---- the transports' bookkeeping ----

def test_store_transport_in_a_directory_sees_the_others_uploads_and_ignores_oversized_ones(tmp_path):
    import asyncio
    import time as _time

    from roles.worker.sparseloco.transport import RoundKey, StoreTransport

    members = ["A", "B", "C"]
    limit = lambda fragment: 100  # noqa: E731
    a = StoreTransport(str(tmp_path), "run", 1, "A", lambda: members, limit)
    b = StoreTransport(f"file://{tmp_path}", "run", 1, "B", lambda: members, limit)
    key = RoundKey(5, 0)

    async def scenario():
        # C uploads something far too large for a fragment: nobody waits for or reads it
        big = tmp_path / "run" / "sparseloco" / "stage-1" / "r0000000005-f0"
        big.mkdir(parents=True)
        (big / "C.frag").write_bytes(b"x" * 500)
        started = _time.monotonic()
        got_a, got_b = await asyncio.gather(a.exchange(key, b"from A", started + 2.0),
                                            b.exchange(key, b"from B", started + 2.0))
        return got_a, got_b, _time.monotonic() - started

    got_a, got_b, took = asyncio.run(scenario())
    assert got_a.received == {"B": b"from B"} and got_b.received == {"A": b"from A"}
    assert got_a.bytes_sent == len(b"from A") and got_a.expected == ("B", "C")
    assert 1.5 < took < 4.0  # C never delivered a usable fragment: both waited for it until the deadline
    assert not list(tmp_path.rglob("*.part"))  # uploads were renamed into place


def test_the_inbox_takes_one_fragment_per_sender_and_round_near_its_own():
    from roles.worker.sparseloco.transport import FragmentInbox, RoundKey

    inbox = FragmentInbox(lambda fragment: 10)
    inbox.newest = 100
    inbox.put("A", RoundKey(100, 0), b"abc", round_step=5)
    for sender, key, data, code in (("A", RoundKey(100, 0), b"abc", ErrorCode.INVALID_REQUEST),   # again
                                    ("B", RoundKey(200, 0), b"abc", ErrorCode.INVALID_REQUEST),   # far ahead
                                    ("B", RoundKey(100, 0), b"x" * 11, ErrorCode.FRAME_TOO_LARGE)):
        with pytest.raises(ProtocolError) as raised:
            inbox.put(sender, key, data, round_step=5)
        assert raised.value.code == code
    assert inbox.take(RoundKey(100, 0)) == {"A": b"abc"}
    assert inbox.counters == {"taken": 1, "refused_repeat": 1, "refused_round": 1, "refused_size": 1}


def test_the_memory_plan_counts_sparselocos_three_host_copies():
    from protocol.run_config import load_run_config
    from roles.model.memory_plan import plan_memory, stage_parameter_count

    base = load_run_config("tiny")
    slc = load_run_config("tiny", {"averaging": {"method": "sparseloco"}})
    for stage in range(base.num_stages):
        a, b = plan_memory(base, stage, "cpu", 8), plan_memory(slc, stage, "cpu", 8)
        assert b.outer_host_bytes == 3 * 4 * stage_parameter_count(slc, stage)
        assert b.host_bytes - a.host_bytes == b.outer_host_bytes and a.outer_host_bytes == 0
        assert "SparseLoCo" in b.describe()


def test_the_inbox_forgets_rounds_that_fell_out_of_its_window():
    from roles.worker.sparseloco.transport import FragmentInbox, RoundKey

    inbox = FragmentInbox(lambda fragment: 10)
    inbox.newest = 100
    inbox.put("A", RoundKey(90, 0), b"late", round_step=5)  # a round this replica already exchanged
    inbox.newest = 200
    inbox.put("A", RoundKey(200, 0), b"new", round_step=5)
    assert not inbox.has(RoundKey(90, 0), "A") and inbox.has(RoundKey(200, 0), "A")
