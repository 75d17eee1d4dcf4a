"""A stage replica's gradient accumulation, stage-wise clipping and CPU-offloaded AdamW [3.3.1, 4.3].

A worker accumulates the gradients of every backward batch it serves and only steps when the
stage as a whole has seen `target_batch_size` samples, so the step must turn a sum over however
many samples this replica happened to get into a mean. Clipping is per stage, with no cross-stage
barrier [4.3]; `stage_clip_threshold` gives the report's budget.

The float32 master weights and the AdamW moments live in CPU RAM [3.3.1]: that frees device
memory for activations and batch coalescing, and lets the background averager edit the weights
without interrupting GPU compute. On a CPU-only worker with float32 parameters the master copy is
the parameters themselves.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from protocol.errors import AgoraError

STATE_VERSION = 1


class NonFiniteGradients(AgoraError):
    """The accumulated gradients hold NaN or Inf; they were discarded and the weights left as they were.

    The worker's monitor treats this as a reason to terminate [3.3.1.6].
    """


@dataclass(frozen=True)
class StepReport:
    """What one optimizer step did; `step` is the 0-based index of the step just taken."""

    step: int
    lr: float
    grad_norm: float
    clipped: bool
    samples: int


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Learning rate of 0-based `step`: linear warmup from lr/warmup_steps up to lr, then cosine
    decay to `min_lr_ratio * lr` at `total_steps`, flat after it.

    A pure function of the step so every replica of a stage, and a replica that jumped its position
    with `set_step`, agrees on the rate without talking to the others.
    """
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    min_lr = lr * min_lr_ratio
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0 or step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / decay_steps
    return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def stage_clip_threshold(num_stages: int, *, is_tail: bool) -> float:
    """Per-stage gradient-norm threshold that splits a unit global budget evenly over the stages.

    The squared global norm is the sum of the stages' squared norms, hence 1/sqrt(S); the tail,
    which computes the loss over the whole vocabulary, has consistently larger gradients and gets
    twice that [4.3].
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    return (2.0 if is_tail else 1.0) / math.sqrt(num_stages)


class StageOptimizer:
    """Owns a stage replica's accumulated gradients and its AdamW, with master weights on the CPU.

    `lock` (re-entrant) is held during `step`, so the averager and the state server, which take it
    too, always see consistent weights; the runtime holds it around each backward pass and its
    `add_samples` so a step never lands in the middle of accumulation.
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
        force_master_copy: bool = False,
    ):
        self._params = list(params)
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
        self._schedule = dict(lr=lr, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)
        self._hparams = dict(betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        self.clip_threshold = clip_threshold
        self.lock = threading.RLock()
        self.local_step = 0
        self.samples_accumulated = 0
        """Samples whose gradients are accumulated now: what `step` divides the sum by."""
        self.samples_counted = 0
        """Of those, the samples that count towards the stage's target batch (what progress publishes)."""

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

    def _host_buffer(self, p: torch.Tensor) -> torch.Tensor:
        return torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=self._on_cuda)

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The float32 CPU weights the averager reads and edits (under `lock`, then `push_master_to_device`)."""
        return self._master

    @property
    def shares_master(self) -> bool:
        """True when the master weights are the compute parameters themselves (no duplicate memory)."""
        return self._shared

    def add_samples(self, n: int, *, counted: bool = True) -> None:
        """Record that the last backward batch added the summed gradients of `n` samples.

        `counted=False` is for a worker in optimizer sync: its gradients are real and its own step
        must average them (it warms AdamW on them), but they count nothing towards the stage's
        target batch [report 3.3.1.1], so they enter `samples_accumulated` and not `samples_counted`.
        """
        if n < 0:
            raise ValueError(f"sample count must be non-negative, got {n}")
        with self.lock:
            self.samples_accumulated += n
            if counted:
                self.samples_counted += n

    def set_step(self, step: int) -> None:
        """Jump the schedule position, for a replica whose stage stepped without it.

        AdamW's per-parameter bias-correction counters are left alone: they count this replica's
        own updates of its moments, not the stage's steps.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        with self.lock:
            self.local_step = step

    def step(self) -> StepReport:
        """Average, clip and apply the accumulated gradients, then clear them for the next step.

        With no accumulated samples the weights are left alone but `local_step` still advances,
        so an idle replica keeps its place in the stage's schedule. Non-finite gradients are
        dropped and raise `NonFiniteGradients` without advancing `local_step`.
        """
        with self.lock:
            step, samples = self.local_step, self.samples_accumulated
            lr = lr_at(step, **self._schedule)
            if samples == 0:
                self._clear_grads()
                self.local_step += 1
                return StepReport(step=step, lr=lr, grad_norm=0.0, clipped=False, samples=0)
            with torch.no_grad():
                for p in self._params:
                    if p.grad is not None:
                        p.grad.div_(samples)
                # Clipping runs where the gradients are, before they cross to the host.
                norm = float(torch.nn.utils.clip_grad_norm_(self._params, self.clip_threshold))
                if not math.isfinite(norm):
                    self._clear_grads()
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
            self._clear_grads()
            self.local_step += 1
            return StepReport(step=step, lr=lr, grad_norm=norm, clipped=norm > self.clip_threshold, samples=samples)

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
        self.samples_counted = 0

    def state_dict(self) -> dict[str, Any]:
        """Schedule position and AdamW moments for a checkpoint; the weights are saved by the model.

        The tensors are live references: hold `lock` until they are serialized if steps may run.
        """
        with self.lock:
            return {"version": STATE_VERSION, "local_step": self.local_step, "optimizer": self._optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a checkpoint's moments and step; this node's configured hyperparameters win."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"optimizer state version {state.get('version')!r}; this node reads {STATE_VERSION}")
        with self.lock:
            self._optimizer.load_state_dict(state["optimizer"])
            for group in self._optimizer.param_groups:
                group.update(self._hparams)
            self.local_step = int(state["local_step"])
            self._clear_grads()
