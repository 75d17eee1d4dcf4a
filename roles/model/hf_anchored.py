"""A Hugging Face Llama with stage anchors: the export of a run in the stage-anchors construction.

This file is copied into the export as `modeling_agora.py` and loaded by
`AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`, so it imports only torch
and transformers. The model is a stock `LlamaForCausalLM` plus one thing a stock Llama cannot
express: where a pipeline stage of the run began, the residual stream's token-dependent part
outside the shared subspace changes from the previous stage's anchor rows to this stage's
(agora-node's roles/model/stage.py). At the first layer of every stage after the head a pre-hook
adds `rows_s[ids] - rows_{s-1}[ids]`, where `rows_s[ids]` is `agora_anchors.{s}.rows[ids]`, times
`agora_anchors.{s}.basis` when the run factored its anchors, and zero for a stage without one
(the head's anchor is also folded into `embed_tokens`, where the stream begins). The rows are
stored already projected off the subspace and scaled, so no basis of the run is needed here.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM


class AgoraAnchoredLlamaConfig(LlamaConfig):
    """`LlamaConfig` plus the first layer of each pipeline stage and the anchors' factor width."""

    model_type = "agora_anchored_llama"

    def __init__(self, agora_stage_first_layers=(0,), agora_anchored_stages=(), agora_anchor_rank=None, **kwargs):
        self.agora_stage_first_layers = list(agora_stage_first_layers)
        self.agora_anchored_stages = list(agora_anchored_stages)
        self.agora_anchor_rank = agora_anchor_rank
        super().__init__(**kwargs)


class _StageAnchor(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank):
        super().__init__()
        self.rows = nn.Parameter(torch.zeros(vocab_size, rank or hidden_size))
        self.basis = nn.Parameter(torch.zeros(rank, hidden_size)) if rank else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = nn.functional.embedding(ids, self.rows)
        return rows if self.basis is None else rows @ self.basis


class AgoraAnchoredLlamaForCausalLM(LlamaForCausalLM):
    """`LlamaForCausalLM` whose stream swaps stage anchors at each stage's first layer; takes
    `input_ids` (the anchors are rows of a token table), not `inputs_embeds`."""

    config_class = AgoraAnchoredLlamaConfig

    def __init__(self, config: AgoraAnchoredLlamaConfig):
        super().__init__(config)
        firsts = config.agora_stage_first_layers
        self.agora_anchors = nn.ModuleDict({
            str(stage): _StageAnchor(config.vocab_size, config.hidden_size, config.agora_anchor_rank)
            for stage in config.agora_anchored_stages})
        self._anchor_ids = None
        for stage in range(1, len(firsts)):
            self.model.layers[firsts[stage]].register_forward_pre_hook(self._swap_hook(stage), with_kwargs=True)

    def _swap_hook(self, stage: int):
        def hook(module, args, kwargs):
            if self._anchor_ids is None:
                raise ValueError("this model needs input_ids (its stage anchors are token tables), not inputs_embeds")
            shift = self._rows(stage) - self._rows(stage - 1)
            if not torch.is_tensor(shift):  # neither stage has an anchor: nothing to swap
                return None
            if args:
                return (args[0] + shift.to(args[0].dtype), *args[1:]), kwargs
            kwargs["hidden_states"] = kwargs["hidden_states"] + shift.to(kwargs["hidden_states"].dtype)
            return args, kwargs
        return hook

    def _rows(self, stage: int):
        anchor = self.agora_anchors[str(stage)] if str(stage) in self.agora_anchors else None
        return 0.0 if anchor is None else anchor(self._anchor_ids)

    def forward(self, input_ids=None, *args, **kwargs):
        self._anchor_ids = input_ids
        try:
            return super().forward(input_ids, *args, **kwargs)
        finally:
            self._anchor_ids = None
