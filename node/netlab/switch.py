"""The lab's switch: one process that holds every host's TUN device and moves IPv4 packets
between them with each path's delay and each host's download rate (node/netlab/shaping.py).

Run as `python -m node.netlab.switch --parent-pid PID` by topology.Lab, which talks to it over
its stdin/stdout, one JSON object per line:

    first line in : {"hosts": [{"name", "netns" (path or null), "device", "address", "delay_s",
                                "down_bps" (or null), "queue_s"}], "vnet_hdr": true}
    first line out: {"ready": true} or {"error": "..."}
    then in       : {"op": "set", "host": INDEX, "delay_s": ..., "down_bps": ..., "queue_s": ...}
                    {"op": "counters"}
    and out       : {"ok": true} / {"counters": [{...} per host]}

It dies with its parent however the parent dies: stdin reaching EOF ends it, and a parent-death
signal covers a parent whose pipe a forked grandchild still holds open. It leaves nothing behind:
its TUN devices are not persistent and vanish with its fds.

Efficiency: the hosts' TUNs carry segmentation-offload packets of up to 64 KiB (kernel.open_tun),
so 200 Mbit/s is a few hundred reads a second; one epoll, one heap, no per-packet logging.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import os
import select
import signal
import sys
import time
from typing import Any

from node.netlab.kernel import VNET_HDR_LEN, open_tun, set_parent_death_signal
from node.netlab.shaping import Downlink, PairClock

READ_BURST = 64
"""Packets read from one TUN per wakeup, so that one busy host cannot starve the others."""
EARLY_S = 0.0005
"""Deliver this early rather than sleep again: epoll's timeout has millisecond resolution."""
MAX_PACKET = 65536 + VNET_HDR_LEN + 64

_COUNTERS = ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets", "drops_queue", "drops_unroutable",
             "drops_write", "drops_other")


def wire_size(packet: bytes, off: int, size: int) -> int:
    """The IP bytes a TCP segmentation-offload packet occupies on a link once split into its
    MSS-sized segments (each carries its own IP and TCP headers), as tbf counts them on upload."""
    gso_size = int.from_bytes(packet[4:6], sys.byteorder)  # virtio_net_hdr.gso_size, native order
    ihl = (packet[off] & 0x0F) * 4
    if gso_size == 0 or len(packet) < off + ihl + 13:
        return size
    headers = ihl + (packet[off + ihl + 12] >> 4) * 4
    segments = -(-(size - headers) // gso_size)
    return size + (segments - 1) * headers


class Switch:
    """The packet loop; every table is indexed by the host's position in the config."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.hosts = config["hosts"]
        self.offset = VNET_HDR_LEN if config.get("vnet_hdr", True) else 0
        self.fds: list[int] = []
        for host in self.hosts:
            self.fds.append(open_tun(host["device"], netns_path=host["netns"], vnet_hdr=bool(self.offset)))
        self.index_of_fd = {fd: i for i, fd in enumerate(self.fds)}
        self.index_of_addr = {bytes(int(x) for x in h["address"].split(".")): i for i, h in enumerate(self.hosts)}
        self.delay = [float(h["delay_s"]) for h in self.hosts]
        self.down_bps = [h.get("down_bps") for h in self.hosts]
        self.queue_s = [float(h.get("queue_s", 0.1)) for h in self.hosts]
        self.downlinks = [Downlink() for _ in self.hosts]
        self.pairs = PairClock()
        self.counters = [dict.fromkeys(_COUNTERS, 0) for _ in self.hosts]
        # (due, seq, destination, packet, wire bytes, paced): paced=False means the packet has only
        # been through propagation and still has to pass the destination's downlink queue
        self.heap: list[tuple[float, int, int, bytes, int, bool]] = []
        self.seq = itertools.count()

    def set_link(self, host: int, delay_s: float, down_bps: float | None, queue_s: float) -> None:
        self.delay[host] = float(delay_s)
        self.down_bps[host] = down_bps
        self.queue_s[host] = float(queue_s)

    def counters_report(self) -> list[dict[str, Any]]:
        return [{"host": h["name"], **c} for h, c in zip(self.hosts, self.counters)]

    def _receive(self, src: int, now: float) -> None:
        fd, off = self.fds[src], self.offset
        counters, index_of_addr, heap = self.counters, self.index_of_addr, self.heap
        delay, pairs, seq = self.delay, self.pairs, self.seq
        sent = counters[src]
        for _ in range(READ_BURST):
            try:
                packet = os.read(fd, MAX_PACKET)
            except BlockingIOError:
                return
            size = len(packet) - off
            if size < 20 or packet[off] >> 4 != 4:  # not IPv4 (the hosts have IPv6 disabled)
                sent["drops_other"] += 1
                continue
            if off and packet[1]:  # a segmentation-offload packet: count it as the segments it stands for
                size = wire_size(packet, off, size)
            sent["tx_bytes"] += size
            sent["tx_packets"] += 1
            dst = index_of_addr.get(packet[off + 16:off + 20])
            if dst is None or dst == src:
                sent["drops_unroutable"] += 1
                continue
            due = pairs.schedule(src, dst, now, delay[src] + delay[dst])
            heapq.heappush(heap, (due, next(seq), dst, packet, size, False))

    def _deliver_due(self, now: float) -> None:
        heap, counters = self.heap, self.counters
        horizon = now + EARLY_S
        while heap and heap[0][0] <= horizon:
            due, _, dst, packet, size, paced = heapq.heappop(heap)
            rate = self.down_bps[dst]
            if not paced and rate:
                depart = self.downlinks[dst].admit(due, size, rate, self.queue_s[dst])
                if depart is None:
                    counters[dst]["drops_queue"] += 1
                    continue
                if depart > horizon:
                    heapq.heappush(heap, (depart, next(self.seq), dst, packet, size, True))
                    continue
            try:
                os.write(self.fds[dst], packet)
            except OSError:  # the host's device is down or its queue is full
                counters[dst]["drops_write"] += 1
                continue
            received = counters[dst]
            received["rx_bytes"] += size
            received["rx_packets"] += 1

    def _control(self, line: bytes) -> dict[str, Any]:
        request = json.loads(line)
        if request.get("op") == "set":
            self.set_link(int(request["host"]), request["delay_s"], request.get("down_bps"), request["queue_s"])
            return {"ok": True}
        if request.get("op") == "counters":
            return {"counters": self.counters_report()}
        return {"error": f"unknown op {request.get('op')!r}"}

    def run(self, control_in: int, control_out) -> None:
        """Move packets until the control pipe closes."""
        poller = select.epoll()
        for fd in self.fds:
            poller.register(fd, select.EPOLLIN)
        poller.register(control_in, select.EPOLLIN)
        os.set_blocking(control_in, False)
        pending = b""
        index_of_fd, heap = self.index_of_fd, self.heap
        while True:
            timeout = max(heap[0][0] - time.monotonic(), 0.0) if heap else -1
            events = poller.poll(timeout)
            now = time.monotonic()
            for fd, _ in events:
                src = index_of_fd.get(fd)
                if src is not None:
                    self._receive(src, now)
                    continue
                try:
                    chunk = os.read(control_in, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    return
                pending += chunk
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    control_out.write(json.dumps(self._control(line)) + "\n")
                    control_out.flush()
            if heap:
                self._deliver_due(time.monotonic())


def _die_with_parent(parent_pid: int) -> None:
    # The death signal fires when the *thread* that started us exits; a thread of a live parent
    # leaves our parent pid unchanged, so only a changed parent pid means the parent is gone.
    def on_signal(signum, frame):
        if os.getppid() != parent_pid:
            os._exit(1)

    signal.signal(signal.SIGUSR1, on_signal)
    set_parent_death_signal(signal.SIGUSR1)
    if os.getppid() != parent_pid:
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the network lab's packet switch (started by node.netlab.topology.Lab)")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--lab-id", default="", help="only to tell this switch's processes apart in ps")
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the Lab stops us, not the terminal's Ctrl-C
    control_in = sys.stdin.fileno()
    with os.fdopen(control_in, "rb", buffering=0, closefd=False) as stdin:
        first = stdin.readline()
    if not first:
        return 1
    try:
        switch = Switch(json.loads(first))
    except (OSError, ValueError, KeyError) as exc:
        sys.stdout.write(json.dumps({"error": f"switch could not open the TUN devices: {exc}"}) + "\n")
        sys.stdout.flush()
        return 1
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    switch.run(control_in, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
