"""Spot checks on the workers path without a network (roles/trainer/chain_checks.py): the hops of a
chained sample are checked with what the checked worker's neighbours kept, never asking the worker
itself; a signature that does not bind the neighbours' records decides nothing; a record no longer
kept is counted; the hop handed over is evidence; and an excluded worker is left off chained routes."""

from __future__ import annotations

import asyncio
import random
import types

import torch
from cryptography.hazmat.primitives.asymmetric import ed25519

from protocol.errors import ErrorCode, RemoteError
from protocol.evidence import Evidence, SignedResult, check_evidence, loss_tensor, result_signing_bytes, tensor_digest
from protocol.identity import Identity
from protocol.messages import ChainReply, ChainStage, HopRecordReply, SignedHop
from protocol.run_config import RoutingConfig
from roles.trainer.chain_checks import ChainChecks
from roles.trainer.chained import ChainedRouting
from roles.trainer.discovery import WorkerDiscovery
from roles.trainer.spot_checks import SpotChecks
from tests.unit.test_chain_routing import _driver

RUN = "run-c"
TOKENS = torch.arange(8)
X = torch.linspace(-1, 1, 32).reshape(8, 4)  # the head's output, the body's input
Y = torch.linspace(0, 1, 32).reshape(8, 4)  # the body's output, the tail's input
G2 = torch.linspace(1, 2, 32).reshape(8, 4)  # the tail's input gradient
G1 = torch.linspace(2, 3, 32).reshape(8, 4)  # the body's input gradient
LOSS = 2.5
VERSION = 4


def _identity() -> Identity:
    return Identity(ed25519.Ed25519PrivateKey.generate(), "")


def _hop(identity, stage, kind, coords, grad_output, result) -> SignedHop:
    signature = identity.sign(result_signing_bytes(RUN, stage, VERSION, kind, TOKENS, coords, grad_output, result))
    return SignedHop(peer_id=identity.peer_id.to_base58(), stage=stage, version=VERSION,
                     coords_digest=tensor_digest(coords), grad_output_digest=tensor_digest(grad_output),
                     result_digest=tensor_digest(result), attestation=signature)


class _Chain:
    """A head, a body and a tail that ran one sample honestly, and what each kept of it."""

    def __init__(self):
        self.head, self.body, self.tail = _identity(), _identity(), _identity()
        self.ids = [w.peer_id.to_base58() for w in (self.head, self.body, self.tail)]
        head_out = _hop(self.head, 0, "output", None, None, X)
        body_out = _hop(self.body, 1, "output", X, None, Y)
        tail_grad = _hop(self.tail, 2, "gradient", Y, None, G2)
        body_grad = _hop(self.body, 1, "gradient", X, G2, G1)
        self.records = {
            (0, "coords_sent"): (X, head_out), (0, "gradient_received"): (G1, body_grad),
            (1, "coords_received"): (X, head_out), (1, "coords_sent"): (Y, body_out),
            (1, "gradient_received"): (G2, tail_grad), (1, "gradient_sent"): (G1, body_grad),
            (2, "coords_received"): (Y, body_out), (2, "gradient_sent"): (G2, tail_grad),
        }
        self.asked: list[tuple[str, str]] = []
        self.reply = ChainReply(
            stages=[ChainStage(stage=s, worker=w, version=VERSION, elapsed_s=0.1) for s, w in enumerate(self.ids)],
            loss=LOSS, step=0, signed_loss=_hop(self.tail, 2, "loss", Y, None, loss_tensor(LOSS)))

    async def fetch(self, stage, peer, request):
        assert peer == self.ids[stage] and request.run_id == RUN and request.sample_id == "t-1"
        self.asked.append((peer, request.which))
        if (stage, request.which) not in self.records:
            raise RemoteError("not kept", ErrorCode.NOT_KEPT)
        tensor, signed = self.records[(stage, request.which)]
        return HopRecordReply(tensor=tensor, signed=signed)


def _checks(chain: _Chain, draw=None):
    spot = SpotChecks(1.0, 0.02, evaluate=None, replicas=lambda stage: [], rng=random.Random(0), run_id=RUN)
    handed = []
    spot.check_forward = lambda *args: handed.append(("output", *args))
    spot.check_backward = lambda *args: handed.append(("gradient", *args))
    spot.check_loss = lambda *args: handed.append(("loss", *args))
    if draw is not None:
        spot.draw = draw
    return ChainChecks(spot, chain.fetch, run_id=RUN, num_stages=3), spot, handed


def _run(checks: ChainChecks, chain: _Chain) -> None:
    async def main():
        checks.on_sample("t-1", TOKENS, chain.reply)
        await asyncio.gather(*checks._tasks)

    asyncio.run(main())


def test_every_drawn_hop_is_handed_over_with_what_its_neighbours_kept():
    chain = _Chain()
    checks, spot, handed = _checks(chain)
    _run(checks, chain)
    head, body, tail = chain.ids
    by_hop = {(kind, args[0]): args for kind, *args in handed}
    assert sorted(by_hop) == [("gradient", 1), ("gradient", 2), ("loss", 2), ("output", 0), ("output", 1)]
    stage, worker, tokens, coords, output, version, attestation, weights = by_hop[("output", 1)]
    assert worker == body and torch.equal(coords, X) and torch.equal(output, Y) and version == VERSION
    stage, worker, tokens, coords, grad_output, grad_input, *_ = by_hop[("gradient", 1)]
    assert torch.equal(coords, X) and torch.equal(grad_output, G2) and torch.equal(grad_input, G1)
    stage, worker, tokens, coords, grad_output, grad_input, *_ = by_hop[("gradient", 2)]
    assert worker == tail and torch.equal(coords, Y) and grad_output is None and torch.equal(grad_input, G2)
    assert by_hop[("loss", 2)][4] == LOSS and by_hop[("output", 0)][3] is None
    assert checks.counters["handed"] == 5 and spot.stats.outcomes["unbound"] == 0
    assert len(chain.asked) == len(set(chain.asked)), "each record is asked once per sample"


def test_the_checked_worker_is_asked_nothing_of_its_own_hops():
    chain = _Chain()
    body = chain.ids[1]
    checks, _, handed = _checks(chain, draw=lambda stage, worker, *_, **__: worker == body)
    _run(checks, chain)
    assert {(kind, args[1]) for kind, *args in handed} == {("output", body), ("gradient", body)}
    assert chain.asked and all(peer != body for peer, _ in chain.asked), chain.asked


def test_a_neighbours_record_the_signature_does_not_bind_decides_nothing():
    chain = _Chain()
    head, body, tail = chain.ids
    _, signed = chain.records[(2, "coords_received")]
    chain.records[(2, "coords_received")] = (Y * 3, signed)  # the tail says it got another output
    checks, spot, handed = _checks(chain, draw=lambda stage, worker, *_, **__: worker == body)
    _run(checks, chain)
    assert [kind for kind, *_ in handed] == ["gradient"], "the output is not checked, the gradient is"
    assert spot.stats.outcomes["unbound"] == 1 and checks.unbound == {body: 1}
    assert spot.summary()["unbound"] == 1 and checks.summary()["unbound_by_worker"] == {body: 1}


def test_a_record_no_longer_kept_is_counted_and_decides_nothing():
    chain = _Chain()
    del chain.records[(2, "coords_received")]
    checks, spot, handed = _checks(chain, draw=lambda stage, worker, *_, **__: worker == chain.ids[1])
    _run(checks, chain)
    assert [kind for kind, *_ in handed] == ["gradient"]
    assert spot.summary()["not_kept"] == 1 and checks.counters["fetch_not_kept"] == 1


def test_a_lie_passed_along_the_chain_becomes_evidence_the_authorizer_can_check():
    chain = _Chain()
    lie = Y * 3
    chain.records[(2, "coords_received")] = (lie, _hop(chain.body, 1, "output", X, None, lie))
    checks, _, handed = _checks(chain, draw=lambda stage, worker, *_, **__: (stage, worker) == (1, chain.ids[1]))
    _run(checks, chain)
    [(_, stage, worker, tokens, coords, output, version, attestation, weights)] = [
        h for h in handed if h[0] == "output"]
    replica = _identity()
    honest = replica.sign(result_signing_bytes(RUN, 1, VERSION, "output", TOKENS, X, None, Y))
    evidence = Evidence(run_id=RUN, stage=1, version=VERSION, weights=weights, kind="output", tokens=tokens,
                        coords=coords, accused=SignedResult(peer_id=worker, result=output, attestation=attestation),
                        witnesses=[SignedResult(peer_id=replica.peer_id.to_base58(), result=Y, attestation=honest)])
    assert check_evidence(evidence, run_id=RUN, tolerance=0.02)[0] > 1.0


def test_no_hop_is_drawn_with_checks_off_and_a_full_pipeline_of_checks_counts_busy():
    chain = _Chain()
    checks, spot, handed = _checks(chain)
    spot.rate = 0.0
    _run(checks, chain)
    assert not handed and not chain.asked
    spot.rate = 1.0
    checks._tasks.update(object() for _ in range(8))  # as many checks in flight as allowed
    checks.on_sample("t-1", TOKENS, chain.reply)
    assert checks.counters["busy"] == 5 and spot.stats.outcomes["busy"] == 5


def test_an_excluded_worker_is_left_off_every_chained_route():
    driver = _driver([["h1", "h2"], ["b1", "b2"], ["t1", "t2"]])
    discovery = WorkerDiscovery(swarm=None, run_id=RUN, balancers=driver.balancers, period_s=1.0)
    record = types.SimpleNamespace(throughput=10.0, max_batch=1, started_at=None)
    discovery.records = [{peer: record for peer in peers} for peers in (["h1", "h2"], ["b1", "b2"], ["t1", "t2"])]
    discovery.exclude(1, "b2", "caught lying")
    chained = ChainedRouting(driver, RoutingConfig(path="workers", candidates=3), run_id=RUN)
    for _ in range(20):
        hops, _ = chained._route()
        assert all("b2" not in hop.workers for hop in hops), hops
        assert hops[1].workers == ["b1"]
        chained._settle(hops, [])
