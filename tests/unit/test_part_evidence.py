"""A poisoned AsyncSPARTA all-reduce part becomes evidence anyone holding the run config can check
from the peer ids alone (protocol/part_evidence.py): the seal binds every field it names, evidence
holds against a sealed lie, and every forgery, mix-up or disagreement is refused with its reason.
The report's envelope carries this kind beside the others, hostile bodies are refused by shape and
size, the reducer's builder picks its witnesses as the screen would, and the worker's reporter
reports once per accused and group and never raises."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ed25519
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from protocol.codec import pack, unpack
from protocol.errors import ProtocolError
from protocol.evidence import EvidenceRejected
from protocol.evidence_report import evidence_report_body, parse_evidence, parse_evidence_report
from protocol.hivemind_adapter import HeldPart
from protocol.identity import Identity
from protocol.messages import to_body
from protocol.part_evidence import (
    PART_MAX_BYTES, PartEvidence, PartProof, PartSigning, SignedPart, check_part_evidence, part_digest,
    part_signing_bytes, seal_refusal,
)
from roles.worker.averaging.evidence import PartReporter, part_evidence

RUN, STAGE, GROUP, PART = "run-p", 2, b"\x07group-id", 3
RATIO = 10.0
BASE = torch.randn(256, generator=torch.Generator().manual_seed(5))


def _identity() -> Identity:
    return Identity(ed25519.Ed25519PrivateKey.generate(), "")


def _peer(identity: Identity) -> str:
    return identity.peer_id.to_base58()


def _proof(identity: Identity, values: torch.Tensor, *, weight: float = 3.0, run_id: str = RUN,
           group_id: bytes = GROUP, part_index: int = PART, compression: int = 0, dtype: str = "float32",
           sign_as: Identity | None = None) -> PartProof:
    """`identity`'s sealed part of `values` (float32 bytes), as a reducer would hold it."""
    buffer = values.to(torch.float32).numpy().tobytes()
    shape = tuple(values.shape)
    signing = PartSigning(run_id, STAGE, _peer(identity), (sign_as or identity).sign)
    seal = signing.seal(group_id, part_index, weight, compression, dtype, shape, buffer)
    return PartProof(compression, dtype, shape, buffer, weight, seal)


def _values(scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return (BASE + torch.randn(256, generator=torch.Generator().manual_seed(seed)) * 0.05) * scale


def _signed(identity: Identity, scale: float = 1.0, seed: int = 0, **kwargs) -> SignedPart:
    return SignedPart.of(_peer(identity), _proof(identity, _values(scale, seed), **kwargs))


def _evidence(accused: SignedPart, *witnesses: SignedPart, **changes) -> PartEvidence:
    fields = dict(run_id=RUN, stage=STAGE, round=11, group_id=GROUP, part_index=PART, accused=accused,
                  witnesses=list(witnesses))
    fields.update(changes)
    return PartEvidence(**fields)


@pytest.fixture(scope="module")
def cast():
    liar, a, b, c = (_identity() for _ in range(4))
    signed = {"liar": _signed(liar, 1000.0), "a": _signed(a, seed=1), "b": _signed(b, seed=2),
              "c": _signed(c, seed=3)}
    return dict(liar=liar, a=a, b=b, c=c, signed=signed)


def _refused(reason: str, evidence: PartEvidence, run_id: str = RUN) -> EvidenceRejected:
    with pytest.raises(EvidenceRejected) as caught:
        check_part_evidence(evidence, run_id=run_id, max_norm_ratio=RATIO)
    assert caught.value.reason == reason, caught.value
    return caught.value


def test_the_signing_bytes_bind_every_field():
    digest = part_digest(0, "float32", (4,), bytes(16))
    base = dict(run_id=RUN, stage=STAGE, group_id=GROUP, part_index=PART, sender="peer", weight=2.0, digest=digest)
    signed = part_signing_bytes(**base)
    changes = [{"run_id": "run-q"}, {"stage": STAGE + 1}, {"group_id": GROUP + b"x"}, {"part_index": PART + 1},
               {"sender": "peeq"}, {"weight": 2.5}, {"digest": part_digest(0, "float32", (4,), bytes(15) + b"\1")}]
    assert len({signed, *(part_signing_bytes(**{**base, **c}) for c in changes)}) == len(changes) + 1
    # the digest binds how the part is encoded too, not only its bytes
    assert len({digest, part_digest(1, "float32", (4,), bytes(16)), part_digest(0, "float16", (4,), bytes(16)),
                part_digest(0, "float32", (2, 2), bytes(16)), part_digest(0, "float32", (4,), bytes(17))}) == 5
    # a field cannot bleed into its neighbour: the run id ends, the group id is length-prefixed
    assert part_signing_bytes(**{**base, "group_id": b"ab", "sender": "c"}) != part_signing_bytes(
        **{**base, "group_id": b"a", "sender": "bc"})


def test_a_seal_verifies_for_its_sender_and_part_only():
    me, other = _identity(), _identity()
    proof = _proof(me, _values())
    fields = dict(run_id=RUN, stage=STAGE, sender=_peer(me), group_id=GROUP, part_index=PART, weight=proof.weight,
                  compression=0, dtype="float32", shape=proof.shape, buffer=proof.buffer)
    assert seal_refusal(proof.signature, **fields) is None
    assert "does not verify" in seal_refusal(proof.signature, **{**fields, "sender": _peer(other)})
    assert "does not verify" in seal_refusal(proof.signature, **{**fields, "part_index": PART + 1})
    assert "does not verify" in seal_refusal(proof.signature, **{**fields, "buffer": bytes(len(proof.buffer))})
    assert seal_refusal(b"", **fields) == "a part without a signature"
    assert "without a valid signature" in seal_refusal(b"\x02" + proof.signature[1:], **fields)
    assert "without a valid signature" in seal_refusal(proof.signature[:-1], **fields)


def test_evidence_of_a_sealed_lie_holds(cast):
    s = cast["signed"]
    norms = check_part_evidence(_evidence(s["liar"], s["a"], s["b"]), run_id=RUN, max_norm_ratio=RATIO)
    assert norms.ratio == pytest.approx(1000.0, rel=0.05) and len(norms.witnesses) == 2
    # with four witnesses, after the wire: what the authorizer parses is what the reducer built
    wire = unpack(pack(to_body(_evidence(s["liar"], s["a"], s["b"], s["c"]))))
    assert check_part_evidence(parse_evidence(wire), run_id=RUN, max_norm_ratio=RATIO).ratio == pytest.approx(
        1000.0, rel=0.05)
    # too small is as caught as too large, and a non-finite part is poison whatever its weight
    tiny = _signed(cast["liar"], 1e-4)
    assert check_part_evidence(_evidence(tiny, s["a"], s["b"]), run_id=RUN, max_norm_ratio=RATIO).ratio < 1e-3
    nan = SignedPart.of(_peer(cast["liar"]), _proof(cast["liar"], torch.full((256,), float("nan")), weight=0.0))
    check_part_evidence(_evidence(nan, s["a"], s["b"]), run_id=RUN, max_norm_ratio=RATIO)


def test_a_forged_part_is_refused(cast):
    s, liar, a = cast["signed"], cast["liar"], cast["a"]
    # values changed after sealing
    forged = s["liar"].model_copy(update={"buffer": (_values(3.0).numpy().tobytes())})
    _refused("bad_signature", _evidence(forged, s["a"], s["b"]))
    # a part sealed by someone else (the reporter's own lie) presented as the liar's
    framed = SignedPart.of(_peer(liar), _proof(liar, _values(1000.0), sign_as=a))
    _refused("bad_signature", _evidence(framed, s["b"], s["c"]))
    # the weight, group or part index the evidence names are not those sealed
    _refused("bad_signature", _evidence(s["liar"].model_copy(update={"weight": 1.0}), s["a"], s["b"]))
    _refused("bad_signature", _evidence(s["liar"], s["a"], s["b"], group_id=b"another group"))
    _refused("bad_signature", _evidence(s["liar"], s["a"], s["b"], part_index=PART + 1))
    _refused("bad_signature", _evidence(s["liar"], s["a"], s["b"], stage=STAGE + 1))
    # a forged witness is refused as well
    _refused("bad_signature", _evidence(s["liar"], s["a"], s["b"].model_copy(update={"seal": s["a"].seal})))


def test_an_accused_within_the_ratio_or_of_weight_0_is_not_convicted(cast):
    s = cast["signed"]
    near = _signed(cast["liar"], 5.0)
    assert "within 10x" in str(_refused("accused_agrees", _evidence(near, s["a"], s["b"])))
    syncing = _signed(cast["liar"], 1000.0, weight=0.0)  # a joiner's own values, never averaged
    assert "weight 0" in str(_refused("accused_agrees", _evidence(syncing, s["a"], s["b"])))


def test_witnesses_that_disagree_prove_nothing(cast):
    s = cast["signed"]
    _refused("witnesses_disagree", _evidence(s["liar"], s["a"], _signed(cast["b"], 50.0)))
    _refused("witnesses_disagree", _evidence(s["liar"], s["a"], s["b"], _signed(cast["c"], 0.0)))
    nan = SignedPart.of(_peer(cast["c"]), _proof(cast["c"], torch.full((256,), float("nan"))))
    _refused("witnesses_disagree", _evidence(s["liar"], s["a"], s["b"], nan))


def test_the_accused_as_its_own_witness_or_another_run_is_refused(cast):
    s = cast["signed"]
    _refused("duplicate_party", _evidence(s["liar"], s["a"], s["liar"]))
    _refused("duplicate_party", _evidence(s["liar"], s["a"], s["a"]))
    _refused("wrong_run", _evidence(s["liar"], s["a"], s["b"]), run_id="another-run")
    # parts sealed for another run, in evidence that names this one
    other = {k: _signed(cast[k], 1000.0 if k == "liar" else 1.0, run_id="another-run") for k in ("liar", "a", "b")}
    _refused("bad_signature", _evidence(other["liar"], other["a"], other["b"]))


def test_parts_not_of_one_shape_or_not_float32_are_refused(cast):
    s, liar = cast["signed"], cast["liar"]
    short = SignedPart.of(_peer(liar), _proof(liar, _values(1000.0)[:100]))
    _refused("mismatched_part", _evidence(short, s["a"], s["b"]))
    halves = SignedPart.of(_peer(liar), _proof(liar, _values(1000.0).half(), dtype="float16"))
    _refused("mismatched_part", _evidence(halves, s["a"], s["b"]))
    compressed = SignedPart.of(_peer(liar), _proof(liar, _values(1000.0), compression=2))
    _refused("mismatched_part", _evidence(compressed, s["a"], s["b"]))
    # a shape that its bytes do not fill
    lying_shape = _proof(liar, _values(1000.0))._replace(shape=(512,))
    resealed = PartSigning(RUN, STAGE, _peer(liar), liar.sign).seal(GROUP, PART, 3.0, 0, "float32", (512,),
                                                                      lying_shape.buffer)
    bad = SignedPart.of(_peer(liar), lying_shape._replace(signature=resealed))
    wide = [w.model_copy(update={"shape": [512]}) for w in (s["a"], s["b"])]
    assert "do not hold" in str(_refused("mismatched_part", _evidence(bad, *wide)))


def test_hostile_bodies_are_refused_by_shape_and_size(cast):
    s = cast["signed"]
    good = to_body(_evidence(s["liar"], s["a"], s["b"]))
    assert isinstance(parse_evidence(good), PartEvidence)
    accused = good["accused"]
    hostile = [
        {**good, "witnesses": good["witnesses"][:1]},  # one witness: a word against a word
        {**good, "witnesses": good["witnesses"] * 3},  # six
        {**good, "group_id": b"g" * 65},
        {**good, "group_id": "text, not bytes"},
        {**good, "part_index": -1},
        {**good, "round": 1 << 63},
        {**good, "part_index": "3"},
        {**good, "stage": 5000},
        {**good, "accused": {**accused, "buffer": "not bytes"}},
        {**good, "accused": {**accused, "weight": "3"}},
        {**good, "accused": {**accused, "seal": accused["seal"][:64]}},
        {**good, "accused": {**accused, "shape": [1] * 9}},
        {**good, "accused": {**accused, "shape": [-1]}},
        {**good, "accused": {**accused, "dtype": "x" * 17}},
        {**good, "accused": {**accused, "buffer": bytes(PART_MAX_BYTES + 1)}},
        {**good, "accused": None},
        {key: value for key, value in good.items() if key != "accused"},
        {**good, "witnesses": {"not": "a list"}},
    ]
    for wire in hostile:
        with pytest.raises(ProtocolError):
            parse_evidence(wire)
    with pytest.raises(ValidationError):
        SignedPart(peer_id="p", weight=1.0, compression=0, dtype="float32", shape=[1],
                   buffer=b"x" * (PART_MAX_BYTES + 1), seal=bytes(65))


def test_the_envelope_carries_part_evidence_beside_the_other_kinds(cast):
    reporter = _identity()
    evidence = _evidence(cast["signed"]["liar"], cast["signed"]["a"], cast["signed"]["b"])
    report, parsed = parse_evidence_report(evidence_report_body(evidence, reporter, signed_at=1000.0))
    assert isinstance(parsed, PartEvidence) and parsed == evidence and report.evidence["kind"] == "part"


def _held(cast, *, own_scale: float = 1.0, liar_scale: float = 1000.0, weights=(3.0, 3.0, 3.0, 3.0)):
    """Part index PART as a reducer (a, sender 0) holds it: its own part (no proof), b's and c's
    sealed, and the liar's (sender 3)."""
    names = ("a", "b", "c", "liar")
    scales = {"a": own_scale, "b": 1.0, "c": 1.0, "liar": liar_scale}
    held = []
    for index, name in enumerate(names):
        values = _values(scales[name], seed=index)
        proof = None if name == "a" else _proof(cast[name], values, weight=weights[index])
        held.append(HeldPart(index, values, weights[index], proof))
    senders = [_peer(cast[name]) for name in names]
    return held, senders


def _found(cast, held, senders, rejected):
    def own_proof(part):
        return _proof(cast["a"], part.tensor, weight=part.weight)

    return part_evidence(run_id=RUN, stage=STAGE, round_id=11, group_id=GROUP, part_index=PART, held=held,
                         rejected=rejected, senders=senders, own=0, own_proof=own_proof, ratio=RATIO)


def test_a_reducer_builds_evidence_from_the_parts_it_accepted(cast):
    held, senders = _held(cast)
    [evidence] = _found(cast, held, senders, {3: "norm 1e3x"})
    assert evidence.accused.peer_id == senders[3] and [w.peer_id for w in evidence.witnesses][0] == senders[0]
    assert {w.peer_id for w in evidence.witnesses} == set(senders[:3]), "its own part and the agreeing others"
    assert check_part_evidence(evidence, run_id=RUN, max_norm_ratio=RATIO).ratio == pytest.approx(1000.0, rel=0.05)
    # nothing refused, or refused unsealed (a bad seal: it proves nothing), or for its weight only
    assert _found(cast, held, senders, {}) == []
    unsealed = [*held[:3], held[3]._replace(proof=None)]
    assert _found(cast, unsealed, senders, {3: "a part whose signature does not verify"}) == []
    held_near, _ = _held(cast, liar_scale=2.0)
    assert _found(cast, held_near, senders, {3: "weight 1e12 outside [0, 1e9]"}) == []
    # fewer than two agreeing accepted parts: b and c in sync (weight 0), only its own is left
    syncing, _ = _held(cast, weights=(3.0, 0.0, 0.0, 3.0))
    assert _found(cast, syncing, senders, {3: "norm"}) == []
    # its own part far from the others: the others are the witnesses
    far, _ = _held(cast, own_scale=300.0, liar_scale=1000.0)
    [evidence] = _found(cast, far, senders, {3: "norm"})
    assert {w.peer_id for w in evidence.witnesses} == {senders[1], senders[2]}


def test_a_worker_reports_a_refused_part_once_per_group_and_survives_failures(cast, caplog):
    sent: list[PartEvidence] = []

    async def report(evidence):
        sent.append(evidence)
        return "upheld"

    s = cast["signed"]
    evidence = _evidence(s["liar"], s["a"], s["b"])

    async def scene(reporter, found):
        reporter.submit(found)
        await asyncio.sleep(0)
        await reporter.close()

    reporter = PartReporter(run_id=RUN, max_norm_ratio=RATIO, report=report)
    asyncio.run(scene(reporter, [evidence, evidence]))
    asyncio.run(scene(reporter, [evidence]))  # the same accused and group: reported once
    assert sent == [evidence] and reporter.counts == {"upheld": 1}

    async def unreachable(evidence):
        raise ConnectionError("the authorizer is down")

    reporter.report = unreachable
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(reporter.send(evidence)) is None
    assert "could not report" in caplog.text and "ConnectionError" in caplog.text
    # evidence its own check refuses is not sent
    reporter.report = report
    assert asyncio.run(reporter.send(_evidence(_signed(cast["liar"], 2.0), s["a"], s["b"]))) is None
    assert reporter.counts == {"upheld": 1, "failed": 1, "unproven": 1} and len(sent) == 1


def test_a_run_that_does_not_average_with_asyncsparta_takes_no_part_evidence(cast):
    from authorizer.evidence import _check
    from protocol.run_config import load_run_config

    evidence = _evidence(cast["signed"]["liar"], cast["signed"]["a"], cast["signed"]["b"])
    assert _check(evidence, load_run_config("tiny", {"run_id": RUN})) == (pytest.approx(1000.0, rel=0.05),)
    sloco = load_run_config("tiny", {"run_id": RUN, "averaging": {"method": "sparseloco"}})
    with pytest.raises(EvidenceRejected) as caught:
        _check(evidence, sloco)
    assert caught.value.reason == "wrong_run" and "not AsyncSPARTA" in str(caught.value)


@settings(max_examples=200, deadline=None)
@given(seal=st.binary(max_size=80), weight=st.floats(allow_nan=True, allow_infinity=True),
       compression=st.integers(-2, 10), dtype=st.text(max_size=20),
       shape=st.lists(st.integers(-5, 1 << 40), max_size=9), buffer=st.binary(max_size=64),
       part_index=st.integers(0, 1 << 40))
def test_any_seal_off_the_wire_is_judged_never_raises(seal, weight, compression, dtype, shape, buffer, part_index):
    why = seal_refusal(seal, run_id=RUN, stage=STAGE, sender="12D3KooWJWoaqZhDaoEFshF7Rh1bpY9ohihFhzcW6d69Lr2NASuq",
                       group_id=GROUP, part_index=part_index, weight=weight, compression=compression, dtype=dtype,
                       shape=shape, buffer=buffer)
    assert isinstance(why, str)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["kind", "run_id", "stage", "round", "group_id", "part_index", "accused",
                                        "witnesses", "peer_id", "buffer", "seal", "shape"]),
                       st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.binary(max_size=70)
                                    | st.text(max_size=10), lambda inner: st.lists(inner, max_size=5)
                                    | st.dictionaries(st.text(max_size=8), inner, max_size=5), max_leaves=20)))
def test_any_part_evidence_map_parses_or_is_a_protocol_error(wire):
    try:
        parse_evidence({**wire, "kind": "part"})
    except ProtocolError:
        pass
