"""Worker-to-worker routing's edges that need no network: the chain request's bounds, the route a
worker accepts, where it looks up the next stage's workers, and what the trainer's balancers learn
from a chain's reply."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hivemind.p2p import PeerID

from protocol.dht_schema import Phase, WorkerRecord
from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import ChainHop, ChainReply, ChainRequest, ChainStage, parse_model, to_body
from protocol.run_config import RoutingConfig
from roles.trainer.balancer import StageBalancer, WorkerView
from roles.trainer.chained import ChainedRouting
from roles.trainer.pipeline import PipelineDriver, SampleDropped
from roles.worker.serving.chain import ChainHandler, StageDirectory
from roles.worker.serving.compute_stats import RecentSamples

TOKENS = torch.arange(8, dtype=torch.int64)
_PEER = PeerID.from_base58("QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")


def _request(**fields):
    body = to_body(ChainRequest(stage=0, sample_id="s", tokens=TOKENS, route=[ChainHop(stage=1, workers=["w"])],
                                budget_s=5.0))
    body.update(fields)
    return body


@pytest.mark.parametrize("fields", [
    {"budget_s": 0.0}, {"budget_s": -1.0}, {"budget_s": 1e9},
    {"route": [{"stage": 1, "workers": []}]},
    {"route": [{"stage": 1, "workers": ["w"] * 9}]},
    {"route": [{"stage": 1, "workers": ["w"]}] * 65},
    {"route": [{"stage": -1, "workers": ["w"]}]},
    {"route": [{"stage": 1, "workers": ["x" * 129]}]},
])
def test_a_chain_request_out_of_bounds_is_refused(fields):
    with pytest.raises(ProtocolError) as refused:
        parse_model(ChainRequest, _request(**fields))
    assert refused.value.code == ErrorCode.INVALID_REQUEST


class _Runtime:
    def __init__(self, stage, kind):
        self.stage, self.kind = stage, kind


class _Handlers:
    def __init__(self, stage, kind):
        self.runtime = _Runtime(stage, kind)


def _handler(stage, kind, num_stages=4):
    return ChainHandler(_Handlers(stage, kind), client=None, p2p=None, directory=None, peer_id="me",
                        num_stages=num_stages)


@pytest.mark.parametrize("stage, kind, route, ok", [
    (0, "head", [1, 2, 3], True),
    (0, "head", [1, 3], True),          # stage 2 skipped
    (1, "body", [2, 3], True),
    (3, "tail", [], True),
    (0, "head", [1, 2], False),         # does not end at the tail
    (0, "head", [2, 1, 3], False),      # out of order
    (1, "body", [1, 2, 3], False),      # names its own stage
    (0, "head", [], False),
    (3, "tail", [3], False),
])
def test_a_worker_takes_only_a_route_of_later_stages_that_ends_at_the_tail(stage, kind, route, ok):
    request = ChainRequest(stage=stage, sample_id="s", tokens=TOKENS, budget_s=5.0,
                           route=[ChainHop(stage=s, workers=["w"]) for s in route])
    handler = _handler(stage, kind)
    if ok:
        handler._check_route(request)
    else:
        with pytest.raises(ProtocolError):
            handler._check_route(request)


def test_the_directory_lists_only_live_workers_of_the_stage_and_reads_at_most_once_a_second():
    reads = []

    async def get(key, model):
        reads.append(key)
        await asyncio.sleep(0.01)
        return {"a": WorkerRecord(stage=2, max_batch=1, throughput=1.0, maddrs=["/ip4/127.0.0.1/tcp/1"]),
                "b": WorkerRecord(stage=2, phase=Phase.LEAVING, max_batch=1, throughput=1.0),
                "c": WorkerRecord(stage=1, max_batch=1, throughput=1.0)}

    async def main():
        directory = StageDirectory(get, "run")
        found = await asyncio.gather(*(directory.addresses(2, peer) for peer in ("a", "b", "c", "a")))
        assert found == [["/ip4/127.0.0.1/tcp/1"], None, None, ["/ip4/127.0.0.1/tcp/1"]]
        assert len(reads) == 1, "concurrent lookups share one read"
        assert await directory.addresses(2, "stranger") is None
        assert len(reads) == 1, "a stranger named again within a second is not read for"

    asyncio.run(main())


def _driver(workers_per_stage):
    balancers = []
    for stage, peers in enumerate(workers_per_stage):
        balancer = StageBalancer(stage)
        balancer.update_workers([WorkerView(peer, throughput=10.0) for peer in peers])
        balancers.append(balancer)

    async def connect(peer):
        pass

    return PipelineDriver(client=None, balancers=balancers, connect=connect)


def test_the_route_names_the_balancers_choice_first_and_skips_a_body_stage_without_workers():
    driver = _driver([["h1", "h2"], [], ["t1"]])
    hops, skipped = ChainedRouting(driver, RoutingConfig(path="workers", candidates=2))._route()
    assert [hop.stage for hop in hops] == [0, 2] and skipped == [1]
    assert hops[0].workers == ["h1", "h2"] and hops[1].workers == ["t1"]
    again, _ = ChainedRouting(driver, RoutingConfig(path="workers", candidates=2))._route()
    assert again[0].workers[0] == "h2", "the first choice was charged: the next route starts elsewhere"
    no_tail = _driver([["h1"], ["b1"], []])
    with pytest.raises(SampleDropped) as dropped:
        ChainedRouting(no_tail, RoutingConfig(path="workers"))._route()
    assert dropped.value.reason == "no_workers"


def test_the_balancers_learn_who_ran_each_stage_and_ban_the_candidates_that_failed():
    driver = _driver([["h1"], ["b1", "b2"], ["t1"]])
    chained = ChainedRouting(driver, RoutingConfig(path="workers"))
    hops, _ = chained._route()
    assert hops[1].workers[0] == "b1"
    reply = ChainReply(stages=[ChainStage(stage=0, worker="h1", version=0, elapsed_s=0.1),
                               ChainStage(stage=1, worker="b2", version=0, elapsed_s=0.2, failed=["b1"]),
                               ChainStage(stage=2, worker="t1", version=0, elapsed_s=0.3)],
                       loss=1.0, step=0)
    route = chained._settle(hops, [], reply)
    assert route == ["h1", "b2", "t1"]
    assert driver.balancers[1].is_banned("b1") and not driver.balancers[1].is_banned("b2")
    assert driver.stats.forward_retries == 1


class _QueueingRuntime:
    """Stands in for StageRuntime around one chained sample at a head: its forward and its
    backward are queued; what the chain releases is recorded."""

    stage, kind = 0, "head"

    def __init__(self, withdrawable: bool):
        self.withdrawable = withdrawable
        self.submitted, self.forgotten, self.abandoned = [], [], []
        self.forwarded = RecentSamples()
        self.fingerprints = {}

    def check_forward(self, request):
        pass

    def check_backward(self, request):
        pass

    def submit(self, kind, request, on_done, caller):
        self.submitted.append(kind)
        if kind.value == "forward":
            on_done(torch.zeros(8, 4), None)  # the forward runs at once; the backward stays queued
        return kind

    def withdraw(self, task):
        return self.withdrawable

    def forget_forward(self, sample_id):
        self.forgotten.append(sample_id)

    def abandon(self, step, sample_id=None):
        self.abandoned.append((step, sample_id))
        return True


@pytest.mark.parametrize("withdrawable", [True, False])
def test_a_tagged_sample_whose_caller_left_before_its_backward_ran_is_abandoned_at_this_stage(withdrawable):
    """Cancelled while its backward is queued: withdrawn unrun, the step it was tagged for must not
    wait for it; if the compute thread took it already, it still counts and is not abandoned."""
    from roles.worker.serving.handlers import WorkerHandlers

    async def main():
        runtime = _QueueingRuntime(withdrawable)
        handlers = WorkerHandlers(runtime, info=lambda: None, serving=lambda: True)
        handler = ChainHandler(handlers, client=None, p2p=None, directory=None, peer_id="me", num_stages=2)

        async def tail_answers(request, route, coords, *, deadline, **signatures):
            return ChainReply(stages=[ChainStage(stage=1, worker="t", version=0, elapsed_s=0.1)], loss=1.0, step=7,
                              grad_input=torch.zeros(8, 4))

        handler._pass_on = tail_answers
        request = to_body(ChainRequest(stage=0, sample_id="s-1", tokens=TOKENS, coords=None,
                                       route=[ChainHop(stage=1, workers=["t"])], budget_s=5.0))
        call = asyncio.ensure_future(handler.chain(_PEER, request))
        async def backward_queued():
            while len(runtime.submitted) < 2 and not call.done():
                await asyncio.sleep(0.001)
        await asyncio.wait_for(backward_queued(), 10.0)
        assert not call.done(), call.result() if not call.exception() else call.exception()
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        return runtime

    runtime = asyncio.run(main())
    if withdrawable:
        assert runtime.abandoned == [(7, "s-1")] and runtime.forgotten == ["s-1"]
    else:
        assert runtime.abandoned == [] and runtime.forgotten == []


def test_a_next_worker_that_cannot_be_reached_is_dialled_again_at_the_addresses_read_anew(monkeypatch):
    """A worker restarted elsewhere with the same identity: its old addresses fail once, then the
    stage's records are read again and the new ones dialled."""
    from protocol.errors import PeerUnavailable
    from roles.worker.serving import chain as chain_module

    peer = _PEER.to_base58()
    listed = {"now": ["/ip4/127.0.0.1/tcp/1"]}
    dialled = []

    async def get(key, model):
        return {peer: WorkerRecord(stage=1, max_batch=1, throughput=1.0, maddrs=listed["now"])}

    async def dial(p2p, peer_id, addresses):
        dialled.append(list(addresses))

    class Client:
        async def request(self, peer_id, handler, request, reply, timeout_s):
            if dialled[-1] == ["/ip4/127.0.0.1/tcp/1"]:
                raise PeerUnavailable("stream closed by peer")
            return ChainReply(stages=[ChainStage(stage=1, worker=peer, version=0, elapsed_s=0.1)], loss=1.0, step=0,
                              grad_input=torch.zeros(8, 4))

    monkeypatch.setattr(chain_module, "dial", dial)
    monkeypatch.setattr(chain_module, "LOOKUP_MIN_INTERVAL_S", 0.0)

    async def main():
        handler = ChainHandler(_Handlers(0, "head"), client=Client(), p2p=None, directory=StageDirectory(get, "run"),
                               peer_id="me", num_stages=2)
        request = ChainRequest(stage=0, sample_id="s", tokens=TOKENS, route=[ChainHop(stage=1, workers=[peer])],
                               budget_s=5.0)
        first = await handler._pass_on(request, list(request.route), torch.zeros(8, 4), deadline=time.monotonic() + 5)
        assert first.dropped == "worker_failures"
        listed["now"] = ["/ip4/127.0.0.1/tcp/2"]  # it came back on another port
        second = await handler._pass_on(request, list(request.route), torch.zeros(8, 4), deadline=time.monotonic() + 5)
        assert second.dropped is None and second.loss == 1.0

    asyncio.run(main())
    assert dialled == [["/ip4/127.0.0.1/tcp/1"], ["/ip4/127.0.0.1/tcp/2"]]


def test_workers_too_old_to_chain_are_kept_off_routes_and_a_stage_of_only_them_goes_the_trainer_way(caplog):
    driver = _driver([["h1", "h-old"], ["b-old"], ["t1"]])
    old = {"h-old": "agora-node 0.9.0", "b-old": "an older agora-node"}
    chained = ChainedRouting(driver, RoutingConfig(path="workers", candidates=3),
                             describe_worker=lambda stage, peer: old.get(peer))
    with caplog.at_level("WARNING"):
        assert chained._route() is None, "stage 1 has no worker that chains"
        assert chained._route() is None
    named = [r.getMessage() for r in caplog.records if "cannot pass samples worker to worker" in r.getMessage()]
    assert len(named) == 2 and any("0.9.0" in line for line in named), "each old worker named once"
    assert all(b.snapshot()[p]["dispatched"] == 0 for b in driver.balancers for p in b.known()), \
        "the first choices charged before the fallback were refunded"

    old.pop("b-old")  # upgraded
    hops, skipped = chained._route()
    assert [hop.workers for hop in hops] == [["h1"], ["b-old"], ["t1"]] and skipped == []


def test_a_worker_announces_that_it_chains_and_an_old_record_reads_as_not():
    assert WorkerRecord(stage=0, max_batch=1, throughput=1.0).chain is False
    body = WorkerRecord(stage=0, max_batch=1, throughput=1.0, chain=True).model_dump()
    assert WorkerRecord.model_validate(body).chain is True
