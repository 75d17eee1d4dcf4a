"""Each admission check, against one live authorizer whose policy each test changes through the
admin API: the rejection carries its machine-readable reason and a sentence saying what to do.
Also placement, the queue, bans, revocation, and the renew/leave proofs."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import pytest

from authorizer.testing import NodeKey
from protocol.credentials import SignedCredential, verify_credential, verify_revocation_list
from tests.authorizer.helpers import ADMIN
from tests.support.polling import poll_until

pytestmark = pytest.mark.timeout(120)
GIB = 1 << 30


@pytest.fixture(scope="module")
def authorizer(module_starter):
    return module_starter("--checks", "capability,integrity,reachability",
                          "--join-rate", "1000", "--reachability-timeout-s", "3")


@pytest.fixture
def http(authorizer):
    with httpx.Client(base_url=authorizer.url, timeout=30) as client:
        original = client.get("/v1/admin/policy", headers=ADMIN).json()
        yield client
        assert client.patch("/v1/admin/policy", json=original, headers=ADMIN).status_code == 200


def set_policy(http: httpx.Client, **changes) -> dict:
    response = http.patch("/v1/admin/policy", json=changes, headers=ADMIN)
    assert response.status_code == 200, response.text
    return response.json()


def join(http: httpx.Client, key: NodeKey | None = None, **fields) -> dict:
    key = key or NodeKey.generate()
    fields.setdefault("account_token", f"account-{key.peer_id[-12:]}")
    response = http.post("/v1/join", json=key.join_body(**fields))
    assert response.status_code == 200, response.text
    return response.json()


def rejected(ticket: dict, reason: str, *phrases: str) -> dict:
    assert ticket["status"] == "rejected", ticket
    assert ticket["rejection"]["reason"] == reason, ticket
    for phrase in phrases:
        assert phrase in ticket["rejection"]["message"], ticket["rejection"]["message"]
    return ticket


def admitted(http: httpx.Client, ticket: dict) -> dict:
    return poll_until(lambda: (t := http.get(f"/v1/join/{ticket['ticket']}").json())["status"] == "admitted" and t,
                      10, "admission")


def no_reachability(http):
    set_policy(http, checks={"reachability": False})


# -- capability ------------------------------------------------------------------------------

def test_capability_floors(http):
    no_reachability(http)
    set_policy(http, floors={"head": {"min_vram_bytes": 16 * GIB}, "body": {"min_vram_bytes": 8 * GIB},
                             "tail": {"min_vram_bytes": 16 * GIB}, "trainer": {"min_ram_bytes": 4 * GIB}})
    rejected(join(http, vram_bytes=4 * GIB), "insufficient_vram", "8.00 GiB", "stage 1 (body)", "larger GPU")
    rejected(join(http, vram_bytes=0, ram_bytes=2 * GIB), "insufficient_ram", "host RAM", "add a GPU")
    rejected(join(http, role="trainer", ram_bytes=1 * GIB), "insufficient_ram", "a trainer", "4.00 GiB")
    network = {"min_bandwidth_mbps": 500.0, "max_latency_ms": 100.0}
    set_policy(http, floors={"head": network, "body": network, "tail": network})
    rejected(join(http, bandwidth_mbps=100.0), "insufficient_bandwidth", "500 Mbit/s", "faster connection")
    rejected(join(http, latency_ms=250.0), "latency_too_high", "at most 100 ms", "closer")


def test_accelerator_allow_list(http):
    no_reachability(http)
    set_policy(http, accelerators=["H100", "A100"])
    rejected(join(http, device_name="NVIDIA GeForce RTX 4090"), "accelerator_not_allowed", "H100, A100")
    assert join(http, device_name="NVIDIA H100 80GB HBM3")["status"] in ("queued", "admitted")


def test_bandwidth_floor_from_the_runs_plan(http):
    from protocol.run_config import load_run_config
    from roles.model.traffic_plan import plan_traffic

    no_reachability(http)
    run = load_run_config("tiny")  # the module's authorizer serves the tiny preset
    floors = [round(s.total_mbps_fp32, 1) for s in plan_traffic(run).stages]
    slow = min(floors) * 0.9
    assert join(http, bandwidth_mbps=slow)["status"] in ("queued", "admitted")  # off: no bandwidth floor
    set_policy(http, bandwidth_floor_from_plan="fp32")
    ticket = rejected(join(http, bandwidth_mbps=slow), "insufficient_bandwidth", "Mbit/s")
    assert f"{min(floors):g} Mbit/s" in ticket["rejection"]["message"]
    just_enough = join(http, bandwidth_mbps=min(floors))
    assert just_enough["status"] in ("queued", "admitted")
    assert floors[just_enough["stage"]] == min(floors)  # only the stages whose plan it meets


def test_heavier_stages_only_to_nodes_meeting_their_floor(http):
    no_reachability(http)
    set_policy(http, floors={"head": {"min_vram_bytes": 20 * GIB}, "body": {"min_vram_bytes": 4 * GIB},
                             "tail": {"min_vram_bytes": 20 * GIB}})
    weak = [join(http, vram_bytes=8 * GIB) for _ in range(4)]
    assert {t["stage"] for t in weak} == {1}  # even though the body is now the fullest stage
    run = http.get("/v1/run").json()
    deficits = {s["index"]: s["target"] - s["admitted"] - s["queued"] for s in run["stages"] if s["index"] != 1}
    strong = join(http, vram_bytes=24 * GIB)
    best = max(deficits.values())
    assert deficits[strong["stage"]] == best  # furthest below its target among the stages it may serve
    if deficits[0] == deficits[2]:
        assert strong["stage"] == 2  # ties go to the most demanding stage (the tail, with the LM head)


def test_placement_fills_the_stage_furthest_below_target(http):
    no_reachability(http)
    run = http.get("/v1/run").json()
    occupied = [s["admitted"] + s["queued"] for s in run["stages"]]
    target = [occupied[0] + 1, occupied[1] + 3, occupied[2] + 1]
    set_policy(http, stage_target=target)
    stages = [join(http)["stage"] for _ in range(3)]
    assert stages[0] == 1 and sorted(stages) == [0, 1, 1] or sorted(stages) == [1, 1, 2]


def test_a_stage_preference_counts_only_when_the_policy_honours_it(http):
    no_reachability(http)
    run = http.get("/v1/run").json()
    occupied = [s["admitted"] + s["queued"] for s in run["stages"]]
    set_policy(http, stage_target=[occupied[0] + 1, occupied[1] + 3, occupied[2] + 1],
               stage_capacity=[occupied[0] + 1, occupied[1] + 3, occupied[2] + 1])
    assert join(http, preferred_stage=2)["stage"] == 1  # ignored: stage 1 is furthest below its target
    set_policy(http, honor_stage_preference=True)
    assert join(http, preferred_stage=2)["stage"] == 2
    assert join(http, preferred_stage=2)["stage"] != 2  # stage 2 is full now: placed by deficit instead
    assert join(http, preferred_stage=0)["stage"] == 0


# -- integrity ---------------------------------------------------------------------------------

def test_integrity(http):
    no_reachability(http)
    set_policy(http, client_versions=["1.4.0", "1.4.1"], package_digests=["sha256:" + "ab" * 32])
    rejected(join(http, client_version="1.3.9", package_digest="sha256:" + "ab" * 32),
             "client_version_not_accepted", "1.4.0, 1.4.1", "install")
    rejected(join(http, client_version="1.4.1", package_digest="sha256:" + "cd" * 32),
             "package_digest_not_accepted", "reinstall agora-node")
    assert join(http, client_version="1.4.1", package_digest="sha256:" + "ab" * 32)["status"] in ("queued", "admitted")


# -- reachability ------------------------------------------------------------------------------

def test_reachability(http, tmp_path):
    import socket

    from hivemind.p2p import P2P

    from protocol.identity import load_or_create_identity

    with socket.socket() as sock:  # a port where, once this socket closes, nothing listens
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    ticket = join(http, announce_maddrs=[f"/ip4/127.0.0.1/tcp/{closed_port}"])
    rejected(ticket, "unreachable", f"/ip4/127.0.0.1/tcp/{closed_port}", f"open TCP port {closed_port} on 127.0.0.1",
             "--announce-maddrs")
    rejected(join(http, announce_maddrs=[]), "no_dialable_address", "--announce-maddrs")
    rejected(join(http, announce_maddrs=["/ip4/0.0.0.0/tcp/4001"]), "no_dialable_address")

    async def with_live_node():
        identity = load_or_create_identity(str(tmp_path / "node.key"))
        node = await P2P.create(identity_path=identity.path, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                check_if_identity_free=False)
        try:
            maddrs = [str(m) for m in await node.get_visible_maddrs()]
            key = NodeKey.from_identity(identity)
            async with httpx.AsyncClient(base_url=str(http.base_url), timeout=30) as client:
                live = (await client.post("/v1/join", json=key.join_body(announce_maddrs=maddrs))).json()
                # another identity announcing this node's address: the libp2p handshake exposes it
                impostor = NodeKey.generate()
                address = maddrs[0].split("/p2p/")[0]
                stolen = (await client.post("/v1/join", json=impostor.join_body(announce_maddrs=[address]))).json()
                set_policy(http, dial_private_addresses=False)
                private = (await client.post("/v1/join", json=NodeKey.generate().join_body(
                    announce_maddrs=[address]))).json()
            return live, stolen, private, address
        finally:
            await node.shutdown()

    live, stolen, private, address = asyncio.run(with_live_node())
    assert live["status"] in ("queued", "admitted"), live
    rejected(stolen, "unreachable", address, "open TCP port")
    rejected(private, "no_dialable_address", "private address")


# -- accountability ----------------------------------------------------------------------------

def test_account_required_and_limit(http):
    no_reachability(http)
    set_policy(http, checks={"accountability": True})
    rejected(join(http, account_token=""), "account_required", "account token")
    set_policy(http, max_nodes_per_account=2)
    account = http.post("/v1/admin/accounts", json={"label": "limit"}, headers=ADMIN).json()["token"]
    assert all(join(http, account_token=account)["status"] in ("queued", "admitted") for _ in range(2))
    rejected(join(http, account_token=account), "account_limit", "2 node(s)", "stop one of them")
    set_policy(http, checks={"accountability": False})
    assert join(http, account_token="")["status"] in ("queued", "admitted")


def test_ban_peer_revokes_and_refuses(http):
    no_reachability(http)
    run = http.get("/v1/run").json()
    root = base64.b64decode(run["authorizer_public_key"])
    key = NodeKey.generate()
    ticket = admitted(http, join(http, key))
    signed = SignedCredential.from_bytes(base64.b64decode(ticket["admission"]["credential_msgpack"]))
    verify_credential(root, signed, peer_id=key.peer_id, run_id="tiny")
    ban = http.post("/v1/admin/bans", json={"peer_id": key.peer_id, "reason": "poisoned gradients"}, headers=ADMIN)
    assert ban.json() == {"target": key.peer_id, "kind": "peer", "ended_tickets": 1}
    ended = http.get(f"/v1/join/{ticket['ticket']}").json()
    assert ended["status"] == "banned" and ended["rejection"]["reason"] == "banned_peer"
    assert "poisoned gradients" in ended["rejection"]["message"]
    revocations = verify_revocation_list(root, http.get("/v1/revocations").json() and
                                         _revocation_list(http), run_id="tiny")
    assert revocations.is_revoked(signed.credential) and key.peer_id in revocations.peer_ids
    assert signed.credential.serial in revocations.serials
    renew = http.post("/v1/renew", json=key.proof_body("renew", "tiny"))
    assert renew.status_code == 403 and renew.json()["error"]["code"] == "renewal_refused"
    rejected(join(http, key), "banned_peer", "contact the operator")
    assert http.post("/v1/admin/unban", json={"peer_id": key.peer_id}, headers=ADMIN).json()["was_banned"]
    assert join(http, key)["status"] in ("queued", "admitted")


def _revocation_list(http):
    from protocol.credentials import RevocationList

    return RevocationList.model_validate_json(http.get("/v1/revocations").content)


def test_ban_account(http):
    no_reachability(http)
    account = f"acct-{time.time_ns()}"
    first = join(http, account_token=account)
    ban = http.post("/v1/admin/bans", json={"account_token": account}, headers=ADMIN).json()
    assert ban["kind"] == "account" and ban["ended_tickets"] == 1
    assert http.get(f"/v1/join/{first['ticket']}").json()["status"] == "banned"
    rejected(join(http, account_token=account), "banned_account", "banned this account")
    listing = http.get("/v1/admin/participants", params={"status": "banned", "limit": 1000}, headers=ADMIN).json()
    assert ban["target"] in {p["account_id"] for p in listing["participants"]}


# -- capacity and queue --------------------------------------------------------------------------

def test_run_full_and_queue_full(http):
    no_reachability(http)
    run = http.get("/v1/run").json()
    set_policy(http, stage_capacity=[s["admitted"] + s["queued"] for s in run["stages"]])
    rejected(join(http), "run_full", "at capacity", "GET /v1/run")
    set_policy(http, trainer_capacity=run["trainers"]["admitted"] + run["trainers"]["queued"])
    rejected(join(http, role="trainer"), "run_full", "trainer slots")
    set_policy(http, stage_capacity=[64, 64, 64], max_queue=0)
    rejected(join(http), "queue_full", "retry")


def test_queue_positions_and_wait(http):
    no_reachability(http)
    # A release round already under way may hold more than one token. Once a probe joined after
    # the burst became 1 is admitted, every later round holds at most one, so after the rate drops
    # at most one of the joins below is released.
    set_policy(http, join_burst=1)
    admitted(http, join(http))
    set_policy(http, join_rate_per_s=0.001)
    tickets = [join(http) for _ in range(3)]
    polled = [http.get(f"/v1/join/{t['ticket']}").json() for t in tickets]
    queued = [p for p in polled if p["status"] == "queued"]
    assert len(queued) >= 2
    positions = [p["queue_position"] for p in queued]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert all(p["estimated_wait_s"] >= 1000 * (p["queue_position"] + 1) * 0.99 for p in queued)
    assert all(p["stage"] is not None and p["run_config"]["run_id"] == "tiny" for p in queued)  # fetch state early
    key = NodeKey.generate()
    join(http, key)
    refused = http.post("/v1/renew", json=key.proof_body("renew", "tiny"))
    assert refused.status_code == 403 and "still queued" in refused.json()["error"]["message"]


# -- identity and proofs -------------------------------------------------------------------------

def test_identity_mismatch(http):
    key, other = NodeKey.generate(), NodeKey.generate()
    body = key.join_body()
    body["peer_id"] = other.peer_id
    response = http.post("/v1/join", json=body)
    assert response.status_code == 400 and response.json()["error"]["code"] == "identity_mismatch"
    body["public_key"] = base64.b64encode(b"\x01" * 20).decode()
    assert http.post("/v1/join", json=body).json()["error"]["code"] == "identity_mismatch"


def test_renew_and_leave_proofs(http):
    no_reachability(http)
    key = NodeKey.generate()
    first = admitted(http, join(http, key))
    serial = first["admission"]["credential"]["credential"]["serial"]
    forged = key.proof_body("renew", "tiny")
    forged["signature"] = NodeKey.generate().proof_body("renew", "tiny")["signature"]
    assert http.post("/v1/renew", json=forged).json()["error"]["code"] == "bad_proof"
    stale = http.post("/v1/renew", json=key.proof_body("renew", "tiny", signed_at=time.time() - 600))
    assert stale.status_code == 401 and "NTP" in stale.json()["error"]["message"]
    wrong_action = key.proof_body("leave", "tiny")
    assert http.post("/v1/renew", json=wrong_action).status_code == 401
    proof = key.proof_body("renew", "tiny")
    renewed = http.post("/v1/renew", json=proof)
    assert renewed.status_code == 200, renewed.text
    fresh = renewed.json()
    assert fresh["credential"]["credential"]["serial"] > serial and fresh["stage"] == first["stage"]
    assert fresh["renew_at"] == pytest.approx(fresh["credential"]["credential"]["issued_at"] + 2 / 3 * 1800)
    assert http.post("/v1/renew", json=proof).json()["error"]["code"] == "bad_proof"  # replayed
    stage = first["stage"]
    before = http.get("/v1/run").json()["stages"][stage]["admitted"]
    left = http.post("/v1/leave", json=key.proof_body("leave", "tiny"))
    assert left.json() == {"peer_id": key.peer_id, "status": "left"}
    assert http.get("/v1/run").json()["stages"][stage]["admitted"] == before - 1
    revocations = _revocation_list(http)
    assert fresh["credential"]["credential"]["serial"] in revocations.serials
    assert http.post("/v1/renew", json=key.proof_body("renew", "tiny")).status_code == 403
