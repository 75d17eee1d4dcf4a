"""The worker's compute loop: validated single-sample requests in, coalesced batches through the
stage model, one result back to each requester [report 3.3.1.2-3.3.1.4].

Requests are checked here before they are queued, so one malformed request can never spoil a
batch. A head or body stage keeps its forward batch's activations for the backward while its
memory budget allows (roles/worker/serving/kept_activations.py); otherwise, and whenever the kept graph
no longer fits the weights, backward recomputes the stage forward from the input the trainer
sends back (stage-level activation checkpointing [report 3.3.1.4]).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import BackwardRequest, EvaluateReply, EvaluateRequest, ForwardRequest
from protocol.stats import BusyWindow, Distribution, powers_of_two
from roles.model.stage import StageModel
from roles.periodic import Signal
from roles.worker.steps.optimizer import NonFiniteGradients, StageOptimizer, StepReport
from roles.worker.steps.step_ledger import StepDue, StepLedger
from roles.worker.steps.gradient_exchange import Contribution, StepSum
from roles.worker.serving.kept_activations import KeptActivations, KeptBatch, SavedBytes
from roles.worker.serving.queues import QueueClosed, Task, TaskKind, TaskQueues, run_batch
from roles.worker.steps.step_tagger import TagGrant

logger = logging.getLogger(__name__)

_COORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def autocast_dtype(requested: str, run_dtype: str, device: torch.device) -> Optional[torch.dtype]:
    """The dtype a worker runs its blocks under autocast in, None for none. `auto` follows the run
    config's dtype on a GPU and stays float32 on the CPU (bfloat16 there is slower on most CPUs);
    `bfloat16` autocasts on either, so a CPU worker can match a GPU replica's numerics or stand
    beside one. Replicas of mixed precision hold the same weights; their outputs differ by what
    bfloat16 rounds, which the run's spot-check tolerance must cover (docs/operations.md)."""
    if requested == "auto":
        return getattr(torch, run_dtype) if torch.device(device).type == "cuda" and run_dtype != "float32" else None
    return None if requested == "float32" else getattr(torch, requested)


@dataclass
class BackwardResult:
    grad_input: Optional[torch.Tensor]
    loss: Optional[float]
    step: Optional[int] = None
    """The global step the sample was accumulated into here (the tail's tag)."""
    version: Optional[int] = None
    """The weight version (steps applied) the gradient was taken at."""


class RecentSamples:
    """The samples this worker ran forward for and whose backward has not come yet, with the weight
    version (optimizer step) each forward saw: backward requests that were not pinned to us are
    counted (they use gradients from other weights [report 4.2.1]), the version gap measures
    staleness, and the head gates its forwards on how many are in flight. A sample whose backward
    never comes (dropped without a notice) is forgotten after `ttl_s`."""

    def __init__(self, capacity: int = 65536, ttl_s: float = 120.0):
        self._ids: collections.OrderedDict[str, tuple[int, float]] = collections.OrderedDict()
        self._capacity = capacity
        self._ttl_s = ttl_s
        self._lock = threading.Lock()

    def add(self, sample_id: str, version: int = 0) -> None:
        with self._lock:
            self._ids[sample_id] = (version, time.monotonic())
            self._ids.move_to_end(sample_id)
            self._expire()

    def _expire(self) -> None:
        horizon = time.monotonic() - self._ttl_s
        while self._ids and (len(self._ids) > self._capacity or next(iter(self._ids.values()))[1] < horizon):
            self._ids.popitem(last=False)

    def peek(self, sample_id: str) -> Optional[int]:
        with self._lock:
            entry = self._ids.get(sample_id)
            return None if entry is None else entry[0]

    def pop(self, sample_id: str) -> Optional[int]:
        """The version the sample's forward saw here, or None if it did not run here."""
        with self._lock:
            entry = self._ids.pop(sample_id, None)
            return None if entry is None else entry[0]

    def in_flight(self, max_age_s: float) -> int:
        """Forwards younger than `max_age_s` whose backward has not come yet (entries are in the
        order they were added, so the count stops at the first older one)."""
        horizon = time.monotonic() - max_age_s
        count = 0
        with self._lock:
            for _, at in reversed(self._ids.values()):
                if at < horizon:
                    break
                count += 1
        return count


class StalenessStats:
    """How old the weights behind a stage's gradients are, two ways:

    - `gaps`: versions between the weights a sample's forward saw here and the ones its backward
      recomputed on (0 when pinned: the recompute then uses the forward's weights);
    - `delays`: versions between the weights the gradient was taken at and the step it is applied
      in (its tag). One process has 0 for every sample; this is what costs fidelity.
    """

    def __init__(self) -> None:
        self.gaps: collections.Counter[int] = collections.Counter()
        self.delays: collections.Counter[int] = collections.Counter()
        self.pinned_samples = 0
        """Backwards recomputed on the previous weights their forward used."""

    def record(self, gap: int, delay: int) -> None:
        self.gaps[gap] += 1
        self.delays[delay] += 1

    @staticmethod
    def _stats(counts: collections.Counter[int]) -> tuple:
        total = sum(counts.values())
        if not total:
            return None, None, None
        return (round(sum(g * n for g, n in counts.items()) / total, 4), max(counts),
                round(sum(n for g, n in counts.items() if g > 0) / total, 4))

    def summary(self) -> dict:
        mean_gap, max_gap, stale_share = self._stats(self.gaps)
        mean_delay, max_delay, delayed_share = self._stats(self.delays)
        return {
            "samples": sum(self.gaps.values()),
            "mean_gap": mean_gap, "max_gap": max_gap, "stale_share": stale_share,
            "pinned": self.pinned_samples,
            "mean_delay": mean_delay, "max_delay": max_delay, "delayed_share": delayed_share,
            "delays": {str(d): n for d, n in sorted(self.delays.items())},
        }


class BatchStats:
    """The four balance signals the report monitors per stage [report 3.4.3], per pass: how long
    each request waited in the queue for the compute thread (microbatch data-await time), how long
    each coalesced batch computed, how many requests each batch coalesced, and the compute
    thread's busy share of recent wall time. Recorded once per batch by the compute thread."""

    def __init__(self, max_batch: int, window_s: float = 30.0):
        self.queue_wait = {kind: Distribution() for kind in TaskKind}
        self.compute = {kind: Distribution() for kind in TaskKind}
        self.batch_size = {kind: Distribution(powers_of_two(max_batch)) for kind in TaskKind}
        self.busy = BusyWindow(window_s)

    def record(self, batch: list[Task], taken_at: float, started: float, ended: float) -> None:
        """`taken_at` (monotonic) is when the batch left the queue; `started`/`ended` are
        perf_counter times around its compute."""
        kind = batch[0].kind
        waits = self.queue_wait[kind]
        for task in batch:
            waits.observe(max(0.0, taken_at - task.enqueued_at))
        self.compute[kind].observe(ended - started)
        self.batch_size[kind].observe(len(batch))
        self.busy.record(taken_at, taken_at + (ended - started))


FINGERPRINT_SAMPLES = 64
"""Elements of each parameter a weights fingerprint reads (evenly strided): replicas that parted
differ nearly everywhere, so a few of each catch it."""


def weights_fingerprint(tensors) -> bytes:
    """8 bytes that name a set of weights: equal replicas have the same, replicas that stepped
    differently (a step without some replica's gradients) do not. Spot checks compare two
    replicas' results only under the same fingerprint (roles/trainer/spot_checks.py)."""
    picks = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        picks.append(flat[::max(1, flat.numel() // FINGERPRINT_SAMPLES)][:FINGERPRINT_SAMPLES].float())
    if not picks:
        return bytes(8)
    return hashlib.sha256(torch.cat(picks).cpu().numpy().tobytes()).digest()[:8]


class StageRuntime:
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
        self.test_device_fault_after_batches = 0
        """TESTS ONLY (AGORA_TEST_DEVICE_FAULT_AFTER_BATCHES): batches after which every batch raises
        a CUDA-like error."""
        self.test_nan_gradients_after_steps = 0
        """TESTS ONLY (AGORA_TEST_NAN_GRADIENTS_AFTER_STEPS): from this local step on, every step's
        accumulated gradients are made NaN before the step."""

    # ---- validation (called on the event loop, before queueing) ----

    def check_forward(self, request: ForwardRequest) -> None:
        if self.kind == "tail":
            raise ProtocolError("the tail fuses loss forward and backward: send a backward request",
                                ErrorCode.INVALID_REQUEST)
        self._check_common(request.stage, request.tokens, request.coords)

    def check_backward(self, request: BackwardRequest) -> None:
        seq_len = self._check_common(request.stage, request.tokens, request.coords)
        if self.kind == "tail":
            if request.grad_output is not None:
                raise ProtocolError("the tail computes its own loss; grad_output must be absent",
                                    ErrorCode.INVALID_REQUEST)
            if request.step is not None:
                raise ProtocolError("the tail tags samples with their step itself; step must be absent",
                                    ErrorCode.INVALID_REQUEST)
            if seq_len < 2:
                raise ProtocolError("the tail needs at least 2 tokens", ErrorCode.INVALID_TENSOR)
        else:
            self._check_coords(request.grad_output, seq_len, "grad_output")
        if request.step is not None and request.step > self.optimizer.local_step + 1_000_000:
            raise ProtocolError(f"step {request.step} is implausibly far ahead of this stage's "
                                f"{self.optimizer.local_step}", ErrorCode.INVALID_REQUEST)

    def check_evaluate(self, request: EvaluateRequest) -> None:
        seq_len = self._check_common(request.stage, request.tokens, request.coords)
        if self.kind == "tail" and seq_len < 2:
            raise ProtocolError("the tail needs at least 2 tokens", ErrorCode.INVALID_TENSOR)
        if request.grad_output is not None:
            if self.kind != "body":
                raise ProtocolError("grad_output is for a body stage (the tail takes input_grad, the head has no "
                                    "input gradient)", ErrorCode.INVALID_REQUEST)
            self._check_coords(request.grad_output, seq_len, "grad_output")
        if request.input_grad and self.kind != "tail":
            raise ProtocolError("input_grad is for the tail (a body stage takes grad_output)",
                                ErrorCode.INVALID_REQUEST)

    def _check_common(self, stage: int, tokens: torch.Tensor, coords: Optional[torch.Tensor]) -> int:
        if stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {stage}", ErrorCode.WRONG_STAGE)
        if tokens.dtype != torch.int64 or tokens.dim() != 1 or not 0 < tokens.numel() <= self.max_seq_len:
            raise ProtocolError(
                f"tokens must be int64 of shape [T] with 0 < T <= {self.max_seq_len}; "
                f"got {tokens.dtype} {list(tokens.shape)}", ErrorCode.INVALID_TENSOR)
        low, high = torch.aminmax(tokens)
        if int(low) < 0 or int(high) >= self.vocab_size:
            raise ProtocolError(f"token ids must lie in [0, {self.vocab_size})", ErrorCode.INVALID_TENSOR)
        seq_len = tokens.numel()
        if self.kind == "head":
            if coords is not None:
                raise ProtocolError("the head embeds tokens itself; coords must be absent", ErrorCode.INVALID_REQUEST)
        else:
            self._check_coords(coords, seq_len, "coords")
        return seq_len

    def _check_coords(self, tensor: Optional[torch.Tensor], seq_len: int, name: str) -> None:
        if tensor is None:
            raise ProtocolError(f"{name} is required at stage {self.stage}", ErrorCode.INVALID_REQUEST)
        if tensor.dtype not in _COORD_DTYPES or list(tensor.shape) != [seq_len, self.rank]:
            raise ProtocolError(
                f"{name} must be float of shape [{seq_len}, {self.rank}]; got {tensor.dtype} {list(tensor.shape)}",
                ErrorCode.INVALID_TENSOR)
        if not _all_finite(tensor):
            raise ProtocolError(f"{name} contains non-finite values", ErrorCode.INVALID_TENSOR)

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
                out = (self.model(coords, tokens) if weights is None
                       else torch.func.functional_call(self.model, weights, (coords, tokens)))
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
        try:
            self.queues.requeue(rest)
        except QueueClosed as exc:
            for task in rest:
                task.on_done(None, exc)
            return
        if not grants:
            self._stop.wait(0.01)  # nothing could be tagged: let the stage step before asking again

    def _run_gated(self, batch: list[Task]) -> None:
        """Head with replicas: run as many forwards as the stage's gate grants (step_tagger.py
        `ForwardSlots`), put back the rest, and ask again a little later if none was granted."""
        granted = self.forward_slots(len(batch)) or 0
        if granted:
            self._run(batch[:granted], self._forward_batch)
        rest = batch[granted:]
        if not rest:
            return
        try:
            self.queues.requeue(rest)
        except QueueClosed as exc:
            for task in rest:
                task.on_done(None, exc)
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
            batches = self.counters["forward_batches"] + self.counters["backward_batches"]
            if 0 < self.test_device_fault_after_batches <= batches:
                raise RuntimeError("CUDA error: an illegal memory access was encountered (test fault: "
                                   "AGORA_TEST_DEVICE_FAULT_AFTER_BATCHES)")
            return compute(payloads)
        except Exception as exc:
            if self.on_compute_error is not None:
                self.on_compute_error(exc)
            raise

    def arrived(self) -> tuple[int, int]:
        """Samples of the open step and of the next that reached this replica: accumulated here, or
        reported abandoned by their trainer (they complete the step without a gradient)."""
        opt, ledger = self.optimizer, self.ledger
        step = opt.local_step
        return (opt.samples_accumulated + ledger.abandoned(step), opt.next_accumulated + ledger.abandoned(step + 1))

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

    def _forward_allowance(self) -> Optional[int]:
        """Forwards the head may start now without delaying gradients beyond its bound.

        The tail tags samples in about the order the head forwarded them, so the samples in flight
        here fill the open step's remaining slots first; a forward beyond those belongs to the next
        step but runs on the open step's weights, so its gradient will be a step old. At most
        `max_delayed_per_step` such forwards run ahead; the rest wait for the step (0: the
        pipeline drains at every step, and no gradient is delayed). A forward whose backward has
        not come within `forward_gate_timeout_s` no longer holds a slot: its sample was probably
        dropped, and a gate waiting for it would stall the stage (a slow one costs a delayed
        gradient instead).
        """
        if self.max_delayed_per_step is None:
            return None
        open_samples, _ = self.arrived()
        remaining = self.ledger.target - open_samples - self.ledger.peers.counts.get(self.optimizer.local_step, 0)
        in_flight = self.forwarded.in_flight(self.forward_gate_timeout_s)
        return max(0, remaining + self.max_delayed_per_step - in_flight)

    def _untagged_capacity(self) -> tuple[int, int]:
        open_samples, next_samples = self.arrived()
        return self.ledger.capacity(self.optimizer.local_step, open_samples, next_samples, self.queues.max_batch)

    def _maybe_step(self) -> None:
        opt = self.optimizer
        with opt.lock:
            open_samples, next_samples = self.arrived()
            held, earliest = self.queues.held(opt.local_step + 1)
            exchanging = self.exchange_step is not None and bool(self.ledger.peers.members)
            if held and not open_samples and not next_samples and opt.samples_accumulated == 0 and (
                    not exchanging or self.ledger.may_jump_to(earliest)):
                self._jump_to(earliest)
                return
            # A tail waiting with untagged samples queued is waiting on this step too: the stage's
            # tagger gives them no tag until it closes (a tag handed to a replica that died leaves
            # a hole only the close timeout ends).
            waiting = held > 0 or (self.tagging is not None and self.queues.pending()[TaskKind.BACKWARD] > 0)
            due = self.ledger.due(opt.local_step, open_samples, next_samples > 0 or waiting, overtaken=held > 0)
            if due is None:
                return
            own = None
            if exchanging:
                step = opt.local_step
                own = Contribution(peer="", step=step, samples=opt.samples_accumulated,
                                   abandoned=self.ledger.abandoned(step), grad=opt.open_gradient_sum(),
                                   consumed=opt.samples_consumed)
        if own is not None:
            # The exchange waits for the other replicas; the lock stays free meanwhile (the averager
            # and the state server take it), and nothing accumulates since this thread waits.
            total = self.exchange_step(own)
            if total is None:  # stopping
                return
            due = StepDue(total.stage_samples, _exchange_reason(total, due, self.ledger.target))
        with opt.lock:
            if own is not None:
                opt.set_open_gradient_sum(total.grad, total.samples)
                opt.samples_consumed = max(opt.samples_consumed, total.consumed)
            had_samples = opt.samples_accumulated > 0
            if had_samples and 0 < self.test_nan_gradients_after_steps <= opt.local_step:
                opt.poison_gradients()
            try:
                report = opt.step(stage_samples=due.stage_samples)
            except NonFiniteGradients as exc:
                self.counters["non_finite_steps"] += 1
                logger.error("%s", exc)
                report = None
                if self.on_step is not None:
                    self.on_step(False, str(exc))
            else:
                if had_samples and self.on_step is not None:
                    self.on_step(True, "")
            self.ledger.stepped(opt.local_step - 1, due)
            for hook in self.after_step:
                hook(opt.local_step)
        for hook in self.after_step_unlocked:
            hook(opt.local_step)
        if due.reason != "complete":
            why = {"peer_ahead": "a replica of this stage was ahead",
                   "peer_due": "a replica of this stage closed it",
                   "replica_lost": "a replica of this stage did not bring its gradients",
                   "adopted": "this replica came late and applied the sum the others stepped on",
                   "overtaken": "samples two steps ahead arrived; the rest of it was lost",
                   "timeout": f"no sample of it for {self.ledger.close_timeout_s:.0f}s"}[due.reason]
            logger.info("stage %d closed step %d with %d of %d samples (%s)", self.stage, opt.local_step - 1,
                        due.stage_samples, self.ledger.target, why)
        if report is not None:
            self.last_step = report
            logger.info("stage %d step %d: lr %.2e, grad norm %.3f%s, %d local samples", self.stage, report.step,
                        report.lr, report.grad_norm, " (clipped)" if report.clipped else "", report.samples)
        self.stepped.fire()
        self.changed.fire()

    def _jump_to(self, step: int) -> None:
        """Samples of a step two or more ahead arrived while this worker holds nothing: the run
        moved on without it (it was away, or it restarted a stage that had no replica left), so
        it joins the run's step at once instead of closing every step in between. With the
        stage's replicas adding up gradients, only when none of them can still close a skipped
        step (StepLedger.may_jump_to); else it closes them in turn through the exchange."""
        opt = self.optimizer
        skipped = step - opt.local_step
        opt.set_step(step, opt.samples_consumed + skipped * self.ledger.target)
        self.ledger.skipped(skipped)
        logger.info("stage %d jumped from step %d to %d: samples of step %d arrived and this worker held none of "
                    "the steps in between", self.stage, step - skipped, step, step)
        self.stepped.fire()
        self.changed.fire()

    def stop(self, timeout_s: float = 30.0) -> list[Task]:
        """Stop taking work; return what was still queued so the caller can hand it back. Gradients
        of steps the stage never completed are discarded and reported, never stepped on alone."""
        leftover = self.queues.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        leftover += self.kept.drain()  # backwards parked for their forward batch's others
        self.discarded_at_shutdown = self.optimizer.discard_all()
        return leftover

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def _inputs(self, requests):
        tokens = torch.stack([r.tokens for r in requests]).to(self.device, non_blocking=True)
        coords = None
        if self.kind != "head":
            coords = torch.stack([r.coords for r in requests]).to(self.device, torch.float32, non_blocking=True)
        return tokens, coords

    def _forward_batch(self, requests: list[ForwardRequest]) -> list[torch.Tensor]:
        tokens, coords = self._inputs(requests)
        keep = self.kept.enabled and self.kept.room_for(self._kept_bytes_per_sample * len(requests))
        if keep:
            out, version = self._forward_kept(requests, tokens, coords)
        else:
            with torch.no_grad(), self.optimizer.lock, self._autocast():
                version = self.optimizer.local_step
                out = self.model(coords, tokens)
                self._note_fingerprint(version)
        if self.mid_compute is not None:
            self.mid_compute("forward")
        out = out.detach().to(self.wire_dtype).cpu()
        for request in requests:
            self.forwarded.add(request.sample_id, version)
        self.counters["forward_requests"] += len(requests)
        self.counters["forward_batches"] += 1
        return list(out.unbind(0))

    def _forward_kept(self, requests: list[ForwardRequest], tokens: torch.Tensor, coords: Optional[torch.Tensor]
                      ) -> tuple[torch.Tensor, int]:
        """The forward with its graph, kept for the batch's backwards if the budget has room."""
        if coords is not None:
            coords.requires_grad_(True)
        saved = SavedBytes(self._param_storages)
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(saved, _unpacked), \
                self.optimizer.lock, self._autocast():
            version = self.optimizer.local_step
            out = self.model(coords, tokens)
            self._note_fingerprint(version)
        self._kept_bytes_per_sample = saved.nbytes // len(requests)
        if self.kept.keep(out, coords, version, [r.sample_id for r in requests], saved.nbytes):
            self.counters["forward_kept"] += len(requests)
        return out, version

    def _backward_through(self, kept: KeptBatch, requests: list[BackwardRequest]) -> list[BackwardResult]:
        """One backward through a kept forward graph: every sample of the forward batch has its
        output gradient here (`requests`, in row order) or was abandoned (a zero row)."""
        opt = self.optimizer
        n = len(requests)
        rows = [kept.rows[r.sample_id] for r in requests]
        for r in requests:
            self.forwarded.pop(r.sample_id)
        grad = torch.zeros(kept.out.shape, dtype=torch.float32, device=self.device)
        grad[rows] = torch.stack([r.grad_output for r in requests]).to(self.device, torch.float32)
        with opt.lock:
            if opt.local_step != kept.version:  # cannot happen: the step is taken on this thread
                raise RuntimeError(f"a kept graph of version {kept.version} at step {opt.local_step}")
            tag = requests[0].step if requests[0].step is not None else opt.local_step
            offset = tag - opt.local_step
            if offset < 0:
                self.ledger.note_late(n)
            elif offset == 0:
                self.ledger.arrived()
            with opt.accumulating(min(offset, 1) if offset >= 0 else -1):
                kept.out.float().backward(grad)
                if self.mid_compute is not None:
                    self.mid_compute("backward")
            if offset >= 0:
                opt.add_samples(n, offset=min(offset, 1))
            used = opt.local_step
        grads = kept.coords.grad[rows].to(self.wire_dtype).cpu() if kept.coords is not None else None
        kept.out = kept.coords = None  # the graph's memory goes now, not when the batch object does
        for _ in range(n):
            self.staleness.record(0, tag - used)
        self.counters["backward_requests"] += n
        self.counters["backward_batches"] += 1
        self.counters["backward_kept"] += n
        if offset < 0:
            self.counters["late_samples"] += n
        self.changed.fire()
        return [BackwardResult(grad_input=None if grads is None else grads[i], loss=None, step=tag, version=used)
                for i in range(n)]

    def _note_fingerprint(self, version: Optional[int], weights: Optional[list[torch.Tensor]] = None) -> None:
        """Remember the fingerprint of the weights a batch at `version` ran on (the current
        parameters, or `weights`); call under the optimizer lock."""
        if version is None:
            return
        self.fingerprints[version] = weights_fingerprint(self.optimizer.params if weights is None else weights)
        for old in [v for v in self.fingerprints if v < version - 2]:
            del self.fingerprints[old]

    def _previous_weights(self, versions: list[Optional[int]]) -> Optional[dict[str, torch.Tensor]]:
        """The weights the batch's forward ran on, if they are the previous version and kept."""
        opt = self.optimizer
        version = versions[0]
        if (version is None or opt.previous is None or opt.previous_version != version
                or any(v != version for v in versions)):
            return None
        return {name: t.detach().requires_grad_(True) for name, t in zip(self._param_names, opt.previous)}

    def _backward_batch(self, requests: list[BackwardRequest], tag: Optional[int] = None) -> list[BackwardResult]:
        """`tag`: the step the stage's tagger gave these untagged tail samples (None: tag here)."""
        tokens, coords = self._inputs(requests)
        if coords is not None:
            coords.requires_grad_(True)
        opt = self.optimizer
        n = len(requests)
        versions = [self.forwarded.pop(r.sample_id) for r in requests] if self.kind != "tail" else []
        with opt.lock:
            tag = requests[0].step if requests[0].step is not None else tag
            if tag is None:
                limit, offset = self._untagged_capacity()
                tag = opt.local_step + offset
            else:
                offset = tag - opt.local_step  # 0 open step, 1 next, < 0 closed (late: discarded)
            if offset < 0:
                self.ledger.note_late(n)
            elif offset == 0:
                self.ledger.arrived()
            pinned = self._previous_weights(versions) if versions else None
            with opt.accumulating(min(offset, 1) if offset >= 0 else -1):
                if pinned is not None:
                    # Gradients taken at the previous weights join this step's sum in place: autograd
                    # adds into an existing .grad, so no third gradient buffer is ever allocated.
                    for param, old in zip(opt.params, pinned.values()):
                        old.grad = param.grad
                with self._autocast():
                    if pinned is not None:
                        out = torch.func.functional_call(self.model, pinned, (coords, tokens))
                    else:
                        out = self.model(coords, tokens)
                if self.mid_compute is not None and self.kind == "tail":
                    self.mid_compute("forward")  # the tail has no forward requests: its forward runs here
                if self.kind == "tail":
                    losses = out.float()
                    losses.sum().backward()
                else:
                    grad = torch.stack([r.grad_output for r in requests]).to(self.device, torch.float32)
                    out.float().backward(grad)
                    losses = None
                if pinned is not None:
                    for param, old in zip(opt.params, pinned.values()):
                        param.grad, old.grad = old.grad, None
                if self.mid_compute is not None:
                    self.mid_compute("backward")
            # A worker in optimizer sync accumulates too: it steps on its own gradients to warm its
            # moments [report 3.3.1.1], and its samples complete the step they were tagged with.
            if offset >= 0:
                opt.add_samples(n, offset=min(offset, 1))
            used = opt.previous_version if pinned is not None else opt.local_step  # the gradient's weights
            self._note_fingerprint(used, None if pinned is None else list(pinned.values()))
        grads = coords.grad.to(self.wire_dtype).cpu() if coords is not None else None
        loss_values = losses.detach().cpu().tolist() if losses is not None else [None] * n
        if self.kind != "tail":
            self.counters["backward_unpinned"] += sum(1 for v in versions if v is None)
            self.staleness.pinned_samples += n if pinned is not None else 0
            for v in versions:
                if v is not None:
                    self.staleness.record(used - v, tag - used)
        self.counters["backward_requests"] += n
        self.counters["backward_batches"] += 1
        if offset < 0:
            self.counters["late_samples"] += n
        self.changed.fire()
        return [
            BackwardResult(grad_input=None if grads is None else grads[i], loss=loss_values[i], step=tag, version=used)
            for i in range(n)
        ]


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _all_finite(tensor: torch.Tensor) -> bool:
    """torch.isfinite(t).all() in a fifth of the time for the float32 and float16 tensors a
    request brings (numpy's reduction has no dispatcher in front of it)."""
    if tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float16) and not tensor.requires_grad:
        return bool(np.isfinite(tensor.numpy()).all())
    return bool(torch.isfinite(tensor).all())


def _exchange_reason(total: StepSum, due: StepDue, target: int) -> str:
    """Why the stage's step closed, once the replicas' gradients are added up."""
    if total.adopted_from is not None:
        return "adopted"
    if total.stage_samples >= target:
        return "complete"
    return "replica_lost" if total.missing else due.reason
