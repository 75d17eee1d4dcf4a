"""Stage skipping in the trainer's pipeline driver (roles/trainer/pipeline.py, skipping.py): which
stages are routed around, what the routed coordinates and gradients are, and what is counted.

The workers are in-process fakes behind the client's `request` (the driver's only network call):
stage s adds s+1 to the coordinates on the forward and doubles the gradient on the backward, so a
skipped stage shows in the numbers the tail receives and the head's gradient.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch
from hivemind.p2p import PeerID

from protocol import version
from protocol.errors import PeerUnavailable
from protocol.messages import AbandonReply, BackwardReply, ForwardReply
from protocol.run_config import SkippingConfig
from roles.trainer.balancer import StageBalancer, WorkerView
from roles.trainer.pipeline import PipelineDriver, SampleDropped
from roles.trainer.skipping import StageSkipping

K, T = 4, 6
_IDS = ["QmNnooDu7bfjPFoTZYxMNLWUQJyrVwtbZg5gBMjTezGAJN", "QmQCU2EcMqAqQPR2i9bChDtGNJchTbq5TbXJJ16u19uLTa",
        "QmbLHAnMoJPWSCR5Zhtx6BHJX9KiKNN6tpvbUcqanj75Nb", "QmcZf59bWwK5XFi76CZX8cbJ4BhTzzA3gU1ZjYZcYW3dwt",
        "QmSoLPppuBtQSGwKDZT2M73ULpjvfd3aZ6ha4oWFRZ6kFv"]


class FakeWorkers:
    """The client: peer -> (stage, alive). Records every call as (handler, stage, peer)."""

    def __init__(self):
        self.stage_of: dict[str, int] = {}
        self.dead: set[str] = set()
        self.die_after_forward: set[str] = set()
        self.calls: list[tuple[str, int, str]] = []
        self.tail_input: list[torch.Tensor] = []
        self.head_grad: list[torch.Tensor] = []

    async def request(self, peer_id, handler, request, reply, timeout_s=None):
        peer = peer_id.to_base58()
        self.calls.append((handler, request.stage, peer))
        if peer in self.dead:
            raise PeerUnavailable(f"cannot reach {peer}")
        stage = self.stage_of[peer]
        if handler == version.ABANDON:
            return AbandonReply(taken=True)
        if handler == version.FORWARD:
            if peer in self.die_after_forward:
                self.dead.add(peer)
            base = torch.zeros(1, T, K) if request.coords is None else request.coords
            return ForwardReply(coords=base + (stage + 1))
        if request.grad_output is None:  # the tail's fused loss forward and backward
            self.tail_input.append(request.coords.clone())
            return BackwardReply(loss=1.0, grad_input=torch.ones(1, T, K), step=7, version=7)
        grad = request.grad_output * 2
        if stage == 0:
            self.head_grad.append(request.grad_output.clone())
        return BackwardReply(grad_input=None if stage == 0 else grad, step=request.step, version=request.step)


def make_driver(workers_per_stage: list[int], skipping: SkippingConfig = SkippingConfig()):
    fake = FakeWorkers()
    balancers, ids = [], iter(_IDS)
    for stage, n in enumerate(workers_per_stage):
        balancer = StageBalancer(stage, backoff_s=0.01, max_backoff_s=0.02)
        peers = [next(ids) for _ in range(n)]
        for peer in peers:
            fake.stage_of[peer] = stage
        balancer.update_workers(WorkerView(peer_id=p) for p in peers)
        balancers.append(balancer)

    async def connect(peer: str) -> None:
        return None

    refreshes: list[int] = []
    driver = PipelineDriver(fake, balancers, connect=connect, on_no_workers=lambda: refreshes.append(1),
                            skipping=StageSkipping(len(balancers), skipping))
    return driver, fake, refreshes


def train(driver, n: int = 1):
    async def go():
        return [await driver.train_sample(f"s{i}", torch.zeros(1, T, dtype=torch.long)) for i in range(n)]
    return asyncio.run(go())


def test_a_body_stage_without_workers_is_routed_around_forward_and_backward():
    driver, fake, _ = make_driver([1, 0, 1, 1])
    [result] = train(driver)
    assert result.skipped == [1]
    assert result.route[1] == ""
    # head adds 1, stage 1 is skipped, stage 2 adds 3: the tail saw 4, not 1 + 2 + 3
    assert torch.equal(fake.tail_input[0], torch.full((1, T, K), 4.0))
    # the tail's gradient 1 is doubled by stage 2 only
    assert torch.equal(fake.head_grad[0], torch.full((1, T, K), 2.0))
    assert not [c for c in fake.calls if c[1] == 1]
    assert driver.skipping.summary()["skipped_stages"] == {"1": {"forward": 1, "backward": 0}}
    assert (1, "") not in driver.stats.served


def test_with_skipping_disabled_the_sample_drops_as_no_workers():
    driver, _, _ = make_driver([1, 0, 1, 1], SkippingConfig(enabled=False))
    with pytest.raises(SampleDropped) as info:
        train(driver)
    assert info.value.reason == "no_workers"
    assert driver.skipping.summary()["skipped_stages"] == {}


@pytest.mark.parametrize("empty", [0, 3])
def test_the_head_and_the_tail_are_never_skipped(empty):
    layout = [1, 1, 1, 1]
    layout[empty] = 0
    driver, _, _ = make_driver(layout)
    with pytest.raises(SampleDropped) as info:
        train(driver)
    assert info.value.reason == "no_workers"
    assert driver.skipping.counts == {}


def test_at_most_max_consecutive_adjacent_stages_are_skipped():
    driver, _, _ = make_driver([1, 0, 0, 1])
    with pytest.raises(SampleDropped) as info:
        train(driver)
    assert info.value.reason == "no_workers" and "stage 2" in info.value.detail

    driver, fake, _ = make_driver([1, 0, 0, 1], SkippingConfig(max_consecutive=2))
    [result] = train(driver)
    assert result.skipped == [1, 2]
    assert torch.equal(fake.tail_input[0], torch.full((1, T, K), 1.0))
    assert torch.equal(fake.head_grad[0], torch.ones(1, T, K))

    driver, _, _ = make_driver([1, 0, 1, 0, 1])  # two skipped stages, not adjacent
    [result] = train(driver)
    assert result.skipped == [1, 3]


def test_an_unreachable_worker_is_skipped_and_then_not_waited_for():
    """A SIGKILLed worker's record outlives it: its stage is skipped once its attempts fail as
    unreachable, and while it is skipped one failed attempt is enough."""
    driver, fake, _ = make_driver([1, 1, 1])
    dead = next(p for p, s in fake.stage_of.items() if s == 1)
    fake.dead.add(dead)
    first, second = train(driver, 2)
    assert first.skipped == second.skipped == [1]
    attempts = [c for c in fake.calls if c[2] == dead and c[0] == version.FORWARD]
    assert len(attempts) == driver.max_attempts + 1
    # the stage still lists the worker, so the tagged sample is abandoned there (best effort)
    assert first.abandon_to == [(1, dead)]


def test_a_slow_or_busy_stage_is_not_skipped():
    from protocol.errors import ErrorCode, RemoteError

    driver, fake, _ = make_driver([1, 1, 1])
    busy = next(p for p, s in fake.stage_of.items() if s == 1)
    original = fake.request

    async def overloaded(peer_id, handler, request, reply, timeout_s=None):
        if peer_id.to_base58() == busy:
            raise RemoteError("busy", ErrorCode.OVERLOADED)
        return await original(peer_id, handler, request, reply, timeout_s)

    fake.request = overloaded
    with pytest.raises(SampleDropped) as info:
        train(driver)
    assert info.value.reason == "worker_failures"


def test_a_worker_that_dies_between_forward_and_backward_is_passed_through_on_backward():
    driver, fake, _ = make_driver([1, 1, 1, 1])
    victim = next(p for p, s in fake.stage_of.items() if s == 2)
    fake.die_after_forward.add(victim)
    [result] = train(driver)
    assert result.skipped == [2]
    assert result.versions[2] is None
    assert torch.equal(fake.tail_input[0], torch.full((1, T, K), 6.0))  # the forward did run stage 2
    assert torch.equal(fake.head_grad[0], torch.full((1, T, K), 2.0))  # only stage 1 doubled it
    assert driver.skipping.summary()["skipped_stages"] == {"2": {"forward": 0, "backward": 1}}
    # the next sample finds the stage skipped and does not wait for the dead worker
    [result] = train(driver)
    assert result.skipped == [2]
    assert driver.skipping.counts[(2, "forward")] == 1


def test_a_head_that_dies_between_forward_and_backward_still_drops_the_sample():
    driver, fake, _ = make_driver([1, 1, 1])
    head = next(p for p, s in fake.stage_of.items() if s == 0)
    fake.die_after_forward.add(head)
    with pytest.raises(SampleDropped) as info:
        train(driver)
    assert info.value.reason == "backward_failed"
    assert info.value.step == 7


def test_skipping_ends_when_a_worker_serves_the_stage_again_and_is_logged_once(caplog):
    driver, fake, refreshes = make_driver([1, 0, 1])
    caplog.set_level(logging.INFO, logger="roles.trainer.skipping")
    train(driver, 3)
    assert driver.skipping.active(1)
    assert len(refreshes) == 1, "a skipped stage asks discovery once, not per sample"
    newcomer = _IDS[-1]
    fake.stage_of[newcomer] = 1
    driver.balancers[1].update_workers([WorkerView(peer_id=newcomer)])
    [result] = train(driver)
    assert result.skipped == [] and result.route[1] == newcomer
    assert not driver.skipping.active(1)
    lines = [r.getMessage() for r in caplog.records]
    assert sum("skipping it" in line for line in lines) == 1
    assert sum("served again; it was skipped for 3 samples" in line for line in lines) == 1
    assert driver.skipping.summary()["samples_skipping_a_stage"] == 3


def test_run_config_defaults():
    from protocol.run_config import load_run_config

    run = load_run_config("tiny")
    assert run.skipping.enabled is True and run.skipping.max_consecutive == 1
    assert load_run_config("tiny", {"skipping": {"enabled": False}}).skipping.enabled is False


def test_the_benchmarks_outages_cover_the_fraction_on_body_stages_and_skip_for_real():
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
    from bench_skipping import SkippingModel, build_stages, outage_schedule, run_config

    down = outage_schedule(200, 0.1, 4, seed=3)
    assert len(down) == 20 and set(down.values()) <= {1, 2}
    assert outage_schedule(200, 0.1, 4, seed=3) == down
    run = run_config(10, seed=0)
    model = SkippingModel(build_stages(run))
    tokens = torch.randint(0, run.model.vocab_size, (2, 8))
    full = model(tokens)
    model.skip = 1
    assert model(tokens).shape == full.shape and not torch.allclose(model(tokens), full)
