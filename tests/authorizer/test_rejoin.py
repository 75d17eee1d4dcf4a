"""A node that comes back: a restart with the same identity replaces its stale ticket at once
(signed joins only), a node that leaves while queued frees its slot, and a queued node's estimate
shrinks as the queue moves. Against a live authorizer over HTTP, and through the node's own
client (node.admission) where that is what was broken."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from authorizer.testing import NodeKey
from tests.authorizer.helpers import ADMIN
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(120)
CHECKS = ("--checks", "capability,integrity")


def ticket_of(http: httpx.Client, ticket: dict) -> dict:
    return http.get(f"/v1/join/{ticket['ticket']}").json()


def admitted(http: httpx.Client, ticket: dict) -> dict:
    return poll_until(lambda: (t := ticket_of(http, ticket))["status"] == "admitted" and t, 10, "admission")


def test_signed_rejoin_replaces_the_stale_ticket(start_authorizer, db_url):
    authorizer = start_authorizer(*CHECKS, "--join-rate", "100", "--stage-capacity", "1", db=db_url)
    key = NodeKey.generate()
    with httpx.Client(base_url=authorizer.url, timeout=30) as http:
        first_body = key.join_body(role="trainer")
        first = admitted(http, http.post("/v1/join", json=first_body).json())
        old_serial = first["admission"]["credential"]["credential"]["serial"]
        assert http.get("/v1/run").json()["trainers"]["admitted"] == 1

        again = http.post("/v1/join", json=first_body).json()  # the same request again: its answer was lost
        assert again["ticket"] == first["ticket"]

        unsigned = http.post("/v1/join", json=key.join_body(role="trainer", run_id=None))
        assert unsigned.status_code == 401 and unsigned.json()["error"]["code"] == "proof_required"
        assert "live ticket" in unsigned.json()["error"]["message"]

        second = http.post("/v1/join", json=key.join_body(role="trainer")).json()  # a restart after a crash
        assert second["ticket"] != first["ticket"] and second["status"] in ("queued", "admitted")
        replaced = ticket_of(http, first)
        assert replaced["status"] == "replaced" and replaced["rejection"]["reason"] == "replaced"
        admitted(http, second)
        trainers = http.get("/v1/run").json()["trainers"]
        assert (trainers["admitted"], trainers["queued"]) == (1, 0)  # the stale slot was freed, not doubled
        assert old_serial in http.get("/v1/revocations").json()["serials"]

        stale = http.post("/v1/join", json=first_body)  # an older proof than the live ticket's
        assert stale.status_code == 401 and stale.json()["error"]["code"] == "bad_proof"


def test_queued_leave_frees_the_slot_and_estimates_shrink(start_authorizer):
    authorizer = start_authorizer(*CHECKS, "--join-rate", "0.001", "--join-burst", "1")
    with httpx.Client(base_url=authorizer.url, timeout=30) as http:
        keys = [NodeKey.generate() for _ in range(4)]
        tickets = [http.post("/v1/join", json=k.join_body(role="trainer")).json() for k in keys]
        admitted(http, tickets[0])  # the one token of the burst; the rest wait for the join rate
        assert [ticket_of(http, t)["status"] for t in tickets[1:]] == ["queued"] * 3
        last = ticket_of(http, tickets[3])
        assert last["queue_position"] == 2
        assert http.get("/v1/run").json()["trainers"]["queued"] == 3

        left = http.post("/v1/leave", json=keys[1].proof_body("leave", "tiny"))
        assert left.status_code == 200 and left.json()["status"] == "left"
        assert ticket_of(http, tickets[1])["status"] == "left"
        assert http.get("/v1/run").json()["trainers"]["queued"] == 2  # freed at once
        moved = ticket_of(http, tickets[3])
        assert moved["queue_position"] == 1 and moved["estimated_wait_s"] < last["estimated_wait_s"]


def test_node_restarted_with_its_identity_gets_back_in(start_authorizer):
    """The node's client, joining twice with one identity (a crash and a restart): the second
    join is admitted at once instead of failing on the stale ticket's join reply."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from node.admission import AuthorizerClient, join_run
    from protocol.identity import Identity

    authorizer = start_authorizer(*CHECKS, "--join-rate", "100")
    identity = Identity(Ed25519PrivateKey.generate(), path="")
    hardware = {"device_name": "cpu", "vram_bytes": 0, "ram_bytes": 1 << 34, "bandwidth_mbps": 1000.0,
                "latency_ms": 1.0}

    async def join_once():
        client = AuthorizerClient(authorizer.url)
        try:
            return await join_run(client, identity, "trainer", hardware=hardware, announce_maddrs=[], timeout_s=10)
        finally:
            await client.close()

    first = asyncio.run(join_once())
    second = asyncio.run(join_once())  # the first process "crashed" without leaving
    assert second.credential.credential.serial != first.credential.credential.serial
    with httpx.Client(base_url=authorizer.url, timeout=30) as http:
        assert http.get("/v1/run").json()["trainers"]["admitted"] == 1
        live = http.get("/v1/admin/participants", params={"status": "admitted"}, headers=ADMIN).json()
        assert [p["serial"] for p in live["participants"]] == [second.credential.credential.serial]
