"""The worker's compute loop: validated single-sample requests in, coalesced batches through the
stage model, one result back to each requester [report 3.3.1.2-3.3.1.4].

Requests are checked here before they are queued, so one malformed request can never spoil a
batch. Backward recomputes the stage forward from the input the trainer sends back (stage-level
activation checkpointing): nothing is kept per request between the two passes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import BackwardRequest, ForwardRequest
from roles.model.stage import StageModel
from roles.worker.optimizer import StageOptimizer
from roles.worker.queues import Task, TaskKind, TaskQueues, run_batch

logger = logging.getLogger(__name__)

_COORD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class BackwardResult:
    grad_input: Optional[torch.Tensor]
    loss: Optional[float]


class RecentSamples:
    """Bounded memory of the sample ids this worker ran forward for, to count backward requests
    that were not pinned to us (they would use gradients from other weights [report 4.2.1])."""

    def __init__(self, capacity: int = 65536):
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def add(self, sample_id: str) -> None:
        with self._lock:
            self._ids[sample_id] = None
            if len(self._ids) > self._capacity:
                self._ids.popitem(last=False)

    def pop(self, sample_id: str) -> bool:
        with self._lock:
            return self._ids.pop(sample_id, 0) is None


class StageRuntime:
    """Owns the stage model, its optimizer and the task queues; runs the compute thread."""

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
        autocast_dtype: Optional[torch.dtype] = None,
        counts_towards_target: Callable[[], bool] = lambda: True,
        on_backward: Callable[[], None] = lambda: None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.queues = queues
        self.stage = stage
        self.kind = model.kind
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.rank = model.subspace_rank
        self.device = device
        self.autocast_dtype = autocast_dtype
        self.counts_towards_target = counts_towards_target
        self.on_backward = on_backward
        self.counters: collections.Counter[str] = collections.Counter()
        self.compute_s = 0.0
        self.throughput = 0.0  # samples per second of compute, smoothed
        self.forwarded = RecentSamples()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.failure: Optional[BaseException] = None

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
            if seq_len < 2:
                raise ProtocolError("the tail needs at least 2 tokens", ErrorCode.INVALID_TENSOR)
        else:
            self._check_coords(request.grad_output, seq_len, "grad_output")

    def _check_common(self, stage: int, tokens: torch.Tensor, coords: Optional[torch.Tensor]) -> int:
        if stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {stage}", ErrorCode.WRONG_STAGE)
        if tokens.dtype != torch.int64 or tokens.dim() != 1 or not 0 < tokens.numel() <= self.max_seq_len:
            raise ProtocolError(
                f"tokens must be int64 of shape [T] with 0 < T <= {self.max_seq_len}; "
                f"got {tokens.dtype} {list(tokens.shape)}", ErrorCode.INVALID_TENSOR)
        if int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size:
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
        if not bool(torch.isfinite(tensor).all()):
            raise ProtocolError(f"{name} contains non-finite values", ErrorCode.INVALID_TENSOR)

    # ---- submission ----

    def submit(self, kind: TaskKind, request, on_done) -> None:
        self.queues.submit(Task(kind=kind, payload=request, on_done=on_done, group_key=request.tokens.numel()))

    # ---- compute thread ----

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"stage{self.stage}-compute", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                batch = self.queues.next_batch(timeout=0.1)
                if not batch:
                    continue
                compute = self._forward_batch if batch[0].kind == TaskKind.FORWARD else self._backward_batch
                started = time.perf_counter()
                run_batch(batch, compute)
                elapsed = time.perf_counter() - started
                self.compute_s += elapsed
                rate = len(batch) / max(elapsed, 1e-6)
                self.throughput = rate if self.throughput == 0 else 0.9 * self.throughput + 0.1 * rate
        except BaseException as exc:  # a dead compute thread must bring the node down, not hang it
            logger.exception("compute thread crashed")
            self.failure = exc

    def stop(self, timeout_s: float = 30.0) -> list[Task]:
        """Stop taking work; return what was still queued so the caller can hand it back."""
        leftover = self.queues.close()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
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
        with torch.no_grad(), self.optimizer.lock, self._autocast():
            out = self.model(coords, tokens)
        out = out.float().cpu()
        for request in requests:
            self.forwarded.add(request.sample_id)
        self.counters["forward_requests"] += len(requests)
        self.counters["forward_batches"] += 1
        return list(out.unbind(0))

    def _backward_batch(self, requests: list[BackwardRequest]) -> list[BackwardResult]:
        tokens, coords = self._inputs(requests)
        if coords is not None:
            coords.requires_grad_(True)
        with self.optimizer.lock:
            with self._autocast():
                out = self.model(coords, tokens)
            if self.kind == "tail":
                losses = out.float()
                losses.sum().backward()
            else:
                grad = torch.stack([r.grad_output for r in requests]).to(self.device, torch.float32)
                out.float().backward(grad)
                losses = None
            # Always accumulate (a worker in optimizer sync steps on its own gradients to warm its
            # moments); only an active worker's samples count towards the stage's target.
            self.optimizer.add_samples(len(requests), counted=self.counts_towards_target())
        grads = coords.grad.cpu() if coords is not None else None
        loss_values = losses.detach().cpu().tolist() if losses is not None else [None] * len(requests)
        if self.kind != "tail":
            unpinned = sum(0 if self.forwarded.pop(r.sample_id) else 1 for r in requests)
            self.counters["backward_unpinned"] += unpinned
        self.counters["backward_requests"] += len(requests)
        self.counters["backward_batches"] += 1
        self.on_backward()
        return [
            BackwardResult(grad_input=None if grads is None else grads[i], loss=loss_values[i])
            for i in range(len(requests))
        ]
