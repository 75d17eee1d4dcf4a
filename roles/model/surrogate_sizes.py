"""How big a surrogate stage is, from the run config alone (no torch): its trainable values, the
untrained payload that pads its averaged vector, and the memory one replica needs [report 3.5.1].

The payload is sized so that one averaging round of the surrogate moves exactly as many values
as one round of the real stage it mirrors: the real stage averages
`ceil(stage_parameter_count / mirror_segments)` values a round, so the surrogate's averaged vector
holds that many values per `averaging.segments` (1 in the presets), trainable ones included.
"""

from __future__ import annotations

import math

from protocol.run_config import RunConfig
from roles.model.memory_plan import stage_parameter_count

_F32 = 4
_I64 = 8


def _surrogate(run: RunConfig):
    if run.model.kind != "surrogate" or run.surrogate is None:
        raise ValueError(f"run {run.run_id} is not a surrogate run (model.kind {run.model.kind})")
    return run.surrogate


def surrogate_trainable_count(run: RunConfig, stage_index: int) -> int:
    """Trainable values of a surrogate stage, as `SurrogateStage` lays them out: the head's
    vocab x k embedding, then `layers` residual layers k -> width -> k with biases."""
    sur = _surrogate(run)
    k = run.model.subspace_rank
    count = sur.layers * (k * sur.width + sur.width + sur.width * k + k)
    if run.stage_kind(stage_index) == "head":
        count += run.model.vocab_size * k
    return count


def mirrored_values_per_round(run: RunConfig, stage_index: int) -> int:
    """Values one averaging round of the mirrored (real) stage moves: the largest of its
    `mirror_segments` index sets."""
    sur = _surrogate(run)
    return math.ceil(stage_parameter_count(run, stage_index) / sur.mirror_segments)


def surrogate_payload_count(run: RunConfig, stage_index: int) -> int:
    """Untrained values appended to the averaged vector so a round moves as many values as the
    mirrored stage's (never negative: a surrogate wider than one real round simply has none)."""
    target = mirrored_values_per_round(run, stage_index) * run.averaging.segments
    return max(0, target - surrogate_trainable_count(run, stage_index))


def surrogate_averaged_count(run: RunConfig, stage_index: int) -> int:
    """Length of the surrogate stage's averaged vector: payload first, then trainable values."""
    return surrogate_payload_count(run, stage_index) + surrogate_trainable_count(run, stage_index)


def surrogate_host_bytes(run: RunConfig, stage_index: int) -> int:
    """Host memory beyond the trainable tensors: the payload, the round's int64 index set, the
    averager's shared round buffer and the round's snapshot (float32 each)."""
    per_round = math.ceil(surrogate_averaged_count(run, stage_index) / run.averaging.segments)
    return surrogate_payload_count(run, stage_index) * _F32 + per_round * (_I64 + 2 * _F32)


def surrogate_activation_bytes_per_sample(run: RunConfig, stage_index: int) -> int:
    """Saved tensors of one sample's recomputed forward: each layer keeps its input, hidden
    pre-activation and activation (float32), plus the boundary in and out."""
    sur = _surrogate(run)
    t, k = run.seq_len, run.model.subspace_rank
    return t * _F32 * (sur.layers * (k + 2 * sur.width) + 3 * k) + t * _I64
