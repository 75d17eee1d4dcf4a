"""What a chained worker checks of its neighbours' signatures before it uses what they sent
(roles/worker/serving/chain_signatures.py): an honest chain passes; an output signed over an input
the signer was not given, a signature by another worker, a gradient signed over an output gradient
the next stage did not send, or a tail's loss over another input, is refused."""

from __future__ import annotations

import asyncio

import torch
from cryptography.hazmat.primitives.asymmetric import ed25519

from protocol.evidence import loss_tensor, sign_hop
from protocol.identity import Identity
from protocol.messages import ChainHop, ChainReply, ChainRequest, ChainStage, to_body
from roles.worker.serving.batches import BackwardResult
from roles.worker.serving.chain import ChainHandler
from roles.worker.serving.chain_signatures import check_reply, check_request
from roles.worker.serving.compute_stats import RecentSamples
from roles.worker.serving.handlers import WorkerHandlers
from tests.unit.test_chain_routing import _Handlers

RUN = "run-s"
TOKENS = torch.arange(8)
X = torch.linspace(-1, 1, 32).reshape(8, 4)
Y = torch.linspace(0, 1, 32).reshape(8, 4)
G2 = torch.linspace(1, 2, 32).reshape(8, 4)
G1 = torch.linspace(2, 3, 32).reshape(8, 4)
LOSS = 2.5


def _identity() -> Identity:
    return Identity(ed25519.Ed25519PrivateKey.generate(), "")


HEAD, BODY, TAIL = _identity(), _identity(), _identity()


def _id(identity: Identity) -> str:
    return identity.peer_id.to_base58()


def _sign(identity, stage, kind, coords, grad_output, result, version=3):
    return sign_hop(identity.sign, RUN, _id(identity), stage, version, None, kind, TOKENS, coords, grad_output, result)


def _request_to_tail(**changes) -> ChainRequest:
    fields = dict(stage=2, sample_id="t-1", tokens=TOKENS, coords=Y, budget_s=5.0,
                  signed=_sign(BODY, 1, "output", X, None, Y), signed_input=_sign(HEAD, 0, "output", None, None, X))
    fields.update(changes)
    return ChainRequest(**fields)


def test_an_honest_request_passes_and_one_from_a_worker_that_signs_nothing_is_taken_as_before():
    assert check_request(_request_to_tail(), _id(BODY), RUN) is None
    head_to_body = ChainRequest(stage=1, sample_id="t-1", tokens=TOKENS, coords=X, budget_s=5.0,
                                signed=_sign(HEAD, 0, "output", None, None, X))
    assert check_request(head_to_body, _id(HEAD), RUN) is None
    assert check_request(_request_to_tail(signed=None, signed_input=None), _id(BODY), RUN) is None


def test_a_request_whose_signatures_do_not_bind_what_it_carries_is_refused():
    other = torch.linspace(5, 6, 32).reshape(8, 4)
    cases = {
        "an output over an input no one sent": _request_to_tail(signed=_sign(BODY, 1, "output", other, None, Y)),
        "coordinates other than the signed ones": _request_to_tail(coords=Y * 3),
        "the input's signature left out": _request_to_tail(signed_input=None),
        "the input signed by the sender itself": _request_to_tail(signed_input=_sign(BODY, 0, "output", None, None, X)),
        "a signature for another run": _request_to_tail(
            signed=sign_hop(BODY.sign, "other-run", _id(BODY), 1, 3, None, "output", TOKENS, X, None, Y)),
        "a garbage signature": _request_to_tail(
            signed=_sign(BODY, 1, "output", X, None, Y).model_copy(update={"attestation": bytes(64)})),
    }
    for what, request in cases.items():
        assert check_request(request, _id(BODY), RUN) is not None, what
    assert check_request(_request_to_tail(), _id(HEAD), RUN) is not None, "signed by another than the caller"
    head_over_input = ChainRequest(stage=1, sample_id="t-1", tokens=TOKENS, coords=X, budget_s=5.0,
                                   signed=_sign(HEAD, 0, "output", other, None, X))
    assert check_request(head_over_input, _id(HEAD), RUN) is not None, "a head has no input coordinates"


def _tail_reply(**changes) -> ChainReply:
    fields = dict(stages=[ChainStage(stage=2, worker=_id(TAIL), version=3, elapsed_s=0.1)], loss=LOSS, step=0,
                  grad_input=G2, signed_grad=_sign(TAIL, 2, "gradient", Y, None, G2),
                  signed_loss=_sign(TAIL, 2, "loss", Y, None, loss_tensor(LOSS)))
    fields.update(changes)
    return ChainReply(**fields)


def _body_reply(**changes) -> ChainReply:
    fields = dict(stages=[ChainStage(stage=1, worker=_id(BODY), version=3, elapsed_s=0.1)], loss=LOSS, step=0,
                  grad_input=G1, signed_grad=_sign(BODY, 1, "gradient", X, G2, G1),
                  signed_output=_sign(BODY, 1, "output", X, None, Y),
                  signed_grad_output=_sign(TAIL, 2, "gradient", Y, None, G2),
                  signed_loss=_sign(TAIL, 2, "loss", Y, None, loss_tensor(LOSS)))
    fields.update(changes)
    return ChainReply(**fields)


def test_honest_replies_pass_at_the_callers():
    assert check_reply(_tail_reply(), _id(TAIL), Y, TOKENS, RUN) is None
    assert check_reply(_body_reply(), _id(BODY), X, TOKENS, RUN) is None
    assert check_reply(_body_reply(signed_grad=None), _id(BODY), X, TOKENS, RUN) is None, "an older worker"


def test_a_reply_whose_signatures_do_not_bind_the_callers_output_is_refused():
    flipped = -G1
    other = torch.linspace(5, 6, 32).reshape(8, 4)
    cases = {
        "a gradient other than the signed one": (_body_reply(grad_input=flipped), _id(BODY), X),
        "a gradient over an output gradient the tail did not send": (
            _body_reply(grad_input=flipped, signed_grad=_sign(BODY, 1, "gradient", X, other, flipped)), _id(BODY), X),
        "an output over another input": (_body_reply(signed_output=_sign(BODY, 1, "output", other, None, Y)),
                                         _id(BODY), X),
        "the next stage's signature left out": (_body_reply(signed_grad_output=None), _id(BODY), X),
        "the next stage's signature by the callee itself": (
            _body_reply(signed_grad_output=_sign(BODY, 2, "gradient", Y, None, G2)), _id(BODY), X),
        "a reply to another input": (_body_reply(), _id(BODY), other),
        "a tail's loss over another input": (
            _tail_reply(signed_loss=_sign(TAIL, 2, "loss", other, None, loss_tensor(LOSS))), _id(TAIL), Y),
        "a tail's loss other than the signed one": (_tail_reply(loss=LOSS / 3), _id(TAIL), Y),
        "a tail's loss unsigned": (_tail_reply(signed_loss=None), _id(TAIL), Y),
        "a reply signed by another worker": (_tail_reply(), _id(BODY), Y),
    }
    for what, (reply, callee, sent) in cases.items():
        assert check_reply(reply, callee, sent, TOKENS, RUN) is not None, what


def test_a_worker_refuses_a_chained_sample_whose_signatures_do_not_bind_before_it_computes():
    handlers = _Handlers(2, "tail")  # computing anything would fail: the stand-in runtime cannot
    handler = ChainHandler(handlers, client=None, p2p=None, directory=None, peer_id=_id(TAIL), num_stages=3,
                           run_id=RUN)
    lie = _request_to_tail(signed=_sign(BODY, 1, "output", torch.zeros(8, 4), None, Y))  # over an input never sent
    reply = asyncio.run(handler._chain(BODY.peer_id, to_body(lie)))
    assert reply.dropped == "bad_signature" and reply.stages[0].worker == _id(TAIL), reply
    assert handler.counters["refused_bad_signature"] == 1 and len(handler.records) == 0


class _BodyRuntime:
    """Stands in for a body stage's StageRuntime: its forward gives Y, its backward G1, at once."""

    stage, kind = 1, "body"

    def __init__(self):
        self.forwarded = RecentSamples()
        self.fingerprints = {}

    def check_forward(self, request):
        pass

    def check_backward(self, request):
        pass

    def submit(self, kind, request, on_done, caller):
        if kind.value == "forward":
            self.forwarded.add(request.sample_id, 3)
            on_done(Y.clone(), None)
        else:
            on_done(BackwardResult(grad_input=G1.clone(), loss=None, step=0, version=3), None)
        return kind


def _body_handler() -> tuple[ChainHandler, list]:
    handlers = WorkerHandlers(_BodyRuntime(), info=lambda: None, serving=lambda: True, run_id=RUN, sign=BODY.sign)
    handler = ChainHandler(handlers, client=None, p2p=None, directory=None, peer_id=_id(BODY), num_stages=3,
                           run_id=RUN, sign=BODY.sign)
    return handler, []


def _body_request(signed) -> dict:
    return to_body(ChainRequest(stage=1, sample_id="t-1", tokens=TOKENS, coords=X, budget_s=5.0, signed=signed,
                                route=[ChainHop(stage=2, workers=[_id(TAIL)])]))


def test_a_worker_next_to_an_older_one_passes_on_unsigned_what_its_neighbour_could_not_bind():
    """An older head signs nothing: the body's output goes on unsigned (the tail would refuse an
    output signed over an input no one signed), and so does its gradient back to that head. An older
    tail signs nothing: the body's gradient goes back unsigned (its caller could not bind the output
    gradient). Those hops go unchecked."""
    for head_signs, tail_signs in [(True, True), (False, True), (True, False)]:
        handler, sent = _body_handler()

        async def tail(request, route, coords, *, deadline, signed=None, signed_input=None):
            onward = ChainRequest(stage=2, sample_id="t-1", tokens=TOKENS, coords=coords, budget_s=1.0,
                                  signed=signed, signed_input=signed_input)
            sent.append(onward)
            return _tail_reply() if tail_signs else _tail_reply(signed_grad=None, signed_loss=None)

        handler._pass_on = tail
        head = _sign(HEAD, 0, "output", None, None, X) if head_signs else None
        reply = asyncio.run(handler._chain(HEAD.peer_id, _body_request(head)))
        assert reply.dropped is None, reply.detail
        onward = sent[0]
        assert (onward.signed is not None) == head_signs
        if head_signs:
            assert check_request(onward, _id(BODY), RUN) is None, "the tail takes it"
        assert (reply.signed_grad is not None) == (head_signs and tail_signs)
        assert check_reply(reply, _id(BODY), X, TOKENS, RUN) is None, "the head takes it"
