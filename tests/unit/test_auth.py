"""The attack matrix against the RPC layer, in-process over real libp2p streams: every forged,
stale, stolen or redirected request is rejected with its reason counted, and the server keeps
serving honest peers afterwards. (tests/integration/test_auth_swarm.py repeats it against real
agora-node processes.)"""

from __future__ import annotations

import asyncio
import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P

from protocol.auth import PeerAuthenticator, RequestRejected
from protocol.codec import pack, unpack
from protocol.credentials import Credential, root_public_key_bytes, sign_credential, sign_revocation_list
from protocol.errors import ErrorCode, PeerUnavailable, RemoteError
from protocol.framing import read_frame, write_frame
from protocol.identity import load_or_create_identity
from protocol.transport import RpcClient, RpcServer, hello_frame

RUN = "auth-test"
ROOT = Ed25519PrivateKey.generate()
ROOT_PUBLIC = root_public_key_bytes(ROOT)
_serial = iter(range(1, 1 << 20))


def credential_for(identity, *, role="trainer", stage=None, root=ROOT, lifetime_s=600, issued_at=None, run=RUN):
    now = int(time.time()) if issued_at is None else issued_at
    cred = Credential(run_id=run, peer_id=identity.peer_id.to_base58(), public_key=identity.public_key, role=role,
                      stage=stage, issued_at=now, expires_at=now + lifetime_s, serial=next(_serial))
    return sign_credential(root, cred)


def authenticator(identity, credential, **kwargs):
    return PeerAuthenticator(identity=identity, run_id=RUN, root_public_key=ROOT_PUBLIC,
                             credential=lambda: credential, **kwargs)


class Scene:
    """A worker-like server and a set of client identities, on real libp2p daemons."""

    def __init__(self, tmp_path):
        self.server_id = load_or_create_identity(str(tmp_path / "server.key"))
        self.honest_id = load_or_create_identity(str(tmp_path / "honest.key"))
        self.other_id = load_or_create_identity(str(tmp_path / "other.key"))

    async def start(self):
        self.server_p2p = await P2P.create(identity_path=self.server_id.path, check_if_identity_free=False)
        self.server_auth = authenticator(self.server_id, credential_for(self.server_id, role="worker", stage=0))
        self.server = RpcServer(self.server_p2p, authenticator=self.server_auth)

        async def forward(peer_id, body):
            return {"echo": body}

        await self.server.add_handler("agora/v1/forward", forward, roles=frozenset({"trainer"}))
        maddrs = await self.server_p2p.get_visible_maddrs()
        self.client_p2p = await P2P.create(identity_path=self.honest_id.path, initial_peers=maddrs, check_if_identity_free=False)
        self.honest = RpcClient(self.client_p2p, authenticator=authenticator(self.honest_id, credential_for(self.honest_id)))
        return self

    async def call(self, client, body=None):
        return await client.call(self.server_p2p.peer_id, "agora/v1/forward", body or {"x": 1})

    async def stop(self):
        await self.honest.close()
        await self.client_p2p.shutdown()
        await self.server_p2p.shutdown()


def run_scene(tmp_path, scenario):
    async def main():
        scene = await Scene(tmp_path).start()
        try:
            await scenario(scene)
            # whatever happened before, an honest peer is still served
            assert await scene.call(scene.honest, {"honest": True}) == {"echo": {"honest": True}}
        finally:
            await scene.stop()

    asyncio.run(asyncio.wait_for(main(), 60))


async def expect_rejection(scene, client, reason):
    with pytest.raises(RemoteError) as info:
        await scene.call(client)
    assert info.value.code == ErrorCode.UNAUTHENTICATED
    assert reason in str(info.value)
    assert scene.server.auth_rejected[reason] >= 1


def test_honest_request_passes_and_reply_is_signed(tmp_path):
    async def scenario(scene):
        assert await scene.call(scene.honest) == {"echo": {"x": 1}}
        assert scene.server.auth_rejected == {}


def test_a_server_that_cannot_prove_its_credential_is_not_trusted(tmp_path):
    async def scenario(scene):
        scene.server_auth.credential = lambda: credential_for(scene.server_id, role="worker", stage=0,
                                                              root=Ed25519PrivateKey.generate())
        with pytest.raises(RequestRejected, match="bad_signature"):
            await scene.call(RpcClient(scene.client_p2p, authenticator=authenticator(
                scene.honest_id, credential_for(scene.honest_id))))
        scene.server_auth.credential = lambda: credential_for(scene.server_id, role="worker", stage=0)

    run_scene(tmp_path, scenario)


def test_no_credential(tmp_path):
    async def scenario(scene):
        await expect_rejection(scene, RpcClient(scene.client_p2p), "no_credential")

    run_scene(tmp_path, scenario)


def test_credential_signed_by_another_root_key(tmp_path):
    async def scenario(scene):
        forged = credential_for(scene.honest_id, root=Ed25519PrivateKey.generate())
        await expect_rejection(scene, RpcClient(scene.client_p2p, authenticator=authenticator(scene.honest_id, forged)),
                               "bad_signature")

    run_scene(tmp_path, scenario)


def test_expired_credential(tmp_path):
    async def scenario(scene):
        old = credential_for(scene.honest_id, issued_at=int(time.time()) - 7200, lifetime_s=1800)
        await expect_rejection(scene, RpcClient(scene.client_p2p, authenticator=authenticator(scene.honest_id, old)),
                               "expired")

    run_scene(tmp_path, scenario)


def test_revoked_credential(tmp_path):
    async def scenario(scene):
        revoked = credential_for(scene.honest_id)
        scene.server_auth.revocations = sign_revocation_list(ROOT, run_id=RUN, serials=[revoked.credential.serial])
        await expect_rejection(scene, RpcClient(scene.client_p2p, authenticator=authenticator(scene.honest_id, revoked)),
                               "revoked")
        scene.server_auth.revocations = None

    run_scene(tmp_path, scenario)


def test_another_peers_credential(tmp_path):
    async def scenario(scene):
        stolen = credential_for(scene.other_id)
        thief = RpcClient(scene.client_p2p, authenticator=authenticator(scene.honest_id, stolen))
        await expect_rejection(scene, thief, "wrong_peer")

    run_scene(tmp_path, scenario)


def test_wrong_role(tmp_path):
    async def scenario(scene):
        as_worker = credential_for(scene.honest_id, role="worker", stage=1)
        await expect_rejection(
            scene, RpcClient(scene.client_p2p, authenticator=authenticator(scene.honest_id, as_worker)), "wrong_role")

    run_scene(tmp_path, scenario)


async def _raw_exchange(scene, hello: bytes, body=None) -> dict:
    """Open a stream with a hand-made hello and send one request; the first refusal, or the reply."""
    _, reader, writer = await scene.client_p2p.call_binary_stream_handler(scene.server_p2p.peer_id, "agora/v1/forward")
    try:
        await write_frame(writer, hello)
        ack = unpack(await read_frame(reader))
        if not ack["ok"]:
            return ack
        await write_frame(writer, pack({"seq": 1, "body": body or {"x": 1}}))
        return unpack(await read_frame(reader))
    finally:
        writer.close()


def _signed_hello(scene, *, recipient=None, tamper=False):
    auth = authenticator(scene.honest_id, credential_for(scene.honest_id))
    hello = unpack(hello_frame("agora/v1/forward", recipient or scene.server_id.peer_id.to_base58(), auth)[0])
    if tamper:
        hello["timestamp"] += 1
    return pack(hello)


def test_replayed_hello(tmp_path):
    async def scenario(scene):
        hello = _signed_hello(scene)
        assert (await _raw_exchange(scene, hello))["ok"] is True
        reply = await _raw_exchange(scene, hello)
        assert reply["ok"] is False and "replayed" in reply["error"]["message"]
        assert scene.server.auth_rejected["replayed"] == 1

    run_scene(tmp_path, scenario)


def test_hello_addressed_to_another_node(tmp_path):
    async def scenario(scene):
        reply = await _raw_exchange(scene, _signed_hello(scene, recipient=scene.other_id.peer_id.to_base58()))
        assert reply["ok"] is False and "wrong_recipient" in reply["error"]["message"]

    run_scene(tmp_path, scenario)


def test_tampered_hello(tmp_path):
    async def scenario(scene):
        reply = await _raw_exchange(scene, _signed_hello(scene, tamper=True))
        assert reply["ok"] is False and "bad_signature" in reply["error"]["message"]
        assert scene.server.auth_rejected["bad_signature"] == 1

    run_scene(tmp_path, scenario)


def test_hello_for_another_handler_cannot_open_this_one(tmp_path):
    async def scenario(scene):
        auth = authenticator(scene.honest_id, credential_for(scene.honest_id))
        hello = unpack(hello_frame("agora/v1/info", scene.server_id.peer_id.to_base58(), auth)[0])
        hello["handler"] = "agora/v1/forward"  # the signature covers the handler
        reply = await _raw_exchange(scene, pack(hello))
        assert reply["ok"] is False and "bad_signature" in reply["error"]["message"]

    run_scene(tmp_path, scenario)


def test_stale_timestamp(tmp_path):
    async def scenario(scene):
        auth = authenticator(scene.honest_id, credential_for(scene.honest_id), clock=lambda: time.time() - 300)
        await expect_rejection(scene, RpcClient(scene.client_p2p, authenticator=auth), "stale")

    run_scene(tmp_path, scenario)


def test_revocation_ends_an_open_stream(tmp_path):
    """A stream authenticated before the revocation: its next request is refused and the stream
    closed; an idle one is closed by the server without waiting for a request."""
    async def scenario(scene):
        credential = credential_for(scene.honest_id)
        client = RpcClient(scene.client_p2p, authenticator=authenticator(scene.honest_id, credential))
        assert await scene.call(client) == {"echo": {"x": 1}}
        idle = await _raw_exchange_open(scene, authenticator(scene.honest_id, credential))
        scene.server_auth.revocations = sign_revocation_list(ROOT, run_id=RUN, serials=[credential.credential.serial])
        with pytest.raises(Exception):  # closed by the server's sweep
            await asyncio.wait_for(read_frame(idle[0]), 10)
        idle[1].close()
        assert scene.server.streams_closed["revoked"] >= 1
        # the client's pooled stream was closed the same way; a new stream is refused at its hello
        with pytest.raises((RemoteError, PeerUnavailable)):
            await scene.call(client)
        await expect_rejection(scene, client, "revoked")
        scene.server_auth.revocations = None
        await client.close()

    run_scene(tmp_path, scenario)


def test_a_server_revoked_after_its_stream_opened_is_not_asked_on_it_again(tmp_path):
    """The client checks the server as the server checks it: a pooled stream to a server revoked
    since its ack is not reused, and the new stream's ack is refused (a revoked replica's answers,
    say the sum it closed a step with, are not taken)."""
    async def scenario(scene):
        client_auth = authenticator(scene.honest_id, credential_for(scene.honest_id))
        client = RpcClient(scene.client_p2p, authenticator=client_auth)
        assert await scene.call(client) == {"echo": {"x": 1}}
        server_serial = scene.server_auth.credential().credential.serial
        client_auth.revocations = sign_revocation_list(ROOT, run_id=RUN, serials=[server_serial])
        with pytest.raises(RequestRejected) as info:
            await scene.call(client)
        assert info.value.reason == "revoked"
        client_auth.revocations = None
        assert await scene.call(client) == {"echo": {"x": 1}}
        await client.close()

    run_scene(tmp_path, scenario)


def test_an_expiring_credential_ends_its_streams_and_a_renewed_one_opens_new_ones(tmp_path):
    async def scenario(scene):
        now = [time.time()]
        scene.server_auth.clock = lambda: now[0]
        server_credential = credential_for(scene.server_id, role="worker", stage=0, lifetime_s=7200)
        scene.server_auth.credential = lambda: server_credential
        held = [credential_for(scene.honest_id, lifetime_s=600)]
        auth = PeerAuthenticator(identity=scene.honest_id, run_id=RUN, root_public_key=ROOT_PUBLIC,
                                 credential=lambda: held[0], clock=lambda: now[0])
        client = RpcClient(scene.client_p2p, authenticator=auth)
        assert await scene.call(client) == {"echo": {"x": 1}}
        held[0] = credential_for(scene.honest_id, lifetime_s=1200)  # renewed: the pooled stream is not reused
        now[0] += 700  # the first credential is now expired on the server's clock
        assert await scene.call(client) == {"echo": {"x": 1}}
        assert scene.server.auth_rejected.get("expired", 0) == 0
        # a client that keeps an expired stream is refused and the stream closed
        stale_stream = await _raw_exchange_open(scene, auth)
        now[0] += 1200
        await write_frame(stale_stream[1], pack({"seq": 1, "body": {}}))
        reply = unpack(await read_frame(stale_stream[0]))
        assert reply["ok"] is False and "expired" in reply["error"]["message"]
        stale_stream[1].close()
        scene.server_auth.clock = time.time
        await client.close()

    run_scene(tmp_path, scenario)


async def _raw_exchange_open(scene, auth):
    """A stream past its hello, left open."""
    _, reader, writer = await scene.client_p2p.call_binary_stream_handler(scene.server_p2p.peer_id, "agora/v1/forward")
    await write_frame(writer, hello_frame("agora/v1/forward", scene.server_id.peer_id.to_base58(), auth)[0])
    assert unpack(await read_frame(reader))["ok"] is True
    return reader, writer
