"""Taking a sample back out of a step still open here (`agora/v1/retract`): what a trainer asks
after it excluded a worker the sample went through (roles/trainer/retraction.py), so that what
the cheater added to the open step is left out of it.

The trainer sends what the sample's backward brought to this stage: its input (tokens, and the
coordinates for a body or the tail) and the output gradient it sent back (none at the tail, which
recomputes its own loss). The compute thread recomputes the sample's forward and backpropagates the
negated output gradient (at the tail: the loss times -1) into the accumulators of the sample's
step (`StageOptimizer.accumulating`), under the optimizer lock, so the step's sum loses the
sample's gradient, and the step divides by one sample fewer (`StageOptimizer.retract_samples`).
The trainer names the weight version the sample's backward reported (`version`): a backward
pinned to the previous version (its forward ran there, a step closed in between) is undone on
that version's kept copy, so the subtraction equals what was added. Otherwise it runs on the
current weights, which equal those of the backward unless an averaging round moved them since
(or the version named is no longer kept: counted as `retractions_unpinned`); then it is the
gradient at the nearby current weights instead.

The step ledger still counts the sample, as it counts an abandoned one (`StepLedger.retracted`):
the step closes on schedule one gradient short, and no replacement sample is routed.

A sample that another replica of this stage accumulated (`accumulated_by`: the trainer excluded
that replica, and asks this one instead) is not in this replica's accumulators. Its negated
gradient is computed apart (`StageOptimizer.separate_gradients`) and held as a correction on that
replica's behalf (`StageRuntime.corrections`), which goes with this replica's contribution to the
stage's gradient exchange: the sum takes it only if the other replica's gradients are in it
(gradient_exchange.py `add_up`). A replica revoked or gone before the exchange took its samples
with it, and they are not subtracted twice. Where the stage's replicas do not exchange gradients
the answer is `unsummed`, with nothing changed: the sample is in the other replica's own step.

Only the open step and the next one can lose a sample: a retraction runs on the compute thread
between batches, the thread that also takes the step and waits for the stage's gradient exchange,
so by the time it runs, a step whose sum this replica already handed to the exchange is closed and
the answer is `too_late`, with nothing changed. A step already taken cannot be undone here. A
replica that comes late to its stage's exchange and adopts the sum the others already stepped on
(gradient_exchange.py) drops its own sum, and with it what it retracted from it.

A retraction subtracts the gradient of an input the trainer supplies; a trainer can already send
any input and any output gradient through `agora/v1/backward`, so it gains nothing it could not
add before, except taking samples out of a step's count. That is budgeted: at most half the target
batch per step, from all trainers together, and never more than the step holds here. Requests are
checked like a backward (request_checks.py `check_retract`) before anything is queued, and at
most RETRACTIONS_WAITING_MAX wait for the compute thread at once.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import RetractReply, RetractRequest
from roles.worker.serving.batches import gradients_into
from roles.worker.serving.queues import QueueClosed, loop_future
from roles.worker.serving.runtime import StageRuntime
from roles.worker.steps.gradient_exchange import CORRECTIONS_MAX

RETRACTIONS_WAITING_MAX = 32
"""Retractions that may wait for the compute thread at once; beyond that a caller is told the worker is overloaded."""


class Retractions:
    """One worker's side of `agora/v1/retract`; its counts are the runtime's `retractions_*` counters."""

    def __init__(self, runtime: StageRuntime):
        self.runtime = runtime
        self._by_step: dict[int, int] = {}
        """Retractions applied per step still open or next (pruned as steps close)."""
        self._waiting = 0

    @property
    def per_step_limit(self) -> int:
        """Samples a step may lose here: half the target batch, so no step falls below half of it."""
        return self.runtime.optimizer.target_batch_size // 2

    async def handle(self, request: RetractRequest) -> RetractReply:
        """Check the request, run it on the compute thread, answer what it did (event loop)."""
        self.runtime.check_retract(request)
        if self._waiting >= RETRACTIONS_WAITING_MAX:
            self.runtime.counters["retractions_overloaded"] += 1
            raise ProtocolError(f"{RETRACTIONS_WAITING_MAX} retractions already wait here; retry later",
                                ErrorCode.OVERLOADED)
        future, on_done = loop_future()
        self._waiting += 1
        try:
            self.runtime.call_on_compute(functools.partial(self.apply, request), on_done)
            return await future
        except QueueClosed as exc:  # the runtime stopped, before or after it took the call
            raise ProtocolError("worker is shutting down", ErrorCode.NOT_READY) from exc
        finally:
            self._waiting -= 1

    def apply(self, request: RetractRequest) -> RetractReply:
        """Subtract the sample's gradient from its step if that step is open or next here (the
        compute thread, between batches). Raises ProtocolError(RATE_LIMITED) past the budget."""
        runtime = self.runtime
        opt = runtime.optimizer
        with opt.lock:
            open_step = opt.local_step
            offset = request.step - open_step
            if offset < 0:
                runtime.counters["retractions_too_late"] += 1
                return RetractReply(outcome="too_late", open_step=open_step)
            if offset > 1:
                runtime.counters["retractions_ahead"] += 1
                return RetractReply(outcome="ahead", open_step=open_step)
            on_behalf = request.accumulated_by is not None
            if on_behalf and runtime.exchange_step is None:
                runtime.counters["retractions_unsummed"] += 1
                return RetractReply(outcome="unsummed", open_step=open_step)
            self._by_step = {s: n for s, n in self._by_step.items() if s >= open_step}
            done = self._by_step.get(request.step, 0)
            held = opt.samples_accumulated if offset == 0 else opt.next_accumulated
            why = None
            if done >= self.per_step_limit:
                why = f"{done} samples of step {request.step} were retracted here already (at most {done})"
            elif not on_behalf and held < 1:
                why = f"no sample of step {request.step} is held here"
            elif on_behalf and not runtime.corrections.room_for(request.step, request.accumulated_by):
                why = f"step {request.step} holds corrections for {CORRECTIONS_MAX} other replicas already"
            if why is not None:
                runtime.counters["retractions_refused"] += 1
                raise ProtocolError(why, ErrorCode.RATE_LIMITED)
            if on_behalf:
                with opt.separate_gradients() as flat:
                    self._subtract(request)
                runtime.corrections.add(request.step, request.accumulated_by, flat[0])
                runtime.counters["retractions_on_behalf"] += 1
            else:
                with opt.accumulating(offset):
                    self._subtract(request)
                opt.retract_samples(1, offset=offset)
                runtime.ledger.retracted(request.step)
            self._by_step[request.step] = done + 1
            runtime.counters["retractions_applied"] += 1
        return RetractReply(outcome="applied", open_step=open_step)

    def _subtract(self, request: RetractRequest) -> None:
        """The sample's forward and its backward with the negated output gradient, into the
        parameters' gradients (hold the optimizer lock): on the weights its backward ran on
        (`request.version`) when those are the previous version and still kept, as a pinned
        backward's were, else on the current ones."""
        runtime = self.runtime
        opt = runtime.optimizer
        pinned = None
        if request.version is not None and request.version != opt.local_step:
            pinned = runtime._previous_weights([request.version])
            runtime.counters["retractions_pinned" if pinned is not None else "retractions_unpinned"] += 1
        tokens = request.tokens.unsqueeze(0).to(runtime.device)
        coords: Optional[torch.Tensor] = None
        if runtime.kind != "head":
            coords = request.coords.unsqueeze(0).to(runtime.device, torch.float32)
        with torch.enable_grad(), gradients_into(opt.params, pinned):
            with runtime._autocast():
                out = runtime._model_on(pinned, coords, tokens)
            if runtime.kind == "tail":  # the model gives each sample's mean loss, as in a backward batch
                (-out.float().sum()).backward()
            else:
                grad = request.grad_output.unsqueeze(0).to(runtime.device, torch.float32)
                out.float().backward(-grad)
