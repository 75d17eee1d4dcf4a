"""What a chained worker checks of its neighbours' signatures before it uses what they sent.

Every result passed along a chain travels with its worker's signature, as it would in a
ForwardReply or BackwardReply (protocol/evidence.py sign_hop): the trainer's spot checks of the workers path
(roles/trainer/chain_checks.py) hand them to the authorizer as evidence. A signature names the
input it was computed from only by digest, and a worker could sign its output over an input it
was never given: its neighbours' records would then not bind the signature, and its hop would go
unchecked. So each worker checks, before it uses what it got, that every signature binds what it
knows, and the sample stops there (`bad_signature`) when one does not:

- a callee, of its request: the caller signed the coordinates it sent (`signed`), over the input
  that the caller's own caller signed as its output (`signed_input`); a head's output over no input;
- a caller, of the callee's reply (it knows the callee's input, its own output): the callee's
  output was computed from that input (`signed_output`), its input gradient from it and from the
  gradient the stage after it signed as sent back (`signed_grad_output`), and at the tail, its
  loss and its gradient from that input.

So a lie passes on only signed over the input the liar was given, and a check of it binds. A
result with no signature at all (a worker older than these fields) is taken as before and its hop
goes unchecked; the trainer counts such hops per worker. For the same reason a worker next to an
older one passes on unsigned what its neighbour could not bind: its output after an unsigned input,
its gradient after an unsigned output gradient (roles/worker/serving/chain.py). Leaving a signature
out is therefore no lie anyone can prove; it only takes the hop out of the checks, visibly.
"""

from __future__ import annotations

from typing import Optional

import torch

from protocol.evidence import NO_TENSOR, hop_holds, loss_tensor, tensor_digest
from protocol.messages import ChainReply, ChainRequest


def check_request(request: ChainRequest, caller: str, run_id: str) -> Optional[str]:
    """Why the caller's signature over the coordinates it sent does not bind, or None when it does
    (or when the caller signs nothing: a worker older than these fields)."""
    signed = request.signed
    if signed is None:
        return None
    tokens = tensor_digest(request.tokens)
    if signed.peer_id != caller or signed.stage >= request.stage:
        return f"the coordinates are signed by {signed.peer_id[-8:]} of stage {signed.stage}, not by the caller"
    if signed.result_digest != tensor_digest(request.coords) or not hop_holds(run_id, "output", tokens, signed):
        return f"stage {signed.stage} worker {caller[-8:]}'s signature does not cover the coordinates it sent"
    given = request.signed_input
    if signed.stage == 0:
        return None if signed.coords_digest == NO_TENSOR and given is None else "a head's output signed over an input"
    if given is None or given.result_digest != signed.coords_digest:
        return f"stage {signed.stage} worker {caller[-8:]} signed its output over an input no one signed as sent"
    if (given.peer_id == signed.peer_id or given.stage >= signed.stage
            or not hop_holds(run_id, "output", tokens, given)):
        return f"the signature over stage {signed.stage}'s input does not verify"
    return None


def check_reply(reply: ChainReply, callee: str, sent: torch.Tensor, tokens: torch.Tensor, run_id: str) -> Optional[str]:
    """Why the callee's signatures do not bind the coordinates this worker sent it (`sent`), or
    None when they do (or when it signs nothing: a worker older than these fields)."""
    grad = reply.signed_grad
    if grad is None:
        return None
    tokens_digest, given = tensor_digest(tokens), tensor_digest(sent)
    if grad.peer_id != callee or grad.coords_digest != given or grad.result_digest != tensor_digest(reply.grad_input):
        return f"worker {callee[-8:]}'s gradient is signed over another input or by another worker"
    if not hop_holds(run_id, "gradient", tokens_digest, grad):
        return f"worker {callee[-8:]}'s signature over its gradient does not verify"
    output, sent_back = reply.signed_output, reply.signed_grad_output
    if output is None:  # the tail: its gradient was taken from the loss alone, and it signed the loss
        loss = reply.signed_loss
        if grad.grad_output_digest != NO_TENSOR or loss is None or reply.loss is None:
            return f"tail worker {callee[-8:]} sent no signed loss, or a gradient signed over an output gradient"
        if (loss.peer_id != callee or loss.coords_digest != given
                or loss.result_digest != tensor_digest(loss_tensor(reply.loss))
                or not hop_holds(run_id, "loss", tokens_digest, loss)):
            return f"tail worker {callee[-8:]}'s signature over its loss does not bind its input"
        return None
    if (output.peer_id != callee or output.coords_digest != given
            or not hop_holds(run_id, "output", tokens_digest, output)):
        return f"worker {callee[-8:]}'s output is signed over another input than the one it was sent"
    if (sent_back is None or sent_back.peer_id == callee or sent_back.coords_digest != output.result_digest
            or sent_back.result_digest != grad.grad_output_digest
            or not hop_holds(run_id, "gradient", tokens_digest, sent_back)):
        return f"worker {callee[-8:]} signed its gradient over an output gradient the stage after it did not sign"
    return None
