"""A worker takes a sample back out of a step still open (`agora/v1/retract`,
roles/worker/serving/retractions.py): the step's accumulated gradients become those of the other
samples alone, its count loses the sample while the ledger still counts it, a closed step answers
too late and changes nothing, and hostile requests get typed errors."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import PeerID

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import BackwardRequest, ForwardRequest, InfoReply, RetractReply, RetractRequest, to_body
from protocol.run_config import load_run_config
from roles.model.stage import StageModel
from roles.worker.serving.handlers import WorkerHandlers
from roles.worker.serving.queues import TaskQueues
from roles.worker.serving.retractions import Retractions
from roles.worker.serving.runtime import StageRuntime
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.steps.step_ledger import StepLedger

pytestmark = pytest.mark.timeout(60)

RUN = load_run_config("tiny", {"target_batch_size": 4})
PEER = PeerID(b"\x00\x24\x08\x01\x12\x20" + bytes(32))


def make_runtime(stage: int, run=RUN) -> StageRuntime:
    model = StageModel(run, stage)
    optimizer = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), "cpu")
    ledger = StepLedger(run.target_batch_size, assigns=model.kind == "tail")
    return StageRuntime(model, optimizer, TaskQueues(8), stage=stage, vocab_size=run.model.vocab_size,
                        max_seq_len=run.model.max_seq_len, device=torch.device("cpu"), ledger=ledger)


def sample(i: int, stage: int, step: int = 0, run=RUN) -> dict:
    """What the trainer sends stage `stage` for sample i on its backward (and again to retract it)."""
    gen = torch.Generator().manual_seed(i)
    kind = run.stage_kind(stage)
    fields = {"stage": stage, "sample_id": f"s{i}",
              "tokens": torch.randint(0, run.model.vocab_size, (run.seq_len,), generator=gen)}
    if kind != "head":
        fields["coords"] = torch.randn(run.seq_len, run.model.subspace_rank, generator=gen) * 0.1
    if kind != "tail":
        fields["grad_output"] = torch.randn(run.seq_len, run.model.subspace_rank, generator=gen) * 0.01
        fields["step"] = step
    return fields


def backward(runtime: StageRuntime, i: int, step: int = 0) -> None:
    """Sample i's backward, as the compute thread runs a batch of one (the tail tags it `step`)."""
    fields = sample(i, runtime.stage, step)
    runtime._backward_batch([BackwardRequest(**fields)], tag=step if runtime.kind == "tail" else None)


def retract_request(i: int, stage: int, step: int = 0, **changes) -> RetractRequest:
    fields = {**sample(i, stage, step), "step": step, **changes}
    return RetractRequest(**fields)


def grads(runtime: StageRuntime) -> list[torch.Tensor]:
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in runtime.optimizer.params]


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_retracting_a_sample_leaves_the_others_gradients(stage):
    runtime = make_runtime(stage)
    backward(runtime, 1)
    only_a = grads(runtime)
    backward(runtime, 2)
    assert runtime.optimizer.samples_accumulated == 2
    assert any(not torch.allclose(a, b) for a, b in zip(only_a, grads(runtime)))
    reply = Retractions(runtime).apply(retract_request(2, stage))
    assert reply == RetractReply(outcome="applied", open_step=0)
    for a, b in zip(only_a, grads(runtime)):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    assert runtime.optimizer.samples_accumulated == 1, "the step divides by one sample fewer"
    assert runtime.arrived() == (2, 0), "the step still counts it: it closes on schedule"
    assert runtime.ledger.summary()["retracted_samples"] == 1
    assert runtime.counters["retractions_applied"] == 1


def test_a_sample_of_the_next_step_is_retracted_from_the_next_steps_accumulators():
    runtime = make_runtime(1)
    backward(runtime, 1, step=0)
    backward(runtime, 2, step=1)
    open_grads = grads(runtime)
    Retractions(runtime).apply(retract_request(2, 1, step=1))
    opt = runtime.optimizer
    assert (opt.samples_accumulated, opt.next_accumulated) == (1, 0)
    assert all(torch.equal(a, b) for a, b in zip(open_grads, grads(runtime))), "the open step is untouched"
    assert all(g is None or float(g.abs().max()) < 1e-6 for g in opt._next_grads)


@pytest.mark.parametrize("named", [True, False])
def test_a_pinned_backward_is_undone_on_the_weights_it_ran_on(named):
    """Sample 0's forward ran on version 0, a step closed, and its backward was pinned to version
    0's kept weights: the retraction naming version 0 subtracts exactly that gradient; one that
    names no version recomputes on version 1's weights and leaves a remainder."""
    run = load_run_config("tiny", {"target_batch_size": 4, "staleness": {"pin_forward_weights": True}})
    runtime = make_runtime(1, run)
    fields = sample(0, 1, step=1)
    runtime._forward_batch([ForwardRequest(stage=1, sample_id="s0", tokens=fields["tokens"], coords=fields["coords"])])
    backward(runtime, 1, step=0)
    runtime.optimizer.step()
    backward(runtime, 2, step=1)
    only_2 = grads(runtime)
    [result] = runtime._backward_batch([BackwardRequest(**fields)])
    assert result.version == 0, "the backward was pinned to its forward's weights"
    version = result.version if named else None
    Retractions(runtime).apply(retract_request(0, 1, step=1, version=version))
    close = all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(only_2, grads(runtime)))
    assert close == named
    assert runtime.counters["retractions_pinned"] == (1 if named else 0)


@pytest.mark.parametrize("stage", [0, 2])
def test_another_replicas_sample_is_held_as_a_correction_for_the_exchange(stage):
    """The excluded replica X accumulated sample 7; this replica, asked on X's behalf, leaves its
    own step alone and holds the sample's negated gradient for the stage's sum, where it counts
    only if X's gradients are in it (gradient_exchange.add_up)."""
    x = make_runtime(stage)  # what X added for the sample, on the same weights
    backward(x, 7)
    added = x.optimizer.open_gradient_sum()
    runtime = make_runtime(stage)
    runtime.exchange_step = lambda own: None  # the stage adds up its replicas' gradients
    nothing_held = Retractions(runtime).apply(retract_request(7, stage, accumulated_by="X"))
    assert nothing_held.outcome == "applied", "holding no sample of the step is no reason to refuse"
    backward(runtime, 1)
    own = grads(runtime)
    Retractions(runtime).apply(retract_request(7, stage, step=1, accumulated_by="X"))
    assert all(torch.equal(a, b) for a, b in zip(own, grads(runtime))), "its own step is untouched"
    assert runtime.optimizer.samples_accumulated == 1 and runtime.arrived() == (1, 0)
    assert runtime.counters["retractions_on_behalf"] == 2
    [fix] = runtime.corrections.take(0)
    assert fix.peer == "X" and fix.samples == 1
    assert torch.allclose(fix.grad, -added, atol=1e-6, rtol=1e-4)
    assert runtime.corrections.samples(1) == 1, "the next step's correction waits for that step"


def test_another_replicas_sample_is_unsummed_where_replicas_average_weights():
    runtime = make_runtime(1)
    backward(runtime, 1)
    before = grads(runtime)
    reply = Retractions(runtime).apply(retract_request(1, 1, accumulated_by="X"))
    assert reply == RetractReply(outcome="unsummed", open_step=0)
    assert all(torch.equal(a, b) for a, b in zip(before, grads(runtime))) and runtime.corrections.samples(0) == 0
    assert runtime.counters["retractions_unsummed"] == 1


def test_a_closed_step_answers_too_late_and_changes_nothing():
    runtime = make_runtime(1)
    backward(runtime, 1, step=0)
    backward(runtime, 2, step=0)
    runtime.optimizer.step()
    backward(runtime, 3, step=1)
    before = grads(runtime)
    weights = [p.detach().clone() for p in runtime.optimizer.params]
    reply = Retractions(runtime).apply(retract_request(2, 1, step=0))
    assert reply == RetractReply(outcome="too_late", open_step=1)
    assert all(torch.equal(a, b) for a, b in zip(before, grads(runtime)))
    assert all(torch.equal(a, p) for a, p in zip(weights, runtime.optimizer.params))
    assert runtime.optimizer.samples_accumulated == 1 and runtime.counters["retractions_too_late"] == 1
    assert Retractions(runtime).apply(retract_request(2, 1, step=3)).outcome == "ahead"


def test_the_budget_keeps_at_least_half_the_target_in_a_step():
    runtime = make_runtime(1)  # target 4: at most 2 retractions per step
    for i in range(4):
        backward(runtime, i, step=0)
    retractions = Retractions(runtime)
    retractions.apply(retract_request(0, 1))
    retractions.apply(retract_request(1, 1))
    with pytest.raises(ProtocolError) as caught:
        retractions.apply(retract_request(2, 1))
    assert caught.value.code == ErrorCode.RATE_LIMITED
    assert runtime.optimizer.samples_accumulated == 2 and runtime.counters["retractions_refused"] == 1
    with pytest.raises(ProtocolError) as caught:  # nothing of step 1 held here: nothing to take back
        retractions.apply(retract_request(5, 1, step=1))
    assert caught.value.code == ErrorCode.RATE_LIMITED
    assert runtime.optimizer.next_accumulated == 0


def test_hostile_requests_get_typed_errors():
    runtime = make_runtime(1)
    handlers = WorkerHandlers(runtime, lambda: InfoReply(peer_id="x", role="worker"), lambda: True)
    runtime.start()
    rank = RUN.model.subspace_rank

    async def call(body):
        return await handlers.retract(PEER, body)

    def code(body) -> ErrorCode:
        with pytest.raises(ProtocolError) as caught:
            asyncio.run(call(body))
        return caught.value.code

    try:
        good = to_body(retract_request(1, 1))
        assert code({**good, "stage": 2}) == ErrorCode.WRONG_STAGE
        assert code({k: v for k, v in good.items() if k != "step"}) == ErrorCode.INVALID_REQUEST
        assert code(to_body(retract_request(1, 1, coords=torch.zeros(RUN.seq_len, rank + 1)))) == \
            ErrorCode.INVALID_TENSOR
        nan = torch.full((RUN.seq_len, rank), float("nan"))
        assert code(to_body(retract_request(1, 1, grad_output=nan))) == ErrorCode.INVALID_TENSOR
        assert code(to_body(retract_request(1, 1, grad_output=None))) == ErrorCode.INVALID_REQUEST
        assert code(good) == ErrorCode.RATE_LIMITED, "nothing accumulated: nothing to take back"
        runtime.call_on_compute(lambda: backward(runtime, 1), lambda result, exc: None)
        reply = asyncio.run(call(good))
        assert reply.outcome == "applied", "run on the compute thread"
        assert handlers.outcomes[("retract", "ok")] == 1
        assert handlers.outcomes[("retract", "invalid_tensor")] == 2
    finally:
        runtime.stop(5)
    tail = make_runtime(2)
    tail_checks = Retractions(tail)
    with pytest.raises(ProtocolError) as caught:
        asyncio.run(tail_checks.handle(retract_request(1, 2, grad_output=torch.zeros(RUN.seq_len, rank))))
    assert caught.value.code == ErrorCode.INVALID_REQUEST
