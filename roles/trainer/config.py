"""The trainer's section of the node settings: every field is a flag (`--lanes`), an
`AGORA_LANES` environment variable and a key of the config file's `node:` section."""

from __future__ import annotations

from typing import Optional

from pydantic import BaseModel, ConfigDict, Field


class TrainerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    lanes: int = Field(default=4, ge=1, le=256, description="independent samples in flight at once")
    data: str = Field(default="synthetic", description="'synthetic', a path to .txt/.jsonl files, or a corpus "
                      "prepared with `agora-node data prepare` (its directory or URL: s3://, gs://, https://)")
    data_dir: str = Field(default="~/.cache/agora-node/data", description="where a prepared corpus's fetched "
                          "shards and this trainer's read position are kept")
    tokenizer: Optional[str] = Field(default=None, description="tokenizers JSON file; default is byte-level")
    max_samples: Optional[int] = Field(default=None, ge=1, description="stop after this many samples end")
    shard_index: int = Field(default=0, ge=0, description="this trainer's shard of the data")
    num_shards: int = Field(default=1, ge=1, description="trainers sharing the data")
    discovery_period_s: float = Field(default=5.0, gt=0, description="how often workers are re-read from the DHT")
    announce_period_s: float = Field(default=5.0, gt=0, description="how often the node re-announces itself in the DHT")
    request_timeout_s: float = Field(default=30.0, gt=0, description="deadline for one request to a worker")
    max_attempts: int = Field(default=3, ge=1, description="workers tried per stage before a sample is dropped")
    ban_s: float = Field(default=15.0, gt=0, description="how long a failed worker is avoided; the "
                         "last usable worker of a stage is never avoided, only retried after a short backoff")
    drain_timeout_s: float = Field(default=15.0, ge=0, description="time in-flight work gets to finish on exit")
    wait_log_period_s: float = Field(default=5.0, gt=0, description="how often waiting for workers is reported")
    progress_log_period_s: float = Field(default=10.0, gt=0, description="how often training progress is logged")
