"""Link measurement between two lab hosts: `python -m node.netlab.probe serve|client`, run inside
the hosts' namespaces by Lab.measure.

serve  listens on --bind (port 0), prints `PROBE-READY <port>`, then answers connections whose
       first byte picks the test: b"P" echoes 64-byte messages (round trips), b"B" swallows a bulk
       stream and, once the client has shut its side down, replies with what it received.
client measures the median round trip of small messages on one TCP_NODELAY connection while the
       path is idle, then sends bulk for --seconds and prints one JSON object.

Throughput is taken at the receiver: `throughput_mbit` over the last two thirds of the transfer
(TCP's start-up excluded, as a long pipeline stream would see it), `throughput_total_mbit` over
all of it.
"""

from __future__ import annotations

import argparse
import bisect
import json
import socket
import statistics
import sys
import time

PING_SIZE = 64
PINGS = 12
CHUNK = 256 * 1024
STEADY_BINS = 8


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("peer closed mid-message")
        data += chunk
    return data


def _sink(conn: socket.socket) -> dict:
    samples: list[tuple[float, int]] = []  # (time, cumulative bytes), at most one per 5 ms
    total = 0
    first = last = None
    while True:
        chunk = conn.recv(1 << 20)
        if not chunk:
            break
        now = time.monotonic()
        if first is None:
            first = now
        total += len(chunk)
        last = now
        if not samples or now - samples[-1][0] >= 0.005:
            samples.append((now, total))
    if samples and samples[-1][0] < last:
        samples.append((last, total))
    if first is None or last <= first:
        return {"bytes": total, "throughput_mbit": 0.0, "throughput_total_mbit": 0.0}
    # the steady window: the last two thirds, split in STEADY_BINS bins; the median bin's rate.
    # A loss holds the data behind it in the receiver's reordering queue for a round trip and then
    # releases it at once: a plain bytes/seconds over the window over- or under-counts by up to
    # one RTT's worth of data depending on where the window's edges fall; the median does not.
    start = first + (last - first) / 3
    edges = [start + (last - start) * i / STEADY_BINS for i in range(STEADY_BINS + 1)]
    rates = []
    for lo, hi in zip(edges, edges[1:]):
        rates.append((_bytes_at(samples, hi) - _bytes_at(samples, lo)) * 8 / (hi - lo) / 1e6)
    return {"bytes": total, "seconds": last - first, "throughput_mbit": statistics.median(rates),
            "throughput_total_mbit": total * 8 / (last - first) / 1e6}


def _bytes_at(samples: list[tuple[float, int]], t: float) -> float:
    """Cumulative bytes received at time t, interpolated between samples."""
    i = bisect.bisect_left(samples, (t, -1))
    if i == 0:
        return 0.0 if t < samples[0][0] else samples[0][1]
    if i == len(samples):
        return samples[-1][1]
    (t0, b0), (t1, b1) = samples[i - 1], samples[i]
    return b0 + (b1 - b0) * (t - t0) / (t1 - t0)


def serve(bind: str) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((bind, 0))
    listener.listen(8)
    print(f"PROBE-READY {listener.getsockname()[1]}", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                mode = _recv_exactly(conn, 1)
                if mode == b"P":
                    while True:
                        conn.sendall(_recv_exactly(conn, PING_SIZE))
                elif mode == b"B":
                    conn.sendall(json.dumps(_sink(conn)).encode())
            except (ConnectionError, OSError):
                pass


def client(host: str, port: int, seconds: float, pings: int) -> dict:
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.sendall(b"P")
        message = b"x" * PING_SIZE
        rtts = []
        for _ in range(pings + 2):
            t = time.monotonic()
            conn.sendall(message)
            _recv_exactly(conn, PING_SIZE)
            rtts.append((time.monotonic() - t) * 1000)
        rtts = rtts[2:]  # the first round trips pay for the connection's warm-up
    with socket.create_connection((host, port), timeout=30) as conn:
        conn.sendall(b"B")
        payload = b"\0" * CHUNK
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            conn.sendall(payload)
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while True:
            chunk = conn.recv(65536)
            if not chunk:
                break
            reply += chunk
    return {"rtt_ms": statistics.median(rtts), "rtt_min_ms": min(rtts), "rtt_max_ms": max(rtts), **json.loads(reply)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="network lab link probe (run by Lab.measure)")
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--bind", required=True)
    c = sub.add_parser("client")
    c.add_argument("--host", required=True)
    c.add_argument("--port", type=int, required=True)
    c.add_argument("--seconds", type=float, default=3.0)
    c.add_argument("--pings", type=int, default=PINGS)
    args = parser.parse_args(argv)
    if args.command == "serve":
        serve(args.bind)
    else:
        print(json.dumps(client(args.host, args.port, args.seconds, args.pings)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
