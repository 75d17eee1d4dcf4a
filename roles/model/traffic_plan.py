"""The bandwidth a node of a run needs, per stage, worked out from the run config alone
[report 3.5.2.1].

The report sizes a contributor's floor from three kinds of traffic: forward and backward
activations, `a_f` and `a_b` samples a second of [seq_len, hidden_dim] float32, and an averaging
burst of `AR_payload` values in `AR_dtype` within `AR_time`:

    32 * (a_f + a_b) * seq_len * hidden_dim  +  AR_dtype_bits * AR_payload / AR_time   bits/s

Our boundary is the subspace rank k, not d_model: only k coordinates per token cross a stage
boundary [report 4.1], and with k the formula reproduces the report's ~113 Mbit/s (BF16) and
~186 Mbit/s (FP32) for an 8B body stage. `AR_payload` is what a replica averages per round: the
stage's averaged values / `averaging.segments` (SPARTA's sparse_avg * num_params [report 4.2]).

Besides the report's floor, the plan carries the bytes that actually cross the wire per sample
(the token ids travel beside the coordinates, and a backward request carries the stage's input
again for the recompute), so a lab can compare what it measures per node with what it expects.
A surrogate run [report 3.5.1] plans exactly like the run it mirrors.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from protocol.run_config import RunConfig
from roles.model.memory_plan import stage_parameter_count

_WIRE_BYTES = {"float32": 4, "bfloat16": 2}
"""Bytes per boundary coordinate and gradient value, by the run's `boundary_dtype`."""
_TOKEN_BYTES = 8  # token ids travel as int64 beside them
_MEGA = 1e6

REPORT_BODY_MBPS = {"bf16": 113.0, "fp32": 186.0}
"""The report's floor for a Pluralis-8B body stage at a_f = a_b = 3, AR_time = 10 s [report 3.5.2.1]."""


def averaged_values(run: RunConfig, stage_index: int) -> int:
    """Length of the vector a replica of the stage averages: its trainable parameters, or for a
    surrogate its trainable values plus the payload that mirrors the real stage."""
    if run.model.kind == "surrogate":
        from roles.model.surrogate_sizes import surrogate_averaged_count

        return surrogate_averaged_count(run, stage_index)
    return stage_parameter_count(run, stage_index)


def averaged_values_per_round(run: RunConfig, stage_index: int) -> int:
    """Values one averaging round moves for one replica: the largest index set of the stage
    (`ceil(averaged_values / averaging.segments)`, the averager's round buffer)."""
    return math.ceil(averaged_values(run, stage_index) / run.averaging.segments)


@dataclass(frozen=True)
class StageTraffic:
    """One stage's expected traffic. Bytes count tensor payloads only (framing adds well under 1%);
    `_in` is what the stage's worker receives, `_out` what it sends."""

    stage: int
    kind: str
    boundary_values: int  # seq_len * k: values in one boundary tensor
    forward_bytes_in: int  # per sample: tokens (+ input coordinates below the head)
    forward_bytes_out: int  # per sample: output coordinates (0 at the tail, which has no forward)
    backward_bytes_in: int  # per sample: tokens, input coordinates (recompute) and output gradient
    backward_bytes_out: int  # per sample: input gradient (0 at the head)
    round_values: int  # values one replica averages per round (AR_payload)
    activation_mbps: float  # the report's 32 * (a_f + a_b) * seq_len * k, per direction
    averaging_mbps_bf16: float  # 16 * AR_payload / AR_time
    averaging_mbps_fp32: float  # 32 * AR_payload / AR_time
    wire_mbps_in: float  # the wire bytes above at a_f forwards and a_b backwards a second
    wire_mbps_out: float
    gradient_values: int = 0  # values in one replica's per-step gradient (the stage's trainable parameters)
    gradient_mbps: float = 0.0  # 32 * gradient_values * steps a second, two replicas at a_b backwards a second each
    gradients_every_step: bool = False  # whether the run's replicas of this stage exchange them (averaging.gradients)

    @property
    def sample_bytes(self) -> int:
        """Bytes in and out for one sample's forward and backward at this stage."""
        return self.forward_bytes_in + self.forward_bytes_out + self.backward_bytes_in + self.backward_bytes_out

    @property
    def total_mbps_bf16(self) -> float:
        return self.activation_mbps + self.averaging_mbps_bf16

    @property
    def total_mbps_fp32(self) -> float:
        return self.activation_mbps + self.averaging_mbps_fp32

    def round_bytes(self, dtype_bytes: int = 4) -> int:
        """Bytes of one replica's round payload; our averager sends float32 (4)."""
        return self.round_values * dtype_bytes

    def allreduce_bytes_sent(self, group_size: int, dtype_bytes: int = 4) -> int:
        """Bytes one replica sends (and receives) in a butterfly all-reduce of `group_size`
        equal peers: its parts to the other reducers, then its reduced part to the others."""
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        return round(2 * (group_size - 1) / group_size * self.round_bytes(dtype_bytes))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(sample_bytes=self.sample_bytes, total_mbps_bf16=self.total_mbps_bf16,
                   total_mbps_fp32=self.total_mbps_fp32, round_bytes_fp32=self.round_bytes(4),
                   round_bytes_bf16=self.round_bytes(2))
        return out


@dataclass(frozen=True)
class TrafficPlan:
    """A run's per-stage bandwidth floor at the given rates [report 3.5.2.1]."""

    run_id: str
    mirrors: str | None  # the run a surrogate mirrors, else None
    seq_len: int
    subspace_rank: int
    segments: int
    a_f: float
    a_b: float
    ar_time_s: float
    stages: list[StageTraffic] = field(default_factory=list)

    def stage(self, index: int) -> StageTraffic:
        for traffic in self.stages:
            if traffic.stage == index:
                return traffic
        raise KeyError(f"stage {index} is not in this plan")

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "stages"}
        out["stages"] = [traffic.to_dict() for traffic in self.stages]
        out["report_body_mbps"] = dict(REPORT_BODY_MBPS)
        return out


def _stage_traffic(run: RunConfig, index: int, a_f: float, a_b: float, ar_time_s: float) -> StageTraffic:
    kind = run.stage_kind(index)
    t, k = run.seq_len, run.model.subspace_rank
    coords, tokens = t * k * _WIRE_BYTES[run.boundary_dtype], t * _TOKEN_BYTES
    if kind == "head":
        fwd_in, fwd_out, bwd_in, bwd_out = tokens, coords, tokens + coords, 0
    elif kind == "body":
        fwd_in, fwd_out, bwd_in, bwd_out = tokens + coords, coords, tokens + 2 * coords, coords
    else:  # the tail fuses forward and backward in its backward request
        fwd_in, fwd_out, bwd_in, bwd_out = 0, 0, tokens + coords, coords
    values = averaged_values_per_round(run, index)
    return StageTraffic(
        stage=index, kind=kind, boundary_values=t * k,
        forward_bytes_in=fwd_in, forward_bytes_out=fwd_out, backward_bytes_in=bwd_in, backward_bytes_out=bwd_out,
        round_values=values,
        activation_mbps=32 * (a_f + a_b) * t * k / _MEGA,
        averaging_mbps_bf16=16 * values / ar_time_s / _MEGA,
        averaging_mbps_fp32=32 * values / ar_time_s / _MEGA,
        wire_mbps_in=8 * (a_f * fwd_in + a_b * bwd_in) / _MEGA,
        wire_mbps_out=8 * (a_f * fwd_out + a_b * bwd_out) / _MEGA,
        gradient_values=stage_parameter_count(run, index),
        gradient_mbps=_gradient_mbps(run, index, a_b),
        gradients_every_step=gradient_exchange_on(run, index),
    )


def _gradient_mbps(run: RunConfig, index: int, a_b: float) -> float:
    """Mbit/s one replica sends when two replicas of the stage push each other their float32
    gradient every step, each at `a_b` backwards a second (so the stage steps 2 a_b / B times a
    second). With R replicas it is (R - 1) R / 2 times that: every replica pushes to every other."""
    return 32 * stage_parameter_count(run, index) * 2 * a_b / run.target_batch_size / _MEGA


def gradient_exchange_on(run: RunConfig, stage_index: int) -> bool:
    """Whether the replicas of a stage add up their gradients every step (`averaging.gradients`):
    always or never as the run says, else where the plan's exchange fits `gradient_max_mbps`.
    Every replica of a stage decides alike, from the run config alone."""
    mode = run.averaging.gradients
    if run.averaging.method == "sparseloco":
        return False  # the replicas step on their own samples between exchanges (config forbids every_step)
    if mode != "auto":
        return mode == "every_step"
    return _gradient_mbps(run, stage_index, 3.0) <= run.averaging.gradient_max_mbps


def plan_traffic(run: RunConfig, *, a_f: float = 3.0, a_b: float = 3.0, ar_time_s: float = 10.0,
                 stages: list[int] | None = None) -> TrafficPlan:
    """The bandwidth plan of `run` (all stages, or `stages`): `a_f` and `a_b` forward and backward
    samples a second per node, an averaging round within `ar_time_s` [report 3.5.2.1].

    Raises ValueError for a non-positive rate or time, and `ConfigError` for a stage the run lacks.
    """
    if a_f < 0 or a_b < 0 or not math.isfinite(a_f + a_b):
        raise ValueError(f"a_f and a_b must be non-negative samples per second, got {a_f} and {a_b}")
    if not ar_time_s > 0 or not math.isfinite(ar_time_s):
        raise ValueError(f"ar_time_s must be a positive number of seconds, got {ar_time_s}")
    indices = list(range(run.num_stages)) if stages is None else list(stages)
    for index in indices:
        run.stage_kind(index)  # ConfigError naming the run's stages
    return TrafficPlan(
        run_id=run.run_id, mirrors=run.surrogate.mirrors if run.surrogate is not None else None,
        seq_len=run.seq_len, subspace_rank=run.model.subspace_rank, segments=run.averaging.segments,
        a_f=a_f, a_b=a_b, ar_time_s=ar_time_s,
        stages=[_stage_traffic(run, index, a_f, a_b, ar_time_s) for index in indices],
    )
