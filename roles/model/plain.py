"""The unconstrained model: a plain Llama-style decoder of a run's shape, trained in one process.

It prices the subspace constraint [issue 7]: same blocks, norms, LM head, loss and data as the
stage model, but a learned full-rank token embedding and full-rank residual writes in every
block, so nothing is confined to span(U_k) and no token embedding is fixed. It never runs in a
swarm (its boundaries would carry d values, not k), which is why it is one module, not stages.

The init knobs exist so `scripts/bench_fidelity.py --ablation` can move one difference at a time
between this model and the subspace one; the defaults are the stage model's own std values.
"""

from __future__ import annotations

import hashlib
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.run_config import RunConfig
from roles.model.layers import Block, DenseLinear, RMSNorm
from roles.model.stage import torch_dtype

INIT_STD = 0.02
"""The stage model's init std (embedding, input projections, LM head)."""


def plain_init_seed(run_seed: int) -> int:
    """Seed of the plain model's weights; its own stream, so it never aliases a stage's."""
    digest = hashlib.sha256(f"agora/plain-init/{run_seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PlainModel(nn.Module):
    """Learned embedding, `n_layers` full-rank blocks, final norm and LM head; returns the same
    per-sample mean next-token loss [B] as `FullModel`.

    `embedding_std` (default `INIT_STD`) and `out_std` (default INIT_STD/sqrt(2 n_layers), the
    output projections) are the init scales the ablation varies.
    """

    def __init__(self, run: RunConfig, *, embedding_std: float = INIT_STD, out_std: Optional[float] = None,
                 device: torch.device | str = "cpu"):
        super().__init__()
        model = run.model
        self.n_layers = model.n_layers
        # `_weight` skips nn.Embedding's own init, which would draw from the global RNG.
        self.embedding = nn.Embedding(model.vocab_size, model.d_model,
                                      _weight=torch.empty(model.vocab_size, model.d_model))
        # Full-rank blocks never read the basis: their output projections are dense.
        self.blocks = nn.ModuleList(Block(model, None, full_rank=True) for _ in range(model.n_layers))
        self.final_norm = RMSNorm(model.d_model, model.norm_eps)
        self.lm_head = DenseLinear(model.d_model, model.vocab_size)
        generator = torch.Generator(device="cpu").manual_seed(plain_init_seed(run.seed))
        out_std = INIT_STD / math.sqrt(2 * model.n_layers) if out_std is None else out_std
        with torch.no_grad():
            self.embedding.weight.normal_(0.0, embedding_std, generator=generator)
            for block in self.blocks:
                block.reset_parameters(generator, INIT_STD, out_std)
            self.final_norm.reset_parameters()
            self.lm_head.reset_parameters(generator, INIT_STD)
        self.to(device=device, dtype=torch_dtype(run.dtype))

    def embed(self, tokens: Tensor) -> Tensor:
        """The residual stream at the first block: the learned embedding rows, in float32."""
        return self.embedding(tokens).float()

    def run_blocks(self, hidden: Tensor) -> Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return hidden

    def loss_from_hidden(self, hidden: Tensor, tokens: Tensor) -> Tensor:
        """Per-sample mean cross-entropy [B]; position t predicts token t+1 (as the tail stage)."""
        logits = self.lm_head(self.final_norm(hidden[:, :-1]))
        losses = F.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none")
        return losses.mean(dim=1)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.loss_from_hidden(self.run_blocks(self.embed(tokens)), tokens)

    def stage_parameters(self, run: RunConfig) -> list[list[nn.Parameter]]:
        """Parameters grouped as the run's stages would hold them (embedding with the head's
        blocks, norm and LM head with the tail's), so each group can get its stage's optimizer
        and clip threshold and the comparison with the stage model differs in the model only."""
        groups: list[list[nn.Parameter]] = []
        for index, stage in enumerate(run.stages):
            group = [p for block in self.blocks[stage.first_layer:stage.last_layer] for p in block.parameters()]
            if index == 0:
                group = [self.embedding.weight, *group]
            if index == run.num_stages - 1:
                group += [*self.final_norm.parameters(), *self.lm_head.parameters()]
            groups.append(group)
        return groups
