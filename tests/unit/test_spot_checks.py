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
