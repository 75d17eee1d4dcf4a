"""Held-out evaluation in-process: the worker's `agora/v1/evaluate` handler validates what it is sent,
answers typed errors, bounds its threads and leaves every training count as it was; the trainer's
evaluator runs at step 0 and then once per `every_steps`, one at a time, leaves out samples that
fail, and is cancelled at once on stop."""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from corpus.sample import Sample
from protocol.errors import AgoraError, ErrorCode, ProtocolError
from protocol.messages import EvaluateRequest, InfoReply, to_body
from protocol.run_config import EvaluationConfig, load_run_config
from roles.model.stage import StageModel
from roles.trainer.evaluation import HeldOutEvaluator
from roles.trainer.pipeline import EvaluatedSample, SampleDropped
from roles.worker.serving import handlers as worker_handlers
from roles.worker.serving.handlers import WorkerHandlers
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.serving.queues import TaskQueues
from roles.worker.serving.runtime import StageRuntime

pytestmark = pytest.mark.timeout(60)

RUN = load_run_config("tiny")
TAIL = RUN.num_stages - 1


def _handlers(stage: int, serving: bool = True) -> WorkerHandlers:
    model = StageModel(RUN, stage)
    optimizer = StageOptimizer.for_stage(RUN, stage, model.trainable_parameters(), "cpu")
    runtime = StageRuntime(model, optimizer, TaskQueues(8), stage=stage, vocab_size=RUN.model.vocab_size,
                           max_seq_len=RUN.model.max_seq_len, device=torch.device("cpu"))
    return WorkerHandlers(runtime, lambda: InfoReply(peer_id="p", role="worker"), lambda: serving)


def _tokens(n: int = RUN.seq_len) -> torch.Tensor:
    return torch.randint(0, RUN.model.vocab_size, (n,), generator=torch.Generator().manual_seed(n))


def _coords(n: int = RUN.seq_len) -> torch.Tensor:
    return torch.randn(n, RUN.model.subspace_rank, generator=torch.Generator().manual_seed(1)) * 0.1


def _body(for_stage: int, **fields) -> dict:
    body = to_body(EvaluateRequest(stage=for_stage, sample_id="eval0-0", tokens=_tokens(),
                                   coords=None if for_stage == 0 else _coords()))
    body.update(fields)
    return {k: v for k, v in body.items() if v is not None}


def _refused(handlers: WorkerHandlers, body) -> ErrorCode:
    with pytest.raises(AgoraError) as caught:  # typed: the RPC server answers with its code
        asyncio.run(handlers.evaluate(None, body))
    return caught.value.code


def test_evaluate_answers_typed_errors_for_bad_requests():
    head, tail = _handlers(0), _handlers(TAIL)
    assert _refused(head, _body(0, stage=1)) == ErrorCode.WRONG_STAGE
    assert _refused(head, {"stage": 0}) == ErrorCode.INVALID_REQUEST
    assert _refused(head, ["not", "a", "map"]) == ErrorCode.INVALID_REQUEST
    float_tokens = to_body(EvaluateRequest(stage=0, sample_id="x", tokens=torch.zeros(8)))["tokens"]
    assert _refused(head, _body(0, tokens=float_tokens)) == ErrorCode.INVALID_TENSOR
    too_large = to_body(EvaluateRequest(stage=0, sample_id="x", tokens=torch.full((8,), RUN.model.vocab_size)))
    assert _refused(head, _body(0, tokens=too_large["tokens"])) == ErrorCode.INVALID_TENSOR
    assert _refused(head, _body(0, coords=to_body(EvaluateRequest(stage=0, sample_id="x", tokens=_tokens(),
                                                                  coords=_coords()))["coords"])) \
        == ErrorCode.INVALID_REQUEST  # the head embeds tokens itself
    assert _refused(tail, _body(TAIL, coords=None)) == ErrorCode.INVALID_REQUEST
    nan = _coords()
    nan[0, 0] = math.nan
    nan_body = to_body(EvaluateRequest(stage=0, sample_id="x", tokens=_tokens(), coords=nan))
    assert _refused(tail, _body(TAIL, coords=nan_body["coords"])) == ErrorCode.INVALID_TENSOR
    one = to_body(EvaluateRequest(stage=TAIL, sample_id="x", tokens=_tokens(1), coords=_coords(1)))
    assert _refused(tail, one) == ErrorCode.INVALID_TENSOR  # the tail needs a next token to predict
    assert _refused(_handlers(0, serving=False), _body(0)) == ErrorCode.NOT_READY
    assert head.runtime.counters["eval_requests"] == 0 and tail.runtime.counters["eval_requests"] == 0
    assert head.outcomes[("evaluate", "wrong_stage")] == 1 and head.outcomes[("evaluate", "invalid_tensor")] == 2


_HEAD = _handlers(0)
_TENSORS = st.builds(lambda dtype, shape, data: {"dtype": dtype, "shape": shape, "data": data},
                     st.sampled_from(["int64", "int32", "float32", "bfloat16", "nope"]),
                     st.lists(st.integers(-2, 70), max_size=3), st.binary(max_size=600))
_BODIES = st.fixed_dictionaries({}, optional={
    "stage": st.one_of(st.integers(-3, 5), st.text(max_size=3), st.none()),
    "sample_id": st.one_of(st.text(max_size=200), st.integers()),
    "tokens": st.one_of(_TENSORS, st.just(to_body(EvaluateRequest(stage=0, sample_id="x", tokens=_tokens()))["tokens"])),
    "coords": _TENSORS,
})


@given(body=st.one_of(_BODIES, st.lists(st.integers(), max_size=3), st.text(max_size=5)))
@settings(max_examples=150, deadline=None)
def test_any_body_gets_a_reply_or_a_typed_error(body):
    try:
        asyncio.run(_HEAD.evaluate(None, body))
    except AgoraError as exc:
        assert isinstance(exc.code, ErrorCode)


def test_evaluate_computes_without_touching_training_counts():
    head, tail = _handlers(0), _handlers(TAIL)
    reply = asyncio.run(head.evaluate(None, _body(0)))
    assert reply.loss is None and reply.version == 0
    assert reply.coords.shape == (RUN.seq_len, RUN.model.subspace_rank) and reply.coords.dtype == torch.float32
    answer = asyncio.run(tail.evaluate(None, _body(TAIL, coords=to_body(EvaluateRequest(
        stage=TAIL, sample_id="x", tokens=_tokens(), coords=reply.coords))["coords"])))
    assert answer.coords is None and math.isfinite(answer.loss) and answer.loss > 0
    with torch.no_grad():
        expected = tail.runtime.model(reply.coords.unsqueeze(0), _tokens().unsqueeze(0))
    assert answer.loss == pytest.approx(float(expected[0]), rel=1e-5), "the tail's per-sample mean loss"
    for handlers in (head, tail):
        runtime = handlers.runtime
        assert runtime.counters["eval_requests"] == 1
        assert runtime.counters["forward_requests"] == 0 and runtime.counters["backward_requests"] == 0
        assert runtime.forwarded.peek("eval0-0") is None and runtime.forwarded.in_flight(60) == 0
        assert runtime.optimizer.samples_accumulated == 0 and runtime.ledger.step_sizes == []
        assert all(p.grad is None for p in runtime.model.parameters()), "no gradient"
        assert handlers.outcomes[("evaluate", "ok")] == 1


def test_waiting_evaluations_are_bounded(monkeypatch):
    """While the stage is busy (its optimizer lock held), two evaluations compute, a few wait,
    and the next caller is told the worker is overloaded instead of queueing a thread."""
    monkeypatch.setattr(worker_handlers, "EVALUATIONS_WAITING_MAX", 3)
    head = _handlers(0)

    async def scenario():
        lock = head.runtime.optimizer.lock
        lock.acquire()  # the event loop's thread holds it: the evaluation threads block on it
        try:
            calls = [asyncio.ensure_future(head.evaluate(None, _body(0))) for _ in range(2 + 3)]
            await asyncio.sleep(0.2)
            with pytest.raises(ProtocolError) as caught:
                await head.evaluate(None, _body(0))
            assert caught.value.code == ErrorCode.OVERLOADED
            assert not any(call.done() for call in calls)
        finally:
            lock.release()
        replies = await asyncio.gather(*calls)
        assert all(r.coords is not None for r in replies)

    asyncio.run(scenario())
    assert head.runtime.counters["eval_requests"] == 5 and head.outcomes[("evaluate", "overloaded")] == 1


class FakeDriver:
    """The pipeline as the evaluator sees it: a loss per held-out sample, after `delay_s`."""

    def __init__(self, delay_s: float = 0.0, fail: frozenset[int] = frozenset()):
        self.delay_s, self.fail = delay_s, fail
        self.calls: list[str] = []
        self.in_flight = self.max_in_flight = 0
        self.version = 0

    async def evaluate_sample(self, sample_id: str, tokens: torch.Tensor) -> EvaluatedSample:
        self.calls.append(sample_id)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        index = int(sample_id.rsplit("-", 1)[1])
        if index in self.fail:
            raise SampleDropped("worker_failures", "stage 1: 3 worker(s) failed")
        return EvaluatedSample(loss=float(index), version=self.version)


def _samples(n: int) -> list[Sample]:
    return [Sample(f"heldout-{i}", torch.zeros(4, dtype=torch.int64)) for i in range(n)]


async def _settle(evaluator: HeldOutEvaluator) -> None:
    while evaluator.running:
        await asyncio.sleep(0.01)


def test_evaluations_run_at_step_0_then_every_n_steps_one_at_a_time():
    driver = FakeDriver(fail=frozenset({3}))
    loads = []
    seen = []

    def load():
        loads.append(1)
        return _samples(8)

    async def scenario():
        evaluator = HeldOutEvaluator(EvaluationConfig(every_steps=5, samples=8), driver, load,
                                     on_result=seen.append, in_flight=2)
        evaluator.saw_step(None)
        assert not evaluator.running
        evaluator.saw_step(0)
        evaluator.saw_step(7)  # due, but one evaluation runs already: it waits for the next sample
        await _settle(evaluator)
        evaluator.saw_step(4)  # an older tag arrives late: the step due is still the highest seen
        await _settle(evaluator)
        evaluator.saw_step(9)
        assert not evaluator.running
        evaluator.saw_step(12)  # crossed 10: one evaluation, at the step seen
        await _settle(evaluator)
        evaluator.saw_step(14)
        assert not evaluator.running
        evaluator.saw_step(15)
        await _settle(evaluator)
        return evaluator

    evaluator = asyncio.run(scenario())
    assert [r.step for r in evaluator.results] == [0, 7, 12, 15] and seen == evaluator.results
    first = evaluator.results[0]
    assert first.samples == 7 and first.dropped == 1, "the failed sample is left out and counted"
    assert first.loss == pytest.approx(sum(i for i in range(8) if i != 3) / 7)
    assert first.perplexity == pytest.approx(math.exp(first.loss))
    assert first.stderr == pytest.approx(statistics.stdev(i for i in range(8) if i != 3) / math.sqrt(7))
    assert evaluator.evaluations == 4 and len(loads) == 1, "the samples are loaded once"
    assert driver.max_in_flight == 2
    assert evaluator.summary()[0] == {"step": 0, "loss": round(first.loss, 6), "perplexity": round(first.perplexity, 4),
                                      "stderr": round(first.stderr, 6),
                                      "samples": 7, "dropped": 1, "seconds": round(first.seconds, 3),
                                      "versions": [0, 0]}


def test_a_running_evaluation_is_cancelled_at_once_and_none_starts_after():
    driver = FakeDriver(delay_s=30.0)

    async def scenario():
        evaluator = HeldOutEvaluator(EvaluationConfig(every_steps=2, samples=4), driver, lambda: _samples(4))
        evaluator.saw_step(0)
        await asyncio.sleep(0.1)
        assert evaluator.running and driver.in_flight == 4
        started = time.monotonic()
        await evaluator.close()
        assert time.monotonic() - started < 1.0
        evaluator.saw_step(10)
        assert not evaluator.running and evaluator.results == []
        return driver

    assert asyncio.run(scenario()).in_flight == 0


def test_conclude_takes_a_last_evaluation_at_the_last_step_seen():
    driver = FakeDriver(delay_s=0.01)

    async def scenario():
        evaluator = HeldOutEvaluator(EvaluationConfig(every_steps=100, samples=2), driver, lambda: _samples(2))
        evaluator.saw_step(0)
        evaluator.saw_step(42)
        await evaluator.conclude(asyncio.Event(), 10.0)
        steps = [r.step for r in evaluator.results]
        await evaluator.conclude(asyncio.Event(), 10.0)  # the last step was evaluated already
        return steps, [r.step for r in evaluator.results]

    assert asyncio.run(scenario()) == ([0, 42], [0, 42])


def test_a_split_smaller_than_the_count_is_used_whole_and_said_once(caplog):
    driver = FakeDriver()

    async def scenario():
        evaluator = HeldOutEvaluator(EvaluationConfig(every_steps=1, samples=512), driver, lambda: _samples(3))
        evaluator.saw_step(0)
        await _settle(evaluator)
        evaluator.saw_step(1)
        await _settle(evaluator)
        return [r.samples for r in evaluator.results]

    with caplog.at_level(logging.INFO, logger="roles.trainer.evaluation"):
        assert asyncio.run(scenario()) == [3, 3]
    said = [r.getMessage() for r in caplog.records if "fewer than evaluation.samples" in r.getMessage()]
    assert said == ["held-out evaluation: the held-out split holds 3 samples, fewer than evaluation.samples (512); "
                    "every evaluation uses all of them"]
