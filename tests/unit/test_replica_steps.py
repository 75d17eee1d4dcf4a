"""Several replicas per stage [issue 20]: one tagger per stage step, the head's stage-wide forward
gate, and the per-step gradient exchange that keeps replicas equal."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import random

import pytest
import torch

from protocol.errors import PeerUnavailable, ProtocolError
from roles.worker.steps.gradient_exchange import Contribution, Correction, GradientExchange, HeldCorrections, add_up
from roles.worker.steps.step_tagger import AnsweredAsks, ForwardSlots, StepTagger, elect_tagger

TARGET = 16


# ---- tags ----

def test_asks_from_any_replica_in_any_order_fill_each_step_exactly():
    tagger = StepTagger(TARGET)
    rng = random.Random(0)
    per_step: dict[int, int] = {}
    open_step = 0
    for _ in range(400):
        n = rng.randint(1, 7)  # a batch at either replica: the tagger cannot tell them apart
        grants = tagger.take(n, open_step, known=lambda step: 0)
        assert sum(g.count for g in grants) <= n
        for g in grants:
            assert open_step <= g.step <= open_step + 1
            per_step[g.step] = per_step.get(g.step, 0) + g.count
        if per_step.get(open_step, 0) == TARGET and rng.random() < 0.5:
            open_step += 1  # the stage stepped
    assert all(count == TARGET for step, count in per_step.items() if step < open_step)
    assert max(per_step.values()) == TARGET


def test_an_ask_repeated_after_its_reply_was_lost_gets_the_same_tags_and_the_step_fills_exactly():
    tagger = StepTagger(TARGET)
    answered = AnsweredAsks(keep=4)

    def ask(asker, ask_id, n):
        return answered.answer(asker, ask_id, lambda: tagger.take(n, 0, known=lambda step: 0))

    first = ask("a", 7, 10)
    assert ask("a", 7, 10) == first, "the retry of a served ask claims its tags"
    assert ask("b", 7, 6) != first, "another asker's id is another ask"
    assert tagger.tags_issued == 16 and answered.repeated == 1
    ask("a", None, 1), ask("a", None, 1)  # an older worker's asks carry no id: each is served
    assert tagger.tags_issued == 18 and answered.repeated == 1
    for ask_id in range(100, 110):  # only the newest answers are kept
        ask("c", ask_id, 1)
    ask("a", 7, 10)
    assert answered.repeated == 1, "an answer past `keep` is served anew"


def test_the_tagger_never_runs_past_the_step_after_the_open_one():
    tagger = StepTagger(TARGET)
    grants = tagger.take(40, 3, known=lambda step: 0)
    assert [(g.step, g.count) for g in grants] == [(3, 16), (4, 16)]
    assert tagger.take(5, 3, known=lambda step: 0) == []
    assert tagger.asks_held == 2
    assert [(g.step, g.count) for g in tagger.take(5, 4, known=lambda step: 0)] == [(5, 5)]


def test_a_new_tagger_starts_from_what_the_stage_is_known_to_hold():
    tagger = StepTagger(TARGET)
    grants = tagger.take(10, 7, known=lambda step: {7: 12}.get(step, 0))
    assert [(g.step, g.count) for g in grants] == [(7, 4), (8, 6)]
    # The stage closed step 8 short and moved to 9 (a replica died): the cursor follows.
    assert [(g.step, g.count) for g in tagger.take(3, 9, known=lambda step: 2)] == [(9, 3)]


def test_the_incumbent_keeps_tagging_and_two_claims_resolve_to_the_lowest():
    assert elect_tagger("b", False, [("c", False)]) == "b"  # nobody tags: the lowest id
    assert elect_tagger("c", False, [("b", False)]) == "b"  # ... which is another replica: wait for it
    assert elect_tagger("a", False, [("c", True)]) == "c"  # a newcomer with a lower id defers
    assert elect_tagger("c", True, [("a", True)]) == "a"  # split brain: the lowest claimant wins
    assert elect_tagger("b", False, [("a", True)], unreachable=["a"]) == "b"  # a tagger that is gone


# ---- the head's forward gate ----

def test_forward_slots_give_a_step_its_target_over_all_head_replicas():
    clock = [0.0]
    gate = ForwardSlots(TARGET, max_delayed=0, timeout_s=5.0, clock=lambda: clock[0])
    assert gate.take(10, back_total=0, open_known=0) == 10  # replica A
    assert gate.take(10, back_total=0, open_known=0) == 6  # replica B: the step's rest
    assert gate.take(1, back_total=0, open_known=0) == 0
    # 16 came back, the stage stepped: the next step's 16 may go.
    assert gate.take(20, back_total=16, open_known=0) == 16


def test_forwards_started_before_the_step_hold_slots_of_it():
    clock = [0.0]
    gate = ForwardSlots(TARGET, max_delayed=2, timeout_s=5.0, clock=lambda: clock[0])
    assert gate.take(18, back_total=0, open_known=0) == 18  # 16 and 2 running ahead
    # The 16 came back and the stage stepped; the 2 that ran ahead are still out: 14 more, not 16.
    assert gate.take(20, back_total=16, open_known=0) == 14 + 2


def test_a_slot_held_longer_than_the_timeout_is_freed():
    clock = [0.0]
    gate = ForwardSlots(4, max_delayed=0, timeout_s=5.0, clock=lambda: clock[0])
    assert gate.take(4, back_total=0, open_known=0) == 4
    clock[0] = 3.0
    assert gate.take(1, back_total=3, open_known=3) == 0  # 3 back, one still out
    clock[0] = 6.0
    assert gate.take(1, back_total=3, open_known=3) == 1  # that one was lost: its slot is free


def test_a_replica_leaving_with_samples_does_not_stall_the_gate():
    """The stage's known count drops when a replica leaves with the open step's samples; slots
    are counted back from the new count, not from the old high-water mark."""
    clock = [0.0]
    gate = ForwardSlots(4, max_delayed=0, timeout_s=5.0, clock=lambda: clock[0])
    assert gate.take(4, back_total=0, open_known=0) == 4
    clock[0] = 1.0
    assert gate.take(4, back_total=3, open_known=3) == 0  # 3 back (2 of them on the replica that leaves)
    assert gate.take(4, back_total=1, open_known=1) == 2  # it left: 1 known, 1 out, 2 to make up
    clock[0] = 2.0
    assert gate.take(4, back_total=2, open_known=2) == 0  # the one out came back: 2 known, 2 out
    assert gate.take(4, back_total=4, open_known=4) == 0  # the step is whole again
    assert gate.take(4, back_total=8, open_known=0) == 4  # it stepped: the next step's 4


# ---- the gradient exchange ----

def _contribution(peer: str, step: int, samples: int, seed: int, numel: int = 64) -> Contribution:
    grad = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) if samples else None
    return Contribution(peer=peer, step=step, samples=samples, abandoned=0, grad=grad, consumed=step * TARGET)


def _pair(timeout_s: float = 5.0, fail: set[str] = frozenset()):
    """Two replicas whose pushes call each other's `receive` directly (the RPC's two ends)."""
    open_steps = {"a": 0, "b": 0}
    exchanges: dict[str, GradientExchange] = {}

    def pusher(sender: str):
        async def push(peer: str, c: Contribution):
            await asyncio.sleep(0.001)
            if peer in fail:
                raise PeerUnavailable(f"{peer} is gone")
            return exchanges[peer].receive(c, open_steps[peer])
        return push

    for me, other in (("a", "b"), ("b", "a")):
        exchanges[me] = GradientExchange(me, numel=64, target=TARGET, timeout_s=timeout_s, push=pusher(me),
                                         members=lambda other=other: [other])
    return exchanges, open_steps


def test_two_replicas_apply_the_same_bits():
    exchanges, _ = _pair()

    async def main():
        return await asyncio.gather(exchanges["a"].exchange(_contribution("a", 0, 9, 1)),
                                    exchanges["b"].exchange(_contribution("b", 0, 7, 2)))

    a, b = asyncio.run(main())
    assert a.samples == b.samples == 16 and a.stage_samples == 16 and not a.missing
    assert torch.equal(a.grad, b.grad)
    expected = add_up(0, {"a": _contribution("a", 0, 9, 1), "b": _contribution("b", 0, 7, 2)})
    assert torch.equal(a.grad, expected.grad) and a.members == ("a", "b")


def test_a_replica_that_is_gone_is_left_out_and_counted():
    exchanges, _ = _pair(fail={"b"})

    async def main():
        return await exchanges["a"].exchange(_contribution("a", 0, 9, 1))

    total = asyncio.run(main())
    assert total.missing == ("b",) and total.samples == 9
    assert exchanges["a"].counters["steps_partial"] == 1


def test_a_silent_replica_is_left_out_after_the_timeout():
    exchanges, _ = _pair(timeout_s=0.3)
    exchanges["b"].push = lambda peer, c: asyncio.sleep(10)  # b never answers a's push in time

    async def main():
        return await exchanges["a"].exchange(_contribution("a", 0, 9, 1))

    total = asyncio.run(main())
    assert total.missing == ("b",) and total.samples == 9


def test_a_late_replica_applies_the_sum_the_others_stepped_on():
    exchanges, open_steps = _pair(timeout_s=0.3)

    async def main():
        first = await exchanges["a"].exchange(_contribution("a", 0, 9, 1))  # b is late: a goes on alone
        open_steps["a"] = 1
        late = await exchanges["b"].exchange(_contribution("b", 0, 7, 2))
        return first, late

    first, late = asyncio.run(main())
    assert late.adopted_from == "a" and torch.equal(late.grad, first.grad) and late.samples == first.samples
    assert exchanges["b"].counters["samples_lost_late"] == 7


def test_a_correction_counts_only_while_the_replica_it_names_is_in_the_sum():
    """An honest replica takes an excluded replica's sample out on its behalf: subtracted when the
    excluded one's gradients are summed, ignored when it left the step (its samples went with it)."""
    x = _contribution("x", 0, 3, 1)
    fix = Correction("x", 1, -torch.randn(64, generator=torch.Generator().manual_seed(5)))
    a = dataclasses.replace(_contribution("a", 0, 4, 2), corrections=(fix,))
    with_x = add_up(0, {"a": a, "x": x})
    plain = add_up(0, {"a": _contribution("a", 0, 4, 2), "x": x})
    assert torch.equal(with_x.grad, plain.grad + fix.grad)
    assert with_x.samples == 6 and with_x.stage_samples == 7, "one gradient fewer, the step still consumed it"
    without_x = add_up(0, {"a": a})
    assert torch.equal(without_x.grad, _contribution("a", 0, 4, 2).grad) and without_x.samples == 4


def test_corrections_never_take_more_samples_than_their_replica_brought():
    x = _contribution("x", 0, 2, 1)
    a = dataclasses.replace(_contribution("a", 0, 4, 2), corrections=(Correction("x", 2, torch.ones(64)),))
    b = dataclasses.replace(_contribution("b", 0, 4, 3), corrections=(Correction("x", 1, torch.ones(64)),))
    total = add_up(0, {"a": a, "b": b, "x": x})
    assert total.samples == 8, "a's correction takes x's two samples; b's finds none left"
    only_x = add_up(0, {"a": dataclasses.replace(_contribution("a", 0, 0, 2), corrections=(
        Correction("x", 2, -x.grad),)), "x": x})
    assert only_x.samples == 0 and only_x.grad is None, "a step left with no gradient has none"
    self_named = dataclasses.replace(_contribution("a", 0, 4, 2), corrections=(Correction("a", 1, torch.ones(64)),))
    assert add_up(0, {"a": self_named}).samples == 4


def test_held_corrections_add_up_per_replica_and_go_with_their_step():
    held = HeldCorrections()
    held.add(3, "x", torch.ones(64))
    held.add(3, "x", torch.ones(64))
    held.add(3, "y", torch.ones(64))
    held.add(4, "x", torch.ones(64))
    held.add(2, "x", torch.ones(64))
    assert held.samples(3) == 3
    taken = {c.peer: c for c in held.take(3)}
    assert taken["x"].samples == 2 and torch.equal(taken["x"].grad, torch.full((64,), 2.0)) and taken["y"].samples == 1
    assert held.samples(2) == 0, "an earlier step's corrections go when a later one is taken"
    assert held.samples(4) == 1
    for i in range(7):
        held.add(4, f"p{i}", torch.ones(64))
    assert held.room_for(4, "x") and not held.room_for(4, "another"), "no more replicas than receivers take"
    assert held.room_for(5, "another")


def test_contributions_that_cannot_be_used_are_refused():
    exchange = GradientExchange("a", numel=64, target=TARGET, timeout_s=1.0, push=None, members=lambda: ["b"])
    bad = [
        Contribution("b", 5, 3, 0, torch.zeros(64)),  # too far ahead of open step 0
        Contribution("b", 0, 3, 0, torch.zeros(10)),  # wrong shape
        Contribution("b", 0, 3, 0, torch.full((64,), float("nan"))),  # not finite
        Contribution("b", 0, 3, 0, None),  # samples without a gradient
        Contribution("b", 0, 10_000, 0, torch.zeros(64)),  # more samples than a step can hold
        Contribution("b", 0, 3, 0, torch.zeros(64), corrections=tuple(  # more corrections than replicas
            Correction(f"x{i}", 1, torch.zeros(64)) for i in range(9))),
        Contribution("b", 0, 3, 0, torch.zeros(64), corrections=(Correction("x", 1, torch.zeros(64)),) * 2),
        Contribution("b", 0, 3, 0, torch.zeros(64), corrections=(Correction("b", 1, torch.zeros(64)),)),  # itself
        Contribution("b", 0, 3, 0, torch.zeros(64), corrections=(Correction("x", TARGET, torch.zeros(64)),)),
        Contribution("b", 0, 3, 0, torch.zeros(64), corrections=(Correction("x", 1, torch.zeros(10)),)),
        Contribution("b", 0, 3, 0, torch.zeros(64), corrections=(Correction("x", 1, torch.full((64,), float("inf"))),)),
    ]
    for c in bad:
        with pytest.raises(ProtocolError):
            exchange.receive(c, open_step=0)
    assert exchange.counters["refused_invalid"] + exchange.counters["refused_ahead"] == len(bad)
    assert exchange.receive(Contribution("b", 0, 3, 0, torch.zeros(64)), open_step=0) is None
    assert exchange.pushed(0)


def test_a_replica_whose_gradients_were_refused_is_not_waited_for():
    """A NaN contribution is refused and its sender left out of the step at once, not after the
    exchange's timeout (the others would stall a whole timeout for every step it spoils)."""

    async def accepted(peer, c):
        return None

    exchange = GradientExchange("a", numel=64, target=TARGET, timeout_s=30.0, push=accepted, members=lambda: ["b"])
    with pytest.raises(ProtocolError):
        exchange.receive(Contribution("b", 0, 3, 0, torch.full((64,), float("nan"))), open_step=0)

    async def main():
        return await asyncio.wait_for(exchange.exchange(_contribution("a", 0, 9, 1)), 5.0)

    total = asyncio.run(main())
    assert total.missing == ("b",) and total.samples == 9


def test_a_replica_passed_over_as_unreachable_that_pushes_after_all_is_summed_and_answered():
    """Replicas must apply the same sum: one that was unreachable at the last step but pushes
    this one while the exchange still waits (here for c) is added to the sum, and gets this
    replica's contribution in return."""
    sent = []

    async def accepted(peer, c):
        sent.append(peer)
        return None

    exchange = GradientExchange("a", numel=64, target=TARGET, timeout_s=5.0, push=accepted,
                                members=lambda: ["b", "c"])
    exchange._unreachable["b"] = time.monotonic() + 60  # its push failed at the step before

    async def main():
        task = asyncio.create_task(exchange.exchange(_contribution("a", 0, 6, 1)))
        await asyncio.sleep(0.05)
        exchange.receive(_contribution("b", 0, 5, 2), open_step=0)
        await asyncio.sleep(0.05)
        exchange.receive(_contribution("c", 0, 5, 3), open_step=0)
        return await asyncio.wait_for(task, 3.0)

    total = asyncio.run(main())
    assert total.samples == 16 and not total.missing and sorted(sent) == ["b", "c"]


def test_a_push_lost_after_the_peers_gradients_arrived_is_sent_again_and_both_apply_the_same_sum():
    """b's gradients reached a, but a's push to b failed once (a relay died, a stream reset): a
    would step on both while b waited out its timeout and stepped alone. a pushes again, so both
    apply the same sum."""
    exchanges, _ = _pair(timeout_s=3.0)
    to_b = exchanges["a"].push
    failures = [PeerUnavailable("stream reset")]

    async def flaky(peer, c):
        if failures:
            await asyncio.sleep(0.05)  # b's push lands first
            raise failures.pop()
        return await to_b(peer, c)

    exchanges["a"].push = flaky

    async def main():
        return await asyncio.gather(exchanges["a"].exchange(_contribution("a", 0, 9, 1)),
                                    exchanges["b"].exchange(_contribution("b", 0, 7, 2)))

    a, b = asyncio.run(main())
    assert not a.missing and not b.missing and a.samples == b.samples == 16
    assert torch.equal(a.grad, b.grad)
    assert exchanges["a"].counters["pushes_retried"] == 1


def test_corrections_cross_the_wire_and_hostile_ones_are_refused_typed():
    from protocol.errors import ErrorCode
    from protocol.messages import StepGradientsRequest, parse_model, to_body

    fix = {"peer": "X", "samples": 2, "grad": torch.randn(64)}
    body = to_body(StepGradientsRequest(stage=1, step=3, samples=4, grad=torch.randn(64), corrections=[fix]))
    [back] = parse_model(StepGradientsRequest, body).corrections
    assert (back.peer, back.samples) == ("X", 2) and torch.equal(back.grad, fix["grad"])
    good = body["corrections"][0]
    for corrections in ([{**good, "peer": ""}], [{**good, "samples": 0}], [good] * 9, [{**good, "grad": b"\0" * 7}],
                        "not a list"):
        with pytest.raises(ProtocolError) as caught:
            parse_model(StepGradientsRequest, {**body, "corrections": corrections})
        assert caught.value.code in (ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_TENSOR)
