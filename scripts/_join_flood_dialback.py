#!/usr/bin/env python
"""A join flood at the authorizer with the reachability check on (scripts/bench_authorizer.py
turns it off): FLOOD well-formed joins from 127.0.0.1 announcing an address that accepts TCP and
never speaks, so each dial-back waits its full timeout, on CONNS cheap keep-alive connections with
a 10 s deadline per request; meanwhile an honest join from 127.0.0.2 every 2 s (its announced
address refuses at once). Prints the flood's outcomes per 10 s and each honest join's latency.

    FLOOD=1500 CONNS=300 LIMIT_S=100 .venv/bin/python scripts/_join_flood_dialback.py

Before dial-backs were bounded: 445 flood requests timed out, no 429 for the first 80 s, and an
honest join waited 25.8 s; after: 1,484 of 1,500 answered 429 within 10 s, honest joins 0.01 s.
"""
import asyncio
import collections
import json
import os
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx  # noqa: E402
from authorizer.testing import AuthorizerProcess, KeepAliveClient, NodeKey  # noqa: E402

FLOOD, CONNS = int(os.environ.get("FLOOD", "2000")), int(os.environ.get("CONNS", "100"))
EXTRA = os.environ.get("EXTRA", "").split()

async def main():
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(4096)  # accepts nothing: the kernel completes the handshake, nobody speaks
    work = tempfile.mkdtemp(prefix="joinflood-")
    proc = AuthorizerProcess(["--run-config", "tiny", "--port", "0", "--data-dir", work, "--admin-token",
                              "flood-admin-token-0123456789", "--stage-capacity", "100000", "--trainer-capacity",
                              "100000", "--log-level", "warning", "--no-monitor", *EXTRA],
                             log_path=os.path.join(work, "a.log")).start()
    try:
        bodies = [json.dumps(NodeKey.generate().join_body(
            run_id=None, role="trainer", account_token=f"junk-{i}",
            announce_maddrs=[f"/ip4/127.0.0.1/tcp/{hole.getsockname()[1]}"])).encode() for i in range(FLOOD)]
        outcomes = collections.defaultdict(collections.Counter)
        t0 = time.monotonic()
        queue = list(reversed(bodies))

        async def conn():
            client = await KeepAliveClient(proc.url).connect()
            while queue:
                body = queue.pop()
                try:
                    status, _, _ = await asyncio.wait_for(client.request("POST", "/v1/join", body), 10)
                    what = str(status)
                except Exception as exc:
                    what = type(exc).__name__
                    await client.close()
                    try:
                        client = await asyncio.wait_for(KeepAliveClient(proc.url).connect(), 10)
                    except Exception as exc2:
                        outcomes[int((time.monotonic() - t0) // 10) * 10]["reconnect_" + type(exc2).__name__] += 1
                        return
                outcomes[int((time.monotonic() - t0) // 10) * 10][what] += 1
            await client.close()

        honest = []
        async def honest_joins():
            async with httpx.AsyncClient(base_url=proc.url, timeout=60.0,
                                         transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")) as c:
                n = 0
                while queue or n < 3:
                    body = NodeKey.generate().join_body(run_id=None, role="trainer", account_token=f"honest-{n}",
                                                        announce_maddrs=["/ip4/127.0.0.1/tcp/1"])  # refused at once
                    start = time.monotonic()
                    try:
                        r = await c.post("/v1/join", json=body)
                        honest.append((round(start - t0), round(time.monotonic() - start, 2), r.status_code))
                    except Exception as exc:
                        honest.append((round(start - t0), round(time.monotonic() - start, 2), type(exc).__name__))
                    print("honest", honest[-1], flush=True)
                    n += 1
                    await asyncio.sleep(2.0)

        async def report():
            while queue:
                await asyncio.sleep(10)
                print(f"{time.monotonic() - t0:.0f}s", {k: dict(v) for k, v in sorted(outcomes.items())}, flush=True)

        print(f"authorizer {proc.url}; flooding {FLOOD} joins on {CONNS} connections", flush=True)
        try:
            await asyncio.wait_for(asyncio.gather(*(conn() for _ in range(CONNS)), honest_joins(), report()),
                                   float(os.environ.get("LIMIT_S", "240")))
        except asyncio.TimeoutError:
            print("scenario timed out", flush=True)
        print("flood outcomes by 10 s:", {k: dict(v) for k, v in sorted(outcomes.items())})
        print("honest (t, latency_s, status):", honest)
    finally:
        proc.stop()
        hole.close()

if __name__ == "__main__":
    asyncio.run(main())
