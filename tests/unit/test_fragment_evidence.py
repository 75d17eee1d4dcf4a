"""A poisoned SparseLoCo fragment becomes evidence anyone holding the run config can check from the
peer ids alone (roles/worker/sparseloco/evidence.py): it holds against a signed lie, and every
forgery, mix-up or disagreement is refused with its reason. The report's envelope carries either
kind, and a spot check's evidence travels exactly as before. A replica's screen finds the lie,
and its reporter builds the evidence once per accused and round and never raises."""

from __future__ import annotations

import asyncio
import hashlib
import logging

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ed25519

from protocol.codec import pack, unpack
from protocol.evidence import Evidence, EvidenceRejected
from protocol.evidence_report import evidence_report_body, parse_evidence_report, report_signing_bytes
from protocol.fragment_evidence import FragmentEvidence, SignedFragment
from protocol.identity import Identity, verify_peer_signature
from protocol.messages import to_body
from protocol.run_config import SparseLoCoConfig
from roles.worker.layout import FlatLayout
from roles.worker.sparseloco.chunks import plan_fragments
from roles.worker.sparseloco.codec import Envelope, compress, compressed_norm, decompress, encode_fragment
from protocol.evidence import choose_witnesses
from roles.worker.sparseloco.evidence import FragmentReporter, check_fragment_evidence
from tests.unit.test_evidence import _evidence as spot_check_evidence

RUN, STAGE, ROUND = "run-f", 1, 15
LAYOUT = FlatLayout(["embed", "norm", "w"], [(64, 64), (64,), (64, 96)])
CONFIG = SparseLoCoConfig(chunk_size=512, topk_per_chunk=16, fragments=2, max_norm_ratio=10.0)
PLAN = plan_fragments(LAYOUT, chunk_size=CONFIG.chunk_size, topk=CONFIG.topk_per_chunk, fragments=CONFIG.fragments)
FRAGMENT = PLAN[1]
BASE = torch.randn(FRAGMENT.numel, generator=torch.Generator().manual_seed(7))


def _identity() -> Identity:
    return Identity(ed25519.Ed25519PrivateKey.generate(), "")


def _peer(identity: Identity) -> str:
    return identity.peer_id.to_base58()


def _wire(identity: Identity, scale: float = 1.0, *, round_id: int = ROUND, run_id: str = RUN, seed: int = 0) -> bytes:
    """`identity`'s signed fragment of a pseudo-gradient like every honest replica's, times `scale`."""
    noise = torch.randn(FRAGMENT.numel, generator=torch.Generator().manual_seed(seed)) * 0.1
    c = compress((BASE + noise) * scale, FRAGMENT, CONFIG.bits)
    envelope = Envelope(run_id, STAGE, round_id, FRAGMENT.index, LAYOUT.digest, CONFIG.chunk_size,
                        CONFIG.topk_per_chunk, CONFIG.bits, sender=_peer(identity), anchor="00ff")
    return encode_fragment(c, envelope, identity)


def _signed(identity: Identity, data: bytes) -> SignedFragment:
    return SignedFragment(peer_id=_peer(identity), data=data)


def _evidence(accused: SignedFragment, *witnesses: SignedFragment, **changes) -> FragmentEvidence:
    fields = dict(run_id=RUN, stage=STAGE, round=ROUND, fragment=FRAGMENT.index, tensor_names=LAYOUT.names,
                  tensor_shapes=[list(s) for s in LAYOUT.shapes], accused=accused, witnesses=list(witnesses))
    fields.update(changes)
    return FragmentEvidence(**fields)


@pytest.fixture(scope="module")
def cast():
    liar, a, b, c = (_identity() for _ in range(4))
    signed = {name: _signed(who, _wire(who, 1000.0 if who is liar else 1.0, seed=i))
              for i, (name, who) in enumerate((("liar", liar), ("a", a), ("b", b), ("c", c)))}
    return dict(liar=liar, a=a, b=b, c=c, signed=signed)


def _refused(reason: str, evidence: FragmentEvidence, run_id: str = RUN) -> EvidenceRejected:
    with pytest.raises(EvidenceRejected) as caught:
        check_fragment_evidence(evidence, run_id=run_id, config=CONFIG)
    assert caught.value.reason == reason, caught.value
    return caught.value


def _resigned(data: bytes, identity: Identity, **changes) -> bytes:
    outer = unpack(data)
    fields = unpack(outer["m"])
    fields.update(changes)
    signed = pack(fields)
    return pack({"m": signed, "g": identity.sign(hashlib.sha256(signed).digest())})


def test_compressed_norm_is_the_dense_vector_s():
    c = compress(BASE, FRAGMENT, CONFIG.bits)
    assert compressed_norm(c, FRAGMENT) == pytest.approx(float(decompress(c, FRAGMENT).norm()), rel=1e-6)


def test_evidence_of_a_signed_lie_holds(cast):
    s = cast["signed"]
    evidence = _evidence(s["liar"], s["a"], s["b"])
    norms = check_fragment_evidence(evidence, run_id=RUN, config=CONFIG)
    assert norms.ratio == pytest.approx(1000.0, rel=0.05) and len(norms.witnesses) == 2
    # with four witnesses, and after the wire: what the authorizer parses is what the replica built
    again = FragmentEvidence.model_validate(unpack(pack(to_body(_evidence(s["liar"], s["a"], s["b"], s["c"])))))
    assert check_fragment_evidence(again, run_id=RUN, config=CONFIG).ratio == pytest.approx(1000.0, rel=0.05)
    # a liar that sends too little is as caught as one that sends too much
    tiny = _signed(cast["liar"], _wire(cast["liar"], 1e-4))
    assert check_fragment_evidence(_evidence(tiny, s["a"], s["b"]), run_id=RUN, config=CONFIG).ratio < 1e-3


def test_a_forged_fragment_is_refused(cast):
    s, liar, a = cast["signed"], cast["liar"], cast["a"]
    fields = unpack(unpack(s["liar"].data)["m"])
    scales = np.frombuffer(fields["x"], dtype="<f4") * 3
    forged = pack({"m": pack({**fields, "x": scales.astype("<f4").tobytes()}), "g": unpack(s["liar"].data)["g"]})
    _refused("bad_signature", _evidence(SignedFragment(peer_id=_peer(liar), data=forged), s["a"], s["b"]))
    # a reporter's own lie, presented as another replica's
    framed = SignedFragment(peer_id=_peer(liar), data=_wire(a, 1000.0))
    _refused("bad_signature", _evidence(framed, s["b"], s["c"]))
    # a fragment naming the liar as its sender but signed by someone else
    renamed = _resigned(s["a"].data, a, p=_peer(liar))
    _refused("bad_signature", _evidence(SignedFragment(peer_id=_peer(liar), data=renamed), s["b"], s["c"]))


def test_an_accused_within_the_ratio_is_not_convicted(cast):
    s = cast["signed"]
    near = _signed(cast["liar"], _wire(cast["liar"], 5.0))  # refused by nobody's screen at ratio 10 either
    error = _refused("accused_agrees", _evidence(near, s["a"], s["b"]))
    assert "within 10x" in str(error)


def test_witnesses_that_disagree_prove_nothing(cast):
    s = cast["signed"]
    loud = _signed(cast["b"], _wire(cast["b"], 50.0))
    _refused("witnesses_disagree", _evidence(s["liar"], s["a"], loud))
    _refused("witnesses_disagree", _evidence(s["liar"], s["a"], s["b"], _signed(cast["c"], _wire(cast["c"], 0.0))))


def test_evidence_for_another_run_or_a_duplicate_sender_is_refused(cast):
    s = cast["signed"]
    _refused("wrong_run", _evidence(s["liar"], s["a"], s["b"]), run_id="another-run")
    # fragments signed for another run, in evidence that names this one
    other = {k: _signed(cast[k], _wire(cast[k], 1000.0 if k == "liar" else 1.0, run_id="another-run"))
             for k in ("liar", "a", "b")}
    _refused("mismatched_fragment", _evidence(other["liar"], other["a"], other["b"]))
    _refused("duplicate_party", _evidence(s["liar"], s["a"], s["a"]))
    _refused("duplicate_party", _evidence(s["liar"], s["liar"], s["a"]))


def test_fragments_of_other_rounds_fragments_or_layouts_are_refused(cast):
    s = cast["signed"]
    later = _signed(cast["b"], _wire(cast["b"], round_id=ROUND + 5))
    _refused("mismatched_fragment", _evidence(s["liar"], s["a"], later))
    _refused("mismatched_fragment", _evidence(s["liar"], s["a"], s["b"], round=ROUND + 5))
    _refused("mismatched_fragment", _evidence(s["liar"], s["a"], s["b"], fragment=0))
    _refused("mismatched_fragment", _evidence(s["liar"], s["a"], s["b"], fragment=7))
    _refused("mismatched_fragment", _evidence(s["liar"], s["a"], s["b"], tensor_shapes=[[64, 64], [64], [96, 64]]))
    _refused("mismatched_fragment", _evidence(s["liar"], s["a"], s["b"], tensor_shapes=[[64, 64], [64]]))
    _refused("mismatched_fragment", _evidence(SignedFragment(peer_id=s["liar"].peer_id, data=b"\xc1" * 64),
                                              s["a"], s["b"]))


def test_sizes_are_bounded():
    from pydantic import ValidationError

    one = SignedFragment(peer_id="p", data=b"x")
    with pytest.raises(ValidationError):
        _evidence(one, one)  # one witness: a word against a word
    with pytest.raises(ValidationError):
        _evidence(one, *[one] * 5)
    with pytest.raises(ValidationError):
        SignedFragment(peer_id="p", data=b"x" * (12 << 20))
    with pytest.raises(ValidationError):  # the authorizer stores it in a signed 64-bit column
        _evidence(one, one, one, round=1 << 63)


def test_the_envelope_carries_either_kind_and_a_spot_check_s_as_before(cast):
    reporter = _identity()
    spot = spot_check_evidence(_identity(), [_identity(), _identity()])
    report, parsed = parse_evidence_report(evidence_report_body(spot, reporter))
    assert isinstance(parsed, Evidence) and report.evidence == to_body(spot) and report.evidence["kind"] == "output"
    assert torch.equal(parsed.accused.result, spot.accused.result) and parsed.version == spot.version
    s = cast["signed"]
    fragment = _evidence(s["liar"], s["a"], s["b"])
    report, parsed = parse_evidence_report(evidence_report_body(fragment, reporter, signed_at=1000.0))
    assert isinstance(parsed, FragmentEvidence) and parsed == fragment and report.evidence["kind"] == "fragment"
    # the reporter's signature covers the evidence's wire map, whichever kind
    signed = report_signing_bytes(RUN, report.evidence, report.signed_at)
    assert verify_peer_signature(reporter.peer_id, signed, report.signature)
    tampered = {**report.evidence, "round": ROUND + 1}
    assert not verify_peer_signature(reporter.peer_id, report_signing_bytes(RUN, tampered, 1000.0), report.signature)


def test_witnesses_are_the_largest_agreeing_group_nearest_this_replica():
    norms = {"own": 1.0, "x": 1.5, "y": 0.8, "z": 30.0, "w": 2.0, "v": 0.9}
    chosen = choose_witnesses(norms, ratio=10.0, own="own")
    assert chosen[0] == "own" and len(chosen) == 4 and "z" not in chosen
    assert choose_witnesses({"own": 1.0, "x": 50.0}, ratio=10.0, own="own") in (["own"], ["x"])
    assert choose_witnesses({"own": 0.0}, ratio=10.0, own="own") == []


def test_a_replica_reports_a_refused_fragment_once_per_round_and_survives_failures(cast, caplog):
    own = cast["a"]
    sent: list[FragmentEvidence] = []

    async def report(evidence):
        sent.append(evidence)
        return "upheld"

    def screened(round_id: int):
        """What a screen of `round_id` hands the reporter: the liar's refused, a's (own) and b's good."""
        wires = {k: _signed(cast[k], _wire(cast[k], 1000.0 if k == "liar" else 1.0, round_id=round_id, seed=i))
                 for i, k in enumerate(("liar", "a", "b"))}
        c = {k: compressed_norm(compress(BASE, FRAGMENT, 2), FRAGMENT) * (1000 if k == "liar" else 1) for k in wires}
        return ({wires["liar"].peer_id: (wires["liar"].data, c["liar"])},
                {wires[k].peer_id: (wires[k].data, c[k]) for k in ("a", "b")})

    reporter = FragmentReporter(run_id=RUN, stage=STAGE, layout=LAYOUT, config=CONFIG, self_id=_peer(own),
                                report=report)
    refused, good = screened(ROUND)
    [evidence] = reporter.evidence(ROUND, FRAGMENT.index, refused, good)
    assert evidence.accused.peer_id == _peer(cast["liar"]) and [w.peer_id for w in evidence.witnesses] == [
        _peer(own), _peer(cast["b"])]  # this replica's own first
    assert reporter.evidence(ROUND, FRAGMENT.index, refused, good) == []  # once per accused and round
    assert asyncio.run(reporter.send(evidence)) == "upheld" and sent == [evidence]
    # its own fragment alone is no evidence
    refused, good = screened(ROUND + 5)
    assert reporter.evidence(ROUND + 5, FRAGMENT.index, refused, {_peer(own): good[_peer(own)]}) == []

    async def unreachable(evidence):
        raise ConnectionError("the authorizer is down")

    reporter.report = unreachable
    refused, good = screened(ROUND + 10)
    [later] = reporter.evidence(ROUND + 10, FRAGMENT.index, refused, good)
    with caplog.at_level(logging.WARNING):
        assert asyncio.run(reporter.send(later)) is None
    assert "could not report" in caplog.text and "ConnectionError" in caplog.text
    # evidence its own check refuses is not sent: here fragments of round 15 as round 25's
    refused, good = screened(ROUND)
    [unproven] = reporter.evidence(ROUND + 20, FRAGMENT.index, refused, good)
    assert asyncio.run(reporter.send(unproven)) is None
    assert reporter.counts == {"upheld": 1, "failed": 1, "unproven": 1} and len(sent) == 1


def test_a_run_that_does_not_average_with_sparseloco_takes_no_fragment_evidence(cast):
    from authorizer.evidence import _check
    from protocol.run_config import load_run_config

    s = cast["signed"]
    evidence = _evidence(s["liar"], s["a"], s["b"])
    with pytest.raises(EvidenceRejected) as caught:
        _check(evidence, load_run_config("tiny", {"run_id": RUN}))
    assert caught.value.reason == "wrong_run" and "not SparseLoCo" in str(caught.value)
    sloco = load_run_config("tiny", {"run_id": RUN, "averaging": {
        "method": "sparseloco", "sparseloco": CONFIG.model_dump(exclude_none=True)}})
    assert _check(evidence, sloco) == (pytest.approx(1000.0, rel=0.05),)
