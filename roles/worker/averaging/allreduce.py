"""hivemind's butterfly all-reduce [report 3.3.1.8], instrumented so partial rounds are seen.

hivemind finishes a round even when peers fail: a reducer that stops answering has its slice
filled with zeros (the peer keeps its local values there), a sender that misses its timeout is
banned and averaged without, and the caller learns none of it (DESIGN §3). `InstrumentedRunner`
records, inside the averager process, exactly what the report measures [5.7.1.1]:

- averaging success: which reducers' slices came back, and how many values fell back;
- reduce success: for this peer's own slice, how much of it each sender delivered before it
  finished or was banned.

It also hosts the one fault a test needs to inject: stalling this peer mid-round, so a test can
kill it while its peers wait for its next chunk.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, AsyncIterator, Optional

from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.proto import averaging_pb2

logger = logging.getLogger(__name__)


class InstrumentedRunner(AllReduceRunner):
    """An `AllReduceRunner` that keeps count of what failed, readable through `telemetry()`."""

    def __init__(self, *, stall_s: float = 0.0, label: str = "", **kwargs):
        super().__init__(**kwargs)
        self.started = time.monotonic()
        self.label = label
        self.stall_s = stall_s
        self._stall_logged = False
        container = self.tensor_part_container
        # Each peer's slice is the run of parts assigned to it, in group order (hivemind's
        # TensorPartContainer splits the flat buffer in that order).
        self.slice_sizes = [sum(int(part.numel()) for part, _ in parts) for parts in container._input_parts_by_peer]
        self.fell_back: dict[int, int] = {}
        original = container.register_failed_reducer

        def register_failed_reducer(peer_index: int) -> None:
            before = container.failed_size
            original(peer_index)
            self.fell_back[peer_index] = self.fell_back.get(peer_index, 0) + container.failed_size - before

        container.register_failed_reducer = register_failed_reducer

    async def _maybe_stall(self, where: str) -> None:
        if self.stall_s <= 0:
            return
        if not self._stall_logged:
            self._stall_logged = True
            logger.warning("test fault: stalling this peer mid-round %s (while %s) for %.0fs",
                           self.label, where, self.stall_s)
        await asyncio.sleep(self.stall_s)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
            await self._maybe_stall("sending")

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        async for message in super()._accumulate_parts_streaming(stream, sender_index):
            yield message
            await self._maybe_stall("reducing")

    def telemetry(self) -> dict[str, Any]:
        """What this peer saw of the round: plain data, so it can cross the process boundary."""
        peers = [peer.to_base58() for peer in self.ordered_peer_ids]
        me = self.ordered_peer_ids.index(self.peer_id)
        reducer_view: Optional[dict[str, Any]] = None
        if self.slice_sizes[me] > 0:
            reducer = self.tensor_part_reducer
            part_sizes = [math.prod(shape) for shape in reducer.part_shapes]
            cumulative = [0]
            for size in part_sizes:
                cumulative.append(cumulative[-1] + size)
            received = {}
            for index, sender in enumerate(self.sender_peer_ids):
                failed_after = reducer.sender_failed_after[index]
                parts = reducer.num_parts_received[index]
                if failed_after != float("inf"):
                    parts = min(parts, int(failed_after))
                received[sender.to_base58()] = cumulative[min(parts, len(part_sizes))]
            reducer_view = {
                "slice": self.slice_sizes[me],
                "received": received,
                "banned": sorted(peer.to_base58() for peer in self.banned_senders),
            }
        return {
            "peers": peers,
            "modes": [AveragingMode(mode).name.lower() for mode in self.modes],
            "slice_sizes": list(self.slice_sizes),
            "fell_back": {peers[index]: count for index, count in self.fell_back.items() if count},
            "reducer": reducer_view,
            "allreduce_s": time.monotonic() - self.started,
        }
