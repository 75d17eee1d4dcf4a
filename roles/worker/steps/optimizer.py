"""A stage replica's gradient accumulation, stage-wise clipping and CPU-offloaded AdamW [report 3.3.1, 4.3].

A worker accumulates the gradients of every backward batch it serves and only steps when the
stage as a whole has seen `target_batch_size` samples, so the step must turn a sum over however
many samples this replica happened to get into a mean. Clipping is per stage, with no cross-stage
barrier [report 4.3]; `stage_clip_threshold` gives the report's budget.

The float32 master weights and the AdamW moments live in CPU RAM [report 3.3.1]: that frees device
memory for activations and batch coalescing, and lets the background averager edit the weights
without interrupting GPU compute. On a CPU-only worker with float32 parameters the master copy is
the parameters themselves.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from protocol.errors import AgoraError
from protocol.run_config import OptimizerConfig, RunConfig

STATE_VERSION = 2


class NonFiniteGradients(AgoraError):
    """The accumulated gradients hold NaN or Inf; they were discarded and the weights left as they were.

    The worker's monitor treats this as a reason to terminate [report 3.3.1.6].
    """


@dataclass(frozen=True)
class StepReport:
    """What one optimizer step did; `step` is the 0-based index of the step just taken."""

    step: int
    lr: float
    grad_norm: float
    clipped: bool
    samples: int


def stage_clip_threshold(num_stages: int, *, is_tail: bool) -> float:
    """Per-stage gradient-norm threshold that splits a unit global budget evenly over the stages.

    The squared global norm is the sum of the stages' squared norms, hence 1/sqrt(S); the tail,
    which computes the loss over the whole vocabulary, has consistently larger gradients and gets
    twice that [report 4.3].
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    return (2.0 if is_tail else 1.0) / math.sqrt(num_stages)


class StageOptimizer:
    """Owns a stage replica's accumulated gradients and its AdamW, with master weights on the CPU.

    Gradients accumulate per global step: the open step (`local_step`) in the parameters'
    `.grad`, and the step after it in a second set of buffers, so that samples arriving for the
    next step while the open one waits for its last samples neither join the wrong step nor
    stall. `accumulating(offset)` routes a backward pass to one of the two.

    The schedule follows samples, not steps: the learning rate of a step is taken at the
    position `samples_consumed / target_batch_size`, so a short or long step cannot shift it.

    With `keep_previous` the optimizer snapshots the weights before each update (`previous`,
    one extra copy of the parameters where they compute), so a backward whose forward ran on the
    version before the step can recompute on exactly those weights.

    `lock` (re-entrant) is held during `step`, so the averager and the state server, which take it
    too, always see consistent weights; the runtime holds it around each backward pass and its
    `add_samples` so a step never lands in the middle of accumulation; checkpoints and the state
    loader take it to read or write the weights. The event loop never takes it (it goes through
    `asyncio.to_thread`). Lock order: the averager's buffer lock, then `lock`, then the task
    queues' condition, then leaf locks; never the other way round (the averager process holds
    its buffer lock for a whole all-reduce). Who takes which lock and why: docs/architecture.md,
    "Processes and threads".
    """

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        warmup_steps: int,
        total_steps: int,
        min_lr_ratio: float,
        clip_threshold: float,
        device: torch.device | str,
        target_batch_size: int = 1,
        keep_previous: bool = False,
        force_master_copy: bool = False,
        payload: Iterable[torch.Tensor] = (),
    ):
        self._params = list(params)
        # Averaged-only values (a surrogate stage's payload [report 3.5.1]): float32 CPU tensors the
        # averager, checkpoints and state transfer see ahead of the master weights, but that never
        # get a gradient, a moment or a step.
        self._payload = list(payload)
        for t in self._payload:
            if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.requires_grad:
                raise ValueError("a payload tensor must be a contiguous float32 CPU tensor without gradients")
        self._device = torch.device(device)
        if not self._params:
            raise ValueError("StageOptimizer needs at least one trainable parameter")
        for p in self._params:
            if p.device.type != self._device.type:
                raise ValueError(f"parameter on {p.device} but the stage runs on {self._device}")
        if not clip_threshold > 0:
            raise ValueError(f"clip_threshold must be positive, got {clip_threshold}")
        if warmup_steps < 0 or total_steps < 0 or not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError("warmup_steps and total_steps must be >= 0 and min_lr_ratio in [0, 1]")
        if target_batch_size < 1:
            raise ValueError(f"target_batch_size must be at least 1, got {target_batch_size}")
        self.schedule = OptimizerConfig.model_construct(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, warmup_steps=warmup_steps,
            total_steps=max(total_steps, 1), min_lr_ratio=min_lr_ratio)
        self.target_batch_size = target_batch_size
        self._hparams = dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.clip_threshold = clip_threshold
        self.lock = threading.RLock()
        self.local_step = 0
        """Steps this replica has applied; also the version of its weights."""
        self.samples_consumed = 0
        """Samples the whole stage consumed in all steps so far: the schedule's position."""
        self.samples_accumulated = 0
        """Samples whose gradients are accumulated for the open step: what `step` divides the sum by."""
        self.next_accumulated = 0
        """Samples accumulated for the step after the open one."""
        self._next_grads: list[Optional[torch.Tensor]] = [None] * len(self._params)

        self._on_cuda = self._device.type == "cuda"
        self._shared = (
            self._device.type == "cpu"
            and not force_master_copy
            and all(p.dtype == torch.float32 for p in self._params)
        )
        if self._shared:
            self._master = self._params
            self._grad_buffers: list[torch.Tensor] = []
        else:
            # Pinned buffers make the per-step device<->host copies asynchronous DMA transfers.
            self._master = [self._host_buffer(p).copy_(p.detach()).requires_grad_(True) for p in self._params]
            self._grad_buffers = [self._host_buffer(p) for p in self._params]
        self._optimizer = torch.optim.AdamW(self._master, lr=lr, **self._hparams)
        self._averaged = [*self._payload, *self._master]
        self.outer_state: Optional[Callable[[], dict[str, torch.Tensor]]] = None
        """Tensors of an outer method that travel with the optimizer's state (SparseLoCo's consensus
        anchor, roles/worker/sparseloco): into checkpoints and state transfer, by name."""
        self.loaded_outer: dict[str, torch.Tensor] = {}
        """The outer tensors the last loaded state carried (empty for a state without them)."""
        self.previous: Optional[list[torch.Tensor]] = (
            [torch.empty_like(p, requires_grad=False) for p in self._params] if keep_previous else None)
        self.previous_version: Optional[int] = None
        """The weight version `previous` holds (the step before the last update), if any."""

    @classmethod
    def for_stage(cls, run: RunConfig, stage: int, params: Iterable[torch.nn.Parameter],
                  device: torch.device | str, **kwargs: Any) -> "StageOptimizer":
        """The optimizer a worker of `stage` builds from the run config: the run's AdamW settings,
        schedule by samples, and the stage-wise clip threshold [report 4.3]."""
        opt = run.optimizer
        # The tail runs forward and backward in one pass: its samples never see two versions.
        kwargs.setdefault("keep_previous", run.staleness.pin_forward_weights and run.stage_kind(stage) != "tail")
        return cls(params, lr=opt.lr, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay,
                   warmup_steps=opt.warmup_steps, total_steps=opt.total_steps, min_lr_ratio=opt.min_lr_ratio,
                   clip_threshold=run.clip_threshold(stage), device=device,
                   target_batch_size=run.target_batch_size, **kwargs)

    def _host_buffer(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=self._on_cuda)

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The float32 CPU weights the averager reads and edits (under `lock`, then `push_master_to_device`),
        after the payload tensors if there are any (the layout's order)."""
        return self._averaged

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters the stage computes with, in layout order."""
        return self._params

    @property
    def shares_master(self) -> bool:
        """True when the master weights are the compute parameters themselves (no duplicate memory)."""
        return self._shared

    @property
    def schedule_position(self) -> float:
        """Where the stage is in its learning-rate schedule, in nominal steps of target_batch_size."""
        return self.samples_consumed / self.target_batch_size

    def lr_now(self) -> float:
        return self.schedule.lr_at(self.schedule_position)

    @contextlib.contextmanager
    def accumulating(self, offset: int) -> Iterator[None]:
        """Backward passes inside add their gradients to the open step (offset 0) or the one after
        it (offset 1); a negative offset (a step already closed) sends them to a scratch set that
        is thrown away. Hold `lock` around it."""
        if offset == 0:
            yield
            return
        if offset > 1:
            raise ValueError(f"gradients accumulate for the open step or the next one, not offset {offset}")
        with self.lock:
            current = [p.grad for p in self._params]
            for p, g in zip(self._params, self._next_grads if offset == 1 else [None] * len(self._params)):
                p.grad = g
            try:
                yield
            finally:
                if offset == 1:
                    self._next_grads = [p.grad for p in self._params]
                for p, g in zip(self._params, current):
                    p.grad = g

    @contextlib.contextmanager
    def separate_gradients(self) -> Iterator[list[torch.Tensor]]:
        """Backward passes inside leave both steps' accumulators alone; what they produce is put,
        flat as `open_gradient_sum` lays it out, in the list yielded, on leaving. Hold `lock`."""
        out: list[torch.Tensor] = []
        current = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        try:
            yield out
            out.append(self._flat_gradients())
        finally:
            for p, g in zip(self._params, current):
                p.grad = g

    def add_samples(self, n: int, *, offset: int = 0) -> None:
        """Record that the last backward batch added the summed gradients of `n` samples to the
        open step (offset 0) or the next (offset 1)."""
        if n < 0:
            raise ValueError(f"sample count must be non-negative, got {n}")
        with self.lock:
            if offset == 0:
                self.samples_accumulated += n
            else:
                self.next_accumulated += n

    def retract_samples(self, n: int, *, offset: int = 0) -> None:
        """Record that a backward pass inside `accumulating(offset)` just subtracted the gradients
        of `n` samples accumulated earlier (a retraction, roles/worker/serving/retractions.py):
        `step` divides by `n` fewer. Refuses to take the count below zero. Hold `lock`."""
        if n < 0:
            raise ValueError(f"sample count must be non-negative, got {n}")
        with self.lock:
            held = self.samples_accumulated if offset == 0 else self.next_accumulated
            if n > held:
                raise ValueError(f"cannot retract {n} samples from a step that holds {held}")
            if offset == 0:
                self.samples_accumulated -= n
            else:
                self.next_accumulated -= n

    @property
    def gradient_numel(self) -> int:
        """Length of the flat gradient the replicas of a stage exchange (trainable parameters only)."""
        return sum(p.numel() for p in self._params)

    def open_gradient_sum(self) -> Optional[torch.Tensor]:
        """The open step's summed gradients, flat float32 on the CPU in parameter order (zeros
        where a parameter has none), or None when no sample is accumulated. Hold `lock`."""
        if self.samples_accumulated == 0:
            return None
        return self._flat_gradients()

    def _flat_gradients(self) -> torch.Tensor:
        with torch.no_grad():
            parts = [torch.zeros(p.numel(), dtype=torch.float32, device=p.device) if p.grad is None
                     else p.grad.detach().reshape(-1).float() for p in self._params]
            return torch.cat(parts).cpu()

    def set_open_gradient_sum(self, flat: Optional[torch.Tensor], samples: int) -> None:
        """Replace the open step's gradients with `flat` (the stage's sum, as `open_gradient_sum`
        lays it out) summed over `samples` samples, so that `step` applies the stage's update.
        None with 0 samples: the step has no gradient. Hold `lock`."""
        if (flat is None) != (samples == 0):
            raise ValueError("a gradient sum comes with its samples, and only then")
        if flat is not None and flat.numel() != self.gradient_numel:
            raise ValueError(f"gradient sum has {flat.numel()} values; the stage has {self.gradient_numel}")
        with torch.no_grad():
            offset = 0
            for p in self._params:
                if flat is None:
                    p.grad = None
                    continue
                part = flat[offset:offset + p.numel()].view(p.shape).to(p.device, p.dtype)
                offset += p.numel()
                if p.grad is None:
                    p.grad = part.clone()  # never a view of `flat`, which the caller may reuse
                else:
                    p.grad.copy_(part)
        self.samples_accumulated = samples

    def set_step(self, step: int, samples_consumed: Optional[int] = None) -> None:
        """Jump the step and schedule position, for a replica whose stage stepped without it.

        `samples_consumed` is the stage's (from its progress records); without it the position is
        taken as `step` exact batches. AdamW's per-parameter bias-correction counters are left
        alone: they count this replica's own updates of its moments, not the stage's steps.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        with self.lock:
            self.local_step = step
            self.samples_consumed = step * self.target_batch_size if samples_consumed is None else samples_consumed

    def step(self, stage_samples: Optional[int] = None) -> StepReport:
        """Average, clip and apply the open step's gradients, then make the next step's the open ones.

        `stage_samples` is what the whole stage consumed in this step (it advances the schedule);
        by default this replica's own samples. With no accumulated samples the weights are
        left alone but `local_step` still advances, so an idle replica keeps its place in the
        stage's schedule. Non-finite gradients are dropped and raise `NonFiniteGradients`, and the
        step counts as taken, so this replica stays at the stage's step.
        """
        with self.lock:
            step, samples = self.local_step, self.samples_accumulated
            consumed = samples if stage_samples is None else stage_samples
            lr = self.lr_now()
            if self.previous is not None:
                with torch.no_grad():
                    for prev, p in zip(self.previous, self._params):
                        prev.copy_(p.detach())
                self.previous_version = step
            try:
                if samples == 0:
                    return StepReport(step=step, lr=lr, grad_norm=0.0, clipped=False, samples=0)
                with torch.no_grad():
                    for p in self._params:
                        if p.grad is not None:
                            p.grad.div_(samples)
                    # Clipping runs where the gradients are, before they cross to the host.
                    norm = float(torch.nn.utils.clip_grad_norm_(self._params, self.clip_threshold))
                    if not math.isfinite(norm):
                        raise NonFiniteGradients(
                            f"gradient norm is {norm} at step {step}; the {samples} accumulated samples were dropped"
                        )
                    if not self._shared:
                        self._grads_to_master()
                    for group in self._optimizer.param_groups:
                        group["lr"] = lr
                    self._optimizer.step()
                    if not self._shared:
                        self._copy_master_to_device()
                return StepReport(step=step, lr=lr, grad_norm=norm, clipped=norm > self.clip_threshold, samples=samples)
            finally:
                self._advance()
                self.samples_consumed += consumed

    def _advance(self) -> None:
        """Close the open step: the next step's gradients and counts become the open ones."""
        self._clear_grads()
        for p, g in zip(self._params, self._next_grads):
            p.grad = g
        self._next_grads = [None] * len(self._params)
        self.samples_accumulated, self.next_accumulated = self.next_accumulated, 0
        self.local_step += 1

    def push_master_to_device(self) -> None:
        """Copy the master weights to the compute parameters after someone (the averager) edited them."""
        with self.lock, torch.no_grad():
            if not self._shared:
                self._copy_master_to_device()

    def _grads_to_master(self) -> None:
        for p, master, buffer in zip(self._params, self._master, self._grad_buffers):
            if p.grad is None:
                master.grad = None
                continue
            buffer.copy_(p.grad, non_blocking=self._on_cuda)
            master.grad = buffer
        if self._on_cuda:
            torch.cuda.synchronize(self._device)

    def _copy_master_to_device(self) -> None:
        for p, master in zip(self._params, self._master):
            p.copy_(master, non_blocking=self._on_cuda)
        # Wait so nobody edits the pinned master while the DMA still reads it.
        if self._on_cuda:
            torch.cuda.synchronize(self._device)

    def _clear_grads(self) -> None:
        for p in self._params:
            p.grad = None
        if not self._shared:
            for master in self._master:
                master.grad = None
        self.samples_accumulated = 0

    def discard_all(self) -> dict[int, int]:
        """Drop every accumulated gradient (open and next step) and say how many samples each held,
        by step; for a worker leaving with unfinished steps."""
        with self.lock:
            dropped = {self.local_step: self.samples_accumulated, self.local_step + 1: self.next_accumulated}
            self._clear_grads()
            self._next_grads = [None] * len(self._params)
            self.next_accumulated = 0
            return {step: n for step, n in dropped.items() if n}

    def state_dict(self) -> dict[str, Any]:
        """Schedule position and AdamW moments for a checkpoint; the weights are saved by the model.

        The tensors are live references: hold `lock` until they are serialized if steps may run.
        """
        with self.lock:
            state = {"version": STATE_VERSION, "local_step": self.local_step,
                     "samples_consumed": self.samples_consumed, "optimizer": self._optimizer.state_dict()}
            if self.outer_state is not None:
                state["outer"] = self.outer_state()
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's moments and step; this node's configured hyperparameters win."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"optimizer state version {state.get('version')!r}; this node reads {STATE_VERSION}")
        with self.lock:
            self._optimizer.load_state_dict(state["optimizer"])
            for group in self._optimizer.param_groups:
                group.update(self._hparams)
            self.local_step = int(state["local_step"])
            self.samples_consumed = int(state["samples_consumed"])
            self.loaded_outer = {k: v for k, v in (state.get("outer") or {}).items() if isinstance(v, torch.Tensor)}
            self._clear_grads()
            self._next_grads = [None] * len(self._params)
            self.next_accumulated = 0
