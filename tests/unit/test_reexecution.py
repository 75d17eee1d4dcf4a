"""The weights referee: a worker hands over the weights it computed with at one version
(`agora/v1/weights`, roles/worker/serving/weights_server.py), and the trainer re-executes a
disputed hop on each side's weights (roles/trainer/reexecution.py): a side whose claim its own
weights do not compute lied; an honest one, float32 or bfloat16, never is."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
import torch

from protocol.errors import ErrorCode, ProtocolError, RemoteError
from protocol.messages import EvaluateReply, parse_model, to_body
from protocol.run_config import load_run_config
from protocol.state_messages import MAX_WEIGHTS_CHUNK_ELEMENTS, WeightsReply
from roles.model.stage import build_stage_model
from roles.trainer.reexecution import Side, WeightsReferee
from roles.trainer.spot_checks import SpotChecks
from roles.worker.serving.compute_stats import weights_fingerprint
from roles.worker.serving.weights_server import WeightsServer

RUN = load_run_config("tiny")
STAGE = 1
TOLERANCE = RUN.verification.tolerance
gen = torch.Generator().manual_seed(0)
TOKENS = torch.randint(0, RUN.model.vocab_size, (32,), generator=gen)
COORDS = torch.randn(32, RUN.model.subspace_rank, generator=gen)


class Peer:
    def __init__(self, name: str):
        self.name = name

    def to_base58(self) -> str:
        return self.name


class Optimizer:
    """What the weights server reads of a StageOptimizer."""

    def __init__(self, params, version=7, previous=None):
        self.params = params
        self.lock = threading.RLock()
        self.local_step = version
        self.previous = previous
        self.previous_version = None if previous is None else version - 1


class Worker:
    """A stage replica: its module, weights at `version` and what it claims for a hop."""

    def __init__(self, name: str, *, version=7, keep_previous=True, budget_copies=4, chunk=1 << 14, clock=None):
        self.name = name
        self.model = build_stage_model(RUN, STAGE)
        params = self.model.trainable_parameters()
        previous = [p.detach().clone() - 0.01 for p in params] if keep_previous else None
        self.optimizer = Optimizer(params, version, previous)
        self.server = WeightsServer(self.optimizer, run_id=RUN.run_id, stage=STAGE, serving=lambda: True,
                                    max_chunk_elements=chunk, budget_copies=budget_copies,
                                    **({} if clock is None else {"clock": clock}))

    @property
    def fingerprint(self) -> bytes:
        return weights_fingerprint(self.optimizer.params)

    def output(self, autocast=None) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            return self.model(COORDS.unsqueeze(0), TOKENS.unsqueeze(0))[0].float()


async def _ask(worker: Worker, body: dict, peer="trainer") -> WeightsReply:
    reply = await worker.server.handle(Peer(peer), body)
    return parse_model(WeightsReply, to_body(reply))


def _fetcher(workers: dict[str, Worker], between_chunks=None, forge=None):
    calls = []

    async def fetch(stage, peer, request):
        calls.append((peer, request.offset))
        if between_chunks is not None and request.offset > 0:
            between_chunks(workers[peer])
        try:
            reply = await _ask(workers[peer], to_body(request))
        except ProtocolError as exc:  # what the client gets of a typed error reply
            raise RemoteError(str(exc), exc.code) from exc
        if forge is not None and peer == forge:  # other weights under the fingerprint of its own
            reply = reply.model_copy(update={"data": reply.data + 0.01})
        return reply
    return fetch, calls


def _referee(workers, max_bytes=256 << 20, **kwargs):
    fetch, calls = _fetcher(workers, **kwargs)
    return WeightsReferee(fetch, lambda stage: build_stage_model(RUN, stage), max_bytes=max_bytes,
                          tolerance=TOLERANCE, chunk_elements=1 << 14), calls


# ---- the worker's handler ----

def test_hostile_requests_get_typed_errors():
    worker = Worker("a")
    numel = worker.server.numel

    async def codes():
        out = []
        for body in [{"stage": 2, "version": 7, "offset": 0, "count": 10},  # another stage
                     {"stage": STAGE, "version": 9, "offset": 0, "count": 10},  # a version not held
                     {"stage": STAGE, "version": 5, "offset": 0, "count": 10},  # older than the previous
                     {"stage": STAGE, "version": -1, "offset": 0, "count": 10},
                     {"stage": STAGE, "version": 7, "offset": numel + 1, "count": 10},
                     {"stage": STAGE, "version": 7, "offset": 0, "count": MAX_WEIGHTS_CHUNK_ELEMENTS + 1},
                     {"stage": STAGE, "version": 7, "offset": 1 << 70, "count": 1},
                     {"stage": STAGE, "version": "7", "offset": 0, "count": 1},
                     {"stage": STAGE}]:
            try:
                await _ask(worker, body)
                out.append(None)
            except ProtocolError as exc:
                out.append(exc.code)
        return out
    assert asyncio.run(codes()) == [ErrorCode.WRONG_STAGE, ErrorCode.NOT_KEPT, ErrorCode.NOT_KEPT,
                                    *[ErrorCode.INVALID_REQUEST] * 6]
    assert worker.server.counters["weights_refused_not_kept"] == 2


def test_weights_are_served_at_the_current_and_the_previous_version_in_bounded_chunks():
    worker = Worker("a", chunk=1000)
    params, previous = worker.optimizer.params, worker.optimizer.previous
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    flat_previous = torch.cat([p.reshape(-1) for p in previous])

    async def main():
        current = await _ask(worker, {"stage": STAGE, "version": 7, "offset": 5, "count": 1 << 20})
        older = await _ask(worker, {"stage": STAGE, "version": 6, "offset": 0, "count": 700})
        described = await _ask(worker, {"stage": STAGE, "version": 7, "offset": 0, "count": 0})
        return current, older, described
    current, older, described = asyncio.run(main())
    assert current.data.numel() == 1000 and torch.equal(current.data, flat[5:1005])  # capped at the chunk
    assert current.version == 7 and current.weights == weights_fingerprint(params) and current.dtype == "float32"
    assert older.version == 6 and torch.equal(older.data, flat_previous[:700])
    assert older.weights == weights_fingerprint(previous)
    assert described.data is None and described.numel == flat.numel()
    assert worker.server.counters["weights_bytes_served"] == 4 * 1700


def test_a_peer_that_fetches_in_a_loop_runs_out_of_budget_and_the_budget_refills():
    now = [0.0]
    worker = Worker("a", budget_copies=2, chunk=MAX_WEIGHTS_CHUNK_ELEMENTS, clock=lambda: now[0])
    numel = worker.server.numel
    body = {"stage": STAGE, "version": 7, "offset": 0, "count": numel}

    async def main():
        await _ask(worker, body)
        await _ask(worker, body)
        with pytest.raises(ProtocolError) as refused:
            await _ask(worker, body)
        await _ask(worker, body, peer="another-trainer")  # a budget per peer
        now[0] += worker.server.window_s / 2  # one copy's worth back
        await _ask(worker, body)
        for _ in range(1000):  # descriptions only, in a loop: they cost too
            try:
                await _ask(worker, {**body, "count": 0}, peer="a-third")
            except ProtocolError as exc:
                return refused.value.code, exc.code
    assert asyncio.run(main()) == (ErrorCode.RATE_LIMITED, ErrorCode.RATE_LIMITED)
    assert worker.server.counters["weights_refused_budget"] == 2


# ---- the trainer's re-execution ----

def _judge(referee, sides):
    return asyncio.run(referee.judge(STAGE, 7, TOKENS, COORDS, sides))


def test_re_execution_convicts_a_scaled_a_stale_and_a_biased_output_and_never_an_honest_one():
    liar, honest = Worker("liar"), Worker("honest")
    truth = honest.output()
    with torch.no_grad():  # a replay on older weights, far enough back that the outputs dispute
        old = build_stage_model(RUN, STAGE)
        for p in old.trainable_parameters():
            p.add_(16 * RUN.optimizer.lr * torch.randn(p.shape, generator=gen).sign())
        stale = old(COORDS.unsqueeze(0), TOKENS.unsqueeze(0))[0].float()
    assert (stale - truth).norm() > TOLERANCE * truth.norm()
    referee, _ = _referee({"liar": liar, "honest": honest})
    for lie in (truth * 3, stale, truth + 0.1):
        gaps = _judge(referee, [Side("liar", lie, liar.fingerprint), Side("honest", truth, honest.fingerprint)])
        assert gaps[0] > TOLERANCE and gaps[1] == 0.0, gaps
    # a bfloat16 worker beside a float32 one, and the wire's bfloat16: within the tolerance
    bf16 = honest.output(autocast=torch.bfloat16)
    gaps = _judge(referee, [Side("liar", bf16, liar.fingerprint),
                            Side("honest", truth.to(torch.bfloat16), honest.fingerprint)])
    assert 0 < gaps[0] <= TOLERANCE / 2 and gaps[1] <= TOLERANCE / 2, gaps
    assert referee.counts["verdicts"] == 3 and referee.no_verdict == {"self_consistent": 1}
    assert referee.counts["kept"] > 0  # one version's weights fetched once per side


def test_weights_that_do_not_carry_their_fingerprint_convict_their_side():
    liar, honest = Worker("liar"), Worker("honest")
    referee, _ = _referee({"liar": liar, "honest": honest}, forge="liar")
    truth = honest.output()
    gaps = _judge(referee, [Side("liar", truth, liar.fingerprint), Side("honest", truth, honest.fingerprint)])
    assert gaps == [float("inf"), 0.0] and referee.counts["forged"] == 1


def test_a_side_that_does_not_hand_its_weights_over_is_held_against_the_other_side_s():
    liar, honest = Worker("liar"), Worker("honest")
    truth = honest.output()
    fetch, _ = _fetcher({"liar": liar, "honest": honest})

    def refusing(who):
        async def fetch_but(stage, peer, request):  # `who` never answers the referee
            if peer == who:
                raise RemoteError("no", ErrorCode.RATE_LIMITED)
            return await fetch(stage, peer, request)
        return WeightsReferee(fetch_but, lambda stage: build_stage_model(RUN, stage), max_bytes=256 << 20,
                              tolerance=TOLERANCE, chunk_elements=1 << 14)
    referee = refusing("liar")
    gaps = _judge(referee, [Side("liar", truth * 3, liar.fingerprint), Side("honest", truth, honest.fingerprint)])
    assert gaps[0] > TOLERANCE and gaps[1] == 0.0 and referee.counts["crossed"] == 1, gaps
    # the honest side unable to answer, the liar handing over its true weights: the liar is wrong by
    # its own, and what does not compute its own claim judges nobody else
    referee = refusing("honest")
    gaps = _judge(referee, [Side("honest", truth, honest.fingerprint), Side("liar", truth * 3, liar.fingerprint)])
    assert gaps[0] is None and gaps[1] > TOLERANCE and referee.counts["crossed"] == 0, gaps
    # nothing to hold it against when the other side signed other weights
    referee = refusing("liar")
    gaps = _judge(referee, [Side("liar", truth * 3, liar.fingerprint), Side("honest", truth, bytes(8))])
    assert gaps is None


def test_no_verdict_over_budget_for_a_version_not_kept_or_weights_that_moved():
    a, b = Worker("a", keep_previous=False), Worker("b", keep_previous=False)
    truth = a.output()
    sides = [Side("a", truth * 3, a.fingerprint), Side("b", truth, b.fingerprint)]
    small, calls = _referee({"a": a, "b": b}, max_bytes=1000)
    assert _judge(small, sides) is None and small.no_verdict == {"over_budget": 1} and not calls

    def step(worker):  # a step between two chunks, the old version not kept
        worker.optimizer.local_step += 1
    stepped, _ = _referee({"a": a, "b": b}, between_chunks=step)
    assert _judge(stepped, sides) is None and stepped.no_verdict == {"not_kept": 1}

    a, b = Worker("a"), Worker("b")

    def average(worker):  # the weights edited at the same version (an averaging round) between chunks
        with torch.no_grad():
            for p in worker.optimizer.params:
                p.mul_(1.001)
    moved, _ = _referee({"a": a, "b": b}, between_chunks=average)
    assert _judge(moved, [Side("a", truth * 3, a.fingerprint), Side("b", truth, b.fingerprint)]) is None
    assert moved.no_verdict == {"moved": 1}
    # a set whose fingerprint now is not the one it signed: its weights moved since it computed
    later, _ = _referee({"a": a, "b": b})
    assert _judge(later, [Side("a", truth * 3, bytes(8)), Side("b", truth, bytes(8))]) is None
    assert later.no_verdict == {"moved": 1}


def test_a_spot_check_dispute_goes_to_the_re_execution_and_excludes_the_liar_either_side():
    liar, honest = Worker("liar"), Worker("honest")
    truth = honest.output()
    referee, _ = _referee({"liar": liar, "honest": honest})
    excluded = []

    async def evaluate(stage, peer, request):  # the liar scales whatever it is asked to compute too
        return EvaluateReply(coords=truth * 3 if peer == "liar" else truth, version=7,
                             weights=liar.fingerprint if peer == "liar" else honest.fingerprint)

    async def losses(stage, tokens, outputs):  # the loss would put the honest side in the wrong
        return [2.0, 3.0] if outputs[0] is truth else [3.0, 2.0]

    async def main():
        checks = SpotChecks(1.0, TOLERANCE, evaluate, lambda stage: ["liar", "honest"], random.Random(0),
                            losses=losses, exclude=lambda stage, peer, why: excluded.append((peer, why)),
                            weights_referee=referee)
        for worker, claimed in [("liar", truth * 3), ("honest", truth), ("liar", truth * 3)]:
            checks.check_forward(STAGE, worker, TOKENS, COORDS, claimed, 7,
                                 weights=liar.fingerprint if worker == "liar" else honest.fingerprint)
            while checks._tasks:
                await asyncio.sleep(0.01)
        return checks
    checks = asyncio.run(main())
    summary = checks.summary()
    assert summary["strikes_by_mechanism"] == {"liar": {"reexecuted": 3}}, summary
    assert [peer for peer, _ in excluded] == ["liar"]
    assert "distance from what its own weights compute" in excluded[0][1]
    assert all(d["reexecuted"] and d["struck"] == "liar" for d in summary["disputes"])
    assert summary["referee"]["verdicts"] == 3 and summary["referee"]["fetched"] == 2
