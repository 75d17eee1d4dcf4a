"""An authenticated run on 127.0.0.1: a real authorizer admits real agora-node processes, which
then check each other's credentials on every stream. The attack matrix is played against a
live worker: each attack is rejected, counted by reason, and honest training goes on."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from authorizer.testing import AuthorizerProcess
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]


def started_authorizer(tmp_path, run_config_path, stages: list[dict], run_prefix: str) -> AuthorizerProcess:
    """An authorizer of a fresh run with `stages`, up to 4 workers a stage; the caller stops it."""
    config = run_config_path(stages=stages, run_id=f"{run_prefix}-{uuid.uuid4().hex[:6]}")
    process = AuthorizerProcess(
        ["--run-config", config, "--data-dir", str(tmp_path / "authorizer"), "--port", "0",
         "--credential-ttl-s", "600", "--admin-token", "test-admin-token-0123456789", "--stage-capacity", "4"],
        log_path=str(tmp_path / "authorizer.log"))
    process.start()
    return process


@pytest.fixture
def authorizer(tmp_path, run_config_path):
    process = started_authorizer(tmp_path, run_config_path, TWO_STAGES, "auth")
    yield process
    process.stop()


def _node_args(authorizer, account: str) -> list[str]:
    return ["--authorizer", authorizer.url, "--account-token", account]


async def _admitted_identity(authorizer_url, path, account):
    """A fresh identity admitted as a trainer: listening (the authorizer checks reachability)."""
    from hivemind.p2p import P2P

    from node.admission import AuthorizerClient, join_run
    from protocol.identity import load_or_create_identity

    identity = load_or_create_identity(path)
    p2p = await P2P.create(identity_path=identity.path, check_if_identity_free=False)
    client = AuthorizerClient(authorizer_url)
    try:
        visible = [str(m) for m in await p2p.get_visible_maddrs()]
        admission = await join_run(client, identity, "trainer", announce_maddrs=visible, account_token=account,
                                   hardware={"device_name": "cpu", "vram_bytes": 0, "ram_bytes": 1 << 34,
                                             "bandwidth_mbps": 1000.0, "latency_ms": 1.0})
    finally:
        await client.close()
    return identity, p2p, admission


async def _attacks(worker, authorizer_url: str, tmp_path, *, ban) -> dict:
    """Play every attack against `worker`; return the reason each one was rejected with."""
    from hivemind.p2p import PeerID

    from protocol import version
    from protocol.auth import PeerAuthenticator
    from protocol.codec import encode_tensor, pack, unpack
    from protocol.credentials import SignedCredential, sign_credential
    from protocol.errors import RemoteError
    from protocol.framing import read_frame, write_frame
    from protocol.transport import RpcClient, dial, hello_frame
    import torch

    me, p2p, admission = await _admitted_identity(authorizer_url, str(tmp_path / "attacker.key"), "mallory")
    other, other_p2p, other_admission = await _admitted_identity(authorizer_url, str(tmp_path / "other.key"), "oscar")
    reasons: dict[str, str] = {}
    try:
        legit = admission.credential
        root = admission.root_public_key
        run_id = legit.credential.run_id
        peer = PeerID.from_base58(worker.peer_id)
        await dial(p2p, peer, worker.maddrs)
        body = {"stage": 0, "sample_id": "attack", "tokens": encode_tensor(torch.zeros(64, dtype=torch.int64))}

        def auth_with(credential, **kwargs):
            return PeerAuthenticator(identity=me, run_id=run_id, root_public_key=root, credential=lambda: credential,
                                     **kwargs)

        async def attempt(name, authenticator):
            try:
                await RpcClient(p2p, authenticator=authenticator, timeout_s=10).call(peer, version.FORWARD, body)
                reasons[name] = "accepted"
            except RemoteError as exc:
                reasons[name] = str(exc)

        async def raw(name, hello):
            """Open a stream with a hand-made hello and send one request on it."""
            _, reader, writer = await p2p.call_binary_stream_handler(peer, version.FORWARD)
            try:
                await write_frame(writer, hello)
                ack = unpack(await read_frame(reader))
                if not ack["ok"]:
                    reasons[name] = ack["error"]["message"]
                    return
                await write_frame(writer, pack({"seq": 1, "body": body}))
                reply = unpack(await read_frame(reader))
                reasons[name] = "accepted" if reply["ok"] else reply["error"]["message"]
            finally:
                writer.close()

        await attempt("honest", auth_with(legit))
        await attempt("no_credential", None)
        other_root = Ed25519PrivateKey.generate()
        await attempt("other_root", auth_with(sign_credential(other_root, legit.credential)))
        stale = legit.credential.model_copy(update={"issued_at": int(time.time()) - 7200,
                                                    "expires_at": int(time.time()) - 3600})
        await attempt("expired", auth_with(SignedCredential(credential=stale, signature=legit.signature)))
        await attempt("another_peers_credential", auth_with(other_admission.credential))

        signer = auth_with(legit)
        hello, _ = hello_frame(version.FORWARD, worker.peer_id, signer)
        await raw("original_for_replay", hello)
        await raw("replayed", hello)
        await raw("wrong_recipient", hello_frame(version.FORWARD, other.peer_id.to_base58(), signer)[0])
        tampered = unpack(hello_frame(version.FORWARD, worker.peer_id, signer)[0])
        tampered["recipient"], tampered["timestamp"] = worker.peer_id, tampered["timestamp"] + 1
        await raw("tampered", pack(tampered))

        await asyncio.to_thread(ban, me.peer_id.to_base58())
        loop = asyncio.get_running_loop()

        def refused() -> bool:  # runs in poll_until's thread; each attempt runs on this loop
            asyncio.run_coroutine_threadsafe(attempt("revoked", auth_with(legit)), loop).result()
            return reasons["revoked"] != "accepted"

        # the worker refreshes revocations every 2 s in this test
        await asyncio.to_thread(poll_until, refused, 30, "the worker to refuse the revoked credential", period_s=0.5)
        return reasons
    finally:
        await p2p.shutdown()
        await other_p2p.shutdown()


@pytest.mark.timeout(300)
def test_authenticated_swarm_rejects_every_attack(make_swarm, authorizer, tmp_path):
    swarm = make_swarm(None, common_args=["--revocation-refresh-s", "2"])
    head = swarm.start("worker", args=_node_args(authorizer, "alice"))
    tail = swarm.start("worker", args=_node_args(authorizer, "bob"))
    assert sorted([head.stage, tail.stage]) == [0, 1], "the authorizer places one worker on each stage"
    if head.stage != 0:
        head, tail = tail, head
    trainer = swarm.start("trainer", args=[*_node_args(authorizer, "carol"), "--max-samples", "60", "--lanes", "2"])
    assert swarm.wait(trainer, 120) == 0, trainer.log_tail()
    summary = trainer.summary()
    assert summary["samples_completed"] == 60, summary

    def ban(peer_id: str) -> None:
        response = httpx.post(f"{authorizer.url}/v1/admin/bans", json={"peer_id": peer_id, "reason": "test"},
                              headers={"Authorization": "Bearer test-admin-token-0123456789"}, timeout=10)
        assert response.status_code == 200, response.text

    reasons = asyncio.run(asyncio.wait_for(_attacks(head, authorizer.url, tmp_path, ban=ban), 150))
    assert reasons["honest"] == "accepted"
    assert reasons["original_for_replay"] == "accepted"
    assert "no_credential" in reasons["no_credential"]
    assert "bad_signature" in reasons["other_root"]
    assert "expired" in reasons["expired"] or "bad_signature" in reasons["expired"]
    assert "wrong_peer" in reasons["another_peers_credential"]
    assert "replayed" in reasons["replayed"]
    assert "wrong_recipient" in reasons["wrong_recipient"]
    assert "bad_signature" in reasons["tampered"]
    assert "revoked" in reasons["revoked"]

    # honest training still works after the attacks
    again = swarm.start("trainer", args=[*_node_args(authorizer, "dave"), "--max-samples", "20"])
    assert swarm.wait(again, 120) == 0 and again.summary()["samples_completed"] == 20
    assert swarm.stop(head, signal.SIGTERM) == 0
    counted = head.summary()["auth_rejected"]  # every attack counted under its reason
    for reason in ("no_credential", "bad_signature", "wrong_peer", "replayed", "wrong_recipient", "revoked"):
        assert counted.get(reason, 0) >= 1, counted


@pytest.mark.timeout(300)
def test_dht_refuses_stock_nodes_and_forged_announcements(make_swarm, authorizer, tmp_path):
    import hivemind

    from node.swarm import join_swarm
    from protocol.auth_state import SharedAuthState
    from protocol.dht import SwarmDHT
    from protocol.dht_auth import CredentialDHTAuthorizer
    from protocol.dht_schema import WorkerRecord, workers_key

    swarm = make_swarm(None)
    worker = swarm.start("worker", args=_node_args(authorizer, "alice"))
    run_id = httpx.get(f"{authorizer.url}/v1/run", timeout=10).json()["run_id"]

    # a stock hivemind node with no credential reaches the worker over libp2p, but its DHT pings
    # go unanswered, so it cannot join
    with pytest.raises(Exception, match="none of the initial_peers responded to a ping"):
        stock = hivemind.DHT(initial_peers=worker.maddrs, start=True, bootstrap_timeout=10, startup_timeout=30)
        stock.shutdown()

    async def admitted():
        identity, p2p, admission = await _admitted_identity(authorizer.url, str(tmp_path / "forger.key"), "eve")
        await p2p.shutdown()
        return identity, admission

    identity, admission = asyncio.run(admitted())
    state = SharedAuthState(str(tmp_path / "forger-trust"), run_id=run_id, root_public_key=admission.root_public_key)
    state.publish_credential(admission.credential)
    membership = join_swarm(identity=identity, run_id=run_id, num_stages=2, initial_peers=worker.maddrs,
                            host_maddrs=["/ip4/127.0.0.1/tcp/0"], announce_maddrs=[], bootstrap_timeout_s=30,
                            auth_state=state, authorizer=CredentialDHTAuthorizer(identity, state))
    try:
        key = workers_key(run_id, worker.stage)
        forged = WorkerRecord(stage=worker.stage, max_batch=4096, throughput=1e9, maddrs=["/ip4/203.0.113.1/tcp/1"])

        dht = SwarmDHT(membership.dht, identity.peer_id.to_base58())

        async def forge():
            # 1: a record under the victim's peer id (our validator will not sign it; peers refuse it unsigned)
            await dht.dht_store_raw(key, worker.peer_id, forged.model_dump(mode="json"), 60)
            # 2: a record under our own id, signed by us, but our credential is a trainer's
            await dht.store(key, forged, 60)

        # each store returns once the peers storing the key answered it, so a read now sees whatever
        # they accepted; read until the worker's own record is among it
        asyncio.run(forge())
        records = poll_until(lambda: (found := asyncio.run(dht.get(key, WorkerRecord))) and worker.peer_id in found
                             and found, 30, "the worker's record in the DHT", period_s=0.5)
        assert set(records) == {worker.peer_id}, records
        assert records[worker.peer_id].max_batch != 4096
    finally:
        membership.shutdown()
