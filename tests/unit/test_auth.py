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

from protocol.auth import PeerAuthenticator
from protocol.codec import pack, unpack
from protocol.credentials import Credential, root_public_key_bytes, sign_credential, sign_revocation_list
from protocol.errors import ErrorCode, RemoteError
from protocol.framing import read_frame, write_frame
from protocol.identity import load_or_create_identity
from protocol.messages import make_envelope
from protocol.transport import RpcClient, RpcServer

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


async def _raw_exchange(scene, frame: bytes) -> dict:
    _, reader, writer = await scene.client_p2p.call_binary_stream_handler(scene.server_p2p.peer_id, "agora/v1/forward")
    try:
        await write_frame(writer, frame)
        return unpack(await read_frame(reader))
    finally:
        writer.close()


def _signed_frame(scene, *, recipient=None, body=None, tamper=False):
    auth = authenticator(scene.honest_id, credential_for(scene.honest_id))
    envelope = make_envelope(body or {"x": 1})
    envelope.update(auth.sign_request("agora/v1/forward", recipient or scene.server_id.peer_id.to_base58(),
                                      envelope["body"]))
    if tamper:
        envelope["body"] = pack({"x": 2})
    return pack(envelope)


def test_replayed_request(tmp_path):
    async def scenario(scene):
        frame = _signed_frame(scene)
        assert (await _raw_exchange(scene, frame))["ok"] is True
        reply = await _raw_exchange(scene, frame)
        assert reply["ok"] is False and "replayed" in reply["error"]["message"]
        assert scene.server.auth_rejected["replayed"] == 1

    run_scene(tmp_path, scenario)


def test_request_addressed_to_another_node(tmp_path):
    async def scenario(scene):
        reply = await _raw_exchange(scene, _signed_frame(scene, recipient=scene.other_id.peer_id.to_base58()))
        assert reply["ok"] is False and "wrong_recipient" in reply["error"]["message"]

    run_scene(tmp_path, scenario)


def test_tampered_body(tmp_path):
    async def scenario(scene):
        reply = await _raw_exchange(scene, _signed_frame(scene, tamper=True))
        assert reply["ok"] is False and "bad_signature" in reply["error"]["message"]
        assert scene.server.auth_rejected["bad_signature"] == 1

    run_scene(tmp_path, scenario)


def test_stale_timestamp(tmp_path):
    async def scenario(scene):
        auth = authenticator(scene.honest_id, credential_for(scene.honest_id), clock=lambda: time.time() - 300)
        await expect_rejection(scene, RpcClient(scene.client_p2p, authenticator=auth), "stale")

    run_scene(tmp_path, scenario)
