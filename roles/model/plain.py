"""The unconstrained reference: `transformers.LlamaForCausalLM` of a run's shape, trained in one
process.

It prices the subspace constraint: the same widths, depth, vocabulary, rotary base and norm
epsilon as the stage model, but a learned full-rank embedding and full-rank residual writes, built
and initialised by transformers itself (normal(0, 0.02) everywhere), so the comparison rests on no
Llama of our own. It never runs in a swarm (its boundaries would carry d values, not k), which is
why it is one module, not stages. An earlier hand-built plain model of ours, with the stage
model's init, trained 9.7% worse than this one over three seeds at the demo's budget, so it is
gone.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from protocol.run_config import RunConfig
from roles.model.stage import torch_dtype


def plain_init_seed(run_seed: int) -> int:
    """Seed of the reference's weights; its own stream, so it never aliases a stage's."""
    digest = hashlib.sha256(f"agora/plain-init/{run_seed}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PlainModel(nn.Module):
    """`LlamaForCausalLM` of `run`'s shape, returning the per-sample mean next-token loss [B] as
    `FullModel` does. Initialised by transformers under `plain_init_seed(run.seed)` with the
    global RNG forked, so building it moves no other random stream."""

    def __init__(self, run: RunConfig, device: torch.device | str = "cpu"):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        m = run.model
        config = LlamaConfig(
            vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
            num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads, num_key_value_heads=m.n_heads,
            max_position_embeddings=m.max_seq_len, rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps,
            tie_word_embeddings=False, attention_bias=False, mlp_bias=False, initializer_range=0.02)
        config._attn_implementation = "sdpa"
        with torch.random.fork_rng():
            torch.manual_seed(plain_init_seed(run.seed))
            self.llama = LlamaForCausalLM(config)
        self.llama.to(device=device, dtype=torch_dtype(run.dtype))

    def forward(self, tokens: Tensor) -> Tensor:
        logits = self.llama(input_ids=tokens).logits[:, :-1]
        return F.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none").mean(dim=1)

    def stage_parameters(self, run: RunConfig) -> list[list[nn.Parameter]]:
        """Parameters grouped as the run's stages would hold them (embedding with the head's
        layers, norm and LM head with the tail's), so each group gets its stage's optimizer and
        clip threshold and the comparison with the stage model differs in the model only."""
        inner = self.llama.model
        groups: list[list[nn.Parameter]] = []
        for index, stage in enumerate(run.stages):
            group = [p for layer in inner.layers[stage.first_layer:stage.last_layer] for p in layer.parameters()]
            if index == 0:
                group = [inner.embed_tokens.weight, *group]
            if index == run.num_stages - 1:
                group += [*inner.norm.parameters(), *self.llama.lm_head.parameters()]
            groups.append(group)
        return groups
