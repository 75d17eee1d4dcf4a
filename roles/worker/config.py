"""Settings of one worker, derived by the node from flags, environment and config file."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class WorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int = Field(ge=0, description="the pipeline stage this worker serves")
    device: str = Field(description="torch device the stage computes on: cpu or cuda[:n]")
    max_batch: int = Field(ge=1, description="largest coalesced batch")
    max_pending: int = Field(default=1024, ge=1, description="queued requests beyond which new ones are refused")
    announce_period_s: float = Field(default=5.0, gt=0, description="how often the worker re-announces itself")
    progress_period_s: float = Field(default=0.25, gt=0, description="how often stage progress is exchanged")
    drain_timeout_s: float = Field(default=20.0, ge=0, description="time allowed to finish in-flight batches on exit")
