"""A reducer screens the parts it averages: honest parts are averaged exactly as hivemind's own
reducer averages them, and a NaN, huge, misshapen or badly weighted part leaves its sender out of
the average from that part on (screening.py, protocol/hivemind_adapter.py HoldingReducer)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
from hivemind.averaging.partition import BannedException, TensorPartReducer

from protocol.hivemind_adapter import HeldPart, HoldingReducer
from roles.worker.averaging.screening import PartScreen

SHAPES = [torch.Size([64]), torch.Size([64]), torch.Size([17])]
SCREEN = PartScreen(max_norm_ratio=10.0, max_sender_weight=1e6)


def _parts(senders: int, seed: int = 0) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=generator) for shape in SHAPES] for _ in range(senders)]


async def _reduce(reducer, parts, weights, order=None):
    """Feed every part index in turn, the senders' parts arriving in `order`; return per part the
    average each sender got back (or the exception it got)."""
    order = order or list(range(len(parts)))
    results = []
    for index in range(len(SHAPES)):
        live = [s for s in order if reducer.sender_failed_after[s] > index]
        tasks = [asyncio.create_task(reducer.accumulate_part(s, index, parts[s][index], weight=weights[s]))
                 for s in live]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        results.append(dict(zip(live, outcomes)))
    return results


def test_honest_parts_are_averaged_bit_for_bit_as_hivemind_averages_them():
    parts, weights = _parts(4), [3.0, 1.0, 0.0, 7.5]

    async def scene():
        stock = await _reduce(TensorPartReducer(SHAPES, 4), parts, weights, order=[2, 0, 3, 1])
        held = await _reduce(HoldingReducer(SHAPES, 4, screen=lambda i, h: SCREEN(h, 0)), parts, weights,
                             order=[2, 0, 3, 1])
        return stock, held

    stock, held = asyncio.run(scene())
    for index in range(len(SHAPES)):
        for sender in range(4):
            assert torch.equal(stock[index][sender], held[index][sender]), (index, sender)
    expected = sum(w * p[0] for w, p in zip(weights, parts)) / sum(weights)
    assert torch.allclose(held[0][0], expected)


@pytest.mark.parametrize("poison, why", [
    (lambda part: torch.full_like(part, math.nan), "not finite"),
    (lambda part: part * 1e6, "norm"),
    (lambda part: part * 1e-4, "norm"),
    (lambda part: torch.full_like(part, math.inf), "not finite"),
    (lambda part: torch.ones(1), "shape"),
    (lambda part: part[:-1], "shape"),
    (lambda part: (part * 100).to(torch.int64), "type"),
])
def test_a_poisoned_part_leaves_its_sender_out_from_that_part_on(poison, why):
    parts, weights = _parts(3), [1.0, 2.0, 1.0]
    parts[2][1] = poison(parts[2][1])  # the third sender poisons the second part

    async def scene():
        reducer = HoldingReducer(SHAPES, 3, screen=lambda i, h: SCREEN(h, 0))
        return reducer, await _reduce(reducer, parts, weights)

    reducer, results = asyncio.run(scene())
    assert torch.equal(results[0][0], results[0][2]), "the first part still averaged all three"
    assert isinstance(results[1][2], BannedException), "the poisoner gets no average back"
    honest = (1.0 * parts[0][1] + 2.0 * parts[1][1]) / 3.0
    assert torch.allclose(results[1][0], honest) and torch.equal(results[1][0], results[1][1])
    assert set(results[2]) == {0, 1}, "the poisoner is not waited for on later parts"
    assert torch.allclose(results[2][0], (1.0 * parts[0][2] + 2.0 * parts[1][2]) / 3.0)
    assert list(reducer.rejected) == [2] and why in reducer.rejected[2]
    assert reducer.sender_failed_after == [math.inf, math.inf, 1]
    assert reducer.finished.is_set()


def test_hivemind_banning_a_rejected_sender_does_not_count_it_out_twice():
    parts, weights = _parts(3), [1.0, 1.0, 1.0]
    parts[2][0] = parts[2][0] * 1e6

    async def scene():
        reducer = HoldingReducer(SHAPES, 3, screen=lambda i, h: SCREEN(h, 0))
        tasks = [asyncio.create_task(reducer.accumulate_part(s, 0, parts[s][0], weight=1.0)) for s in range(3)]
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert isinstance(outcomes[2], BannedException)
        assert reducer.num_current_senders == 2
        reducer.on_sender_failed(2)  # what the runner's _ban_sender does when the sender's stream ends
        assert reducer.num_current_senders == 2 and reducer.sender_failed_after[2] == 0
        second = await asyncio.gather(*(reducer.accumulate_part(s, 1, parts[s][1], weight=1.0) for s in (0, 1)))
        return second

    second = asyncio.run(scene())
    assert torch.allclose(second[0], (parts[0][1] + parts[1][1]) / 2)


def _held(*parts_and_weights):
    return [HeldPart(index, part, weight) for index, (part, weight) in enumerate(parts_and_weights)]


def test_the_screen_checks_weights_values_and_norms_against_its_own_part():
    own = torch.randn(1000)
    near = own * 1.5 + 0.1
    cases = {
        "negative weight": ((near, -1.0), "weight"),
        "nan weight": ((near, math.nan), "weight"),
        "inf weight": ((near, math.inf), "weight"),
        "weight above the cap": ((near, 2e6), "weight"),
        "nan value": ((torch.cat([near[:-1], torch.tensor([math.nan])]), 1.0), "not finite"),
        "huge norm": ((own * 11, 1.0), "norm"),
        "tiny norm": ((own / 11, 1.0), "norm"),
        "zeros": ((torch.zeros(1000), 1.0), "norm"),
        "integers": ((near.to(torch.int32), 1.0), "type"),
    }
    for name, (bad, why) in cases.items():
        rejected = SCREEN(_held((own, 1.0), (near, 3.0), bad), trusted=0)
        assert list(rejected) == [2] and why in rejected[2], (name, rejected)
    assert SCREEN(_held((own, 1.0), (near, 3.0), (own * 9.9, 1.0)), trusted=0) == {}
    # weight 0 adds nothing: a joiner in weight sync is not held to the norm, but must be finite
    assert SCREEN(_held((own, 1.0), (own * 1e6, 0.0)), trusted=0) == {}
    assert 1 in SCREEN(_held((own, 1.0), (torch.full_like(own, math.nan), 0.0)), trusted=0)


def test_the_reducer_trusts_its_own_part_and_without_one_uses_the_median():
    own = torch.randn(500)
    # its own part is the reference even when the others agree among themselves
    assert set(SCREEN(_held((own, 1.0), (own * 50, 1.0), (own * 60, 1.0)), trusted=0)) == {1, 2}
    assert list(SCREEN(_held((own * 1e6, 1.0), (own, 1.0)), trusted=0)) == [1]
    # no part of its own: the median of the senders
    assert list(SCREEN(_held((own, 1.0), (own * 1.2, 1.0), (own * 1e3, 1.0)), trusted=None)) == [2]
    # zero padding (the tail of the round buffer) is zero for everyone
    zeros = torch.zeros(100)
    assert SCREEN(_held((zeros, 1.0), (zeros.clone(), 1.0)), trusted=0) == {}
    assert list(SCREEN(_held((zeros, 1.0), (zeros + 1e-3, 1.0)), trusted=0)) == [1]
