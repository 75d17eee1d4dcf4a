"""Settings of one worker, derived by the node from flags, environment and config file."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class WorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int = Field(ge=0, description="the pipeline stage this worker serves")
    device: str = Field(description="torch device the stage computes on: cpu or cuda[:n]")
    max_batch: int = Field(ge=1, description="largest coalesced batch")
    max_pending: int = Field(default=1024, ge=1, description="queued requests beyond which new ones are refused")
    announce_period_s: float = Field(default=5.0, gt=0, description="how often the worker re-announces itself")
    progress_period_s: float = Field(default=0.25, gt=0, description="how often stage progress is exchanged")
    drain_timeout_s: float = Field(default=20.0, ge=0, description="time allowed to finish in-flight batches on exit")
    reducer: bool = Field(
        default=False, description="reduce slices in averaging rounds (stable nodes); otherwise only send")
    state_source: Literal["auto", "peers", "checkpoint", "none"] = Field(
        default="auto", description="where a joiner loads its stage's parameters: peers, then the checkpoint dir")
    checkpoint_dir: Optional[str] = Field(
        default=None, description="directory of stage checkpoints: read by joiners, written by designated nodes")
    checkpoint_period_s: Optional[float] = Field(
        default=None, gt=0, description="write a checkpoint to checkpoint_dir at start, then every this many seconds")
    test_init_seed_offset: int = Field(
        default=0, ge=0, description="TESTS ONLY: start from other initial weights than the run's seed gives")
    test_averaging_stall_s: float = Field(
        default=0.0, ge=0, description="TESTS ONLY: stall mid-round in every all-reduce for this long (fault injection)")

    @model_validator(mode="after")
    def _check_checkpoints(self) -> WorkerConfig:
        if self.checkpoint_period_s is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_period_s needs checkpoint_dir")
        if self.state_source == "checkpoint" and self.checkpoint_dir is None:
            raise ValueError("state_source 'checkpoint' needs checkpoint_dir")
        return self
