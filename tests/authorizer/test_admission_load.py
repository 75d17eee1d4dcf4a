"""Admission under load, against real authorizer processes over real HTTP, on SQLite and on
PostgreSQL 15: capacity is exact under a burst of concurrent joins, across a kill -9 in the middle
of the burst, and even with two authorizer processes racing on one database."""

from __future__ import annotations

import asyncio
import collections

import httpx
import pytest

from tests.authorizer.helpers import ADMIN, client
from tests.support.polling import poll_until

CAPACITY = [7, 7, 6]  # 20 workers in all over tiny's three stages
TOTAL = sum(CAPACITY)
JOINS = 200
ARGS = ["--stage-capacity", ",".join(map(str, CAPACITY)), "--join-rate", "200", "--join-burst", "5",
        "--checks", "capability,integrity,accountability"]

pytestmark = pytest.mark.timeout(150)


ACCOUNTS = 40


def issue_accounts(url: str, n: int = ACCOUNTS) -> list[str]:
    """Account tokens issued through the admin API (accounts are required in these runs)."""
    with httpx.Client(base_url=url, timeout=30) as http:
        return [http.post("/v1/admin/accounts", json={"label": f"load-{i}"}, headers=ADMIN).json()["token"]
                for i in range(n)]


def bodies(keys, tokens: list[str]) -> list[dict]:
    return [key.join_body(account_token=tokens[i % len(tokens)]) for i, key in enumerate(keys)]


async def _burst(urls: list[str], bodies: list[dict], *, kill_after: int | None = None, kill=None,
                 spread_s: float = 0.0) -> list:
    """POST every body concurrently (spread over `urls`, and over `spread_s` seconds of start
    times); returns (index, status, json) per join, status None where the connection failed.
    With `kill_after`, `kill()` runs after that many answers."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    clients = [httpx.AsyncClient(base_url=url, timeout=30, limits=limits) for url in urls]
    answered = 0

    async def one(index: int, body: dict):
        nonlocal answered
        http = clients[index % len(clients)]
        await asyncio.sleep(spread_s * index / len(bodies))  # the load's shape (start times spread), not a wait
        try:
            response = await http.post("/v1/join", json=body)
        except httpx.HTTPError:
            return index, None, None
        answered += 1
        if kill_after is not None and answered == kill_after:
            kill()
        return index, response.status_code, response.json()

    try:
        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    finally:
        for http in clients:
            await http.aclose()


def burst(urls, bodies, **kwargs) -> list:
    return asyncio.run(_burst(urls, bodies, **kwargs))


def drained(http: httpx.Client) -> dict | None:
    run = http.get("/v1/run").json()
    return run if all(stage["queued"] == 0 for stage in run["stages"]) else None


def assert_exactly_full(http: httpx.Client) -> dict:
    run = poll_until(lambda: drained(http), 30, "the admission queue to drain")
    assert [stage["admitted"] for stage in run["stages"]] == CAPACITY
    admitted = []
    after = 0
    while True:
        page = http.get("/v1/admin/participants", params={"status": "admitted", "after_id": after, "limit": 1000},
                        headers=ADMIN).json()
        admitted += page["participants"]
        if page["next_after_id"] is None:
            break
        after = page["next_after_id"]
    assert len(admitted) == TOTAL
    assert len({p["peer_id"] for p in admitted}) == TOTAL
    assert collections.Counter(p["stage"] for p in admitted) == {i: c for i, c in enumerate(CAPACITY)}
    return run


def test_burst_admits_exactly_capacity(start_authorizer, db_url, node_keys):
    authorizer = start_authorizer(*ARGS, db=db_url)
    tokens = issue_accounts(authorizer.url)
    keys = node_keys(JOINS)
    results = burst([authorizer.url], bodies(keys, tokens))
    assert all(status == 200 for _, status, _ in results), [r for r in results if r[1] != 200][:3]
    statuses = collections.Counter(body["status"] for _, _, body in results)
    assert statuses["queued"] + statuses["admitted"] <= TOTAL + 1  # the queue never outgrows the free slots
    with client(authorizer) as http:
        assert_exactly_full(http)
        final = collections.Counter()
        for _, _, body in results:
            ticket = http.get(f"/v1/join/{body['ticket']}").json()
            final[ticket["status"]] += 1
            if ticket["status"] == "rejected":
                assert ticket["rejection"]["reason"] == "run_full"
                assert "retry" in ticket["rejection"]["message"]
            else:
                assert ticket["status"] == "admitted" and ticket["admission"]["credential_msgpack"]
        assert final == {"admitted": TOTAL, "rejected": JOINS - TOTAL}


def test_kill_9_mid_burst_loses_nothing(start_authorizer, db_url, node_keys, tmp_path):
    data_dir = str(tmp_path / "shared-data")
    first = start_authorizer(*ARGS, db=db_url, data_dir=data_dir)
    with client(first) as http:
        root_key = http.get("/v1/run").json()["authorizer_public_key"]
    keys = node_keys(JOINS)
    sent = bodies(keys, issue_accounts(first.url))
    # arrivals spread over a second, so that the kill surely lands while joins are in flight
    results = burst([first.url], sent, kill_after=JOINS // 4, kill=first.kill, spread_s=1.0)
    answered = [(i, body) for i, status, body in results if status == 200]
    assert JOINS // 4 <= len(answered) < JOINS, "the kill should land mid-burst"
    assert first.proc.poll() is not None

    second = start_authorizer(*ARGS, db=db_url, data_dir=data_dir)
    with client(second) as http:
        assert http.get("/v1/run").json()["authorizer_public_key"] == root_key  # same root of trust
        for _, body in answered:  # every answered join is still on record, for the same peer
            ticket = http.get(f"/v1/join/{body['ticket']}")
            assert ticket.status_code == 200, body
            assert ticket.json()["peer_id"] == body["peer_id"]
        # nodes whose join got no answer retry; a retried live join (the same signed request)
        # returns the very same ticket
        retried = burst([second.url], sent)
        assert all(status == 200 for _, status, _ in retried)
        by_index = dict(answered)
        for index, _, body in retried:
            earlier = by_index.get(index)
            if earlier is not None and body["status"] in ("queued", "admitted"):
                if earlier["status"] in ("queued", "admitted"):
                    assert body["ticket"] == earlier["ticket"]
        assert_exactly_full(http)


def test_two_authorizers_racing_on_one_database(start_authorizer, db_url, node_keys, tmp_path):
    """Capacity is held by the database, not by one process: two authorizers serving and
    releasing joins on the same database still admit exactly the capacity."""
    data_dir = str(tmp_path / "shared-data")
    one = start_authorizer(*ARGS, db=db_url, data_dir=data_dir)
    two = start_authorizer(*ARGS, db=db_url, data_dir=data_dir)
    results = burst([one.url, two.url], bodies(node_keys(JOINS), issue_accounts(one.url)))
    assert all(status == 200 for _, status, _ in results)
    with client(one) as http:
        assert_exactly_full(http)
