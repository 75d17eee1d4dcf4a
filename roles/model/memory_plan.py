"""How much device and host memory one stage replica needs, worked out from shapes alone.

A worker must decide its `max_batch` (the coalescing cap [report 3.3.1.3]) and whether it can serve a
stage at all before it allocates anything; an 8B stage cannot be built just to measure it. So the
plan counts parameters exactly as `StageModel` creates them and estimates the autograd activations
of the recomputed forward that backward runs (stage-level checkpointing [report 3.3.1.4]: the no-grad
forward keeps nothing, the backward pass holds every block's saved tensors at once). The AdamW
master weights and moments live in host RAM, float32 [report 3.3.1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from protocol.run_config import RunConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_WIDE = 4  # bytes of the float32 residual stream, U_k, boundary coordinates and loss logits
_HEADROOM = 1.1  # allocator fragmentation, CUDA context slack, kernels' workspaces
_GIB = float(1 << 30)


def stage_parameter_count(run: RunConfig, stage_index: int) -> int:
    """Trainable values in a stage, exactly as `StageModel` lays them out."""
    model = run.model
    d, f, k, vocab = model.d_model, model.ffn_dim, model.subspace_rank, model.vocab_size
    kind = run.stage_kind(stage_index)
    out_width = d if kind == "tail" and model.tail_full_rank else k
    per_block = 2 * d + 3 * d * d + 2 * d * f + (d + f) * out_width
    count = per_block * run.stages[stage_index].num_layers
    if kind == "head":
        count += vocab * k
    if kind == "tail":
        count += d + vocab * d
    if model.construction == "stage-anchors":
        r = model.anchor_rank
        count += vocab * d if r is None else vocab * r + r * d
    return count


def _fixed_table_values(run: RunConfig) -> int:
    """Values of the fixed token table a stage regenerates: none in the stage-anchors construction."""
    return run.model.vocab_size * run.model.d_model if run.model.construction == "fixed-embedding" else 0


def _activation_bytes_per_sample(run: RunConfig, stage_index: int, flash: bool) -> int:
    """Saved tensors of one sample's recomputed forward plus the largest backward transients.

    Checked against autograd's saved-tensor hooks on CPU: within a few percent per block.
    """
    model = run.model
    t, d, f, k = run.seq_len, model.d_model, model.ffn_dim, model.subspace_rank
    heads, vocab, b = model.n_heads, model.vocab_size, _DTYPE_BYTES[run.dtype]
    kind = run.stage_kind(stage_index)
    # residual input (float32), normalized (float32), output in the compute dtype
    norm = t * d * (_WIDE + _WIDE + b)
    attention = (
        3 * t * d * b  # q, k, v
        + 2 * t * d * b  # rotated q and k
        + 2 * t * d * b  # attention output and its contiguous copy for the output projection
        + heads * t * _WIDE  # log-sum-exp
        + (0 if flash else 2 * heads * t * t * b)  # scores and probabilities
    )
    subspace_out = t * k * (b + _WIDE)  # x @ Z, widened for the expansion by U_k^T
    mlp = 4 * t * f * b  # gate, up, silu(gate), product
    per_block = 2 * norm + attention + mlp + 2 * subspace_out
    saved = per_block * run.stages[stage_index].num_layers
    saved += t * (k * _WIDE + d * _WIDE)  # boundary coordinates and the reconstructed stream
    if model.construction == "stage-anchors" and model.anchor_rank is not None:
        # a factored anchor's [T, r] rows, kept for its second factor's gradient; a full anchor
        # keeps nothing (its projection off U_k multiplies by a buffer)
        saved += t * model.anchor_rank * _WIDE
    if kind == "head":
        saved += t * k * b
    if kind == "tail":
        widened = _WIDE if b != _WIDE else 0
        # logits, their float32 copy, the log-softmax, and the logits' gradient in backward
        saved += norm + t * vocab * (b + widened + 2 * _WIDE)
    transient = t * (2 * f * b + 3 * d * _WIDE) + (0 if flash else heads * t * t * b)
    return saved + transient


@dataclass(frozen=True)
class MemoryPlan:
    """Memory one replica of a stage needs at a given coalescing cap, in bytes."""

    stage_index: int
    device: str
    max_batch: int
    param_bytes: int
    grad_bytes: int  # the open step's gradients, plus the next step's on head and body stages
    previous_weights_bytes: int  # the weights before the last step, kept for pinned backward recomputes
    fixed_buffer_bytes: int  # U_k (the stage's and each block's copy) and the fixed embedding
    optimizer_host_bytes: int  # AdamW master weights + 2 moments, float32, in host RAM [report 3.3.1]
    activation_bytes_per_sample: int  # recomputed forward + backward for one sample at seq_len
    device_bytes: int  # params + grads + buffers + activations*max_batch, plus 10% headroom
    host_bytes: int  # optimizer state, host gradient copy, and the fixed table built at start
    kind: str = ""
    dtype: str = ""
    num_params: int = 0
    payload_values: int = 0  # a surrogate's untrained averaged values (host RAM, counted in host_bytes)
    outer_host_bytes: int = 0  # SparseLoCo's anchor, error buffer and captured weights (host RAM, in host_bytes)

    @property
    def _static_device_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.previous_weights_bytes + self.fixed_buffer_bytes

    def _device_total(self, batch: int) -> int:
        return math.ceil(
            (self._static_device_bytes + self.activation_bytes_per_sample * batch) * _HEADROOM
        )

    def fits(self, device_free_bytes: int | None, host_free_bytes: int) -> bool:
        """Whether the plan fits; `device_free_bytes=None` means the device is the host itself,
        so both totals must fit in host RAM together."""
        if device_free_bytes is None:
            return self.device_bytes + self.host_bytes <= host_free_bytes
        return self.device_bytes <= device_free_bytes and self.host_bytes <= host_free_bytes

    def max_batch_that_fits(
        self, device_free_bytes: int | None, host_free_bytes: int | None = None
    ) -> int:
        """Largest coalesced batch whose device total fits in `device_free_bytes`; 0 if not even
        the weights fit. Not capped at `max_batch`. With `device_free_bytes=None` the device is
        the host, and the activations share `host_free_bytes` with the host totals."""
        if device_free_bytes is None:
            if host_free_bytes is None:
                raise ValueError("a host-memory device needs host_free_bytes to size its batch")
            device_free_bytes = host_free_bytes - self.host_bytes
        per_sample = max(1, self.activation_bytes_per_sample)
        budget = device_free_bytes / _HEADROOM - self._static_device_bytes
        batch = max(0, int(budget // per_sample))
        while batch > 0 and self._device_total(batch) > device_free_bytes:
            batch -= 1
        while self._device_total(batch + 1) <= device_free_bytes:
            batch += 1
        return batch

    def auto_max_batch(self, device_free_bytes: int, cap: int) -> int:
        """The batch a GPU worker coalesces up to when --max-batch is not given: the largest whose
        activations take at most half of what the weights, gradients and buffers leave free (the
        other half keeps forward activations for the backward, kept_activations_budget), at most
        `cap`; 0 if not even the weights fit."""
        static = int(self._static_device_bytes * _HEADROOM)
        if static > device_free_bytes:
            return 0
        return max(1, min(cap, self.max_batch_that_fits(static + (device_free_bytes - static) // 2)))

    def kept_activations_budget(self, device_free_bytes: int | None, host_free_bytes: int) -> int:
        """Bytes a head or body worker may spend keeping forward activations for their backward
        instead of recomputing them: half of what the plan at `max_batch` leaves free (the other
        half stays slack for the allocator and for the rest of the machine), 0 if nothing is left."""
        if device_free_bytes is None:
            left = host_free_bytes - self.host_bytes - self.device_bytes
        else:
            left = device_free_bytes - self.device_bytes
        return max(0, left // 2)

    def describe(self) -> str:
        """A short table in GiB for logs and `agora-node` start-up output."""

        def gib(value: int) -> str:
            return f"{value / _GIB:9.3f} GiB"

        head = f"stage {self.stage_index}"
        if self.kind:
            head += f" ({self.kind}, {self.num_params / 1e6:.1f}M params, {self.dtype})"
        if self.payload_values:
            head += f", surrogate with {self.payload_values / 1e6:.1f}M averaged-only values"
        rows = [
            f"{head} on {self.device}, max batch {self.max_batch}",
            f"  parameters        {gib(self.param_bytes)}",
            f"  gradients         {gib(self.grad_bytes)}",
            f"  previous weights  {gib(self.previous_weights_bytes)}",
            f"  fixed buffers     {gib(self.fixed_buffer_bytes)}",
            f"  activations/sample{gib(self.activation_bytes_per_sample)}",
            f"  device total      {gib(self.device_bytes)}  (incl. 10% headroom)",
            f"  host total        {gib(self.host_bytes)}",
            f"    of which AdamW  {gib(self.optimizer_host_bytes)}",
        ]
        if self.outer_host_bytes:
            rows.append(f"    of which SparseLoCo {gib(self.outer_host_bytes)}")
        return "\n".join(rows)


def plan_memory(run: RunConfig, stage_index: int, device: str, max_batch: int) -> MemoryPlan:
    """Plan one replica of `run`'s stage `stage_index` on `device` ("cuda:0", "cpu", ...) at
    coalescing cap `max_batch`. Attention scores count as materialized except on CUDA, where
    scaled_dot_product_attention uses a fused kernel."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    if run.model.kind == "surrogate":
        return _plan_surrogate(run, stage_index, device, max_batch)
    model = run.model
    kind = run.stage_kind(stage_index)
    b = _DTYPE_BYTES[run.dtype]
    num_params = stage_parameter_count(run, stage_index)
    param_bytes = num_params * b
    basis_copies = 1 + run.stages[stage_index].num_layers
    fixed_buffer_bytes = (
        _fixed_table_values(run) * b
        + basis_copies * model.d_model * model.subspace_rank * _WIDE
    )
    activation = _activation_bytes_per_sample(run, stage_index, flash=device.startswith("cuda"))
    optimizer_host_bytes = 3 * num_params * _WIDE
    host_bytes = (
        optimizer_host_bytes + num_params * _WIDE + _fixed_table_values(run) * _WIDE
    )
    # Head and body stages accumulate the next step's samples beside the open step's while its
    # last samples are in flight, and keep the previous weights for pinned recomputes;
    # the tail tags samples itself and fuses forward with backward, so it needs neither.
    pipelined = kind != "tail"
    plan = MemoryPlan(
        stage_index=stage_index,
        device=device,
        max_batch=max_batch,
        param_bytes=param_bytes,
        grad_bytes=param_bytes * (2 if pipelined else 1),
        previous_weights_bytes=param_bytes if pipelined and run.staleness.pin_forward_weights else 0,
        fixed_buffer_bytes=fixed_buffer_bytes,
        optimizer_host_bytes=optimizer_host_bytes,
        activation_bytes_per_sample=activation,
        device_bytes=0,
        host_bytes=host_bytes,
        kind=kind,
        dtype=run.dtype,
        num_params=num_params,
    )
    return _with_outer(run, replace(plan, device_bytes=plan._device_total(max_batch)), num_params)


def _with_outer(run: RunConfig, plan: MemoryPlan, averaged_values: int) -> MemoryPlan:
    """SparseLoCo keeps three float32 copies of what it exchanges in host RAM: the consensus anchor,
    the error-feedback buffer, and the weights of each fragment between capture and apply."""
    if run.averaging.method != "sparseloco":
        return plan
    outer = 3 * averaged_values * _WIDE
    return replace(plan, outer_host_bytes=outer, host_bytes=plan.host_bytes + outer)


def _plan_surrogate(run: RunConfig, stage_index: int, device: str, max_batch: int) -> MemoryPlan:
    """A surrogate stage [report 3.5.1]: float32 trainable layers (and the tail's fixed code
    table), plus the averaged-only payload, its index set and the round buffers in host RAM."""
    from roles.model import surrogate_sizes as sizes

    kind = run.stage_kind(stage_index)
    num_params = sizes.surrogate_trainable_count(run, stage_index)
    param_bytes = num_params * _WIDE
    pipelined = kind != "tail"
    plan = MemoryPlan(
        stage_index=stage_index,
        device=device,
        max_batch=max_batch,
        param_bytes=param_bytes,
        grad_bytes=param_bytes * (2 if pipelined else 1),
        previous_weights_bytes=param_bytes if pipelined and run.staleness.pin_forward_weights else 0,
        fixed_buffer_bytes=run.model.vocab_size * run.model.subspace_rank * _WIDE if kind == "tail" else 0,
        optimizer_host_bytes=3 * param_bytes,
        activation_bytes_per_sample=sizes.surrogate_activation_bytes_per_sample(run, stage_index),
        device_bytes=0,
        host_bytes=3 * param_bytes + sizes.surrogate_host_bytes(run, stage_index),
        kind=kind,
        dtype="float32",
        num_params=num_params,
        payload_values=sizes.surrogate_payload_count(run, stage_index),
    )
    return _with_outer(run, replace(plan, device_bytes=plan._device_total(max_batch)),
                       num_params + sizes.surrogate_payload_count(run, stage_index))
