"""`agora/v1/state`: serve this replica's parameters, in chunks, to a joining worker of the stage
[report 3.3.1.1].

Each chunk is read under the optimizer's lock, so it is internally consistent; chunks are not
taken from one snapshot (a snapshot would double the stage's memory for the whole transfer), so
a step between two chunks hands the joiner a mix of two adjacent steps, a difference far below
the drift between replicas that the joiner's averaging absorbs anyway. A replica in weight sync
holds stale weights and refuses, naming the reason.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Callable

from hivemind.p2p import PeerID

from protocol.errors import ErrorCode, ProtocolError
from protocol.messages import parse_model
from protocol.state_messages import StateReply, StateRequest
from roles.worker.layout import FlatLayout, ParameterStore


class StateServer:
    def __init__(self, store: ParameterStore, layout: FlatLayout, *, run_id: str, stage: int,
                 step: Callable[[], int], serving: Callable[[], bool], max_chunk_elements: int):
        self.store = store
        self.layout = layout
        self.run_id = run_id
        self.stage = stage
        self.step = step
        self.serving = serving
        self.max_chunk_elements = max_chunk_elements
        self.counters: collections.Counter[str] = collections.Counter()

    def _read(self, offset: int, count: int):
        with self.store.lock:
            return self.step(), self.layout.read(self.store.master_params, offset, count)

    async def handle(self, peer_id: PeerID, body: dict) -> StateReply:
        request = parse_model(StateRequest, body)
        if request.stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {request.stage}", ErrorCode.WRONG_STAGE)
        if not self.serving():
            raise ProtocolError("this worker is not serving its state now (starting, leaving or in weight sync); "
                                "ask another worker of the stage", ErrorCode.NOT_READY)
        if request.offset > self.layout.numel:
            raise ProtocolError(f"offset {request.offset} is past the stage's {self.layout.numel} parameters",
                                ErrorCode.INVALID_REQUEST)
        count = min(request.count, self.max_chunk_elements, self.layout.numel - request.offset)
        step, data = await asyncio.to_thread(self._read, request.offset, count)
        self.counters["state_chunks_served"] += 1
        self.counters["state_bytes_served"] += 4 * count
        return StateReply(run_id=self.run_id, stage=self.stage, step=step, numel=self.layout.numel,
                          layout=self.layout.digest, offset=request.offset, data=data if count else None)
