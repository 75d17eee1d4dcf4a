"""The front door under a flood, against a real authorizer process over real HTTP, on SQLite and on
PostgreSQL 15, with the default limits: 2,000 junk joins in 10 s from one address are answered 429
past the address's burst, the database grows by a bounded number of rows however many joins come,
and admitted nodes behind the same address keep renewing throughout. The flood is sent by a raw
keep-alive client (authorizer.testing.KeepAliveClient): httpx would spend the two cores itself."""

from __future__ import annotations

import asyncio
import collections
import json

import httpx
import pytest

from authorizer.config import AuthorizerConfig
from authorizer.testing import KeepAliveClient, NodeKey, paced_requests, row_counts, steady_renewals
from tests.authorizer.helpers import ADMIN
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(120)

FLOOD_JOINS, FLOOD_S = 2000, 10.0
HONEST_NODES, RENEW_EVERY_S = 4, 0.25
NEIGHBOUR = "198.51.100.23"


def default(name: str):
    return AuthorizerConfig.model_fields[name].default


def admitted_nodes(http: httpx.Client, n: int) -> list[NodeKey]:
    keys = [NodeKey.generate() for _ in range(n)]
    tickets = [http.post("/v1/join", json=k.join_body(role="trainer")).json() for k in keys]
    for ticket in tickets:
        poll_until(lambda: http.get(f"/v1/join/{ticket['ticket']}").json()["status"] == "admitted", 15, "admission",
                   period_s=0.2)
    return keys


async def flood_and_renew(url: str, junk: list[bytes], honest: list[NodeKey]):
    """The junk joins spread over FLOOD_S while every honest node renews every RENEW_EVERY_S from
    the same address, and one join from another address (X-Forwarded-For, which the authorizer
    trusts from 127.0.0.1) halfway through."""

    async def neighbour_joins() -> tuple[int, dict, bytes]:
        await asyncio.sleep(FLOOD_S / 2)  # the load's shape: halfway through the flood
        client = await KeepAliveClient(url, {"X-Forwarded-For": NEIGHBOUR}).connect()
        try:
            return await client.request("POST", "/v1/join", json.dumps(
                NodeKey.generate().join_body(role="trainer")).encode())
        finally:
            await client.close()

    return await asyncio.gather(paced_requests(url, "POST", "/v1/join", junk, FLOOD_S),
                                steady_renewals(url, honest, "tiny", RENEW_EVERY_S, FLOOD_S), neighbour_joins())


def test_a_join_flood_is_refused_bounded_and_does_not_starve_renewals(start_authorizer, db_url):
    authorizer = start_authorizer("--checks", "capability,integrity", "--join-rate", "1000", db=db_url)
    # junk: well-formed joins from many identities that fail the hardware floors (the cheapest
    # joins to send that a store used to keep, one row each); a few hundred keys, cycled
    keys = [NodeKey.generate() for _ in range(200)]
    junk = [json.dumps(keys[i % len(keys)].join_body(run_id=None, vram_bytes=0, ram_bytes=1 << 20,
                                                      account_token=f"junk-{i}")).encode()
            for i in range(FLOOD_JOINS)]
    with httpx.Client(base_url=authorizer.url, timeout=30) as http:
        honest = admitted_nodes(http, HONEST_NODES)
        before = row_counts(db_url)
        answers, renewals, (neighbour_status, _, neighbour_body) = asyncio.run(
            flood_and_renew(authorizer.url, junk, honest))
        counted = http.get("/v1/admin/rejections", params={"limit": 1000}, headers=ADMIN).json()["rejections"]
        stored = http.get("/v1/admin/participants", params={"status": "rejected", "limit": 1000},
                          headers=ADMIN).json()["participants"]
    after = row_counts(db_url)

    # 1. past its burst the address gets 429 with Retry-After, in the typed error shape
    flood = collections.Counter(status for status, _, _ in answers)
    assert set(flood) == {200, 429}, flood
    allowed = default("source_join_burst") + default("source_join_rate_per_s") * FLOOD_S * 1.5
    assert FLOOD_JOINS - allowed <= flood[429] <= FLOOD_JOINS - default("source_join_burst") + 1, flood
    limited = [(headers, body) for status, headers, body in answers if status == 429]
    assert all(headers["retry-after"].isdigit() and int(headers["retry-after"]) >= 1 for headers, _ in limited)
    error = json.loads(limited[0][1])["error"]
    assert error["code"] == "rate_limited" and "127.0.0.1" in error["message"] and "Retry-After" in error["message"]

    # 2. every flood join is accounted for: answered 429 or rejected, stored or counted; rows bounded
    assert sum(c["refused"] for c in counted if c["source"] == "127.0.0.1") + len(stored) == FLOOD_JOINS
    assert sum(c["refused"] for c in counted if c["reason"] == "rate_limited") == flood[429]
    assert len(stored) <= default("rejection_detail_burst") + default("rejection_detail_rate_per_s") * 60
    renewed = sum(1 for status, _ in renewals if status == 200)
    grown = {name: after[name] - before[name] for name in after}
    # each renewal issues a credential, and so does the neighbour's admission: neither is the flood
    assert renewed <= grown["credentials"] <= renewed + 1
    assert grown["participants"] == len(stored) + 1  # the neighbour's join
    assert grown["rejection_counts"] <= 2 * 3  # (rate_limited, insufficient_ram) x the minutes the flood spans
    assert sum(grown.values()) - grown["credentials"] <= default("rejection_detail_burst") + 8, grown

    # 3. the admitted nodes behind the same address renewed throughout, and another address joined
    assert len(renewals) == HONEST_NODES * int(FLOOD_S / RENEW_EVERY_S)
    assert all(status == 200 for status, _ in renewals), collections.Counter(s for s, _ in renewals)
    assert neighbour_status == 200 and json.loads(neighbour_body)["status"] in ("queued", "admitted")
