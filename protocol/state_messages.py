"""Wire records of `agora/v1/state`: a stage replica's trainable parameters, in chunks, for a
joining worker [report 3.3.1.1].

The parameters are addressed as one flat float32 vector (the stage's trainable tensors in model
order), so a transfer that stalls can resume at the first element it has not received yet, from
the same peer or from another replica of the stage. Every reply carries the digest of the
server's parameter layout and the server's step, so a joiner never mixes incompatible tensors
and knows how stale what it loaded is. Optimizer state is not transferred.

The multi-donor download has records of its own below: a donor's manifest of one
frozen snapshot of its state (parameters and optimizer state) and requests for its chunks, each
checked against the SHA-256 the manifest lists. `agora/v1/state` stays the fallback for donors
that do not serve them.

`agora/v1/weights` (records at the end) hands a trainer the parameters a worker computed with at
one weight version, so that the trainer can re-execute a disputed hop itself
(roles/trainer/reexecution.py).
"""

from __future__ import annotations

from typing import Annotated, Optional

from pydantic import Field

from protocol.messages import Fingerprint, WireModel, WireTensor

MAX_STATE_CHUNK_ELEMENTS = 1 << 23
"""Largest chunk one request may ask for: 32 MiB of float32, half the default frame limit."""


class StateRequest(WireModel):
    """Ask for `count` parameters starting at flat element `offset`; `count` 0 asks for the
    layout only."""

    stage: int = Field(ge=0)
    offset: int = Field(ge=0)
    count: int = Field(ge=0, le=MAX_STATE_CHUNK_ELEMENTS)


class StateReply(WireModel):
    """A chunk of the server's parameters, with what the joiner needs to check and place it."""

    run_id: str = Field(max_length=64)
    stage: int = Field(ge=0)
    step: int = Field(ge=0, description="the server's optimizer step when it read this chunk")
    numel: int = Field(ge=0, description="trainable parameters of the stage, in elements")
    layout: str = Field(max_length=128, description="digest of parameter names and shapes")
    offset: int = Field(ge=0)
    data: Optional[WireTensor] = None


# ---- multi-donor download (`agora/v1/state_manifest`, `agora/v1/state_chunk`) ----------------

SNAPSHOT_FORMAT = "agora-stage-state/1"
"""The bytes a manifest describes: roles/worker/state/state_snapshot.py."""
MAX_SNAPSHOT_CHUNKS = 1 << 16
"""Chunks one manifest may list (256 GiB at 4 MiB a chunk); bounds the manifest frame to ~2 MiB."""
MIN_SNAPSHOT_CHUNK_BYTES = 1 << 16
MAX_SNAPSHOT_CHUNK_BYTES = 32 << 20
"""A chunk and its reply frame stay well under the 64 MiB default frame limit."""
ManifestId = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class ManifestRequest(WireModel):
    """Ask a donor for the manifest of its current snapshot of `stage` (it freezes one if it holds none)."""

    stage: int = Field(ge=0)


class ManifestReply(WireModel):
    """A frozen snapshot of the donor's stage state: `total_bytes` bytes in `format`, cut into
    chunks of `chunk_bytes` (the last one shorter), `chunks[i]` the SHA-256 of chunk i.
    `manifest_id` is the SHA-256 of everything else here (state_snapshot.manifest_id): two donors
    with the same id serve the same bytes, and a joiner mixes chunks only of one id."""

    run_id: str = Field(max_length=64)
    stage: int = Field(ge=0)
    step: int = Field(ge=0, description="the donor's optimizer step when it froze the snapshot")
    layout: str = Field(max_length=128, description="digest of parameter names and shapes")
    format: str = Field(max_length=64)
    manifest_id: ManifestId
    total_bytes: int = Field(ge=1)
    chunk_bytes: int = Field(ge=MIN_SNAPSHOT_CHUNK_BYTES, le=MAX_SNAPSHOT_CHUNK_BYTES)
    chunks: list[Annotated[bytes, Field(min_length=32, max_length=32)]] = Field(min_length=1,
                                                                                 max_length=MAX_SNAPSHOT_CHUNKS)


class ChunkRequest(WireModel):
    """Chunk `index` of the snapshot `manifest_id` of `stage`."""

    stage: int = Field(ge=0)
    manifest_id: ManifestId
    index: int = Field(ge=0, lt=MAX_SNAPSHOT_CHUNKS)


class ChunkReply(WireModel):
    manifest_id: ManifestId
    index: int = Field(ge=0, lt=MAX_SNAPSHOT_CHUNKS)
    data: bytes = Field(min_length=1, max_length=MAX_SNAPSHOT_CHUNK_BYTES)


# ---- a worker's weights at one version, for a trainer's referee (`agora/v1/weights`) ----------

MAX_WEIGHTS_CHUNK_ELEMENTS = 1 << 22
"""Largest chunk one request may ask for: 16 MiB of float32, a quarter of the default frame limit."""


class WeightsRequest(WireModel):
    """Ask for `count` of the parameters the worker computes with, flat from element `offset`, as
    they were at weight `version`; `count` 0 asks for the description only."""

    stage: int = Field(ge=0)
    version: int = Field(ge=0)
    offset: int = Field(ge=0)
    count: int = Field(ge=0, le=MAX_WEIGHTS_CHUNK_ELEMENTS)


class WeightsReply(WireModel):
    """A chunk of the parameters at `version`, in the dtype the worker computes with. `weights` is
    the fingerprint of the whole set when this chunk was read (roles/worker/serving/compute_stats.py
    weights_fingerprint): a chunk read after the weights changed (a step the worker no longer keeps
    the version of, an averaging round) names other weights or fails, so a caller never mixes two sets."""

    run_id: str = Field(max_length=64)
    stage: int = Field(ge=0)
    version: int = Field(ge=0, description="the weight version this chunk was read at")
    weights: Fingerprint
    numel: int = Field(ge=0, description="parameters the stage computes with, in elements")
    dtype: str = Field(max_length=16)
    offset: int = Field(ge=0)
    data: Optional[WireTensor] = None
