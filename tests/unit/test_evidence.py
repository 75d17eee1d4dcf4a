"""Workers sign every result; a spot check a third replica settles becomes evidence that anyone can
verify from the peer ids alone, and that no tampering survives."""

import asyncio
import random

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import ed25519

from protocol.evidence import Evidence, EvidenceRejected, SignedResult, check_evidence, result_signing_bytes
from protocol.identity import Identity, verify_peer_signature
from protocol.messages import EvaluateReply, EvaluateRequest
from roles.trainer.spot_checks import SpotChecks
from roles.worker.serving.handlers import WorkerHandlers
from tests.unit.test_adversary import TAIL, coords, make_runtime, tokens

RUN = "run-e"
TOKENS = torch.arange(8)
INPUT = torch.linspace(-1, 1, 32).reshape(8, 4)
TRUE = torch.linspace(0, 1, 32).reshape(8, 4)


def _identity() -> Identity:
    return Identity(ed25519.Ed25519PrivateKey.generate(), "")


def _signed(identity, result, stage=1, version=3, kind="output", tokens=TOKENS, coords=INPUT):
    signature = identity.sign(result_signing_bytes(RUN, stage, version, kind, tokens, coords, None, result))
    return SignedResult(peer_id=identity.peer_id.to_base58(), result=result, attestation=signature)


def _evidence(liar, honest, lie=TRUE * 3, **changes):
    fields = dict(run_id=RUN, stage=1, version=3, kind="output", tokens=TOKENS, coords=INPUT,
                  accused=_signed(liar, lie), witnesses=[_signed(h, TRUE.clone()) for h in honest])
    fields.update(changes)
    return Evidence(**fields)


def test_evidence_of_a_lie_holds_and_every_tampering_is_refused():
    liar, a, b = _identity(), _identity(), _identity()
    evidence = _evidence(liar, [a, b])
    assert check_evidence(evidence, run_id=RUN, tolerance=0.02) == (pytest.approx(2.0), pytest.approx(2.0))
    # it survives the wire: what the authorizer parses is what the trainer built
    assert check_evidence(Evidence.model_validate(evidence.model_dump()), run_id=RUN, tolerance=0.02)

    def refused(reason, bad):
        with pytest.raises(EvidenceRejected) as caught:
            check_evidence(bad, run_id=RUN, tolerance=0.02)
        assert caught.value.reason == reason

    forged = evidence.accused.model_copy(update={"result": TRUE * 4})  # not what the liar signed
    refused("bad_signature", evidence.model_copy(update={"accused": forged}))
    framed = _signed(a, TRUE * 3).model_copy(update={"peer_id": liar.peer_id.to_base58()})  # signed by another
    refused("bad_signature", evidence.model_copy(update={"accused": framed}))
    refused("bad_signature", evidence.model_copy(update={"version": 4}))  # signed for another version
    refused("bad_signature", evidence.model_copy(update={"coords": INPUT * 2}))  # or another input
    refused("witnesses_disagree", _evidence(liar, [a, b]).model_copy(
        update={"witnesses": [_signed(a, TRUE.clone()), _signed(b, TRUE * 2)]}))
    refused("accused_agrees", _evidence(liar, [a, b], lie=TRUE * 1.001))
    refused("duplicate_party", _evidence(liar, [a, a]))
    with pytest.raises(EvidenceRejected, match="run"):
        check_evidence(evidence, run_id="another-run", tolerance=0.02)


def test_a_worker_signs_what_it_evaluates_and_the_signature_covers_the_result():
    identity = _identity()
    runtime = make_runtime(TAIL)
    handlers = WorkerHandlers(runtime, info=None, serving=lambda: True, run_id=RUN, sign=identity.sign)
    request = EvaluateRequest(stage=TAIL, sample_id="e1", tokens=tokens(0), coords=coords(0), input_grad=True)
    reply = asyncio.run(handlers.evaluate(identity.peer_id, request.model_dump()))
    signed = result_signing_bytes(RUN, TAIL, reply.version, "gradient", request.tokens, request.coords, None,
                                  reply.grad_input, reply.weights)
    assert len(reply.weights) == 8 and verify_peer_signature(identity.peer_id, signed, reply.attestation)
    for forged in (dict(result=reply.grad_input * 2), dict(weights=bytes(8))):  # another result, other weights
        fields = {"result": reply.grad_input, "weights": reply.weights, **forged}
        assert not verify_peer_signature(identity.peer_id, result_signing_bytes(
            RUN, TAIL, reply.version, "gradient", request.tokens, request.coords, None, **fields), reply.attestation)
    unsigned = WorkerHandlers(runtime, info=None, serving=lambda: True)
    assert asyncio.run(unsigned.evaluate(identity.peer_id, request.model_dump())).attestation is None


def _signing_replicas(weights_of, replicas=3, lie=lambda: TRUE * 3):
    """`replicas` replicas, the first a liar answering `lie()` (x3 by default), the others the
    truth; `weights_of(peer)` is the fingerprint each names."""
    liar, *others = [_identity() for _ in range(replicas)]
    ids = {identity.peer_id.to_base58(): identity for identity in (liar, *others)}
    liar_id = liar.peer_id.to_base58()

    async def evaluate(stage, peer, request):
        result = lie() if peer == liar_id else TRUE.clone()
        signature = ids[peer].sign(result_signing_bytes(RUN, stage, 3, "output", request.tokens, request.coords,
                                                        None, result, weights_of(peer)))
        return EvaluateReply(coords=result, version=3, weights=weights_of(peer), attestation=signature)
    return liar, ids, evaluate


def _run_checks(evaluate, ids, liar, weights, checks=3):
    reported = []

    async def report(evidence):
        reported.append(evidence)
        return "upheld"

    async def main():
        spot = SpotChecks(1.0, 0.02, evaluate, lambda stage: list(ids), random.Random(0), run_id=RUN,
                          report_evidence=report)
        claim = liar.sign(result_signing_bytes(RUN, 1, 3, "output", TOKENS, INPUT, None, TRUE * 3, weights))
        for _ in range(checks):
            spot.check_forward(1, liar.peer_id.to_base58(), TOKENS, INPUT, TRUE * 3, 3, claim, weights)
            while spot._tasks:
                await asyncio.sleep(0)
        return spot
    return asyncio.run(main()), reported


def test_a_verdict_of_a_third_replica_is_reported_once_with_evidence_that_holds():
    same = b"weights1"
    liar, ids, evaluate = _signing_replicas(lambda peer: same)
    liar_id = liar.peer_id.to_base58()
    checks, reported = _run_checks(evaluate, ids, liar, same)
    assert [d.struck for d in checks.stats.disputes] == [liar_id] * 3 and checks.stats.evidence == {"upheld": 1}
    [evidence] = reported
    assert evidence.accused.peer_id == liar_id and evidence.weights == same
    assert {w.peer_id for w in evidence.witnesses} == set(ids) - {liar_id}
    assert check_evidence(evidence, run_id=RUN, tolerance=0.02) == (pytest.approx(2.0), pytest.approx(2.0))
    forged = evidence.model_copy(update={"weights": b"weights2"})  # the fingerprint is signed too
    with pytest.raises(EvidenceRejected, match="did not sign"):
        check_evidence(forged, run_id=RUN, tolerance=0.02)


def test_replicas_that_name_other_weights_at_the_same_version_are_not_compared():
    liar, ids, evaluate = _signing_replicas(lambda peer: b"parted!!")  # every replica but the checked one
    checks, reported = _run_checks(evaluate, ids, liar, b"weights1")
    assert checks.stats.outcomes["diverged"] == 3 and not checks.stats.disputes and reported == []


def test_a_third_replica_says_which_of_two_parted_and_that_one_is_routed_around():
    routed_around = []

    def run(weights_of, claimed_weights):
        liar, ids, evaluate = _signing_replicas(weights_of)

        async def main():
            spot = SpotChecks(1.0, 0.02, evaluate, lambda stage: list(ids), random.Random(0), run_id=RUN,
                              route_around=lambda stage, peer: routed_around.append(peer))
            spot.check_forward(1, liar.peer_id.to_base58(), TOKENS, INPUT, TRUE * 3, 3, None, claimed_weights)
            while spot._tasks:
                await asyncio.sleep(0)
            return spot
        return liar.peer_id.to_base58(), asyncio.run(main())
    # the checked worker names weights its two replicas do not hold: it is the one that parted
    worker, spot = run(lambda peer: b"stage's!", b"its own!")
    assert dict(spot.stats.parted) == {worker: 1} and routed_around == [worker] and not spot.stats.strikes
    # the two others disagree with each other too: nobody is singled out
    routed_around.clear()
    fresh, named = iter([b"first!!!", b"second!!", b"third!!!"]), {}
    worker, spot = run(lambda peer: named.setdefault(peer, next(fresh)), b"its own!")
    assert not spot.stats.parted and routed_around == []


def test_with_two_replicas_the_exclusion_is_reported_with_the_pair_s_contradiction():
    """No third replica: the loss decides, and when the strikes exclude the liar the trainer sends
    the two signed results (one witness); the authorizer holds such evidence to its quorum."""
    same = b"weights1"
    liar, ids, evaluate = _signing_replicas(lambda peer: same)
    liar_id = liar.peer_id.to_base58()
    pair = [liar_id, next(p for p in ids if p != liar_id)]
    reported = []

    async def report(evidence):
        reported.append(evidence)
        return "pending"

    async def losses(stage, tokens, outputs):
        return [3.0 if torch.equal(out, TRUE * 3) else 2.0 for out in outputs]

    async def main():
        spot = SpotChecks(1.0, 0.02, evaluate, lambda stage: list(pair), random.Random(0), run_id=RUN,
                          report_evidence=report, losses=losses)
        claim = liar.sign(result_signing_bytes(RUN, 1, 3, "output", TOKENS, INPUT, None, TRUE * 3, same))
        for _ in range(4):
            spot.check_forward(1, liar_id, TOKENS, INPUT, TRUE * 3, 3, claim, same)
            while spot._tasks:
                await asyncio.sleep(0)
        return spot

    checks = asyncio.run(main())
    assert [d.struck for d in checks.stats.disputes] == [liar_id] * 4 and not any(d.arbiter for d in checks.stats.disputes)
    assert list(checks.stats.excluded) == [liar_id] and checks.stats.evidence == {"pending": 1}
    [evidence] = reported  # once, at the exclusion
    assert evidence.accused.peer_id == liar_id and [w.peer_id for w in evidence.witnesses] == [pair[1]]
    assert check_evidence(evidence, run_id=RUN, tolerance=0.02) == (pytest.approx(2.0),)
    refused = evidence.model_copy(update={"accused": evidence.witnesses[0], "witnesses": [evidence.accused]})
    assert check_evidence(refused, run_id=RUN, tolerance=0.02)  # the pair alone cannot say who lied: the verdict can


def test_a_side_whose_second_answer_contradicts_its_first_is_struck_and_proves_it_itself():
    """A liar adding fresh noise to every answer: asked the same hop again, it contradicts itself,
    which an honest (deterministic) worker never does; no third replica, no loss measurement."""
    noise = torch.Generator().manual_seed(0)

    def lie():
        return TRUE + torch.randn(TRUE.shape, generator=noise) * 0.1

    liar, ids, evaluate = _signing_replicas(lambda peer: b"weights1", replicas=2, lie=lie)
    liar_id = liar.peer_id.to_base58()
    honest = ids[next(p for p in ids if p != liar_id)]

    reported = []

    async def report(evidence):
        reported.append(evidence)
        return "upheld"

    async def main():
        spot = SpotChecks(1.0, 0.02, evaluate, lambda stage: list(ids), random.Random(0), run_id=RUN,
                          report_evidence=report)
        claimed = lie()
        claim = liar.sign(result_signing_bytes(RUN, 1, 3, "output", TOKENS, INPUT, None, claimed, b"weights1"))
        spot.check_forward(1, liar_id, TOKENS, INPUT, claimed, 3, claim, b"weights1")
        while spot._tasks:
            await asyncio.sleep(0)
        return spot

    checks = asyncio.run(main())
    [dispute] = checks.stats.disputes
    assert dispute.struck == liar_id and dispute.self_contradiction and dispute.measures[1] == 0.0
    [evidence] = reported
    assert evidence.self_contradiction and evidence.accused.peer_id == liar_id
    assert check_evidence(evidence, run_id=RUN, tolerance=0.02)[0] > 0.02
    with pytest.raises(EvidenceRejected, match="within tolerance"):  # an honest worker's two answers agree
        check_evidence(_evidence(honest, [honest], lie=TRUE.clone()), run_id=RUN, tolerance=0.02)
