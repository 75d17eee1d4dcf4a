"""What one batch does to the stage model, on the compute thread: a forward (its graph kept for
the backward while the memory budget allows, roles/worker/serving/kept_activations.py), a backward
through a kept graph, or a backward that recomputes the forward from the input the trainer sends
back (stage-level activation checkpointing [report 3.3.1.4]), on the weights the sample's forward
saw when they are the previous version and still kept.

`BatchCompute` is a part of `StageRuntime` (roles/worker/serving/runtime.py), kept apart from the
loop that feeds it: it reads the runtime's model, optimizer, ledger, kept activations, records and
hooks, and is never built on its own. The adversary harness (tests/support/adversary.py) wraps its
three result-producing methods on this class.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from protocol.messages import BackwardRequest, ForwardRequest
from roles.worker.serving.compute_stats import weights_fingerprint
from roles.worker.serving.kept_activations import KeptBatch, SavedBytes


@dataclass
class BackwardResult:
    grad_input: Optional[torch.Tensor]
    loss: Optional[float]
    step: Optional[int] = None
    """The global step the sample was accumulated into here (the tail's tag)."""
    version: Optional[int] = None
    """The weight version (steps applied) the gradient was taken at."""


class BatchCompute:
    """The forward and backward batches of `StageRuntime` (a mixin: the runtime holds the state)."""

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

    def _model_on(self, weights: Optional[dict[str, torch.Tensor]], coords, tokens) -> torch.Tensor:
        """The stage's forward on `weights` (from `_previous_weights`), or on its own parameters."""
        if weights is None:
            return self.model(coords, tokens)
        return torch.func.functional_call(self.model, weights, (coords, tokens))

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
            with opt.accumulating(min(offset, 1) if offset >= 0 else -1), gradients_into(opt.params, pinned):
                with self._autocast():
                    out = self._model_on(pinned, coords, tokens)
                if self.mid_compute is not None and self.kind == "tail":
                    self.mid_compute("forward")  # the tail has no forward requests: its forward runs here
                if self.kind == "tail":
                    losses = out.float()
                    losses.sum().backward()
                else:
                    grad = torch.stack([r.grad_output for r in requests]).to(self.device, torch.float32)
                    out.float().backward(grad)
                    losses = None
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


@contextlib.contextmanager
def gradients_into(params: list[torch.Tensor], pinned: Optional[dict[str, torch.Tensor]]):
    """Gradients taken at `pinned` weights (detached copies, `_previous_weights`) join `params`'
    .grad in place: autograd adds into an existing .grad, so no third gradient buffer is ever
    allocated. Nothing to do without `pinned`."""
    if pinned is None:
        yield
        return
    for param, old in zip(params, pinned.values()):
        old.grad = param.grad
    try:
        yield
    finally:
        for param, old in zip(params, pinned.values()):
            param.grad, old.grad = old.grad, None


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
