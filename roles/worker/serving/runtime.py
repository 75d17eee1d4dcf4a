"""The worker's compute loop: validated single-sample requests in, coalesced batches through the
stage model, one result back to each requester [report 3.3.1.2-3.3.1.4].

Requests are checked before they are queued (request_checks.py), so one malformed request can
never spoil a batch. Between batches the compute thread takes the stage's step when it is due
(step_decision.py); each batch runs through the model as batches.py says, keeping or recomputing
the forward's activations for the backward.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from typing import Callable, Optional

import torch

from protocol.messages import BackwardRequest, EvaluateReply, EvaluateRequest, ForwardRequest, RetractRequest
from roles.model.stage import StageModel
from roles.periodic import Signal
from roles.worker.serving.batches import BatchCompute
from roles.worker.serving.compute_stats import BatchStats, RecentSamples, StalenessStats, weights_fingerprint
from roles.worker.serving.kept_activations import KeptActivations
from roles.worker.serving.queues import QueueClosed, Task, TaskKind, TaskQueues, run_batch
from roles.worker.serving.request_checks import RequestChecks
from roles.worker.serving.step_decision import StepDecision
from roles.worker.steps.gradient_exchange import Contribution, HeldCorrections, StepSum
from roles.worker.steps.optimizer import StageOptimizer, StepReport
from roles.worker.steps.step_ledger import StepLedger
from roles.worker.steps.step_tagger import TagGrant

logger = logging.getLogger(__name__)


def autocast_dtype(requested: str, run_dtype: str, device: torch.device) -> Optional[torch.dtype]:
    """The dtype a worker runs its blocks under autocast in, None for none. `auto` follows the run
    config's dtype on a GPU and stays float32 on the CPU (bfloat16 there is slower on most CPUs);
    `bfloat16` autocasts on either, so a CPU worker can match a GPU replica's numerics or stand
    beside one. Replicas of mixed precision hold the same weights; their outputs differ by what
    bfloat16 rounds, which the run's spot-check tolerance must cover (docs/operations.md)."""
    if requested == "auto":
        return getattr(torch, run_dtype) if torch.device(device).type == "cuda" and run_dtype != "float32" else None
    return None if requested == "float32" else getattr(torch, requested)


class StageRuntime(StepDecision, BatchCompute):
    """Owns the stage model, its optimizer, the task queues and the step ledger; runs the compute
    thread, which is also where the stage's optimizer steps happen, so a step always falls between
    two batches and the ledger is only ever touched by one thread."""

    def __init__(
        self,
        model: StageModel,
        optimizer: StageOptimizer,
        queues: TaskQueues,
        *,
        stage: int,
        vocab_size: int,
        max_seq_len: int,
        device: torch.device,
        ledger: Optional[StepLedger] = None,
        max_delayed_per_step: Optional[int] = None,
        forward_gate_timeout_s: float = 5.0,
        autocast_dtype: Optional[torch.dtype] = None,
        wire_dtype: torch.dtype = torch.float32,
        kept_activations_bytes: int = 0,
    ):
        self.model = model
        self.optimizer = optimizer
        self.queues = queues
        self.stage = stage
        self.kind = model.kind
        self.ledger = ledger or StepLedger(optimizer.target_batch_size, assigns=model.kind == "tail")
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.rank = model.subspace_rank
        self.checks = RequestChecks(stage=stage, kind=model.kind, vocab_size=vocab_size, max_seq_len=max_seq_len,
                                    rank=model.subspace_rank, local_step=lambda: self.optimizer.local_step)
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.wire_dtype = wire_dtype
        """What the boundary coordinates and input gradients this stage sends travel as (the run's
        `boundary_dtype`): bfloat16 in a bfloat16 run halves the bytes and the device-to-host copy."""
        # What the compute thread tells the rest of the worker (roles/periodic.py): listeners on
        # the event loop wake at once instead of polling these objects.
        self.changed = Signal()
        """This replica's sample counts changed (a backward batch ran, or a step was taken)."""
        self.stepped = Signal()
        """The optimizer's step moved (a step was taken, or the replica jumped to the stage's step)."""
        self.crashed = Signal()
        """The compute thread died; `failure` holds why."""
        self.counters: collections.Counter[str] = collections.Counter()
        self.compute_s = 0.0
        self.throughput = 0.0  # samples per second of compute, smoothed
        self.batch_stats = BatchStats(queues.max_batch)
        self.forwarded = RecentSamples()
        self.fingerprints: dict[int, bytes] = {}
        """Weight version -> the fingerprint of the weights the latest batch at that version ran on
        (`weights_fingerprint`), for the replies' `weights` (the last few versions)."""
        self.staleness = StalenessStats()
        self.discarded_at_shutdown: dict[int, int] = {}
        self.last_step: Optional[StepReport] = None
        self.max_delayed_per_step = max_delayed_per_step
        """Head only: how many more samples than the open step still needs may be in flight here."""
        self.forward_gate_timeout_s = forward_gate_timeout_s
        self._param_names = [name for name, p in model.named_parameters() if p.requires_grad]
        self.kept = KeptActivations(kept_activations_bytes if model.kind != "tail" else 0)
        """Forward graphs kept for their backwards (head and body; the tail's forward runs in its backward)."""
        self._kept_bytes_per_sample = 0
        self._param_storages = frozenset(p.untyped_storage().data_ptr() for p in optimizer.params)
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._calls: collections.deque = collections.deque()
        """Work for the compute thread between two batches (`call_on_compute`), with its on_done."""
        self._calls_lock = threading.Lock()
        self._calls_closed = False
        self.failure: Optional[BaseException] = None
        self.mid_compute: Optional[Callable[[str], None]] = None
        """Called by the compute thread mid batch ("forward" once the model ran, "backward" once the
        gradients are in), before any reply goes back: where an operator's preemption order
        strikes (roles/worker/health/preemption.py)."""
        self.on_compute_error: Optional[Callable[[BaseException], None]] = None
        """Called by the compute thread with each error a batch raised (before its requesters get
        it): the self-termination rules tell a failing device from a bad request there."""
        self.on_step: Optional[Callable[[bool, str], None]] = None
        """Called by the compute thread after each step that had samples: (finite, what happened)."""
        self.after_step: list[Callable[[int], None]] = []
        """Called by the compute thread after every step, optimizer lock held, with the steps applied:
        run checkpoints are written and averaging snapshots taken from here, at exactly the agreed step."""
        self.after_step_unlocked: list[Callable[[int], None]] = []
        """Called by the compute thread after every step with the lock released: hooks that may wait
        on the network (a SparseLoCo round's aggregate) and take the lock themselves to apply it."""
        self.tagging: Optional[Callable[[int], Optional[list[TagGrant]]]] = None
        """Tail with replicas: step tags for n untagged samples from the stage's tagger, in order
        (roles/worker/steps/step_tagger.py); fewer or none when it has none to give yet."""
        self.forward_slots: Optional[Callable[[int], Optional[int]]] = None
        """Head with replicas: how many of n forwards the stage's gate lets start now (None: no
        gate could be asked); used instead of the lone head's own count while it has peers."""
        self._forwards_paused_until = 0.0
        self.exchange_step: Optional[Callable[[Contribution], Optional[StepSum]]] = None
        """With `averaging.gradients` on: hands this replica's contribution to the stage's step to
        the exchange and returns the stage's total (blocking; None if the worker is stopping)."""
        self.corrections = HeldCorrections()
        """Samples of excluded replicas this one takes out of the stage's steps on their behalf
        (retractions.py); they go with its contribution to the exchange."""

    # ---- validation (called on the event loop, before queueing: request_checks.py) ----

    def check_forward(self, request: ForwardRequest) -> None:
        self.checks.check_forward(request)

    def check_backward(self, request: BackwardRequest) -> None:
        self.checks.check_backward(request)

    def check_evaluate(self, request: EvaluateRequest) -> None:
        self.checks.check_evaluate(request)

    def check_retract(self, request: RetractRequest) -> None:
        self.checks.check_retract(request)

    # ---- evaluation (a handler's thread, not the compute thread) ----

    def evaluate(self, request: EvaluateRequest) -> EvaluateReply:
        """One held-out sample through this stage, checked with `check_evaluate` first. It runs
        beside the compute thread, not in its queues, and touches nothing that counts samples (the
        forward record behind the head's gate and staleness, the step ledger, the optimizer): an
        evaluation must leave training exactly as it was. The optimizer lock keeps a step, a batch
        or the averager from changing the weights halfway through."""
        tokens = request.tokens.unsqueeze(0).to(self.device)
        coords = None
        if self.kind != "head":
            coords = request.coords.unsqueeze(0).to(self.device, torch.float32)
        wants_grad = request.grad_output is not None or request.input_grad
        grad = None
        try:
            with torch.enable_grad() if wants_grad else torch.no_grad(), self.optimizer.lock, self._autocast():
                version, weights = self._evaluation_weights(request.version)
                fingerprint = weights_fingerprint(self.optimizer.params if weights is None else weights.values())
                if wants_grad:
                    coords.requires_grad_(True)
                out = self._model_on(weights, coords, tokens)
                if wants_grad:  # into the input only: nothing accumulates in the parameters' .grad
                    target = (out.float().sum() if self.kind == "tail" else
                              (out.float() * request.grad_output.unsqueeze(0).to(self.device, torch.float32)).sum())
                    (grad,) = torch.autograd.grad(target, coords)
                self.counters["eval_requests"] += 1
        except Exception as exc:
            if self.on_compute_error is not None:
                self.on_compute_error(exc)
            raise
        grad_input = None if grad is None else grad.to(self.wire_dtype).cpu()[0]
        if self.kind == "tail":  # the model returns each sample's mean next-token loss
            return EvaluateReply(loss=float(out.detach().float().cpu()[0]), version=version, grad_input=grad_input,
                                 weights=fingerprint)
        return EvaluateReply(coords=out.detach().to(self.wire_dtype).cpu()[0], version=version, grad_input=grad_input,
                             weights=fingerprint)

    def _evaluation_weights(self, version: Optional[int]) -> tuple[int, Optional[dict[str, torch.Tensor]]]:
        """The weight version an evaluation runs at, and the weights if not the current ones: the
        previous version when asked for and still kept (call under the optimizer lock)."""
        current = self.optimizer.local_step
        previous = self._previous_weights([version]) if version is not None and version != current else None
        return (current, None) if previous is None else (version, previous)

    # ---- submission ----

    def submit(self, kind: TaskKind, request, on_done, caller: str | None = None) -> Task:
        """Queue one request. A retry from `caller` for a sample whose earlier request still waits
        replaces it (the caller timed out on that one): a forward gate held by requests nobody
        waits for any more would admit only those, one timeout after another."""
        step, version = None, None
        if kind == TaskKind.BACKWARD:
            step = request.step
            version = self.forwarded.peek(request.sample_id)
        # Only samples of one step, forwarded on one weight version, share a batch: a batch
        # accumulates into one step and recomputes on one set of weights.
        key = (request.tokens.numel(), step, version)
        supersede = None if caller is None else (caller, request.sample_id)
        task = Task(kind=kind, payload=request, on_done=on_done, group_key=key, step=step, supersede_key=supersede)
        self.queues.submit(task)
        return task

    def withdraw(self, task: Task) -> bool:
        """The caller of a queued request left (it timed out and closed the stream): drop the
        request unrun. False if the compute thread already took it."""
        dropped = self.queues.discard(task) or self.kept.withdraw(task)
        if dropped:
            self.counters["withdrawn_by_caller"] += 1
        return dropped

    # ---- compute thread ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"stage{self.stage}-compute", daemon=True)
        self._thread.start()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def wake(self) -> None:
        """Something the step decision depends on changed (a peer's count): re-check it now."""
        self.queues.wake()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._maybe_step()
                self._run_calls()
                open_step = self.optimizer.local_step
                if self.kept.enabled:
                    ready, recompute = self.kept.due(open_step)
                    for kept, tasks in ready:
                        self._run(tasks, functools.partial(self._backward_through, kept))
                    self._recompute(recompute)
                limit = None if self.tagging is not None else self._untagged_capacity()[0]
                gated = self.forward_slots is not None and bool(self.ledger.peers.members)
                if gated:
                    forward_limit = 0 if time.monotonic() < self._forwards_paused_until else None
                else:
                    forward_limit = self._forward_allowance()
                batch = self.queues.next_batch(timeout=0.1, hold_after=open_step + 1, untagged_limit=limit,
                                               forward_limit=forward_limit)
                if not batch:
                    continue
                if batch[0].kind == TaskKind.FORWARD and gated:
                    self._run_gated(batch)
                elif batch[0].kind == TaskKind.FORWARD:
                    self._run(batch, self._forward_batch)
                elif batch[0].step is None and self.tagging is not None:
                    self._run_tagged(batch)
                elif self.kept.enabled:
                    self._run_backward_kept(batch)
                else:
                    self._run(batch, self._backward_batch)
        except BaseException as exc:  # a dead compute thread must bring the node down, not hang it
            logger.exception("compute thread crashed")
            self.failure = exc
            self.crashed.fire()

    def call_on_compute(self, fn: Callable[[], object],
                        on_done: Callable[[object, Optional[BaseException]], None]) -> None:
        """Run `fn` on the compute thread between two batches, after the step decision, and hand
        its result or error to `on_done` there: for work that must neither interleave with a batch
        nor with a step (a retraction, roles/worker/serving/retractions.py). Raises QueueClosed
        once the runtime stops."""
        with self._calls_lock:
            if self._calls_closed:
                raise QueueClosed("the worker is shutting down")
            self._calls.append((fn, on_done))
        self.queues.wake()

    def _run_calls(self) -> None:
        while True:
            with self._calls_lock:
                if not self._calls:
                    return
                fn, on_done = self._calls.popleft()
            try:
                result = fn()
            except Exception as exc:  # the caller's error reply; the thread goes on
                on_done(None, exc)
            else:
                on_done(result, None)

    def _run(self, batch: list[Task], compute) -> None:
        taken_at = time.monotonic()
        started = time.perf_counter()
        run_batch(batch, functools.partial(self._observed, compute))
        ended = time.perf_counter()
        elapsed = ended - started
        self.compute_s += elapsed
        self.batch_stats.record(batch, taken_at, started, ended)
        rate = len(batch) / max(elapsed, 1e-6)
        self.throughput = rate if self.throughput == 0 else 0.9 * self.throughput + 0.1 * rate

    def _run_tagged(self, batch: list[Task]) -> None:
        """Tail: get the batch's step tags from the stage's tagger, run each step's part with its
        tag, and put back what got no tag yet (the next two steps are full, or no tagger answered)."""
        grants = self.tagging(len(batch)) or []
        start = 0
        for grant in grants:
            part = batch[start:start + grant.count]
            start += grant.count
            self._run(part, functools.partial(self._backward_batch, tag=grant.step))
        rest = batch[start:]
        if not rest:
            return
        self.counters["tag_waits"] += 1
        if not self._put_back(rest):
            return
        if not grants:
            self._stop.wait(0.01)  # nothing could be tagged: let the stage step before asking again

    def _put_back(self, rest: list[Task]) -> bool:
        """Requeue tasks this pass could not run; False (each answered with the error) once the
        queues have closed."""
        try:
            self.queues.requeue(rest)
        except QueueClosed as exc:
            for task in rest:
                task.on_done(None, exc)
            return False
        return True

    def _run_gated(self, batch: list[Task]) -> None:
        """Head with replicas: run as many forwards as the stage's gate grants (step_tagger.py
        `ForwardSlots`), put back the rest, and ask again a little later if none was granted."""
        granted = self.forward_slots(len(batch)) or 0
        if granted:
            self._run(batch[:granted], self._forward_batch)
        rest = batch[granted:]
        if not rest or not self._put_back(rest):
            return
        if not granted:
            self.counters["forward_gate_waits"] += 1
            self._forwards_paused_until = time.monotonic() + 0.02  # backwards go on meanwhile

    def _run_backward_kept(self, batch: list[Task]) -> None:
        """Head or body keeping activations: backwards whose forward batch is now complete run
        through its kept graph; the others park (KeptActivations.take) or recompute."""
        ready, recompute = self.kept.take(batch, self.optimizer.local_step)
        for kept, tasks in ready:
            self._run(tasks, functools.partial(self._backward_through, kept))
        self._recompute(recompute)

    def _recompute(self, tasks: list[Task]) -> None:
        """Run backwards by recomputing their forward, in batches of one step and weight version."""
        groups: dict[object, list[Task]] = {}
        for task in tasks:
            groups.setdefault(task.group_key, []).append(task)
        for group in groups.values():
            self._run(group, self._backward_batch)

    def _observed(self, compute, payloads):
        """Run one batch, telling `on_compute_error` what it raised (run_batch hands it on)."""
        try:
            return compute(payloads)
        except Exception as exc:
            if self.on_compute_error is not None:
                self.on_compute_error(exc)
            raise

    def forget_forward(self, sample_id: str) -> None:
        """A forward ran here but its sample will not come back for the backward (a chained
        sample dropped after this stage, before any step tag): release its kept activations and
        its place among the forwards in flight."""
        self.forwarded.pop(sample_id)
        self.kept.abandon(sample_id)

    def abandon(self, step: int, sample_id: Optional[str] = None) -> bool:
        """Called on the event loop when a trainer reports a dropped sample of `step`."""
        if sample_id is not None:
            self.forwarded.pop(sample_id)  # its backward will not come: no longer in flight here
            self.kept.abandon(sample_id)
        taken = self.ledger.abandon(step, self.optimizer.local_step)
        if taken:
            self.queues.wake()
        return taken

    def stop(self, timeout_s: float = 30.0) -> list[Task]:
        """Stop taking work; return what was still queued so the caller can hand it back. Gradients
        of steps the stage never completed are discarded and reported, never stepped on alone."""
        leftover = self.queues.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._calls_lock:
            self._calls_closed = True
            calls, self._calls = list(self._calls), collections.deque()
        for _, on_done in calls:
            on_done(None, QueueClosed("the worker is shutting down"))
        leftover += self.kept.drain()  # backwards parked for their forward batch's others
        self.discarded_at_shutdown = self.optimizer.discard_all()
        return leftover
