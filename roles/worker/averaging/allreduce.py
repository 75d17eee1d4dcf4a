"""hivemind's butterfly all-reduce [report 3.3.1.8], instrumented so partial rounds are seen.

hivemind finishes a round even when peers fail: a reducer that stops answering has its slice
filled with zeros (the peer keeps its local values there), a sender that misses its timeout is
banned and averaged without, and the caller learns none of it. `InstrumentedRunner`
records, inside the averager process, exactly what the report measures [report 5.7.1.1]:

- averaging success: which reducers' slices came back, and how many values fell back;
- reduce success: for this peer's own slice, how much of it each sender delivered before it
  finished or was banned.

As a reducer it screens each part index's parts before averaging them (screening.py): a sender
whose part is not finite, carries an absurd weight or has a norm far from ours is left out of the
round from that part on, and `telemetry()` names it with the reason.

It also hosts the operator's preemption moments `chunk_send` and `reduced_send`
(roles/worker/health/preemption.py), and the two faults tests inject: stalling this peer mid-round, so a test can kill it
while its peers wait for its next chunk, and poisoning the parts it sends to other reducers (NaN
or a million times too large), so a test can watch them leave it out.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional, Sequence

from protocol.control_orders import PreemptMoment
from protocol.hivemind_adapter import AdaptedRunner, HeldPart
from roles.worker.averaging.screening import PartScreen
from roles.worker.health.preemption import PreemptSwitch

logger = logging.getLogger(__name__)


class InstrumentedRunner(AdaptedRunner):
    """An all-reduce runner that keeps count of what failed, readable through `telemetry()`."""

    def __init__(self, *, stall_s: float = 0.0, label: str = "", screen: Optional[PartScreen] = None,
                 poison: str = "", preempt: Optional[PreemptSwitch] = None, **kwargs):
        self.fell_back: dict[int, int] = {}
        self.screen = screen
        self.preempt = preempt
        super().__init__(**kwargs)
        self.started = time.monotonic()
        self.label = label
        self.stall_s = stall_s
        self._stall_logged = False
        self.sizes = self.slice_sizes()
        if poison:
            logger.warning("test fault: sending %s parts to the other reducers in %s", poison, label)
            self.map_outgoing_parts(POISONS[poison])

    def screen_parts(self, part_index: int, held: Sequence[HeldPart]) -> dict[int, str]:
        return {} if self.screen is None else self.screen(held, self.local_sender)

    def on_reducer_failed(self, peer_index: int, values: int) -> None:
        self.fell_back[peer_index] = self.fell_back.get(peer_index, 0) + values

    async def _maybe_stall(self, where: str) -> None:
        if self.stall_s <= 0:
            return
        if not self._stall_logged:
            self._stall_logged = True
            logger.warning("test fault: stalling this peer mid-round %s (while %s) for %.0fs",
                           self.label, where, self.stall_s)
        await asyncio.sleep(self.stall_s)

    async def after_part_sent(self) -> None:
        if self.preempt is not None:
            self.preempt.fire_if(PreemptMoment.CHUNK_SEND)
        await self._maybe_stall("sending")

    async def after_part_reduced(self) -> None:
        if self.preempt is not None:
            self.preempt.fire_if(PreemptMoment.REDUCED_SEND)
        await self._maybe_stall("reducing")

    def telemetry(self) -> dict[str, Any]:
        """What this peer saw of the round: plain data, so it can cross the process boundary."""
        peers = self.peers
        reducer_view: Optional[dict[str, Any]] = None
        if self.sizes[self.index] > 0:
            reducer_view = {"slice": self.sizes[self.index], "received": self.values_received(),
                            "banned": self.banned(), "rejected": self.rejected()}
        return {
            "peers": peers,
            "index": self.index,
            "modes": self.mode_names(),
            "slice_sizes": list(self.sizes),
            "fell_back": {peers[index]: count for index, count in self.fell_back.items() if count},
            "reducer": reducer_view,
            "allreduce_s": time.monotonic() - self.started,
        }


POISONS = {
    "nan": lambda part: part.fill_(float("nan")),
    "huge": lambda part: part.mul_(1e6).add_(1e3),
}
"""Test faults (AGORA_TEST_AVERAGING_POISON): what a poisoning sender sends instead of a part."""
