"""The DHT key schema (docs/architecture.md, 'DHT schema') and the records stored under each key.

Every key is prefixed by the run id; records are dictionaries with one subkey per peer (its
base58 peer id) and a short expiry, re-announced by live nodes and left to lapse by dead ones.
hivemind has no delete, so a node that leaves overwrites its subkey with a tombstone record.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

from pydantic import BaseModel, ConfigDict, Field

MAX_RECORD_TTL_S = 600.0
"""Readers reject records that claim to live longer than this: a forged far-future expiry would
otherwise pin a dead worker in everyone's view."""


class Phase(str, enum.Enum):
    """Where a worker stands in joining its stage [report 3.3.1.1]."""

    WEIGHT_SYNC = "weight_sync"
    OPTIMIZER_SYNC = "optimizer_sync"
    ACTIVE = "active"
    LEAVING = "leaving"


class RecordModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", strict=True)


class WorkerRecord(RecordModel):
    """A worker's announcement under `{run}/stage/{s}/workers`."""

    version: int = 1
    stage: int = Field(ge=0)
    phase: Phase = Field(default=Phase.ACTIVE, strict=False)
    max_batch: int = Field(ge=1, le=65536)
    throughput: float = Field(ge=0.0, description="samples/s the worker measured on its own batches")
    maddrs: list[str] = Field(default_factory=list, max_length=16)
    client_version: str = Field(default="", max_length=64)
    credential_id: Optional[str] = Field(default=None, max_length=128)
    host_rss_bytes: Optional[int] = Field(default=None, ge=0, description="the node's resident memory")
    host_memory_total_bytes: Optional[int] = Field(default=None, ge=0, description="the host's RAM, or the "
                                                   "node's memory limit if lower")
    device_memory_used_bytes: Optional[int] = Field(default=None, ge=0)
    device_memory_total_bytes: Optional[int] = Field(default=None, ge=0)
    relayed_bytes: Optional[int] = Field(default=None, ge=0, description="pipeline bytes the worker sent and "
                                         "received on streams through the run's relays (it sits behind NAT, or its "
                                         "peers do)")
    started_at: Optional[float] = Field(default=None, ge=0, description="when the worker's process started "
                                        "(wall clock): a trainer lifts a ban when this changes (a restart)")
    chain: bool = Field(default=False, description="serves agora/v1/chain (worker-to-worker routing); false in "
                        "the records of workers older than it, which a trainer then keeps off chained routes")
    model_digest: str = Field(default="", max_length=64, description="RunConfig.model_digest of the worker's run "
                              "config: nodes whose digest differs train another model, and are refused or kept "
                              "off routes; empty in the records of workers older than it")
    construction: str = Field(default="", max_length=32, description="the run config's model.construction, so a "
                              "refusal can name the difference")

    def trains_other_model(self, model_digest: str) -> bool:
        """True when the record names a model digest and it is not `model_digest` (a record of a
        worker older than the digest names none, and is taken at its word)."""
        return bool(self.model_digest) and self.model_digest != model_digest


class ProgressRecord(RecordModel):
    """A worker's optimizer progress under `{run}/stage/{s}/progress`: the stage steps together
    once the samples the workers accumulated at the current step reach `target_batch_size`."""

    version: int = 1
    local_step: int = Field(ge=0)
    samples_accumulated: int = Field(ge=0)
    counts_towards_target: bool = True
    time: float
    next_samples: int = Field(default=0, ge=0, description="samples accumulated for local_step + 1")
    samples_consumed: int = Field(default=0, ge=0, description="samples the stage consumed in all its steps")
    tagger: bool = Field(default=False, description="this tail replica hands out the stage's step tags")


class RoundStatus(str, enum.Enum):
    """How one AsyncSPARTA averaging round ended for the peer reporting it [report 5.7.1]."""

    COMPLETE = "complete"  # every slice reduced from every group member and returned; full group
    PARTIAL = "partial"  # ran, but a slice fell back to local values, a sender was banned or peers were missing
    FAILED = "failed"  # no group formed, the all-reduce broke, or nothing of the average came back
    SKIPPED = "skipped"  # not attempted: alone in the stage, no reducer, or the previous round still running


class FailedSliceRecord(RecordModel):
    """A reducer's slice of the round buffer that did not come back: those values kept their local
    values on this peer [report 3.3.1.8]."""

    reducer: str = Field(max_length=128)
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    failed_elements: int = Field(ge=0)


class RoundSummaryRecord(RecordModel):
    """One averaging round as one peer saw it: the report's reduce and averaging success [report 5.7.1.1],
    group size against the stage's workers, duration and why it was not complete."""

    version: int = 1
    kind: str = Field(max_length=8, description="'step' (every N optimizer steps), 'clock' (idle stage) or 'repair' "
                      "(a round's lost slice averaged again by the survivors)")
    round: int = Field(ge=0)
    segment: int = Field(ge=0)
    digest: str = Field(max_length=64, description="digest of the round's index set")
    status: RoundStatus = Field(strict=False)
    group_size: int = Field(ge=0)
    expected_group_size: int = Field(ge=0)
    reduce_success: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    averaging_success: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    duration_s: float = Field(ge=0.0)
    weight: float = Field(ge=0.0)
    failure_reason: str = Field(default="", max_length=512)
    failed_slices: list[FailedSliceRecord] = Field(default_factory=list, max_length=16)
    banned_senders: list[str] = Field(default_factory=list, max_length=16)
    mismatched_peers: list[str] = Field(default_factory=list, max_length=16)
    relative_distance: Optional[float] = Field(default=None, ge=0.0)
    finished_at: float = 0.0


class AveragingRecord(RecordModel):
    """A worker's averaging status under `{run}/stage/{s}/averaging`: whether it reduces, the round
    it is in (with the digest of that round's index set, so peers can spot a mismatch), its
    round counters and its last few rounds."""

    version: int = 1
    reducer: bool = False
    elected: bool = Field(default=False, description="a reducer by the stage's election, not by --reducer")
    can_reduce: bool = Field(default=False, description="the worker promotes itself to reducer when elected "
                             "(nodes that predate the election cannot and are never elected)")
    started_at: float = Field(default=0.0, ge=0.0, le=1e11, description="wall-clock time its averaging began "
                              "(bounded: the reducer election floors it, and infinity would crash that)")
    bandwidth: float = Field(default=0.0, ge=0.0, le=1e15, description="all-reduce bytes/s it measured over its rounds")
    stride: int = Field(default=1, ge=1, le=1024, description="it runs only the rounds whose number this divides "
                        "(its cadence, roles/worker/averaging/schedule.py): the others do not wait for it in the rest")
    phase: Phase = Field(default=Phase.ACTIVE, strict=False)
    round_kind: str = Field(default="", max_length=8)
    round: int = Field(default=0, ge=0)
    segment: int = Field(default=0, ge=0)
    digest: str = Field(default="", max_length=64)
    rounds_complete: int = Field(default=0, ge=0)
    rounds_partial: int = Field(default=0, ge=0)
    rounds_failed: int = Field(default=0, ge=0)
    rounds_skipped: int = Field(default=0, ge=0)
    recent: list[RoundSummaryRecord] = Field(default_factory=list, max_length=8)
    method: str = Field(default="asyncsparta", max_length=16, description="how the stage's replicas are kept "
                        "together: asyncsparta, or sparseloco (then `recent` holds its fragments' rounds)")
    density: Optional[float] = Field(default=None, ge=0.0, le=1.0, description="sparseloco: share of the "
                                     "parameters one cycle sends")
    bytes_per_round: Optional[int] = Field(default=None, ge=0, description="sparseloco: bytes this replica sent "
                                           "each other replica in its last round")
    wait_s: Optional[float] = Field(default=None, ge=0.0, description="sparseloco: seconds the compute thread has "
                                    "waited for exchanges in all (the critical path)")


class TrainerRecord(RecordModel):
    """A trainer's progress under `{run}/trainers`."""

    version: int = 1
    samples_completed: int = Field(ge=0)
    samples_dropped: int = Field(ge=0)
    tokens: int = Field(ge=0)
    last_loss: Optional[float] = None
    first_loss: Optional[float] = None
    recent_loss: Optional[float] = None
    time: float
    final: bool = Field(default=False, description="the trainer left and these are its last counters; written "
                        "in place of a tombstone, so whoever counts progress sees them once more")
    data_manifest: Optional[str] = Field(default=None, max_length=64,
                                         description="SHA-256 of the prepared corpus's manifest it reads")
    data_position: Optional[int] = Field(default=None, ge=0, description="samples of its share that have ended")
    eval_loss: Optional[float] = Field(default=None, description="its latest held-out loss (the run's evaluator, "
                                       "trainer 0, publishes one: roles/trainer/evaluation.py)")
    eval_step: Optional[int] = Field(default=None, ge=0, description="the stage step that held-out loss was taken at")
    eval_stderr: Optional[float] = Field(default=None, ge=0, description="the standard error of that held-out loss "
                                         "over its samples")


class Tombstone(RecordModel):
    """Written over a subkey when its owner leaves, so readers drop it before it expires."""

    version: int = 1
    tombstone: bool = True


def workers_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}/workers"


def progress_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}/progress"


def averaging_key(run_id: str, stage: int) -> str:
    return f"{run_id}/stage/{stage}/averaging"


def trainers_key(run_id: str) -> str:
    return f"{run_id}/trainers"


def control_key(run_id: str) -> str:
    return f"{run_id}/control"


@dataclass(frozen=True)
class KeySpec:
    """What may be written under one key: the record model, and in authenticated runs the role
    (and stage) the writer's credential must carry."""

    model: type[RecordModel]
    role: str
    stage: Optional[int] = None


def schema_for_run(run_id: str, num_stages: int) -> dict[str, KeySpec]:
    """Every peer-owned key this run uses, mapped to what its values must satisfy."""
    schema: dict[str, KeySpec] = {trainers_key(run_id): KeySpec(TrainerRecord, "trainer")}
    for stage in range(num_stages):
        schema[workers_key(run_id, stage)] = KeySpec(WorkerRecord, "worker", stage)
        schema[progress_key(run_id, stage)] = KeySpec(ProgressRecord, "worker", stage)
        schema[averaging_key(run_id, stage)] = KeySpec(AveragingRecord, "worker", stage)
    return schema
