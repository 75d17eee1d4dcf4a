"""A spot check re-executes a backward through `agora/v1/evaluate`: the same input gradient a
backward sends, at the weight version asked for, and nothing accumulated in the worker."""

import pytest
import torch

from protocol.errors import ProtocolError
from protocol.messages import EvaluateRequest
from protocol.run_config import load_run_config
from tests.unit.test_adversary import BODY, HEAD, TAIL, backward, coords, make_runtime, tokens


def _evaluate(runtime, stage, i, **extra):
    request = EvaluateRequest(stage=stage, sample_id=f"c{i}", tokens=tokens(i), coords=coords(i), **extra)
    runtime.check_evaluate(request)
    return runtime.evaluate(request)


@pytest.mark.parametrize("stage", [BODY, TAIL])
def test_the_input_gradient_equals_the_backwards_and_accumulates_nothing(stage):
    runtime = make_runtime(stage)
    extra = {"input_grad": True} if stage == TAIL else {"grad_output": backward(BODY, 0).grad_output}
    reply = _evaluate(runtime, stage, 0, **extra)
    assert all(p.grad is None or not p.grad.any() for p in runtime.optimizer.params)
    [result] = runtime._backward_batch([backward(stage, 0)])
    assert torch.equal(reply.grad_input, result.grad_input) and reply.grad_input.abs().sum() > 0
    if stage == TAIL:
        assert reply.loss == pytest.approx(result.loss, rel=1e-6)


def test_the_previous_version_is_used_when_asked_for_and_kept_else_the_current():
    runtime = make_runtime(BODY, load_run_config("tiny", {"target_batch_size": 1}))
    grad_output = backward(BODY, 0).grad_output
    before = _evaluate(runtime, BODY, 1, grad_output=grad_output)
    runtime._backward_batch([backward(BODY, 0, step=0)])
    runtime._maybe_step()
    assert runtime.optimizer.local_step == 1
    at_previous = _evaluate(runtime, BODY, 1, grad_output=grad_output, version=0)
    at_current = _evaluate(runtime, BODY, 1, grad_output=grad_output)
    too_old = _evaluate(runtime, BODY, 1, grad_output=grad_output, version=7)
    assert before.version == at_previous.version == 0 and at_current.version == too_old.version == 1
    assert torch.equal(at_previous.grad_input, before.grad_input)
    assert torch.equal(at_previous.coords, before.coords)
    assert not torch.equal(at_current.grad_input, before.grad_input)


def test_a_gradient_request_for_the_wrong_stage_kind_or_shape_is_refused():
    body, head, tail = make_runtime(BODY), make_runtime(HEAD), make_runtime(TAIL)
    with pytest.raises(ProtocolError, match="grad_output is for a body stage"):
        tail.check_evaluate(EvaluateRequest(stage=TAIL, sample_id="x", tokens=tokens(0), coords=coords(0),
                                            grad_output=coords(1)))
    with pytest.raises(ProtocolError, match="input_grad is for the tail"):
        head.check_evaluate(EvaluateRequest(stage=HEAD, sample_id="x", tokens=tokens(0), input_grad=True))
    with pytest.raises(ProtocolError, match="grad_output must be float of shape"):
        body.check_evaluate(EvaluateRequest(stage=BODY, sample_id="x", tokens=tokens(0), coords=coords(0),
                                            grad_output=coords(1)[:3]))
    with pytest.raises(ProtocolError, match="non-finite"):
        body.check_evaluate(EvaluateRequest(stage=BODY, sample_id="x", tokens=tokens(0), coords=coords(0),
                                            grad_output=coords(1) * float("inf")))
