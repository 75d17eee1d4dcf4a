"""The trainer's side of retractions (roles/trainer/retraction.py): the kept samples' bounds, and
that excluding a worker retracts the samples it served from the workers that accumulated them,
at its own stage from another replica, never from the excluded worker."""

from __future__ import annotations

import asyncio

import torch

from protocol import version
from protocol.errors import ErrorCode, PeerTimeout, RemoteError
from protocol.messages import RetractReply
from roles.trainer.balancer import WorkerView
from roles.trainer.retraction import KeptHop, KeptSample, KeptSamples, Retractions
from tests.unit.test_stage_skipping import FakeWorkers, K, T, make_driver


def kept(i: int, step: int, peers=("a", "x", "c"), size: int = 4) -> KeptSample:
    hops = [KeptHop(s, p, p, None if s == 0 else torch.zeros(size), None if s == 2 else torch.zeros(size))
            for s, p in enumerate(peers)]
    return KeptSample(f"s{i}", step, torch.zeros(size, dtype=torch.long), hops)


def test_kept_samples_hold_the_latest_three_steps_within_the_byte_cap():
    one = kept(0, 0).nbytes
    assert one == 4 * 8 + 4 * 4 * 4
    store = KeptSamples(max_bytes=6 * one)
    for i in range(3):
        assert store.add(kept(i, 5))
    assert store.add(kept(3, 6)) and store.add(kept(4, 7)) and len(store) == 5
    assert store.add(kept(5, 8)), "step 5 is now three behind: its samples go"
    assert len(store) == 3 and store.dropped == {"old_step": 3}
    assert not store.add(kept(6, 5)), "a sample of a step older than the kept ones is not kept"
    assert store.dropped["old_step"] == 4
    for i in range(7, 12):
        store.add(kept(i, 8))
    assert len(store) == 6 and store.nbytes == 6 * one and store.dropped["bytes"] == 2
    assert [s.sample_id for s in store.take_served_by("x")][:2] == ["s5", "s7"], "oldest first went s3, s4"
    assert len(store) == 0 and store.nbytes == 0


def test_exclusion_retracts_from_every_stage_and_another_replica_of_the_liars():
    sent: list[tuple[int, str, str]] = []
    answers = {"c": RetractReply(outcome="too_late", open_step=3)}

    on_behalf: set[tuple[int, object]] = set()

    async def send(stage, peer, request):
        sent.append((stage, peer, request.sample_id))
        on_behalf.add((stage, request.accumulated_by))
        if peer == "d" or (peer, request.sample_id) == ("y", "s2"):
            raise RemoteError("over budget", ErrorCode.RATE_LIMITED)
        if peer == "e":
            raise PeerTimeout("slow")
        return answers.get(peer, RetractReply(outcome="applied", open_step=2))

    async def go():
        retractions = Retractions(send, lambda stage: {1: ["x", "y", "z"]}.get(stage, []))
        retractions.keep(kept(0, 2))
        retractions.keep(kept(1, 2, ("a", "y", "c")))
        retractions.keep(kept(2, 2, ("d", "x", "e")))
        retractions.exclude(1, "x")
        retractions.keep(kept(3, 2, ("a", "x", "c")))  # in flight when x was excluded
        await retractions.close()
        return retractions

    retractions = asyncio.run(go())
    assert sorted(sent) == sorted([(0, "a", "s0"), (1, "y", "s0"), (2, "c", "s0"),
                                   (0, "d", "s2"), (1, "y", "s2"), (1, "z", "s2"), (2, "e", "s2"),
                                   (0, "a", "s3"), (1, "y", "s3"), (2, "c", "s3")])
    # d refuses and is the only one to ask at its stage; y refuses s2, so z, the next replica, takes it
    assert on_behalf == {(0, None), (1, "x"), (2, None)}, "only x's own stage is asked on its behalf"
    assert retractions.summary() == {"samples": 3, "sent": 10, "applied": 5, "too_late": 2, "ahead": 0,
                                     "unsummed": 0, "refused": 1, "failed": 1, "no_replica": 0, "kept": 1,
                                     "kept_bytes": kept(1, 2).nbytes, "kept_dropped": {}}


def test_a_stage_with_no_other_replica_is_counted():
    async def send(stage, peer, request):
        return RetractReply(outcome="applied", open_step=0)

    async def go():
        retractions = Retractions(send, lambda stage: ["x"])
        retractions.keep(kept(0, 0))
        retractions.exclude(1, "x")
        await retractions.close()
        return retractions.summary()

    summary = asyncio.run(go())
    assert (summary["sent"], summary["no_replica"], summary["applied"]) == (2, 1, 2)


class RetractingWorkers(FakeWorkers):
    """The stage-skipping fakes, answering retractions too (and recording them)."""

    def __init__(self):
        super().__init__()
        self.retracted = []

    async def request(self, peer_id, handler, request, reply, timeout_s=None):
        if handler == version.RETRACT:
            self.retracted.append((request.stage, peer_id.to_base58(), request))
            return RetractReply(outcome="applied", open_step=request.step)
        return await super().request(peer_id, handler, request, reply, timeout_s)


def test_the_driver_keeps_what_each_stage_got_and_retracts_an_excluded_workers_samples():
    driver, fake, _ = make_driver([1, 2, 1])
    fake.__class__ = RetractingWorkers
    fake.retracted = []
    driver._keeps = True
    head, x, y, tail = driver.balancers[0].usable()[0], *driver.balancers[1].usable(), driver.balancers[2].usable()[0]

    async def go():
        results = [await driver.train_sample(f"s{i}", torch.zeros(T, dtype=torch.long)) for i in range(4)]
        driver.balancers[1].update_workers([WorkerView(peer_id=y)])  # what discovery's exclude does
        driver._excluder(None)(1, x, "lied")
        await driver.retractions.close()
        return results

    results = asyncio.run(go())
    by_x = [r for r in results if r.route[1] == x]
    assert 0 < len(by_x) < 4
    retracted = fake.retracted
    assert len(retracted) == 3 * len(by_x)
    assert {(stage, peer) for stage, peer, _ in retracted} == {(0, head), (1, y), (2, tail)}
    assert all(peer != x for _, peer, _ in retracted), "never the excluded worker"
    for stage, _, request in retracted:
        assert request.step == 7  # the tail's tag
        if stage == 1:  # what x was sent: the head's output, and the tail's gradient doubled by nobody
            assert torch.equal(request.coords, torch.zeros(1, T, K) + 1)
            assert torch.equal(request.grad_output, torch.ones(1, T, K))
        elif stage == 0:
            assert request.coords is None and torch.equal(request.grad_output, torch.ones(1, T, K) * 2)
        else:
            assert request.grad_output is None and torch.equal(request.coords, torch.zeros(1, T, K) + 3)
    summary = driver.retractions.summary()
    assert summary["samples"] == len(by_x) and summary["applied"] == 3 * len(by_x)
    assert summary["kept"] == 4 - len(by_x)
