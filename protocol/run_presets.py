"""Named run configurations: a CPU-sized `tiny` for demos and tests, a compute-bound CPU model
(`cpu-compute`) for benchmarks, and the report's two scales.

Each preset is a plain dict in `RunConfig`'s shape so that overrides can be deep-merged into it
before validation; `load_run_config("tiny")` is the way to get a validated one.
"""

from __future__ import annotations

import copy
from typing import Any

from protocol.run_config import AveragingConfig


def _stages(*sizes: int) -> list[dict[str, int]]:
    """Contiguous stage ranges from per-stage block counts, head first."""
    ranges, start = [], 0
    for size in sizes:
        ranges.append({"first_layer": start, "last_layer": start + size})
        start += size
    return ranges


# The CPU presets use the stage-anchors construction (roles/model/stage.py), measured here
# against transformers' Llama (scripts/bench_construction.py). The report's two scales keep the
# report's fixed-embedding construction, so their plans stay comparable with the report and nothing
# unmeasured becomes their default; a run of that size may set `construction: stage-anchors` with
# an `anchor_rank` (a full table would add 45% to a 1b body stage and 74% to an 8b one).

# Byte-level model that trains in a 3-process pipeline on 2 CPU cores: one block per stage.
TINY: dict[str, Any] = {
    "run_id": "tiny",
    "model": {
        "vocab_size": 256,
        "d_model": 64,
        "n_layers": 3,
        "n_heads": 4,
        "ffn_dim": 172,
        "subspace_rank": 16,
        "subspace_seed": 1234,
        "max_seq_len": 128,
        "construction": "stage-anchors",
    },
    "stages": _stages(1, 1, 1),
    "optimizer": {
        "lr": 3e-3,
        "weight_decay": 0.0,
        "warmup_steps": 10,
        "total_steps": 2000,
    },
    "target_batch_size": 16,
    "seq_len": 64,
    "seed": 0,
    "dtype": "float32",
}

# A CPU model whose stages are compute-bound, for measuring what the swarm keeps of one process's
# rate when compute, not messaging, dominates: each stage is two 384-wide blocks, 27-36 ms of
# forward and backward per 128-token sample on one core of the development machine.
CPU_COMPUTE: dict[str, Any] = {
    "run_id": "cpu-compute",
    "model": {
        "vocab_size": 256,
        "d_model": 384,
        "n_layers": 6,
        "n_heads": 6,
        "ffn_dim": 1024,
        "subspace_rank": 32,
        "subspace_seed": 1234,
        "max_seq_len": 128,
        "construction": "stage-anchors",
    },
    "stages": _stages(2, 2, 2),
    "optimizer": {
        "lr": 1e-3,
        "weight_decay": 0.0,
        "warmup_steps": 10,
        "total_steps": 2000,
    },
    "target_batch_size": 32,
    "seq_len": 128,
    "seed": 0,
    "dtype": "float32",
}

# A byte-level model of about 10.8M parameters (as a plain Llama) for judging how the construction
# learns at more than toy size on this machine (scripts/bench_construction.py): cpu-compute's
# widths at the demo's batch; one optimizer step of 16 x 128 tokens takes about 0.7 s in one process
# on two cores.
SMALL: dict[str, Any] = {**copy.deepcopy(CPU_COMPUTE), "run_id": "small", "target_batch_size": 16}

# The report's 1B ablation model [6]: rank 40 at d=2048 (a 51x smaller boundary), four stages.
ONE_B: dict[str, Any] = {
    "run_id": "agora-1b",
    "model": {
        "vocab_size": 32000,
        "d_model": 2048,
        "n_layers": 16,
        "n_heads": 16,
        "ffn_dim": 5632,
        "subspace_rank": 40,
        "subspace_seed": 1,
        "max_seq_len": 2048,
        "rope_theta": 10000.0,
        "construction": "fixed-embedding",
    },
    "stages": _stages(4, 4, 4, 4),
    "optimizer": {
        "lr": 3e-4,
        "weight_decay": 0.1,
        "warmup_steps": 2000,
        "total_steps": 100000,
    },
    "target_batch_size": 512,
    "seq_len": 2048,
    "seed": 0,
    "dtype": "bfloat16",
}

# Pluralis-8B [report 5.2]: 32 blocks over head, five bodies and a 6-block tail; rank ~51 at d=5120.
# About 500B tokens over ~60k steps at 4096 tokens a sample is ~2k samples per step.
EIGHT_B: dict[str, Any] = {
    "run_id": "pluralis-8b",
    "model": {
        "vocab_size": 128256,
        "d_model": 5120,
        "n_layers": 32,
        "n_heads": 40,
        "ffn_dim": 13824,
        "subspace_rank": 51,
        "subspace_seed": 8,
        "max_seq_len": 4096,
        "rope_theta": 500000.0,
        "construction": "fixed-embedding",
    },
    "stages": _stages(4, 4, 4, 5, 5, 4, 6),
    "optimizer": {
        "lr": 3e-4,
        "weight_decay": 0.1,
        "warmup_steps": 2000,
        "total_steps": 60000,
    },
    "target_batch_size": 2048,
    "seq_len": 4096,
    "seed": 0,
    "dtype": "bfloat16",
}



def _surrogate(real: dict[str, Any], name: str, run_id: str) -> dict[str, Any]:
    """A surrogate of preset `real` [report 3.5.1]: the same model shape, stage cut, seq_len and
    batch (so the boundary carries seq_len x subspace_rank float32 coordinates plus the token ids,
    and the plan of `agora-node plan` is the real one), with each stage replaced by two 64-wide
    layers that sleep instead of computing.

    Averaging: the real stage averages params / 20 values per round (`averaging.segments` 20);
    materialising an 8B stage's 885M values to average a twentieth of them would cost GBs per
    node, so the surrogate's averaged vector *is* one round's worth (about 44M values, 177 MB,
    for an 8b body: the surrogate's few trainable values plus an untrained payload that is
    averaged but never stepped) and `averaging.segments` is 1. Every round then moves exactly as
    many values as the real stage's rounds at 20 segments, every `average_every` steps as in
    the real run. Delays default to 0; set `surrogate.forward_s` and friends per experiment.
    """
    preset = copy.deepcopy(real)
    preset["run_id"] = run_id
    preset["model"]["kind"] = "surrogate"
    real_segments = real.get("averaging", {}).get("segments", AveragingConfig.model_fields["segments"].default)
    preset["averaging"] = {**real.get("averaging", {}), "segments": 1}
    preset["surrogate"] = {"mirrors": name, "mirror_segments": real_segments, "width": 64, "layers": 2}
    return preset


# The report's two scales as surrogates: the traffic of 1b and 8b at almost no compute.
SURROGATE_ONE_B = _surrogate(ONE_B, "1b", "surrogate-1b")
SURROGATE_EIGHT_B = _surrogate(EIGHT_B, "8b", "surrogate-8b")

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY,
    "cpu-compute": CPU_COMPUTE,
    "small": SMALL,
    "1b": ONE_B,
    "8b": EIGHT_B,
    "surrogate-1b": SURROGATE_ONE_B,
    "surrogate-8b": SURROGATE_EIGHT_B,
}
