"""Spot checks compare a worker's reply with another replica's re-execution at the same version."""

import asyncio
import random

import torch

from protocol.messages import EvaluateReply
from roles.trainer.spot_checks import CHECKS_IN_FLIGHT_MAX, SpotChecks

TOKENS = torch.zeros(8, dtype=torch.int32)
OUT = torch.linspace(-1, 1, 32).reshape(8, 4)


def _checks(answer, replicas=("honest-b",), rate=1.0, tolerance=0.01):
    asked = []

    async def evaluate(stage, peer, request):
        asked.append((stage, peer, request))
        return answer(peer)

    checks = SpotChecks(rate, tolerance, evaluate, lambda stage: ["worker-a", *replicas], random.Random(0))
    return checks, asked


async def _settle(checks):
    while checks._tasks:
        await asyncio.sleep(0)


def test_an_equal_output_at_the_same_version_agrees_and_goes_to_another_replica():
    async def main():
        checks, asked = _checks(lambda peer: EvaluateReply(coords=OUT.clone(), version=7))
        checks.check_forward(1, "worker-a", TOKENS, None, OUT, 7)
        await _settle(checks)
        return checks, asked
    checks, asked = asyncio.run(main())
    assert checks.stats.outcomes["agreed"] == 1 and not checks.stats.disputes
    assert [peer for _, peer, _ in asked] == ["honest-b"]  # never the checked worker itself
    assert asked[0][2].sample_id.startswith("check-")  # the checked sample's id is not sent


def test_a_scaled_output_is_a_dispute_naming_both_parties():
    async def main():
        checks, _ = _checks(lambda peer: EvaluateReply(coords=OUT.clone(), version=7))
        checks.check_forward(1, "worker-a", TOKENS, None, OUT * 3, 7)
        checks.check_forward(1, "worker-a", TOKENS, None, OUT * float("nan"), 7)
        await _settle(checks)
        return checks
    checks = asyncio.run(main())
    assert checks.stats.outcomes["disputed"] == 2
    dispute = checks.stats.disputes[0]
    assert (dispute.stage, dispute.worker, dispute.checker, dispute.version) == (1, "worker-a", "honest-b", 7)
    assert abs(dispute.distance - 2.0) < 1e-6


def test_another_version_a_missing_replica_or_a_failing_one_decides_nothing():
    async def main():
        stale, _ = _checks(lambda peer: EvaluateReply(coords=OUT * 3, version=8))
        stale.check_forward(0, "worker-a", TOKENS, None, OUT, 7)
        alone, _ = _checks(lambda peer: EvaluateReply(coords=OUT, version=7), replicas=())
        alone.check_forward(0, "worker-a", TOKENS, None, OUT, 7)
        alone.check_forward(0, "worker-a", TOKENS, None, OUT, None)  # a worker that does not say its version

        def fail(peer):
            raise ConnectionError("gone")
        failing, _ = _checks(fail)
        failing.check_forward(0, "worker-a", TOKENS, None, OUT, 7)
        for checks in (stale, alone, failing):
            await _settle(checks)
        return stale, alone, failing
    stale, alone, failing = asyncio.run(main())
    assert dict(stale.stats.outcomes) == {"stale": 1}
    assert dict(alone.stats.outcomes) == {"unchecked": 2}
    assert dict(failing.stats.outcomes) == {"failed": 1}


def test_the_tails_loss_is_checked_against_the_replicas():
    async def main():
        checks, _ = _checks(lambda peer: EvaluateReply(loss=2.0, version=3))
        checks.check_loss(2, "worker-a", TOKENS, OUT, 2.0, 3)
        checks.check_loss(2, "worker-a", TOKENS, OUT, 0.5, 3)  # a tail that says its loss is lower
        await _settle(checks)
        return checks
    checks = asyncio.run(main())
    assert checks.stats.outcomes["agreed"] == 1 and checks.stats.outcomes["disputed"] == 1
    assert abs(checks.stats.disputes[0].distance - 0.75) < 1e-9


def test_checks_in_flight_are_bounded_and_the_rate_is_honoured():
    async def main():
        gate = asyncio.Event()

        async def evaluate(stage, peer, request):
            await gate.wait()
            return EvaluateReply(coords=OUT, version=1)

        checks = SpotChecks(1.0, 0.01, evaluate, lambda stage: ["worker-a", "b"], random.Random(0))
        for _ in range(CHECKS_IN_FLIGHT_MAX + 5):
            checks.check_forward(0, "worker-a", TOKENS, None, OUT, 1)
        await asyncio.sleep(0)
        busy = checks.stats.outcomes["busy"]
        gate.set()
        await _settle(checks)
        await checks.close()
        return busy, checks
    busy, checks = asyncio.run(main())
    assert busy == 5 and checks.stats.outcomes["agreed"] == CHECKS_IN_FLIGHT_MAX
    drawn = SpotChecks(0.01, 0.01, None, lambda stage: [], random.Random(1))
    assert 50 <= sum(drawn.draw() for _ in range(10_000)) <= 150
    assert not any(SpotChecks(0.0, 0.01, None, lambda stage: []).draw() for _ in range(1000))


def _referee_checks(losses_for, **kwargs):
    """The liar answers LIE, the honest replica HONEST; `losses_for(claimed)` gives the losses."""
    excluded = []

    async def evaluate(stage, peer, request):
        return EvaluateReply(coords=LIE if peer == "liar" else HONEST, version=1)

    async def losses(stage, tokens, outputs):
        return losses_for(outputs[0])

    checks = SpotChecks(1.0, 0.01, evaluate, lambda stage: ["liar", "honest"], random.Random(0), losses=losses,
                        exclude=lambda stage, peer, why: excluded.append((stage, peer)), **kwargs)
    return checks, excluded


def test_the_loss_puts_the_liar_in_the_wrong_whichever_side_it_is_on_and_excludes_it():
    async def main():
        checks, excluded = _referee_checks(lambda claimed: [3.0, 2.0] if claimed is LIE else [2.0, 3.0])
        checks.check_forward(1, "liar", TOKENS, None, LIE, 1)  # its lie checked by the honest replica
        await _settle(checks)
        checks.check_forward(1, "honest", TOKENS, None, HONEST, 1)  # the liar re-executes falsely
        await _settle(checks)
        assert excluded == []
        checks.check_forward(1, "liar", TOKENS, None, LIE, 1)
        await _settle(checks)
        return checks, excluded
    checks, excluded = asyncio.run(main())
    assert dict(checks.stats.strikes) == {"liar": 3} and excluded == [(1, "liar")]
    assert "3 spot-check disputes on stage 1" in checks.stats.excluded["liar"]
    assert checks.stats.summary()["strikes_by_mechanism"] == {"liar": {"loss": 3}}
    assert [d.struck for d in checks.stats.disputes] == ["liar"] * 3


def test_a_loss_within_the_margin_or_not_a_number_decides_nothing_and_favours_protect():
    async def main():
        close, _ = _referee_checks(lambda claimed: [2.0, 2.01], loss_margin=0.01)
        broken, _ = _referee_checks(lambda claimed: [float("nan"), 2.0])
        for checks in (close, broken):
            checks.check_forward(1, "liar", TOKENS, None, LIE, 1)
        # a worker the losses also cleared often is not excluded for a few strikes
        mixed, excluded = _referee_checks(lambda claimed: [3.0, 2.0])
        mixed.stats.favoured["liar"] = 1
        for _ in range(3):
            mixed.check_forward(1, "liar", TOKENS, None, LIE, 1)
            await _settle(mixed)
        for checks in (close, broken):
            await _settle(checks)
        return close, broken, mixed, excluded
    close, broken, mixed, excluded = asyncio.run(main())
    assert close.stats.outcomes["unresolved"] == 1 and not close.stats.strikes
    assert broken.stats.outcomes["unresolved"] == 1 and not broken.stats.strikes
    assert mixed.stats.strikes["liar"] == 3 and excluded == []  # 3 * 1 favour is not below 3 strikes


LIE = OUT * 3
HONEST = OUT * 2


def test_a_gradient_dispute_goes_against_the_gradient_whose_slopes_are_wrong():
    true_grad = torch.linspace(-1, 2, 32).reshape(8, 4)

    async def slopes(stage, tokens, coords, directions):  # what finite differences measure
        return [float(torch.dot(true_grad.flatten(), d.flatten())) for d in directions]

    async def main(claimed, replica_answer):
        async def evaluate(stage, peer, request):  # each side answers as it did (asked again, too)
            assert request.grad_output is not None and request.version == 4
            return EvaluateReply(coords=OUT, grad_input=claimed if peer == "a" else replica_answer, version=4)

        checks = SpotChecks(1.0, 0.01, evaluate, lambda stage: ["a", "b"], random.Random(0), slopes=slopes)
        checks.check_backward(1, "a", TOKENS, OUT, OUT, claimed, 4)
        await _settle(checks)
        return checks
    for claimed, replica, struck in [(-true_grad, true_grad, "a"), (torch.zeros_like(true_grad), true_grad, "a"),
                                     (true_grad, -true_grad, "b"), (true_grad, true_grad * 2, "b")]:
        checks = asyncio.run(main(claimed, replica))
        [dispute] = checks.stats.disputes
        assert dispute.kind == "gradient" and dispute.struck == struck, (struck, dispute)
    agreed = asyncio.run(main(true_grad, true_grad.clone()))
    assert agreed.stats.outcomes["agreed"] == 1


def test_a_loss_dispute_goes_against_the_tail_whose_losses_its_own_gradient_does_not_explain():
    async def main(errors):
        async def evaluate(stage, peer, request):
            return EvaluateReply(loss=6.0 if peer == "tail-a" else 2.0, version=3)

        async def consistency(stage, peer, tokens, coords):
            return errors[peer]

        checks = SpotChecks(1.0, 0.01, evaluate, lambda stage: ["tail-a", "tail-b"], random.Random(0),
                            consistency=consistency)
        checks.check_loss(2, "tail-a", TOKENS, OUT, 6.0, 3)  # a tail that says three times the loss
        await _settle(checks)
        return checks
    caught = asyncio.run(main({"tail-a": 2.0, "tail-b": 0.001}))
    [dispute] = caught.stats.disputes
    assert dispute.kind == "loss" and dispute.struck == "tail-a" and dispute.measures == (2.0, 0.001)
    framed = asyncio.run(main({"tail-a": 0.002, "tail-b": float("inf")}))  # the checker is the liar
    assert framed.stats.disputes[0].struck == "tail-b"
    unclear = asyncio.run(main({"tail-a": 0.3, "tail-b": 0.2}))
    assert unclear.stats.outcomes["unresolved"] == 1 and not unclear.stats.strikes


def test_stages_whose_replicas_differ_between_rounds_are_not_checked():
    async def main():
        asked = []

        async def evaluate(stage, peer, request):
            asked.append((stage, peer))
            return EvaluateReply(coords=OUT if peer == "a" else OUT * 5, version=1)

        checks = SpotChecks(1.0, 0.01, evaluate, lambda stage: ["a", "b"], random.Random(0),
                            equal_replicas=lambda stage: stage != 1)  # stage 1: SparseLoCo, say
        checks.check_forward(1, "a", TOKENS, None, OUT, 1)
        checks.check_forward(0, "a", TOKENS, None, OUT, 1)
        await _settle(checks)
        return checks, asked
    checks, asked = asyncio.run(main())
    # stage 0 only: the check, then each side asked again (both answer as before: no verdict from that)
    assert asked == [(0, "b"), (0, "a"), (0, "b")]
    assert checks.stats.outcomes["unchecked"] == 1 and checks.stats.outcomes["disputed"] == 1


def test_a_third_replica_decides_a_dispute_without_the_loss():
    measured = []

    async def main(checked, claimed, third_answer):
        async def evaluate(stage, peer, request):
            return EvaluateReply(coords={"liar": LIE, "honest": HONEST, "third": third_answer}[peer], version=1)

        async def losses(stage, tokens, outputs):
            measured.append(stage)
            return [2.0, 2.0]

        checks = SpotChecks(1.0, 0.01, evaluate, lambda stage: ["liar", "honest", "third"], random.Random(0),
                            losses=losses)
        # the checker is the other side of the dispute, the arbiter the one left
        checks._rng.choice = lambda peers: next(p for p in ("liar", "honest", "third") if p in peers)
        checks.check_forward(1, checked, TOKENS, None, claimed, 1)
        await _settle(checks)
        return checks
    for checked, claimed in [("liar", LIE), ("honest", HONEST)]:
        checks = asyncio.run(main(checked, claimed, HONEST.clone()))
        [dispute] = checks.stats.disputes
        assert dispute.struck == "liar" and dispute.arbiter == "third", dispute
        assert dispute.measures[dispute.worker != "liar"] > 0.01 and dispute.measures[dispute.worker == "liar"] == 0.0
    assert measured == []  # the loss was not needed
    neither = asyncio.run(main("liar", LIE, OUT))  # a third that matches no side: the loss decides (here: nothing)
    assert neither.stats.disputes[0].arbiter is None and neither.stats.outcomes["unresolved"] == 1 and measured == [1]


def test_one_strike_decided_by_a_third_replica_excludes_and_one_decided_by_the_loss_does_not():
    """A re-execution's verdict is evidence by itself: the liar goes at its first such strike
    (`exact_strikes_to_exclude`), while a strike measured on the loss waits for `strikes_to_exclude`."""

    async def main(replicas, **kwargs):
        excluded = []

        async def evaluate(stage, peer, request):
            return EvaluateReply(coords=LIE if peer == "liar" else HONEST, version=1)

        async def losses(stage, tokens, outputs):
            return [3.0, 2.0] if outputs[0] is LIE else [2.0, 3.0]

        checks = SpotChecks(1.0, 0.01, evaluate, lambda stage: list(replicas), random.Random(0), losses=losses,
                            exclude=lambda stage, peer, why: excluded.append((peer, why)), **kwargs)
        checks._rng.choice = lambda peers: next(p for p in ("honest", "third") if p in peers)
        checks.check_forward(1, "liar", TOKENS, None, LIE, 1)
        await _settle(checks)
        return checks, excluded

    checks, excluded = asyncio.run(main(["liar", "honest", "third"]))
    assert checks.stats.disputes[0].arbiter == "third" and [peer for peer, _ in excluded] == ["liar"]
    assert "1 spot-check dispute on stage 1 resolved against it (1 decided exactly, 0 in its favour)" in excluded[0][1]
    patient, excluded = asyncio.run(main(["liar", "honest", "third"], exact_strikes_to_exclude=2))
    assert dict(patient.stats.strikes) == {"liar": 1} and excluded == []
    measured, excluded = asyncio.run(main(["liar", "honest"]))
    assert measured.stats.summary()["strikes_by_mechanism"] == {"liar": {"loss": 1}} and excluded == []


def test_a_lie_worse_by_less_than_the_margin_every_time_is_struck_by_the_tally_and_a_coin_is_not():
    async def disputes(losses_for, count):
        checks, excluded = _referee_checks(losses_for, loss_margin=0.01)
        for i in range(count):
            worker, claim = ("liar", LIE) if i % 2 else ("honest", HONEST)  # either side under check
            checks.check_forward(1, worker, TOKENS, None, claim, 1)
            await _settle(checks)
        return checks, excluded

    # the liar's output costs 0.5% every time: within the margin, never decided one by one
    slightly = lambda claimed: [2.01, 2.0] if claimed is LIE else [2.0, 2.01]  # noqa: E731
    checks, excluded = asyncio.run(disputes(slightly, 30))
    assert dict(checks.stats.strikes) == {"liar": 3} and excluded == [(1, "liar")]
    assert [d.sign_test for d in checks.stats.disputes if d.struck] == [(10, 10)] * 3
    assert "worse loss in 10 of 10 close disputes" in checks.stats.excluded["liar"]
    assert checks.stats.outcomes["unresolved"] == 27 and checks.stats.favoured["honest"] == 3
    assert checks.stats.summary()["tallied"] == 3
    assert checks.stats.summary()["strikes_by_mechanism"] == {"liar": {"tally": 3}}
    # a lie that costs nothing: which side is worse is a coin, and nobody is struck in 40 disputes
    coin = random.Random(3)
    fair = lambda claimed: [2.0, 2.0 + coin.choice((-0.005, 0.005))]  # noqa: E731
    checks, excluded = asyncio.run(disputes(fair, 40))
    assert not checks.stats.strikes and excluded == [] and checks.stats.outcomes["unresolved"] == 40


def test_a_worker_s_first_hops_are_drawn_at_the_suspect_rate_then_at_the_base_rate():
    from roles.trainer.spot_checks import PROBATION_HOPS

    checks = SpotChecks(0.01, 0.01, None, lambda stage: [], random.Random(0), suspect_rate=0.5)
    first = sum(checks.draw(1, f"w{i}") for i in range(200) for _ in range(PROBATION_HOPS))
    later = sum(checks.draw(1, f"w{i}") for i in range(200) for _ in range(PROBATION_HOPS))
    assert 0.4 * 200 * PROBATION_HOPS < first < 0.6 * 200 * PROBATION_HOPS, first
    assert later < 0.03 * 200 * PROBATION_HOPS, later
    assert checks.stats.outcomes["probation"] == first and checks.stats.summary()["probation"] == first


def test_hops_at_the_run_s_first_versions_are_drawn_at_the_suspect_rate_whoever_computed_them():
    from roles.trainer.spot_checks import PROBATION_HOPS, PROBATION_VERSIONS

    checks = SpotChecks(0.01, 0.01, None, lambda stage: [], random.Random(0), suspect_rate=0.5)
    for i in range(200):  # past their own probation
        for _ in range(PROBATION_HOPS):
            checks.draw(1, f"w{i}")
    early = sum(checks.draw(1, f"w{i}", version=PROBATION_VERSIONS - 1) for i in range(200) for _ in range(8))
    later = sum(checks.draw(1, f"w{i}", version=PROBATION_VERSIONS) for i in range(200) for _ in range(8))
    assert 0.4 * 1600 < early < 0.6 * 1600 and later < 0.03 * 1600, (early, later)
