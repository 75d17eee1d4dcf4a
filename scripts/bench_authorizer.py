#!/usr/bin/env python
"""Benchmark the authorizer's join path: joins/s and latency percentiles, SQLite and PostgreSQL.

Starts a real authorizer process (`agora-node --role authorizer`) per backend, and for PostgreSQL a
private PostgreSQL 15 with its default durability (fsync on), as authorizer.testing does for the
tests. Capacity is set high enough that every join is queued and admitted. Joins go over real
HTTP on 127.0.0.1 from a minimal keep-alive HTTP/1.1 client (httpx costs more CPU per request
than the server does, and both share this machine), `--concurrency` requests in flight at a time.
Reachability dial-back is off: its cost is the network's, not the authorizer's.

Prints ONE JSON object on stdout; progress goes to stderr.

    .venv/bin/python scripts/bench_authorizer.py [--joins 3000] [--concurrency 32] [--backends sqlite,postgres]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from authorizer.testing import AuthorizerProcess, NodeKey, PostgresServer, postgres_missing  # noqa: E402

ADMIN_TOKEN = "bench-admin-token-0123456789"
EXTRA = os.environ.get("AGORA_BENCH_EXTRA", "").split()
"""Extra authorizer flags, e.g. AGORA_BENCH_EXTRA='--sqlite-synchronous normal'."""


class KeepAliveClient:
    """One HTTP/1.1 keep-alive connection: POST a JSON body, read status and body. Just enough
    protocol for this server's answers (Content-Length framed)."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port

    async def connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)
        status_line = await self.reader.readline()
        length = 0
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        payload = await self.reader.readexactly(length)
        return int(status_line.split(b" ", 2)[1]), payload

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except Exception:
            pass


async def _drive(url: str, bodies: list[bytes], concurrency: int) -> tuple[float, list[float], int]:
    host, port = url.removeprefix("http://").split(":")
    clients = [KeepAliveClient(host, int(port)) for _ in range(concurrency)]
    await asyncio.gather(*(c.connect() for c in clients))
    latencies: list[float] = []
    failures = 0
    next_index = 0

    async def worker(client: KeepAliveClient) -> None:
        nonlocal next_index, failures
        while next_index < len(bodies):
            body = bodies[next_index]
            next_index += 1
            start = time.perf_counter()
            status, payload = await client.request("POST", "/v1/join", body)
            latencies.append(time.perf_counter() - start)
            if status != 200 or json.loads(payload)["status"] not in ("queued", "admitted"):
                failures += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in clients))
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(c.close() for c in clients))
    return elapsed, latencies, failures


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _wait_admitted(url: str, expected: int, timeout_s: float) -> float:
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        run = httpx.get(f"{url}/v1/run", timeout=30).json()
        if sum(s["admitted"] for s in run["stages"]) >= expected:
            return time.perf_counter() - start
        time.sleep(0.05)
    raise RuntimeError(f"not all {expected} joins were admitted within {timeout_s}s")


def bench_backend(name: str, db: str, workdir: str, joins: int, concurrency: int, warmup: int,
                  light_concurrency: int) -> dict:
    light = max(200, joins // 5)
    total = joins + warmup + light
    print(f"[{name}] generating {total} node identities", file=sys.stderr, flush=True)
    keys = [NodeKey.generate() for _ in range(total)]
    bodies = [json.dumps(k.join_body(account_token=f"account-{i}")).encode() for i, k in enumerate(keys)]
    capacity = str(total)
    process = AuthorizerProcess(
        ["--run-config", "tiny", "--port", "0", "--data-dir", os.path.join(workdir, name), "--db", db,
         "--admin-token", ADMIN_TOKEN, "--checks", "capability,integrity",
         "--stage-capacity", capacity, "--join-rate", "100000", "--join-burst", "1000", "--log-level", "warning", *EXTRA],
        log_path=os.path.join(workdir, f"{name}.log"),
    ).start()
    try:
        asyncio.run(_drive(process.url, bodies[:warmup], concurrency))
        _wait_admitted(process.url, warmup, 120)
        print(f"[{name}] {joins} joins, {concurrency} in flight", file=sys.stderr, flush=True)
        server = psutil.Process(process.proc.pid)
        cpu_before = sum(server.cpu_times()[:2])
        elapsed, latencies, failures = asyncio.run(_drive(process.url, bodies[warmup:], concurrency))
        drain_s = _wait_admitted(process.url, joins + warmup, 120)
        cpu_ms = (sum(server.cpu_times()[:2]) - cpu_before) * 1000 / joins
        print(f"[{name}] {light} joins, {light_concurrency} in flight", file=sys.stderr, flush=True)
        light_elapsed, light_latencies, light_failures = asyncio.run(
            _drive(process.url, bodies[joins + warmup:], light_concurrency))
        result = {
            "joins_per_s": round(joins / elapsed, 1),
            "p50_ms": round(_percentile(latencies, 0.50) * 1000, 2),
            "p99_ms": round(_percentile(latencies, 0.99) * 1000, 2),
            "max_ms": round(max(latencies) * 1000, 2),
            "joins": joins,
            "concurrency": concurrency,
            "failed": failures,
            "all_admitted_after_s": round(drain_s, 2),
            "server_cpu_ms_per_join": round(cpu_ms, 3),  # join + admission + credential, all threads
            "light_load": {
                "concurrency": light_concurrency,
                "joins_per_s": round(light / light_elapsed, 1),
                "p50_ms": round(_percentile(light_latencies, 0.50) * 1000, 2),
                "p99_ms": round(_percentile(light_latencies, 0.99) * 1000, 2),
                "failed": light_failures,
            },
        }
        print(f"[{name}] {result}", file=sys.stderr, flush=True)
        return result
    finally:
        code = process.stop()
        if code != 0:
            print(f"[{name}] authorizer exited {code}:\n{process.log_tail()}", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--joins", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (saturation)")
    parser.add_argument("--light-concurrency", type=int, default=4, help="requests in flight (latency)")
    parser.add_argument("--backends", default="sqlite,postgres")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="agora-bench-authorizer-") as workdir:
        if "sqlite" in backends:
            out["sqlite"] = bench_backend("sqlite", f"sqlite:///{workdir}/bench.db", workdir, args.joins,
                                          args.concurrency, args.warmup, args.light_concurrency)
            out["sqlite"]["synchronous"] = "full"
        if "postgres" in backends:
            missing = postgres_missing()
            if missing:
                out["postgres"] = {"skipped": missing}
            else:
                with PostgresServer(fsync=True) as pg:
                    out["postgres"] = bench_backend("postgres", pg.create_database("bench"), workdir, args.joins,
                                                    args.concurrency, args.warmup, args.light_concurrency)
                    out["postgres"]["fsync"] = True
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _auth_overhead import measure_auth_overhead

        out.update(measure_auth_overhead(workdir, quick=args.joins < 1000))
    out["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
