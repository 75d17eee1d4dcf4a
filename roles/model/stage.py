"""One pipeline stage of the model, as a worker holds it, and the unsplit model for testing.

A stage maps boundary coordinates to boundary coordinates: it reconstructs the residual stream
from the k coordinates and the token ids (the head embeds the tokens instead), runs its blocks and
compresses the result back to k coordinates; the tail ends in the loss [report 4.1]. Token ids travel
beside the coordinates because the fixed embedding they select is what the coordinates omit.

Dtypes: parameters and block compute use `run.dtype`; the residual stream, U_k and the boundary
coordinates stay float32 (wider if the module is cast to float64), so `forward` returns float32
coordinates whatever the compute dtype. The fixed embedding is stored in `run.dtype` to save
device memory; both sides of a boundary read the same rounded table, so nothing is lost. A worker
may also run the stage under autocast: the boundary arithmetic, norms and loss switch it off.

What fills the residual stream outside span(U_k) is the run's `model.construction`:
- 'fixed-embedding' (the report's): one fixed random token table T_fixed, rows of norm ~1, that
  every stage regenerates from `subspace_seed`; nothing outside span(U_k) ever learns.
- 'stage-anchors': no T_fixed. Every stage adds a learned token table of its own, its `anchor`,
  projected orthogonal to U_k, to the stream it reconstructs (the head: to E U_k^T); the
  projection at its exit removes it again, so the boundary still carries exactly the k
  coordinates, and each stage's blocks read a full-width learned embedding as a plain Llama's do.
  Anchors are stored divided by `ANCHOR_SCALE` and multiplied back: under AdamW a larger learning
  rate.
"""

from __future__ import annotations

import hashlib
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.run_config import RunConfig
from roles.model.layers import Block, DenseLinear, RMSNorm
from roles.model.subspace import (
    compress,
    fixed_token_embedding,
    reconstruct,
    subspace_basis,
    without_autocast,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_INIT_STD = 0.02
ANCHOR_SCALE = 4.0
"""stage-anchors: an anchor's stored values times this are its rows; with AdamW that moves anchors
this many times faster than the other weights at the same effective init (the construction
ablation in docs/architecture.md, "Wire protocol")."""


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `RunConfig.dtype` name."""
    return _DTYPES[name]


def stage_init_seed(run_seed: int, stage_index: int) -> int:
    """Seed of a stage's initial weights: equal for all replicas of a stage, distinct across
    stages."""
    digest = hashlib.sha256(f"agora/stage-init/{run_seed}/{stage_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class StageModel(nn.Module):
    """The blocks `run.stages[stage_index]` names, plus the embedding (head) or the final norm,
    LM head and loss (tail). Every replica built from the same `RunConfig` starts identical."""

    def __init__(self, run: RunConfig, stage_index: int, device: torch.device | str = "cpu"):
        super().__init__()
        model = run.model
        self.kind: Literal["head", "body", "tail"] = run.stage_kind(stage_index)
        self.stage_index = stage_index
        self.layers = run.stages[stage_index]
        self.vocab_size = model.vocab_size
        self.subspace_rank = model.subspace_rank
        self.max_seq_len = model.max_seq_len
        compute_dtype = torch_dtype(run.dtype)

        self.construction = model.construction
        basis = subspace_basis(model.d_model, model.subspace_rank, model.subspace_seed)
        self.register_buffer("basis", basis, persistent=False)
        fixed = None
        if self.construction == "fixed-embedding":
            fixed = fixed_token_embedding(model.vocab_size, model.d_model, model.subspace_seed)
        self.register_buffer("fixed_embedding", fixed, persistent=False)
        if self.kind == "head":
            self.embedding = nn.Parameter(torch.empty(model.vocab_size, model.subspace_rank))
        full_rank = self.kind == "tail" and model.tail_full_rank
        self.blocks = nn.ModuleList(
            Block(model, basis, full_rank) for _ in range(self.layers.num_layers)
        )
        if self.kind == "tail":
            self.final_norm = RMSNorm(model.d_model, model.norm_eps)
            self.lm_head = DenseLinear(model.d_model, model.vocab_size)
        # Created last so that a fixed-embedding stage keeps the parameter order (and so the
        # checkpoint layout and seeded init) it always had.
        self.anchor: nn.Parameter | None = None
        self.anchor_basis: nn.Parameter | None = None
        if self.construction == "stage-anchors":
            width = model.anchor_rank or model.d_model
            self.anchor = nn.Parameter(torch.empty(model.vocab_size, width))
            if model.anchor_rank:
                self.anchor_basis = nn.Parameter(torch.empty(model.anchor_rank, model.d_model))

        self._reset_parameters(
            torch.Generator(device="cpu").manual_seed(stage_init_seed(run.seed, stage_index)),
            out_std=_INIT_STD / math.sqrt(2 * model.n_layers),
        )
        if self.fixed_embedding is not None:
            self.fixed_embedding = self.fixed_embedding.to(compute_dtype)
        for param in self.parameters():
            param.data = param.data.to(compute_dtype)
        self.to(device)

    def _reset_parameters(self, generator: torch.Generator, out_std: float) -> None:
        with torch.no_grad():
            if self.kind == "head":
                self.embedding.normal_(0.0, _INIT_STD, generator=generator)
            for block in self.blocks:
                block.reset_parameters(generator, _INIT_STD, out_std)
            if self.kind == "tail":
                self.final_norm.reset_parameters()
                self.lm_head.reset_parameters(generator, _INIT_STD)
            if self.anchor is not None and self.anchor_basis is None:
                self.anchor.normal_(0.0, _INIT_STD / ANCHOR_SCALE, generator=generator)
            elif self.anchor is not None:  # rows codes @ basis, of std _INIT_STD at init
                self.anchor.normal_(0.0, 1.0, generator=generator)
                rank = self.anchor_basis.shape[0]
                self.anchor_basis.normal_(0.0, _INIT_STD / (ANCHOR_SCALE * rank**0.5), generator=generator)

    def trainable_parameters(self) -> list[nn.Parameter]:
        """Everything the optimizer steps and the averager syncs; U_k and the fixed embedding are
        buffers and never appear here."""
        return [param for param in self.parameters() if param.requires_grad]

    def averaged_payload(self) -> list[tuple[str, Tensor]]:
        """Averaged-only tensors: none here (a surrogate stage has some)."""
        return []

    def embed(self, tokens: Tensor) -> Tensor:
        """Head only: the part of the residual stream that crosses the head's boundary,
        E[tokens] U_k^T, plus T_fixed[tokens] in the fixed-embedding construction (eq. 2)."""
        with without_autocast(self.basis):
            trainable = F.embedding(tokens, self.embedding).to(self.basis.dtype) @ self.basis.T
            if self.fixed_embedding is None:
                return trainable
            return self.fixed_embedding[tokens].to(self.basis.dtype) + trainable

    def anchor_rows(self, tokens: Tensor) -> Tensor:
        """stage-anchors: this stage's anchor rows [B, T, d], orthogonal to U_k, in the stream's
        dtype; the projection keeps them out of the boundary coordinates."""
        with without_autocast(self.basis):
            rows = F.embedding(tokens, self.anchor)
            if self.anchor_basis is not None:
                rows = rows @ self.anchor_basis
            rows = rows.to(self.basis.dtype) * ANCHOR_SCALE
            return rows - (rows @ self.basis) @ self.basis.T

    def enter(self, coords: Tensor | None, tokens: Tensor) -> Tensor:
        """The residual stream at this stage's first block: the head embeds the tokens, other
        stages reconstruct it from the boundary coordinates; then this stage's anchor, if any."""
        if self.kind == "head":
            hidden = self.embed(tokens)
        else:
            hidden = reconstruct(coords.to(self.basis.dtype), tokens, self.fixed_embedding, self.basis)
        if self.anchor is not None:
            hidden = hidden + self.anchor_rows(tokens)
        return hidden

    def leave(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Head and body: the boundary coordinates [B, T, k] of the stream after the blocks."""
        return compress(hidden, tokens, self.fixed_embedding, self.basis)

    def run_blocks(self, hidden: Tensor) -> Tensor:
        """Apply this stage's blocks to the residual stream."""
        for block in self.blocks:
            hidden = block(hidden)
        return hidden

    def loss_from_hidden(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Tail only: per-sample mean next-token cross-entropy [B] in float32; position t predicts
        token t+1, and the last position has no label."""
        logits = self.lm_head(self.final_norm(hidden[:, :-1]))
        with without_autocast(logits):
            losses = F.cross_entropy(
                logits.float().transpose(1, 2), tokens[:, 1:], reduction="none"
            )
            return losses.mean(dim=1)

    def forward(self, coords: Tensor | None, tokens: Tensor) -> Tensor:
        """head: `coords` is None and `tokens` [B, T] are embedded; head and body return boundary
        coordinates [B, T, k] in float32; tail returns the per-sample loss [B].

        Token ids must lie in [0, vocab_size); the worker validates requests before queuing them,
        since an out-of-range id would trip a device-side assert on CUDA.
        """
        self._check_inputs(coords, tokens)
        hidden = self.run_blocks(self.enter(coords, tokens))
        if self.kind == "tail":
            return self.loss_from_hidden(hidden, tokens)
        return self.leave(hidden, tokens)

    def _check_inputs(self, coords: Tensor | None, tokens: Tensor) -> None:
        check_stage_inputs(self.kind, coords, tokens, max_seq_len=self.max_seq_len, subspace_rank=self.subspace_rank)


def check_stage_inputs(kind: str, coords: Tensor | None, tokens: Tensor, *, max_seq_len: int,
                       subspace_rank: int) -> None:
    """What every stage's `forward` accepts (a transformer's or a surrogate's): ValueError naming
    the problem otherwise."""
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(
            f"tokens must be an int64 [B, T] tensor, got {tokens.dtype} {tuple(tokens.shape)}"
        )
    batch, seq_len = tokens.shape
    if not 0 < seq_len <= max_seq_len or (kind == "tail" and seq_len < 2):
        raise ValueError(
            f"sequence length {seq_len} is outside 1..{max_seq_len} "
            f"(the tail needs at least 2 tokens)"
        )
    if kind == "head":
        if coords is not None:
            raise ValueError("the head stage embeds tokens itself; pass coords=None")
        return
    expected = (batch, seq_len, subspace_rank)
    if coords is None or tuple(coords.shape) != expected:
        got = None if coords is None else tuple(coords.shape)
        raise ValueError(f"{kind} stage expects coords of shape {expected}, got {got}")


def build_stage_model(run: RunConfig, stage_index: int, device: torch.device | str = "cpu") -> nn.Module:
    """The stage a worker holds: a `StageModel`, or a `SurrogateStage` for `model.kind` surrogate."""
    if run.model.kind == "surrogate":
        from roles.model.surrogate import SurrogateStage

        return SurrogateStage(run, stage_index, device=device)
    return StageModel(run, stage_index, device=device)


class FullModel(nn.Module):
    """The unsplit model, run straight through the stages' own modules on the full residual
    stream with no compression between them (in the stage-anchors construction the stream's part
    outside span(U_k) is each stage's own, so there a boundary swaps the anchors, as the pipeline
    does). It shares the stages' parameters, so its loss and gradients are the reference the
    pipeline must reproduce."""

    def __init__(self, stages: list[StageModel]):
        super().__init__()
        kinds = [stage.kind for stage in stages]
        if len(kinds) < 2 or kinds != ["head", *["body"] * (len(kinds) - 2), "tail"]:
            raise ValueError(f"stages must run head, bodies..., tail in order; got {kinds}")
        self.stages = nn.ModuleList(stages)

    @classmethod
    def from_stages(cls, stages: list[StageModel]) -> FullModel:
        """The reference model over `stages`, in pipeline order."""
        return cls(stages)

    def final_hidden(self, tokens: Tensor) -> Tensor:
        """The residual stream after the tail's blocks [B, T, d]."""
        hidden = self.stages[0].enter(None, tokens)
        for index, stage in enumerate(self.stages):
            previous = self.stages[index - 1]
            if index and (stage.anchor is not None or previous.anchor is not None):
                hidden = stage.enter(previous.leave(hidden, tokens), tokens)
            hidden = stage.run_blocks(hidden)
        return hidden

    def forward(self, tokens: Tensor) -> Tensor:
        """Per-sample mean next-token loss [B], as the tail stage would return it."""
        return self.stages[-1].loss_from_hidden(self.final_hidden(tokens), tokens)
