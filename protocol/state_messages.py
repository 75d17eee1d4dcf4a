"""Wire records of `agora/v1/state`: a stage replica's trainable parameters, in chunks, for a
joining worker [report 3.3.1.1].

The parameters are addressed as one flat float32 vector (the stage's trainable tensors in model
order), so a transfer that stalls can resume at the first element it has not received yet, from
the same peer or from another replica of the stage. Every reply carries the digest of the
server's parameter layout and the server's step, so a joiner never mixes incompatible tensors
and knows how stale what it loaded is. Optimizer state is not transferred.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field

from protocol.messages import WireModel, WireTensor

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
