"""The worker's section of the node settings: every field is a flag (`--max-batch`), an
`AGORA_MAX_BATCH` environment variable and a key of the config file's `node:` section. Faults
that tests inject are no settings: tests/support/faults.py wraps the product from outside."""

from __future__ import annotations

import re
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.stream_limits import StreamLimits

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes from '24GiB', '24GB', '16000MiB' or a plain number of bytes."""
    if isinstance(text, int):
        return text
    match = _SIZE.match(str(text))
    unit = (match.group(2) or "").lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write e.g. 24GiB, 24GB or 16000MiB")
    return int(float(match.group(1)) * _UNITS[unit])


class WorkerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: Optional[int] = Field(default=None, ge=0, description="pipeline stage to serve (with --authorizer: a "
                                 "preference; the authorizer places the worker)")
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$",
                        description="compute device: auto, cpu, cuda or cuda:N")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="run the stage's blocks under autocast in this dtype (auto: the run config's "
        "dtype on a GPU, float32 on the CPU); parameters, optimizer state and the wire stay as the run sets them")
    max_batch: Optional[int] = Field(
        default=None, ge=1, le=4096, json_schema_extra={"default_text": "8 on the CPU; on a GPU, the largest batch "
                                                        "the memory plan fits in half the free memory, at most "
                                                        "target_batch_size and 256"},
        description="largest coalesced batch")
    dry_run: bool = Field(default=False, description="print the memory plan, exit 0 if it fits and 2 if not")
    gpu_memory: Optional[int] = Field(default=None, gt=0, json_schema_extra={"metavar": "SIZE", "text": True},
                                      description="plan for a card of this much memory (e.g. "
                                      "24GiB) instead of the one present; with --dry-run needs no GPU")
    host_memory: Optional[int] = Field(default=None, gt=0, json_schema_extra={"metavar": "SIZE", "text": True},
                                       description="with --dry-run: plan for a host with this much free RAM (e.g. "
                                       "64GiB) instead of this machine's")
    kept_activations: Optional[int] = Field(
        default=None, ge=0, json_schema_extra={"metavar": "SIZE", "text": True},
        description="memory for keeping forward activations until their backward instead of recomputing them "
        "(e.g. 4GiB; 0: always recompute); default: half of what the memory plan leaves free")
    max_pending: int = Field(default=1024, ge=1, description="queued requests beyond which new ones are refused")
    stream_idle_timeout_s: float = Field(
        default=120.0, gt=0, description="close a peer's stream after this long without a request")
    max_streams_per_peer: int = Field(
        default=128, ge=1, description="streams one peer may hold open at once; more are refused")
    announce_period_s: float = Field(default=5.0, gt=0, description="how often the node re-announces itself in the DHT")
    progress_period_s: float = Field(default=0.25, gt=0, description="how often stage progress is exchanged")
    drain_timeout_s: float = Field(default=20.0, ge=0, description="time in-flight work gets to finish on exit")
    reducer: bool = Field(
        default=False, description="reduce slices in averaging rounds (stable nodes); otherwise only send")
    state_source: Literal["auto", "peers", "checkpoint", "none"] = Field(
        default="auto", description="where a joiner loads its stage's parameters: peers, then the checkpoint dir")
    checkpoint_dir: Optional[str] = Field(
        default=None, description="directory of stage checkpoints: read by joiners, written by designated nodes")
    checkpoint_period_s: Optional[float] = Field(
        default=None, gt=0, description="write a checkpoint to checkpoint_dir at start, then every this many seconds")
    checkpoint_store: Optional[str] = Field(
        default=None, description="store of run checkpoints (a directory, file:///dir or s3://bucket/prefix); "
        "default: the run config's checkpoints.store, else ~/.cache/agora-node/checkpoints. Joiners and a "
        "restarted run load from it")
    checkpoint_write: bool = Field(
        default=False, description="upload this stage's parameters and optimizer state to the checkpoint store at "
        "every checkpoints.every_steps step (the run owner's designated writers)")
    def stream_limits(self) -> StreamLimits:
        """What one peer may hold of this worker's RPC server (protocol/stream_limits.py)."""
        return StreamLimits(idle_timeout_s=self.stream_idle_timeout_s, max_streams_per_peer=self.max_streams_per_peer)

    @field_validator("gpu_memory", "host_memory", "kept_activations", mode="before")
    @classmethod
    def _size(cls, value):
        return None if value is None else parse_size(value)

    @model_validator(mode="after")
    def _check_checkpoints(self) -> WorkerConfig:
        if self.checkpoint_period_s is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_period_s needs checkpoint_dir")
        if self.state_source == "checkpoint" and self.checkpoint_dir is None:
            raise ValueError("state_source 'checkpoint' needs checkpoint_dir")
        return self
