"""How a packet's delivery time is computed, and the kernel qdisc that shapes a host's upload.

A packet from a to b goes through three stages, as on a residential path:

1. a's uplink: a tbf qdisc on a's TUN device, in a's namespace (kernel; `upload_qdisc`). It gives
   the sender's TCP local backpressure (TCP small queues), as a modem's buffer does, and costs the
   switch nothing.
2. propagation: d_a + d_b, held in the switch's heap of timed deliveries; packets of one (a, b)
   pair never overtake each other, even when a link's delay drops mid-run (`PairClock`).
3. b's downlink: a drop-tail queue of `queue_ms` at b's download rate, simulated in the switch
   (`Downlink`): the packet leaves when the link has finished the packets before it.

All times are time.monotonic() seconds.
"""

from __future__ import annotations

from typing import Optional

QUEUE_MS = 100.0
"""Buffer of a shaped link, in milliseconds at its rate (upload tbf latency and download queue).
Residential links buffer 50-500 ms; 100 ms lets one TCP flow fill a link at up to ~250 ms RTT."""

MIN_BURST_BYTES = 65536 + 4096
"""tbf's bucket must hold the largest packet the switch moves (a 64 KiB segmentation-offload
packet plus headers): a smaller bucket makes tbf split every such packet into MSS-sized ones."""


class PairClock:
    """Keeps each (source, destination) pair's packets in order: a packet is never scheduled
    before the previous packet of its pair."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: dict[tuple[int, int], float] = {}

    def schedule(self, src: int, dst: int, now: float, delay_s: float) -> float:
        key = (src, dst)
        at = now + delay_s
        last = self.last.get(key, 0.0)
        if at < last:
            at = last
        self.last[key] = at
        return at


class Downlink:
    """A host's download link as a virtual drop-tail queue: `free_at` is when the link finishes
    the packets already accepted. O(1) per packet; the caller holds packets until `depart`."""

    __slots__ = ("free_at",)

    def __init__(self) -> None:
        self.free_at = 0.0

    def admit(self, arrival: float, size_bytes: int, rate_bps: float, queue_s: float) -> Optional[float]:
        """When a packet arriving at `arrival` has been fully received by the host, or None if the
        queue ahead of it is longer than `queue_s` (dropped)."""
        start = arrival if arrival > self.free_at else self.free_at
        if start - arrival > queue_s:
            return None
        self.free_at = start + size_bytes * 8.0 / rate_bps
        return self.free_at


def upload_qdisc(device: str, up_mbit: Optional[float], queue_ms: float = QUEUE_MS) -> list[list[str]]:
    """The `tc` argv lists that make `device`'s egress match `up_mbit` (None = unshaped)."""
    if up_mbit is None:
        # "del" fails when there is nothing to delete; the caller ignores that failure
        return [["tc", "qdisc", "del", "dev", device, "root"]]
    rate_bps = up_mbit * 1e6
    burst = max(int(rate_bps / 8 * 0.004), MIN_BURST_BYTES)  # 4 ms at the rate, at least one big packet
    return [["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{int(rate_bps)}bit",
             "burst", str(burst), "latency", f"{queue_ms:g}ms"]]
