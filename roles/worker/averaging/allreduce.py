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
(roles/worker/health/preemption.py), after a part was sent and after this peer's slice was
reduced (tests/support/faults.py wraps the same two moments to stall a peer mid-round).
"""

from __future__ import annotations

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

    def __init__(self, *, label: str = "", screen: Optional[PartScreen] = None,
                 preempt: Optional[PreemptSwitch] = None, **kwargs):
        self.fell_back: dict[int, int] = {}
        self.screen = screen
        self.preempt = preempt
        super().__init__(**kwargs)
        self.started = time.monotonic()
        self.label = label
        self.sizes = self.slice_sizes()

    def screen_parts(self, part_index: int, held: Sequence[HeldPart]) -> dict[int, str]:
        return {} if self.screen is None else self.screen(held, self.local_sender)

    def on_reducer_failed(self, peer_index: int, values: int) -> None:
        self.fell_back[peer_index] = self.fell_back.get(peer_index, 0) + values

    async def after_part_sent(self) -> None:
        if self.preempt is not None:
            self.preempt.fire_if(PreemptMoment.CHUNK_SEND)

    async def after_part_reduced(self) -> None:
        if self.preempt is not None:
            self.preempt.fire_if(PreemptMoment.REDUCED_SEND)

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
