#!/usr/bin/env python
"""Benchmark the authorizer's join path: joins/s and latency percentiles, SQLite and PostgreSQL.

Starts a real authorizer process (`agora-node --role authorizer`) per backend, and for PostgreSQL a
private PostgreSQL 15 with its default durability (fsync on), as authorizer.testing does for the
tests. Capacity is set high enough that every join is queued and admitted. Joins go over real
HTTP on 127.0.0.1 from a minimal keep-alive HTTP/1.1 client (httpx costs more CPU per request
than the server does, and both share this machine), `--concurrency` requests in flight at a time.
Reachability dial-back is off: its cost is the network's, not the authorizer's. Every join comes
from 127.0.0.1, so the throughput runs lift the per-address join limit.

The flood figure (`flood` per backend) runs a second authorizer with the default rate limits:
admitted nodes renew steadily, first alone and then while one address sends 2,000 junk joins in
10 s (well-formed joins that fail the hardware floors). It reports the renewals' p50/p99 in both
phases and their ratio, how many flood joins were answered 429, and the rows the database gained
(apart from the credentials the renewals themselves issue). `--flood-unlimited` adds the same
figure with the join limit lifted and every rejection stored (`flood_unlimited`, the authorizer
as it was before the limits): what they buy.

Prints ONE JSON object on stdout; progress goes to stderr.

    .venv/bin/python scripts/bench_authorizer.py [--joins 3000] [--concurrency 32] [--backends sqlite,postgres]
        [--flood-joins 2000] [--flood-s 10] [--flood-unlimited]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import tempfile
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from authorizer.testing import (  # noqa: E402
    AuthorizerProcess, KeepAliveClient, NodeKey, PostgresServer, paced_requests, postgres_missing, row_counts,
    steady_renewals,
)

ADMIN_TOKEN = "bench-admin-token-0123456789"
EXTRA = os.environ.get("AGORA_BENCH_EXTRA", "").split()
"""Extra authorizer flags, e.g. AGORA_BENCH_EXTRA='--sqlite-synchronous normal'."""
UNLIMITED = ["--source-join-rate", "1000000", "--source-join-burst", "1000000"]
"""The throughput runs send every join from one address; they measure the store, not the limits."""
NO_FRONT_DOOR = [*UNLIMITED, "--rejection-detail-rate", "1000000", "--rejection-detail-burst", "1000000"]
"""No join limit and every rejection stored as a ticket: the authorizer as it was before the limits."""
HONEST_NODES, RENEW_EVERY_S = 8, 0.25
"""The flood figure's honest side: admitted nodes renewing steadily (32 renewals a second in all),
as long without the flood as with it."""


async def _drive(url: str, bodies: list[bytes], concurrency: int) -> tuple[float, list[float], int]:
    clients = [KeepAliveClient(url) for _ in range(concurrency)]
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
            status, _, payload = await client.request("POST", "/v1/join", body)
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
         "--stage-capacity", capacity, "--join-rate", "100000", "--join-burst", "1000", "--log-level", "warning",
         *UNLIMITED, *EXTRA],
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


def _admit(url: str, keys: list[NodeKey]) -> None:
    import httpx

    with httpx.Client(base_url=url, timeout=30) as http:
        tickets = [http.post("/v1/join", json=k.join_body(role="trainer")).json()["ticket"] for k in keys]
        deadline = time.monotonic() + 60
        while any(http.get(f"/v1/join/{t}").json()["status"] != "admitted" for t in tickets):
            if time.monotonic() > deadline:
                raise RuntimeError("the flood figure's honest nodes were not admitted within 60 s")
            time.sleep(0.1)


def _latencies(renewals: list[tuple[int, float]]) -> dict:
    seconds = [s for status, s in renewals if status == 200]
    return {
        "renewals": len(renewals),
        "failed": sum(1 for status, _ in renewals if status != 200),
        "p50_ms": round(_percentile(seconds, 0.50) * 1000, 2) if seconds else None,
        "p99_ms": round(_percentile(seconds, 0.99) * 1000, 2) if seconds else None,
    }


def bench_flood(name: str, db: str, workdir: str, flood_joins: int, flood_s: float, *, limits: list[str]) -> dict:
    """Honest renewal latency without and with a join flood from one address, under `limits`
    (no flags: the defaults)."""
    print(f"[{name}] {HONEST_NODES} nodes renewing; {flood_joins} junk joins in {flood_s:g} s {' '.join(limits)}",
          file=sys.stderr, flush=True)
    honest = [NodeKey.generate() for _ in range(HONEST_NODES)]
    keys = [NodeKey.generate() for _ in range(200)]  # junk identities, cycled: each join fails the floors
    junk = [json.dumps(keys[i % len(keys)].join_body(run_id=None, vram_bytes=0, ram_bytes=1 << 20,
                                                      account_token=f"junk-{i}")).encode() for i in range(flood_joins)]
    slug = "-".join(name.replace(",", "").split())
    process = AuthorizerProcess(
        ["--run-config", "tiny", "--port", "0", "--data-dir", os.path.join(workdir, slug), "--db", db,
         "--admin-token", ADMIN_TOKEN, "--checks", "capability,integrity", "--join-rate", "1000",
         "--log-level", "warning", *limits, *EXTRA],
        log_path=os.path.join(workdir, f"{slug}.log"),
    ).start()
    try:
        _admit(process.url, honest)
        quiet = asyncio.run(steady_renewals(process.url, honest, "tiny", RENEW_EVERY_S, flood_s))
        before = row_counts(db)

        async def flooded():
            return await asyncio.gather(paced_requests(process.url, "POST", "/v1/join", junk, flood_s),
                                        steady_renewals(process.url, honest, "tiny", RENEW_EVERY_S, flood_s))

        started = time.perf_counter()
        answers, during = asyncio.run(flooded())
        elapsed = time.perf_counter() - started
        import httpx

        httpx.get(f"{process.url}/v1/admin/rejections", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
                  timeout=30).raise_for_status()  # stores the counts still in memory
        grown = {table: n - before[table] for table, n in row_counts(db).items()}
        statuses = collections.Counter(status for status, _, _ in answers)
        without, with_flood = _latencies(quiet), _latencies(during)
        result = {
            "flood_joins": flood_joins,
            "flood_s": round(elapsed, 2),
            "flood_429": statuses.get(429, 0),
            "flood_answered_200": statuses.get(200, 0),
            "rows_written": sum(n for table, n in grown.items() if table != "credentials"),
            "rows_written_by_table": {table: n for table, n in grown.items() if n},
            "renewal_without_flood": without,
            "renewal_during_flood": with_flood,
            "renewal_p99_ratio": (round(with_flood["p99_ms"] / without["p99_ms"], 2)
                                  if with_flood["p99_ms"] and without["p99_ms"] else None),
            "honest_nodes": HONEST_NODES,
            "renew_every_s": RENEW_EVERY_S,
        }
        print(f"[{name}] {result}", file=sys.stderr, flush=True)
        return result
    finally:
        code = process.stop()
        if code != 0:
            print(f"[{name}] authorizer exited {code}:\n{process.log_tail()}", file=sys.stderr)


def bench_floods(name: str, new_db, workdir: str, args) -> dict:
    """`flood` with the default limits, and `flood_unlimited` if asked; `new_db(name)` gives a fresh --db."""
    out = {"flood": bench_flood(f"{name} flood", new_db("flood"), workdir, args.flood_joins, args.flood_s, limits=[])}
    if args.flood_unlimited:
        out["flood_unlimited"] = bench_flood(f"{name} flood, unlimited", new_db("flood_unlimited"), workdir,
                                             args.flood_joins, args.flood_s, limits=NO_FRONT_DOOR)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--joins", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight (saturation)")
    parser.add_argument("--light-concurrency", type=int, default=4, help="requests in flight (latency)")
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument("--flood-joins", type=int, default=2000, help="junk joins from one address (0: no flood figure)")
    parser.add_argument("--flood-s", type=float, default=10.0, help="seconds the flood is spread over")
    parser.add_argument("--flood-unlimited", action="store_true",
                        help="also run the flood with no join limit and every rejection stored (flood_unlimited)")
    args = parser.parse_args()
    backends = [b for b in args.backends.split(",") if b]
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="agora-bench-authorizer-") as workdir:
        if "sqlite" in backends:
            out["sqlite"] = bench_backend("sqlite", f"sqlite:///{workdir}/bench.db", workdir, args.joins,
                                          args.concurrency, args.warmup, args.light_concurrency)
            out["sqlite"]["synchronous"] = "full"
            if args.flood_joins:
                out["sqlite"].update(bench_floods("sqlite", lambda n: f"sqlite:///{workdir}/{n}.db", workdir, args))
        if "postgres" in backends:
            missing = postgres_missing()
            if missing:
                out["postgres"] = {"skipped": missing}
            else:
                with PostgresServer(fsync=True) as pg:
                    out["postgres"] = bench_backend("postgres", pg.create_database("bench"), workdir, args.joins,
                                                    args.concurrency, args.warmup, args.light_concurrency)
                    out["postgres"]["fsync"] = True
                    if args.flood_joins:
                        out["postgres"].update(bench_floods("postgres", pg.create_database, workdir, args))
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from _auth_overhead import measure_auth_overhead

        out.update(measure_auth_overhead(workdir, quick=args.joins < 1000))
    out["machine"] = {"cpus": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
