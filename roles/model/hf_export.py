"""The swarm's model as a Hugging Face `LlamaForCausalLM` checkpoint, exactly.

Our decoder is a Llama: pre-norm blocks with RMSNorm, causal multi-head attention with
rotate-half rotary positions (θ = `rope_theta`, no scaling), a SwiGLU MLP, a final RMSNorm and an
untied LM head, no biases. Two things are reparameterised and fold into dense weights [report 4.1]:

- output projections `x @ Z @ U_kᵀ` (attention out, MLP down; not in full-rank tail blocks) are
  the dense `W = (Z U_kᵀ)ᵀ = U_k Zᵀ`, shape [d_model, in];
- the embedding is the fixed table plus the trained coordinates: `T_fixed + E U_kᵀ`.

The fused `qkv_proj` splits row-wise into q, k and v (our view is [3, heads, head_dim]); the
rotary convention needs no permutation (HF's `rotate_half` is ours). In the fixed-embedding
construction nothing of ours falls outside the stock class, so the export loads with
`AutoModelForCausalLM` and no remote code. In the stage-anchors construction each stage's anchor
swaps in at its first layer, which a stock Llama cannot do: the export is then the stock class
plus that swap (roles/model/hf_anchored.py, shipped beside the weights as `modeling_agora.py`),
loaded with `trust_remote_code=True`; the head's anchor also folds into the embedding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from torch import Tensor

from protocol.errors import ConfigError
from protocol.run_config import RunConfig
from roles.model.stage import StageModel, build_stage_model

__all__ = ["MODELING_FILE", "full_logits", "llama_config_dict", "llama_state_dict", "load_stages", "needs_remote_code"]

MODELING_FILE = "modeling_agora.py"
"""What roles/model/hf_anchored.py is called inside an export of a stage-anchors run."""


def needs_remote_code(run: RunConfig) -> bool:
    """Whether the export of `run` is the stock Llama plus our anchor swap (hf_anchored.py)."""
    return run.model.construction == "stage-anchors"


def modeling_source() -> str:
    """The text of the modeling file an anchored export ships."""
    return (Path(__file__).with_name("hf_anchored.py")).read_text()


def load_stages(run: RunConfig, files: list[Path]) -> list[StageModel]:
    """Every stage of the run, built from the run config and loaded from one stage checkpoint
    per stage (safetensors: a `--checkpoint-dir` file, roles/worker/state/stage_checkpoint.py, or a run
    checkpoint's stage object, roles/checkpoint_store.py); refused in one sentence if a stage is
    missing, doubled or from another run or layout."""
    from roles.checkpoint_store import FORMAT as RUN_FORMAT
    from roles.worker.state.stage_checkpoint import FORMAT
    from roles.worker.layout import FlatLayout

    if run.model.kind != "transformer":
        raise ConfigError(f"only transformer runs export to Hugging Face; this run's model.kind is {run.model.kind}")
    by_stage: dict[int, tuple[Path, dict[str, str]]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as handle:
                metadata = handle.metadata() or {}
        except Exception as exc:  # noqa: BLE001 - not safetensors, truncated, unreadable
            raise ConfigError(f"{path} is not a readable stage checkpoint: {exc}") from exc
        if metadata.get("format") not in (FORMAT, RUN_FORMAT) or metadata.get("run_id") != run.run_id:
            raise ConfigError(f"{path} is not a checkpoint of run {run.run_id} (format {metadata.get('format')!r}, "
                              f"run {metadata.get('run_id')!r})")
        stage = int(metadata.get("stage", "-1"))
        if stage in by_stage:
            raise ConfigError(f"{path} and {by_stage[stage][0]} are both stage {stage}; pass one file per stage")
        by_stage[stage] = (path, metadata)
    missing = [s for s in range(run.num_stages) if s not in by_stage]
    if missing:
        raise ConfigError(f"no checkpoint of stage(s) {missing}; pass one file for each of the run's "
                          f"{run.num_stages} stages")
    stages = []
    for index in range(run.num_stages):
        path, metadata = by_stage[index]
        model = build_stage_model(run, index)
        layout = FlatLayout.of_stage(model)
        if metadata.get("layout") != layout.digest:
            raise ConfigError(f"{path} was written for another parameter layout than stage {index} of this run "
                              "config has")
        params = dict(model.named_parameters())
        with safe_open(str(path), framework="pt") as handle, torch.no_grad():
            for name in layout.names:
                params[name].copy_(handle.get_tensor(name))
        model.checkpoint_step = int(metadata.get("step", "0"))
        stages.append(model.eval())
    return stages


def _dense_output(module) -> Tensor:
    """The [d_model, in] weight of an output projection, subspace or dense."""
    if hasattr(module, "z"):
        return (module.basis.double() @ module.z.detach().double().T).float()
    return module.weight.detach().float()


def llama_state_dict(run: RunConfig, stages: list[StageModel]) -> dict[str, Tensor]:
    """The `LlamaForCausalLM` parameters of the model the stages make up, in float32, plus
    `agora_anchors.*` (hf_anchored.py) in the stage-anchors construction."""
    d = run.model.d_model
    head, tail = stages[0], stages[-1]
    out: dict[str, Tensor] = {}
    with torch.no_grad():
        embedding = head.embedding.detach().double() @ head.basis.double().T
        if head.fixed_embedding is not None:
            embedding = head.fixed_embedding.double() + embedding
        if head.anchor is not None:
            embedding = embedding + head.anchor_rows(torch.arange(run.model.vocab_size)).double()
        for index, stage in enumerate(stages):
            if stage.anchor is not None:
                out.update(_anchor_tensors(index, stage))
    out["model.embed_tokens.weight"] = embedding.float()
    for stage_index, stage in enumerate(stages):
        first = run.stages[stage_index].first_layer
        for local, block in enumerate(stage.blocks):
            prefix = f"model.layers.{first + local}."
            qkv = block.attn.qkv_proj.weight.detach().float()
            out[prefix + "input_layernorm.weight"] = block.attn_norm.weight.detach().float()
            out[prefix + "self_attn.q_proj.weight"] = qkv[:d]
            out[prefix + "self_attn.k_proj.weight"] = qkv[d:2 * d]
            out[prefix + "self_attn.v_proj.weight"] = qkv[2 * d:]
            out[prefix + "self_attn.o_proj.weight"] = _dense_output(block.attn.out_proj)
            out[prefix + "post_attention_layernorm.weight"] = block.mlp_norm.weight.detach().float()
            out[prefix + "mlp.gate_proj.weight"] = block.mlp.gate_proj.weight.detach().float()
            out[prefix + "mlp.up_proj.weight"] = block.mlp.up_proj.weight.detach().float()
            out[prefix + "mlp.down_proj.weight"] = _dense_output(block.mlp.down_proj)
    out["model.norm.weight"] = tail.final_norm.weight.detach().float()
    out["lm_head.weight"] = tail.lm_head.weight.detach().float()
    return {name: tensor.contiguous().clone() for name, tensor in out.items()}


def _anchor_tensors(index: int, stage: StageModel) -> dict[str, Tensor]:
    """A stage's anchor as hf_anchored.py reads it: rows already scaled and projected off U_k
    (a factored anchor keeps its [vocab, r] codes and takes both in its [r, d] basis)."""
    from roles.model.stage import ANCHOR_SCALE

    basis = stage.basis.double()

    def off_subspace(rows: Tensor) -> Tensor:  # no [d, d] projector: d may be 5,120
        rows = ANCHOR_SCALE * rows.detach().double()
        return (rows - (rows @ basis) @ basis.T).float()

    prefix = f"agora_anchors.{index}."
    if stage.anchor_basis is None:
        return {prefix + "rows": off_subspace(stage.anchor)}
    return {prefix + "rows": stage.anchor.detach().float(), prefix + "basis": off_subspace(stage.anchor_basis)}


def llama_config_dict(run: RunConfig, *, eos_token_id: int, bos_token_id: Optional[int] = None) -> dict:
    """The `config.json` of the export (a `LlamaConfig`, or in the stage-anchors construction
    the config of hf_anchored.py's class, which extends it)."""
    m = run.model
    if needs_remote_code(run):
        module = MODELING_FILE.removesuffix(".py")
        return {**_llama_fields(run, eos_token_id, bos_token_id),
                "architectures": ["AgoraAnchoredLlamaForCausalLM"], "model_type": "agora_anchored_llama",
                "auto_map": {"AutoConfig": f"{module}.AgoraAnchoredLlamaConfig",
                             "AutoModelForCausalLM": f"{module}.AgoraAnchoredLlamaForCausalLM"},
                "agora_stage_first_layers": [stage.first_layer for stage in run.stages],
                "agora_anchored_stages": list(range(run.num_stages)),
                "agora_anchor_rank": m.anchor_rank}
    return _llama_fields(run, eos_token_id, bos_token_id)


def _llama_fields(run: RunConfig, eos_token_id: int, bos_token_id: Optional[int]) -> dict:
    m = run.model
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": m.vocab_size, "hidden_size": m.d_model, "intermediate_size": m.ffn_dim,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads,
        "head_dim": m.d_model // m.n_heads, "hidden_act": "silu", "max_position_embeddings": m.max_seq_len,
        "rms_norm_eps": m.norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False, "tie_word_embeddings": False,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": eos_token_id if bos_token_id is None else bos_token_id, "eos_token_id": eos_token_id,
    }


def full_logits(stages: list[StageModel], tokens: Tensor) -> Tensor:
    """Our model's next-token logits [B, T, vocab] (float32) on `tokens` [B, T]: the reference an
    export must reproduce."""
    from roles.model.stage import FullModel

    with torch.no_grad():
        hidden = FullModel.from_stages(stages).final_hidden(tokens)
        tail = stages[-1]
        return tail.lm_head(tail.final_norm(hidden)).float()
