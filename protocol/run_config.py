"""The run's model, optimizer and stage layout, and how they are loaded from presets or YAML.

Every node of a run must agree on these values bit for bit (the subspace basis, the stage cut and
the optimizer schedule are all derived from them), so the models are frozen, reject unknown keys
and validate themselves; a bad file surfaces as one `ConfigError` line naming the fix.
"""

from __future__ import annotations

import copy
import math
import os
import re
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from protocol.errors import ConfigError
from protocol.files import atomic_write

StageKind = Literal["head", "body", "tail"]
ModelKind = Literal["transformer", "surrogate"]
MODEL_CONSTRUCTIONS = ("fixed-embedding", "stage-anchors")
"""How the residual stream outside span(U_k) is made (roles/model/stage.py explains both):
'fixed-embedding' is the report's fixed random token table; 'stage-anchors' gives each stage a
learned token table of its own there. A node refuses a construction it does not build."""
ComputeDtype = Literal["float32", "bfloat16", "float16"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class ModelConfig(BaseModel):
    """Shape of the Llama-style decoder that the stages of a run split between them [report 4.1]."""

    model_config = _FROZEN

    kind: ModelKind = Field(
        default="transformer",
        description="'transformer': the decoder these fields describe; 'surrogate': a few cheap "
        "layers that keep this decoder's boundary and averaging traffic (see `surrogate`).",
    )
    vocab_size: int = Field(gt=0, description="Token ids the embedding and LM head cover.")
    d_model: int = Field(gt=0, description="Width of the residual stream.")
    n_layers: int = Field(gt=0, description="Transformer blocks in the whole model.")
    n_heads: int = Field(gt=0, description="Attention heads per block; must divide d_model.")
    ffn_dim: int = Field(gt=0, description="Hidden width of the SwiGLU MLP.")
    subspace_rank: int = Field(gt=0, description="k: values per token that cross a stage boundary.")
    subspace_seed: int = Field(
        ge=0, description="Seeds U_k and the fixed token embedding; shared by all stages."
    )
    max_seq_len: int = Field(gt=0, description="Longest sequence, in tokens, the model accepts.")
    rope_theta: float = Field(default=10000.0, gt=0, description="Base of the rotary frequencies.")
    norm_eps: float = Field(default=1e-5, gt=0, description="Epsilon inside every RMSNorm.")
    tail_full_rank: bool = Field(
        default=True,
        description="Tail blocks use full-rank output projections (no boundary follows them).",
    )
    construction: str = Field(
        default="fixed-embedding",
        description="How the residual stream outside span(U_k) is made: 'stage-anchors' (every "
        "stage adds a learned token table of its own there; the presets' choice) or "
        "'fixed-embedding' (one fixed random token table shared by all stages, as in the report; "
        "the meaning of a run config that predates this field).",
    )
    anchor_rank: Optional[int] = Field(
        default=None,
        gt=0,
        description="stage-anchors only: factor each stage's token table as [vocab, r] x [r, "
        "d_model] to bound its size at large vocabularies; unset: a full [vocab, d_model] table.",
    )

    @field_validator("construction")
    @classmethod
    def _known_construction(cls, value: str) -> str:
        if value not in MODEL_CONSTRUCTIONS:
            raise ValueError(
                f"this run trains the model construction {value!r}, which this agora-node does not "
                f"build (it builds {', '.join(MODEL_CONSTRUCTIONS)}); upgrade agora-node to join it"
            )
        return value

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelConfig:
        if self.subspace_rank > self.d_model:
            raise ValueError(
                f"subspace_rank {self.subspace_rank} exceeds d_model {self.d_model}; "
                f"lower subspace_rank"
            )
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}; "
                f"pick n_heads that divides it"
            )
        if self.anchor_rank is not None and self.construction != "stage-anchors":
            raise ValueError(
                f"anchor_rank is set but construction is {self.construction!r}; anchors exist only "
                f"with construction 'stage-anchors'"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError(
                f"head size d_model/n_heads = {self.d_model // self.n_heads} is odd; rotary "
                f"attention needs an even head size"
            )
        return self


class OptimizerConfig(BaseModel):
    """AdamW with linear warmup then cosine decay to `min_lr_ratio * lr`, stepped per stage."""

    model_config = _FROZEN

    lr: float = Field(gt=0, description="Peak learning rate, reached at the end of warmup.")
    betas: tuple[float, float] = Field(default=(0.9, 0.95), description="AdamW beta1, beta2.")
    eps: float = Field(default=1e-8, gt=0, description="AdamW denominator epsilon.")
    weight_decay: float = Field(default=0.1, ge=0, description="Decoupled AdamW weight decay.")
    warmup_steps: int = Field(ge=0, description="Optimizer steps of linear warmup from 0 to lr.")
    total_steps: int = Field(gt=0, description="Optimizer steps after which lr stays at its floor.")
    min_lr_ratio: float = Field(
        default=0.1, ge=0, le=1, description="Floor of the cosine decay, as a fraction of lr."
    )

    @model_validator(mode="after")
    def _check_schedule(self) -> OptimizerConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas {list(self.betas)} must each lie in [0, 1)")
        if self.warmup_steps > self.total_steps:
            raise ValueError(
                f"warmup_steps {self.warmup_steps} exceeds total_steps {self.total_steps}; "
                f"shorten the warmup"
            )
        return self

    def lr_at(self, position: float) -> float:
        """Learning rate at schedule `position`, measured in nominal steps: samples the stage has
        consumed divided by `target_batch_size` (0-based; an exact step `s` sits at `s`).

        Linear warmup from lr/warmup_steps up to lr, then cosine decay to `min_lr_ratio * lr` at
        `total_steps`, flat after it. Because the position counts samples, a step that happens to
        consume more or fewer samples cannot shift the schedule; and because it is a pure
        function, every replica of a stage agrees on the rate without talking to the others.
        """
        if position < 0:
            raise ValueError(f"schedule position must be non-negative, got {position}")
        if position < self.warmup_steps:
            return self.lr * min(1.0, (position + 1) / self.warmup_steps)
        floor = self.min_lr_ratio * self.lr
        span = self.total_steps - self.warmup_steps
        if span <= 0 or position >= self.total_steps:
            return floor
        progress = (position - self.warmup_steps) / span
        return floor + (self.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


class StalenessConfig(BaseModel):
    """How far the weights a sample's backward uses may lag the ones its forward saw.

    A pipeline keeps samples in flight while stages step, so a sample's forward at one stage can
    run on weights one step older than its backward recompute. Two remedies, both measured by
    `scripts/bench_fidelity.py`: cap the samples in flight against the batch, and recompute the
    backward with the weights its forward used.
    """

    model_config = _FROZEN

    max_in_flight_ratio: float | None = Field(
        default=None, gt=0,
        description="Trainers together keep at most this fraction of target_batch_size samples in "
        "flight (each trainer takes its share by the number of live trainers); None: no cap beyond lanes.",
    )
    pin_forward_weights: bool = Field(
        default=True,
        description="Keep the previous version of a stage's weights while samples forwarded on it "
        "are in flight, so their backward recomputes with the weights their forward used "
        "(one extra copy of the stage's parameters).",
    )
    max_delayed_per_step: int | None = Field(
        default=0, ge=0,
        description="The head keeps at most this many more samples in flight than its open step "
        "still needs; the rest wait for its step. Bounds how many samples of a step carry gradients "
        "taken on the previous weights; 0 drains the pipeline at every step (no staleness, a bubble "
        "per step); None: no bound beyond the samples in flight.",
    )
    forward_gate_timeout_s: float = Field(
        default=5.0, gt=0,
        description="A forward whose backward has not come back after this long stops holding a "
        "slot of the head's gate (its sample was probably dropped): a slower round trip costs a "
        "delayed gradient, never a stall.",
    )
    step_close_timeout_s: float = Field(
        default=10.0, gt=0,
        description="A stage whose open step misses samples (their trainer died after the tail "
        "tagged them) closes it short after this long without one of them arriving, once later "
        "samples are waiting; the shortfall is reported.",
    )


AVERAGING_METHODS = ("asyncsparta", "sparseloco")
"""How the replicas of a stage are kept together: AsyncSPARTA's weight averaging [report 4.2] or
SparseLoCo's compressed pseudo-gradient exchange (roles/worker/sparseloco)."""


class SparseLoCoConfig(BaseModel):
    """SparseLoCo [Sarfi et al. 2025, as Crucible runs it]: every `inner_steps` stage steps each
    replica sends the top `topk_per_chunk` coordinates of each `chunk_size` chunk of its error-fed
    pseudo-gradient, quantised to `bits` bits with one scale per chunk, and every replica applies
    the mean of what arrived with an outer SGD step of `outer_lr` from the last consensus.

    Streaming: the stage's flat parameters are cut into `fragments` parts of whole chunks; part f
    is captured at inner step f * floor(H / P) + 1 of each cycle and applied `overlap_steps` steps
    later, so its transfer overlaps that much training.
    """

    model_config = _FROZEN

    inner_steps: int = Field(
        default=15, ge=1, description="H: stage steps every replica takes on its own samples between two exchanges."
    )
    chunk_size: int = Field(
        default=4096, ge=16, le=65536,
        description="Elements per chunk (chunks never cross a tensor); top-k is taken within each chunk.",
    )
    topk_per_chunk: int = Field(
        default=64, ge=1, description="Coordinates kept per full chunk (64 of 4096: 1.56% dense)."
    )
    bits: Literal[2, 4, 8] = Field(
        default=2, description="Bits per kept value: a signed level times the chunk's scale."
    )
    error_decay: float = Field(
        default=0.95, ge=0.0, le=1.0,
        description="beta: the error-feedback buffer is decayed by this before the new pseudo-gradient is added.",
    )
    outer_lr: float = Field(
        default=1.0, gt=0.0, description="alpha: the outer SGD step on the mean of the replicas' sparse updates."
    )
    fragments: int = Field(
        default=1, ge=1, description="P: parts the parameters are exchanged in, spread over each H-step cycle."
    )
    overlap_steps: int = Field(
        default=0, ge=0, description="tau: inner steps a fragment's transfer overlaps before its aggregate is applied."
    )
    transport: Literal["swarm", "store"] = Field(
        default="swarm",
        description="swarm: each replica pushes its fragment to the stage's other replicas over the swarm's "
                    "authenticated streams; store: each uploads it to an object store and fetches the others'.",
    )
    store: Optional[str] = Field(
        default=None,
        description="fsspec URL of the store for transport 'store' (a directory, file:///dir, s3://bucket/prefix); "
                    "unset: the run's checkpoints.store.",
    )
    round_timeout_s: float = Field(
        default=30.0, gt=0,
        description="A replica waits this long after its own fragment for the others'; whoever is missing then "
                    "is left out of the round.",
    )
    max_norm_ratio: float = Field(
        default=10.0, gt=1.0,
        description="A fragment whose norm is more than this many times above or below this replica's own "
                    "is refused and its sender named (replicas' updates are alike; garbage is not).",
    )

    @model_validator(mode="after")
    def _check(self) -> SparseLoCoConfig:
        if self.topk_per_chunk > self.chunk_size:
            raise ValueError(f"topk_per_chunk {self.topk_per_chunk} must not exceed chunk_size {self.chunk_size}")
        if self.overlap_steps >= self.inner_steps:
            raise ValueError(f"overlap_steps {self.overlap_steps} must be below inner_steps {self.inner_steps}")
        if self.fragments > self.inner_steps:
            raise ValueError(f"fragments {self.fragments} must not exceed inner_steps {self.inner_steps} "
                             f"(one capture per inner step at most)")
        return self


class AveragingConfig(BaseModel):
    """AsyncSPARTA: how the replicas of a stage average a rotating slice of their weights [report 4.2].

    Every node of a run must agree on `average_every` and `segments` (they fix which index set a
    round averages); the timeouts bound one round's matchmaking and all-reduce [report 3.3.1.8].
    """

    model_config = _FROZEN

    enabled: bool = Field(default=True, description="Average within the stage at all.")
    method: Literal["asyncsparta", "sparseloco"] = Field(
        default="asyncsparta",
        description="asyncsparta: replicas average a rotating slice of their weights every average_every steps; "
                    "sparseloco: they exchange a 97-99% sparse, 2-bit pseudo-gradient every sparseloco.inner_steps "
                    "steps (settings under `sparseloco`).",
    )
    sparseloco: SparseLoCoConfig = Field(
        default_factory=SparseLoCoConfig, description="SparseLoCo's settings; used only with method sparseloco."
    )
    average_every: int = Field(
        default=20, gt=0, description="Optimizer steps between two averaging rounds (N)."
    )
    segments: int = Field(
        default=20, gt=0, description="Index sets that tile the parameters; p = 1/segments."
    )
    matchmaking_time_s: float = Field(
        default=5.0, gt=0, description="Window in which the stage's peers form a round's group."
    )
    request_timeout_s: float = Field(
        default=3.0, gt=0, description="Wait for a potential group leader's answer (< window)."
    )
    sender_timeout_s: float = Field(
        default=10.0, gt=0,
        description="A sender silent this long between chunks is banned from the round; "
        "reducers get twice that.",
    )
    allreduce_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest one all-reduce may run once the group is formed."
    )
    part_size_bytes: int = Field(
        default=1 << 19, ge=1024, description="Size of the chunks the all-reduce streams."
    )
    idle_period_s: float | None = Field(
        default=None, gt=0,
        description="If set, a stage whose step has not moved for this long averages on a "
        "wall-clock cadence of this period (idle stages, tests).",
    )
    max_norm_ratio: float = Field(
        default=10.0, gt=1.0,
        description="A reducer leaves out a sender's part whose norm is more than this many times "
        "above or below its own part's (replicas' weights are close; garbage is not).",
    )
    max_sender_weight: float = Field(
        default=1e9, gt=0,
        description="A reducer leaves out a sender whose weight (samples since its last round) "
        "is above this, or negative, or not finite.",
    )
    min_reducers: int = Field(
        default=1, ge=0,
        description="A stage with fewer reducers than this (too few workers started with --reducer, "
        "or they left) promotes its most stable active workers until it has this many; 0: never.",
    )
    max_divergence: float | None = Field(
        default=0.25, gt=0,
        description="A replica whose slice sits at least this far (relative L2) from the round's average is "
        "reported; if it is also 1.5x farther than every other member, for divergence_rounds rounds in a "
        "row, it rejoins through weight sync. None: never judged.",
    )
    divergence_rounds: int = Field(
        default=2, ge=1, description="Rounds in a row a replica must be the outlier before it resyncs."
    )
    repair_lost_slices: bool = Field(
        default=True,
        description="When a reducer dies mid-round, the survivors average the segment again at once among "
        "themselves (a 'repair' round), so its slice is averaged after all instead of staying local.",
    )
    gradients: Literal["auto", "every_step", "off"] = Field(
        default="auto",
        description="The replicas of a stage add up their gradients before every step, so they apply one "
        "update and stay equal (every_step), or each steps on its own samples and only the weight averaging "
        "pulls them together (off). auto: every_step where the bandwidth plan says two replicas' exchange "
        "needs at most gradient_max_mbps.",
    )
    gradient_max_mbps: float = Field(
        default=50.0, gt=0,
        description="With gradients: auto, the most the per-step gradient exchange may need per replica "
        "(agora-node plan, gradient_mbps) before the run relies on the weight averaging alone.",
    )
    gradient_timeout_s: float = Field(
        default=10.0, gt=0,
        description="A replica waits this long for the others' gradients of a step, then steps without the "
        "missing ones (counted).",
    )

    @model_validator(mode="after")
    def _check_timeouts(self) -> AveragingConfig:
        if self.method == "sparseloco" and self.gradients == "every_step":
            raise ValueError(
                "method sparseloco and gradients every_step exclude each other: with every_step the replicas "
                "apply one update each step and have no pseudo-gradient to exchange; set gradients: off (or auto)"
            )
        if self.request_timeout_s >= self.matchmaking_time_s:
            raise ValueError(
                f"request_timeout_s {self.request_timeout_s} must be below matchmaking_time_s "
                f"{self.matchmaking_time_s} (hivemind matchmaking can deadlock otherwise)"
            )
        if self.idle_period_s is not None and self.idle_period_s < 2 * self.matchmaking_time_s:
            raise ValueError(
                f"idle_period_s {self.idle_period_s} must be at least twice matchmaking_time_s "
                f"{self.matchmaking_time_s}, so a round that finds nobody ends before the next is due"
            )
        return self


class SyncConfig(BaseModel):
    """How a joining worker loads state and catches up with its stage [report 3.3.1.1, 5.6]."""

    model_config = _FROZEN

    max_stale_steps: int = Field(
        default=20, ge=0,
        description="A joiner whose state is more steps behind the stage than this syncs first.",
    )
    weight_sync_steps: int = Field(
        default=400, ge=0,
        description="Stage steps of weight sync: hidden from trainers, averaging with weight 0.",
    )
    optimizer_sync_steps: int = Field(
        default=100, ge=0,
        description="Stage steps of optimizer sync: serves batches, counts no samples, weight 0.",
    )
    weight_sync_exit_distance: float | None = Field(
        default=None, gt=0,
        description="Leave weight sync early once a full pass of rounds moved this replica by "
        "less than this relative L2 distance.",
    )
    alone_exit_s: float = Field(
        default=15.0, gt=0,
        description="A worker in a sync phase that sees no active replica of its stage for this "
        "long becomes active: nobody is left to sync with, and the stage would stand still.",
    )
    state_chunk_elements: int = Field(
        default=1 << 20, gt=0, le=1 << 23, description="Parameters per state-transfer chunk."
    )
    state_chunk_timeout_s: float = Field(
        default=15.0, gt=0, description="A chunk slower than this is resumed from another peer."
    )
    state_load_timeout_s: float = Field(
        default=600.0, gt=0, description="Give up loading state from peers after this long."
    )
    state_chunk_bytes: int = Field(
        default=4 << 20, ge=1 << 16, le=32 << 20,
        description="Bytes per chunk of a multi-donor state download (each hashed with SHA-256).",
    )
    donor_upload_mbps: float = Field(
        default=50.0, gt=0,
        description="Most a worker uploads to joiners, in Mbit/s over all of them: half a 100 Mbit/s link, "
        "so donating never starves its own training.",
    )
    donor_max_concurrent_chunks: int = Field(
        default=4, ge=1, le=64,
        description="State chunks a worker serves at once; a request beyond is refused as overloaded.",
    )
    donor_snapshot_ttl_s: float = Field(
        default=60.0, gt=0,
        description="A donor drops its frozen snapshot (one copy of its stage state) this long after the "
        "last request for it.",
    )
    donor_chunks_in_flight: int = Field(
        default=2, ge=1, le=16,
        description="Chunk requests a joiner keeps in flight to each donor.",
    )


class SurrogateConfig(BaseModel):
    """A surrogate stage [report 3.5.1]: a few linear layers on the k boundary coordinates with
    injected compute time, standing in for a stage of the decoder `model` describes.

    It keeps that decoder's traffic on both axes: boundary tensors of the same shape (seq_len x
    subspace_rank float32, plus the token ids) and an averaged vector sized so each averaging round
    moves as many values as the real stage does at `mirror_segments` segments (the rest of the
    vector is an untrained payload that is averaged but never stepped). Delays are slept, not
    computed, so a small machine can host a swarm that communicates like a large run.
    """

    model_config = _FROZEN

    mirrors: str | None = Field(
        default=None, description="Name of the run (preset) whose traffic this surrogate mirrors; a label."
    )
    mirror_segments: int = Field(
        gt=0,
        description="averaging.segments of the mirrored run: a round averages the real stage's "
        "parameters / mirror_segments values.",
    )
    width: int = Field(default=64, gt=0, description="Hidden width of each surrogate layer.")
    layers: int = Field(default=2, gt=0, description="Residual layers per stage (k -> width -> k).")
    forward_s: float = Field(
        default=0.0, ge=0, le=600, description="Slept once per forward batch (its fixed cost)."
    )
    forward_per_sample_s: float = Field(
        default=0.0, ge=0, le=600, description="Slept per sample of a forward batch."
    )
    backward_s: float = Field(
        default=0.0, ge=0, le=600,
        description="Slept once per backward batch (the tail's fused forward and backward too).",
    )
    backward_per_sample_s: float = Field(
        default=0.0, ge=0, le=600, description="Slept per sample of a backward batch."
    )

    def delay_s(self, batch: int, *, backward: bool) -> float:
        """Seconds a batch of `batch` samples sleeps: a fixed cost plus a per-sample one."""
        if backward:
            return self.backward_s + batch * self.backward_per_sample_s
        return self.forward_s + batch * self.forward_per_sample_s


class StageRange(BaseModel):
    """The blocks one pipeline stage holds: `[first_layer, last_layer)`."""

    model_config = _FROZEN

    first_layer: int = Field(ge=0, description="Index of the stage's first block.")
    last_layer: int = Field(ge=0, description="One past the index of the stage's last block.")

    @model_validator(mode="after")
    def _check_nonempty(self) -> StageRange:
        if self.last_layer <= self.first_layer:
            raise ValueError(
                f"stage [{self.first_layer}, {self.last_layer}) holds no blocks; "
                f"last_layer must exceed first_layer"
            )
        return self

    @property
    def num_layers(self) -> int:
        """Blocks in this stage."""
        return self.last_layer - self.first_layer


class DataConfig(BaseModel):
    """The prepared corpus a run trains on (`agora-node data prepare`); unset: each trainer's own data."""

    model_config = _FROZEN

    manifest_sha256: Optional[str] = Field(
        default=None, pattern=r"^[0-9a-f]{64}$",
        description="SHA-256 of the corpus's manifest.json (prepare prints it); trainers with other data, "
                    "another tokenizer or another held-out split are refused.",
    )
    location: Optional[str] = Field(
        default=None,
        description="Where trainers that pass no --data read it: a directory or a URL (s3://, gs://, https://).",
    )


class EvaluationConfig(BaseModel):
    """Held-out evaluation during the run: the evaluating trainer (trainer 0 of its data shard
    assignment) sends the same held-out samples forward through the live stages, with no backward
    and no effect on any optimizer, every `every_steps` stage steps."""

    model_config = _FROZEN

    every_steps: int = Field(
        default=20, ge=0,
        description="Evaluate when the stages have taken this many more steps; 0 turns evaluation off.",
    )
    samples: int = Field(
        default=512, ge=1, le=4096,
        description="Held-out samples per evaluation (fewer if the held-out split holds fewer): spread evenly "
                    "over the split (corpus/heldout.py), the same every time. 512 keeps the loss's standard error "
                    "under 1% on real text at 64 tokens a sample.",
    )


class VerificationConfig(BaseModel):
    """Checks of the workers' compute by the trainers: a fraction of the forward hops (and the
    tail's losses) re-executed on another replica of the same stage at the same weight version and
    compared (roles/trainer/spot_checks.py)."""

    model_config = _FROZEN

    spot_check_rate: float = Field(
        default=0.01, ge=0, le=1,
        description="Fraction of forward hops and tail losses a trainer has another replica of the stage "
                    "re-execute and compares; 0 turns spot checks off.",
    )
    tolerance: float = Field(
        default=0.02, gt=0, le=1,
        description="Relative L2 distance between two replicas' outputs (or losses) for the same input at the "
                    "same weight version beyond which they disagree.",
    )
    loss_margin: float = Field(
        default=0.01, gt=0, le=1,
        description="A disputed output is put in the wrong when the sample's loss through the later stages from "
                    "it is worse than from the replica's by more than this fraction.",
    )
    suspect_check_rate: float = Field(
        default=0.5, ge=0, le=1,
        description="Fraction of a worker's hops checked while its replies' sizes stand out from its stage's other "
                    "workers' (the trainer's screen); never below spot_check_rate.",
    )
    strikes_to_exclude: int = Field(
        default=3, ge=1, le=1000,
        description="Disputes resolved against a worker (and fewer than a third as many in its favour) after "
                    "which a trainer routes nothing more to it.",
    )
    exact_strikes_to_exclude: int = Field(
        default=1, ge=1, le=1000,
        description="Disputes resolved against a worker by a re-execution (a third replica's, its own second "
                    "answer, or the trainer's on its weights) after which a trainer routes nothing more to it "
                    "(with fewer than a third as many in its favour); strikes_to_exclude counts all strikes.",
    )
    referee_max_bytes: int = Field(
        default=256 << 20, ge=0,
        description="Largest stage (its parameters, in bytes) whose weights a trainer fetches from both sides of "
                    "a two-replica output dispute to re-execute the hop itself; 0 turns this referee off.",
    )


class CheckpointConfig(BaseModel):
    """Run checkpoints in a store (a directory or an object-store URL): every stage's parameters and
    optimizer state at one agreed step, complete only once the run manifest names them all."""

    model_config = _FROZEN

    store: Optional[str] = Field(
        default=None,
        description="Where checkpoints live: a directory, file:///dir, s3://bucket/prefix (fsspec); unset: "
                    "~/.cache/agora-node/checkpoints on each machine. Joiners and restarted workers read it; "
                    "workers started with --checkpoint-write write it.",
    )
    every_steps: int = Field(
        default=50, gt=0,
        description="Writers upload their stage at every multiple of this step: the step all stages agree on.",
    )
    keep: int = Field(default=3, ge=1, description="Complete checkpoints kept; older ones are deleted.")


class SkippingConfig(BaseModel):
    """Stage skipping [Crucible notes on stage skipping]: when a body stage has no worker a
    trainer can reach, its samples go from the stage before it straight to the stage after it
    (forward) and their gradients back along the same shortcut. Every boundary carries the same
    k subspace coordinates and every stage adds to one residual stream, so a skipped stage
    amounts to leaving its blocks' contributions out; it takes no step on those samples."""

    model_config = _FROZEN

    enabled: bool = Field(
        default=True,
        description="Skip a body stage that has no reachable worker instead of dropping its samples; "
        "false: drop them as no_workers, as before. The head and the tail are never skipped.",
    )
    max_consecutive: int = Field(
        default=1, ge=1,
        description="At most this many adjacent body stages are skipped in one sample; a sample "
        "that would need more is dropped.",
    )


class RoutingConfig(BaseModel):
    """How a training sample travels the pipeline. `trainer`: the trainer calls every
    stage itself, forward head to tail and backward tail to head (2 network hops per stage and
    direction, the coordinates of every boundary through the trainer). `workers`: the trainer
    hands the sample to the head with a route, each stage passes its output to the next stage's
    worker and the backward returns the same way, each stage on the worker that ran its forward;
    the trainer gets the loss and the outcome (1 hop per stage and direction)."""

    model_config = _FROZEN

    path: Literal["trainer", "workers"] = Field(
        default="trainer",
        description="`trainer`: the trainer calls each stage in turn; `workers`: each stage's worker "
        "passes the sample on to the next stage's worker (worker-to-worker routing).",
    )
    candidates: int = Field(
        default=3, ge=1, le=8,
        description="With path `workers`: workers named per stage in a sample's route, the "
        "trainer's choice first; a stage whose workers all fail drops the sample.",
    )


class SwitchRule(BaseModel):
    """A self-termination rule with no threshold: it fires on its first cause."""

    model_config = _FROZEN

    enabled: bool = Field(default=True, description="Whether the rule is evaluated at all.")


class ConsecutiveRule(SwitchRule):
    """A rule that fires on the Nth consecutive occurrence of its cause."""

    max_consecutive: int = Field(
        default=2, ge=1,
        description="Fire on this many consecutive occurrences (2: the step's retry failed too).",
    )


class SilenceRule(SwitchRule):
    """A rule that fires once something has failed for a while without one success."""

    after_s: float = Field(default=120.0, gt=0, description="Fire after this long without a success.")


class MemoryRule(SwitchRule):
    """A rule that fires when a memory reading exceeds a limit: bytes, a fraction of the total, or
    whichever is lower when both are set."""

    enabled: bool = Field(default=False, description="Whether the rule is evaluated at all.")
    max_bytes: int | None = Field(default=None, gt=0, description="Fire above this many bytes.")
    max_fraction: float | None = Field(
        default=0.95, gt=0, le=1, description="Fire above this fraction of the total memory."
    )

    @model_validator(mode="after")
    def _check_limit(self) -> MemoryRule:
        if self.enabled and self.max_bytes is None and self.max_fraction is None:
            raise ValueError("an enabled memory rule needs max_bytes or max_fraction")
        return self


class AveragingRule(SwitchRule):
    """The averaging rule [report 3.3.1.6]: `max_failures` failed rounds among the last `window`
    (a successful round resets the count)."""

    max_failures: int = Field(default=2, ge=1, description="Failed rounds that make the worker leave.")
    window: int = Field(default=3, ge=1, description="Rounds the failures are counted over.")

    @model_validator(mode="after")
    def _check_window(self) -> AveragingRule:
        if self.max_failures > self.window:
            raise ValueError(f"max_failures {self.max_failures} exceeds window {self.window}; it could never fire")
        return self


class TerminationConfig(BaseModel):
    """A worker's self-termination rules [report 3.3.1.6]: conditions under which it leaves its
    stage on its own, with the exit code and sentence roles/worker/health/termination.py gives each.
    They are in the run config so the run owner sets them for every worker."""

    model_config = _FROZEN

    check_period_s: float = Field(
        default=5.0, gt=0, description="How often memory and connectivity are sampled and the timers checked."
    )
    device_fault: SwitchRule = Field(
        default_factory=SwitchRule, description="Leave on a CUDA/device error raised by the compute."
    )
    non_finite: ConsecutiveRule = Field(
        default_factory=ConsecutiveRule, description="Leave when consecutive steps had non-finite gradients."
    )
    connectivity: SilenceRule = Field(
        default_factory=SilenceRule, description="Leave when no peer answered for after_s (once one had)."
    )
    progress: SilenceRule = Field(
        default_factory=SilenceRule, description="Leave when the stage's progress records could not be read."
    )
    host_memory: MemoryRule = Field(
        default_factory=MemoryRule, description="Leave when the process's resident memory exceeds a limit."
    )
    device_memory: MemoryRule = Field(
        default_factory=lambda: MemoryRule(max_fraction=0.98),
        description="Leave when the memory torch holds on the device exceeds a limit.",
    )
    averaging: AveragingRule = Field(
        default_factory=AveragingRule, description="Leave after failing max_failures of the last window rounds."
    )


class RunConfig(BaseModel):
    """Everything the nodes of one training run must agree on."""

    model_config = _FROZEN

    run_id: str = Field(
        description="Name of the run; prefixes every DHT key, so no slashes or spaces."
    )
    model: ModelConfig = Field(description="Shape of the decoder.")
    stages: list[StageRange] = Field(description="Contiguous block ranges, head first, tail last.")
    optimizer: OptimizerConfig = Field(description="Per-stage AdamW settings and schedule.")
    target_batch_size: int = Field(
        gt=0, description="Samples the stage processes together before each optimizer step."
    )
    seq_len: int = Field(gt=0, description="Tokens per sample (<= model.max_seq_len).")
    seed: int = Field(default=0, ge=0, description="Seeds the initial weights of every stage.")
    dtype: ComputeDtype = Field(default="float32", description="Compute dtype on the worker.")
    wire_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto",
        description="Boundary coordinates and their gradients on the wire: auto is bfloat16 in a bfloat16 run "
                    "(half the bytes of float32), float32 otherwise.",
    )
    averaging: AveragingConfig = Field(
        default_factory=AveragingConfig, description="AsyncSPARTA weight averaging in a stage."
    )
    sync: SyncConfig = Field(
        default_factory=SyncConfig, description="State loading and sync phases of a joiner."
    )
    staleness: StalenessConfig = Field(
        default_factory=StalenessConfig,
        description="Bounds on the weight-version gap between a sample's forward and backward.",
    )
    surrogate: SurrogateConfig | None = Field(
        default=None, description="The surrogate stage's layers and delays; only with model.kind surrogate."
    )
    skipping: SkippingConfig = Field(
        default_factory=SkippingConfig,
        description="Whether trainers route around a body stage with no reachable worker.",
    )

    routing: RoutingConfig = Field(
        default_factory=RoutingConfig,
        description="How samples travel the pipeline: through the trainer, or worker to worker.",
    )
    termination: TerminationConfig = Field(
        default_factory=TerminationConfig,
        description="When a worker leaves its stage on its own (self-termination rules).",
    )
    data: DataConfig = Field(
        default_factory=DataConfig,
        description="The prepared corpus the run trains on, by its manifest's hash.",
    )
    evaluation: EvaluationConfig = Field(
        default_factory=EvaluationConfig,
        description="Held-out loss during the run: how often, on how many samples.",
    )
    verification: VerificationConfig = Field(
        default_factory=VerificationConfig,
        description="Spot checks of the workers' compute by the trainers.",
    )
    checkpoints: CheckpointConfig = Field(
        default_factory=CheckpointConfig,
        description="Run checkpoints (parameters and optimizer state) in a store, and resume from them.",
    )

    @field_validator("run_id")
    @classmethod
    def _check_run_id(cls, value: str) -> str:
        if not _RUN_ID.fullmatch(value):
            raise ValueError(
                f"run_id {value!r} must be 1-64 letters, digits, '.', '_' or '-', starting with a "
                f"letter or digit (it prefixes DHT keys)"
            )
        return value

    @model_validator(mode="after")
    def _check_layout(self) -> RunConfig:
        if len(self.stages) < 2:
            raise ValueError(
                f"stages has {len(self.stages)} entry; a run needs at least a head and a tail stage"
            )
        expected = 0
        for index, stage in enumerate(self.stages):
            if stage.first_layer != expected:
                problem = "a gap" if stage.first_layer > expected else "an overlap"
                raise ValueError(
                    f"stages must be contiguous; stage {index} starts at layer "
                    f"{stage.first_layer} but the previous one ends at {expected} ({problem})"
                )
            expected = stage.last_layer
        n_layers = self.model.n_layers
        if expected != n_layers:
            raise ValueError(
                f"stages must cover layers 0..{n_layers} exactly; got 0..{expected}"
            )
        if self.model.kind == "surrogate" and self.surrogate is None:
            raise ValueError(
                "model.kind is surrogate but the surrogate: section is missing; add it "
                "(at least surrogate.mirror_segments)"
            )
        if self.model.kind != "surrogate" and self.surrogate is not None:
            raise ValueError(
                f"a surrogate: section is set but model.kind is {self.model.kind}; set model.kind: "
                f"surrogate or remove the section"
            )
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds model.max_seq_len {self.model.max_seq_len}; "
                f"lower seq_len or raise max_seq_len"
            )
        if self.averaging.method == "sparseloco" and self.sparseloco_store is None \
                and self.averaging.sparseloco.transport == "store":
            raise ValueError(
                "averaging.sparseloco.transport is store but no store is named: set averaging.sparseloco.store "
                "or checkpoints.store to a URL every replica reaches (s3://bucket/prefix, a shared directory)"
            )
        return self

    @property
    def model_digest(self) -> str:
        """16 hex digits of what defines the model the stages compute: `model`, the stage cut and
        the surrogate section. Nodes of a run compare it through their records, since nodes of two
        constructions or subspace seeds exchange coordinates of the same shape and would silently
        train different models (values left at their defaults are left out, so a field a later
        version adds with a default does not change it)."""
        import hashlib
        import json

        defining = {"model": self.model.model_dump(mode="json", exclude_defaults=True),
                    "stages": [stage.model_dump(mode="json") for stage in self.stages],
                    "surrogate": None if self.surrogate is None else self.surrogate.model_dump(
                        mode="json", exclude_defaults=True)}
        return hashlib.sha256(json.dumps(defining, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def sparseloco_store(self) -> Optional[str]:
        """The object store SparseLoCo's 'store' transport uses: its own, else the checkpoints' store."""
        return self.averaging.sparseloco.store or self.checkpoints.store

    @property
    def num_stages(self) -> int:
        """Pipeline stages, head and tail included."""
        return len(self.stages)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_stages:
            raise ConfigError(
                f"stage {index} does not exist; run {self.run_id} has stages "
                f"0..{self.num_stages - 1}"
            )

    def stage_kind(self, index: int) -> StageKind:
        """Stage 0 embeds tokens (head), the last computes the loss (tail), the rest are bodies."""
        self._check_index(index)
        if index == 0:
            return "head"
        return "tail" if index == self.num_stages - 1 else "body"

    @property
    def boundary_dtype(self) -> str:
        """The dtype boundary coordinates and their gradients travel in (`wire_dtype` resolved)."""
        if self.wire_dtype != "auto":
            return self.wire_dtype
        return "bfloat16" if self.dtype == "bfloat16" else "float32"

    def clip_threshold(self, index: int) -> float:
        """Stage-wise gradient-norm clip: 1/sqrt(S) splits a unit global budget; the tail,
        whose gradients run consistently larger, gets twice that [report 4.3]."""
        base = 1.0 / math.sqrt(self.num_stages)
        return 2.0 * base if self.stage_kind(index) == "tail" else base


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Merge nested dicts; any other value (lists included) replaces. Dotted keys
    (`"model.d_model"`) address nested fields, as a command-line `--set` would."""
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(key, str) and "." in key:
            head, rest = key.split(".", 1)
            value, key = {rest: value}, head
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe_error(error: dict[str, Any]) -> str:
    where = ".".join(str(part) for part in error.get("loc", ()))
    kind = error.get("type", "")
    if kind == "missing":
        text = "is required; add it"
    elif kind == "extra_forbidden":
        text = "is not a known field; remove it or fix its spelling"
    else:
        text = str(error.get("msg", "is invalid")).removeprefix("Value error, ")
        if kind != "value_error":
            text = f"{text} (got {error.get('input')!r:.60})"
    text = text.replace("\n", " ")
    return f"{where}: {text}" if where else text


def _read_source(source: str) -> dict[str, Any]:
    from protocol.run_presets import PRESETS

    if source in PRESETS:
        return copy.deepcopy(PRESETS[source])
    path = Path(source)
    if not path.is_file():
        raise ConfigError(
            f"config {source}: no such file; pass a preset name "
            f"({', '.join(PRESETS)}) or the path of a YAML file"
        )
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1} column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise ConfigError(f"config {source}: invalid YAML{at}: {problem}; fix the syntax") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config {source}: cannot read the file ({exc}); check it") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {source}: top level must be a mapping of fields, got {type(data).__name__}"
        )
    data.pop("node", None)  # the node's own settings (flags' defaults), read by node/settings.py
    preset = data.pop("preset", None)
    if preset is not None:  # a preset and the fields this file changes, deep-merged on top
        if preset not in PRESETS:
            raise ConfigError(f"config {source}: preset {preset!r} does not exist; use one of {', '.join(PRESETS)}")
        data = _deep_merge(copy.deepcopy(PRESETS[preset]), data)
    return data


def load_run_config(source: str, overrides: dict | None = None) -> RunConfig:
    """Build a `RunConfig` from a preset name or a YAML path, with `overrides` deep-merged on top.

    Raises `ConfigError` with one line naming the source, the field and the fix.
    """
    data = _read_source(source)
    if overrides:
        data = _deep_merge(data, overrides)
    return parse_run_config(data, f"config {source}")


def parse_run_config(data: Any, source: str) -> RunConfig:
    """Validate a run config's fields (a file's, or the authorizer's answer); raises `ConfigError`
    with one line naming `source`, the field and the fix, e.g. a model construction this
    agora-node does not build."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors()
        more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
        raise ConfigError(f"{source}: {_describe_error(errors[0])}{more}") from exc


def dump_run_config(cfg: RunConfig, path: str | os.PathLike[str]) -> None:
    """Write `cfg` as YAML that `load_run_config` reads back equal; atomic, so a reader never
    sees half a file."""
    text = yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    atomic_write(path, text.encode("utf-8"), mode=0o644)
