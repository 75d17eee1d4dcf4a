"""The referee's measurements compare losses of several passes; a worker that steps between two
passes would decide the dispute with its update, so such a measurement is taken again, or given up."""

import asyncio

import pytest
import torch

from protocol.messages import EvaluateReply
from roles.trainer.referee import MEASURE_ATTEMPTS, Referee, WeightsMoved

TOKENS = torch.zeros(4, dtype=torch.int32)


class _Stage:
    def __init__(self, peers):
        self.peers = peers

    def usable(self):
        return list(self.peers)


class _Tail:
    """A one-worker tail whose loss is the input's sum plus its version; it steps (version + 1)
    after each of its first `steps` evaluations."""

    def __init__(self, steps: int):
        self.version, self.steps, self.calls = 0, steps, 0

    async def call(self, stage, peer, handler, request, reply_type):
        self.calls += 1
        reply = EvaluateReply(loss=float(request.coords.sum()) + self.version, version=self.version)
        if request.input_grad:
            reply = EvaluateReply(loss=reply.loss, grad_input=torch.ones_like(request.coords), version=self.version)
        if self.steps > 0:
            self.steps -= 1
            self.version += 1
        return reply


def _referee(tail):
    return Referee(tail.call, [_Stage(["head"]), _Stage(["tail"])])


def test_continuation_losses_are_taken_again_until_both_passes_saw_one_version():
    tail = _Tail(steps=1)  # it steps between the first try's two passes
    losses = asyncio.run(_referee(tail).continuation_losses(0, TOKENS, [torch.full((4,), 1.0), torch.full((4,), 2.0)]))
    assert losses == [5.0, 9.0]  # both at version 1: only the outputs differ
    assert tail.calls == 4


def test_slopes_and_consistency_are_measured_at_one_version():
    tail = _Tail(steps=2)
    x = torch.full((4,), 1.0)
    slopes = asyncio.run(_referee(tail).input_slopes(1, TOKENS, x, [torch.ones(4) / 2]))
    assert slopes == [pytest.approx(2.0, rel=1e-3)]  # d(sum)/dx along (1,1,1,1)/2, no version jump in it
    tail = _Tail(steps=1)
    error = asyncio.run(_referee(tail).loss_consistency(1, "tail", TOKENS, x))
    assert error == pytest.approx(0.0, abs=1e-3)  # gradient of norm 2, slope 2 along it


def test_a_route_that_keeps_stepping_decides_nothing():
    tail = _Tail(steps=10 ** 6)
    with pytest.raises(WeightsMoved):
        asyncio.run(_referee(tail).continuation_losses(0, TOKENS, [torch.zeros(4), torch.ones(4)]))
    assert tail.calls == 2 * MEASURE_ATTEMPTS
