"""How much peer authentication adds to a forward round trip (the aim: ≤ 5 %).

Two libp2p peers in one process; the server answers `agora/v1/forward` by validating the request
exactly as a worker does, then (optionally) running the tiny head stage's forward. The same
client calls it with and without credentials, in interleaved blocks, and the ratio of median
round trips is reported. Authentication happens once per stream (a signed hello and a signed
ack, protocol/auth.py); a request on an open stream adds only a sequence-number and an
expiry/revocation check. Without compute it is the worst case for that. The `new_stream` case
opens a fresh stream for every call (no pooling), so each round trip pays the whole hello: two
Ed25519 signatures and two verifications.
"""

from __future__ import annotations

import asyncio
import statistics
import time
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hivemind.p2p import P2P

from protocol import version
from protocol.auth import PeerAuthenticator
from protocol.codec import encode_tensor
from protocol.credentials import Credential, root_public_key_bytes, sign_credential
from protocol.identity import load_or_create_identity
from protocol.messages import ForwardRequest, parse_model
from protocol.transport import RpcClient, RpcServer

RUN = "bench-auth"


def _credential(root, identity, role, stage=None):
    now = int(time.time())
    return sign_credential(root, Credential(
        run_id=RUN, peer_id=identity.peer_id.to_base58(), public_key=identity.public_key, role=role, stage=stage,
        issued_at=now, expires_at=now + 3600, serial=int.from_bytes(identity.public_key[:6], "big")))


async def _measure(workdir: str, *, seq_len: int, rank: int, compute: bool, blocks: int, per_block: int,
                   pooled: bool = True) -> dict:
    root = Ed25519PrivateKey.generate()
    server_id = load_or_create_identity(f"{workdir}/server.key")
    client_id = load_or_create_identity(f"{workdir}/client.key")
    server_p2p = await P2P.create(identity_path=server_id.path, check_if_identity_free=False)
    client_p2p = await P2P.create(identity_path=client_id.path, check_if_identity_free=False,
                                  initial_peers=await server_p2p.get_visible_maddrs())
    model = None
    if compute:
        from protocol.run_config import load_run_config
        from roles.model.stage import StageModel

        model = StageModel(load_run_config("tiny"), 0)

    def forward(peer_id, body):
        request = parse_model(ForwardRequest, body)
        if model is not None:
            with torch.no_grad():
                return {"coords": encode_tensor(model(None, request.tokens.unsqueeze(0))[0])}
        return {"coords": encode_tensor(torch.zeros(seq_len, rank))}

    async def handler(peer_id, body):
        return forward(peer_id, body)

    def authenticator(identity, credential):
        return PeerAuthenticator(identity=identity, run_id=RUN, root_public_key=root_public_key_bytes(root),
                                 credential=lambda: credential)

    servers = {
        "plain": RpcServer(server_p2p),
        "auth": RpcServer(server_p2p, authenticator=authenticator(server_id, _credential(root, server_id, "worker", 0))),
    }
    await servers["plain"].add_handler("agora/v1/plain_forward", handler)
    await servers["auth"].add_handler(version.FORWARD, handler, roles=frozenset({"trainer"}))
    clients = {
        "plain": (RpcClient(client_p2p, max_idle_per_peer=16 if pooled else 0), "agora/v1/plain_forward"),
        "auth": (RpcClient(client_p2p, max_idle_per_peer=16 if pooled else 0,
                           authenticator=authenticator(client_id, _credential(root, client_id, "trainer"))),
                 version.FORWARD),
    }
    vocab = 256
    body_tokens = encode_tensor(torch.randint(0, vocab, (seq_len,)))
    samples: dict[str, list[float]] = {"plain": [], "auth": []}
    try:
        for kind, (client, name) in clients.items():  # warm up both paths
            for _ in range(20):
                await client.call(server_p2p.peer_id, name, {"stage": 0, "sample_id": "w", "tokens": body_tokens})
        for block in range(blocks):
            for kind in (("plain", "auth") if block % 2 == 0 else ("auth", "plain")):
                client, name = clients[kind]
                for i in range(per_block):
                    started = time.perf_counter()
                    await client.call(server_p2p.peer_id, name, {"stage": 0, "sample_id": f"{block}-{i}",
                                                                 "tokens": body_tokens})
                    samples[kind].append(time.perf_counter() - started)
    finally:
        for client, _ in clients.values():
            await client.close()
        await client_p2p.shutdown()
        await server_p2p.shutdown()
    plain, auth = statistics.median(samples["plain"]), statistics.median(samples["auth"])
    return {
        "seq_len": seq_len, "rank": rank, "compute": "tiny head forward" if compute else "none (worst case)",
        "streams": "pooled" if pooled else "new_stream (a hello per call)",
        "round_trips_each": len(samples["plain"]),
        "plain_p50_ms": round(plain * 1e3, 3), "auth_p50_ms": round(auth * 1e3, 3),
        "auth_overhead_ratio": round(auth / plain, 4),
    }


def measure_auth_overhead(workdir: str, *, quick: bool = False) -> dict:
    blocks, per_block = (6, 50) if quick else (10, 100)
    cases = [
        asyncio.run(_measure(workdir, seq_len=64, rank=16, compute=True, blocks=blocks, per_block=per_block)),
        asyncio.run(_measure(workdir, seq_len=64, rank=16, compute=False, blocks=blocks, per_block=per_block)),
        asyncio.run(_measure(workdir, seq_len=2048, rank=40, compute=False, blocks=blocks, per_block=per_block // 2)),
        asyncio.run(_measure(workdir, seq_len=64, rank=16, compute=False, blocks=blocks, per_block=per_block // 2,
                             pooled=False)),
    ]
    return {"auth_overhead_ratio": cases[0]["auth_overhead_ratio"], "auth_overhead_cases": cases,
            "auth_overhead_method": __doc__.strip().split("\n\n")[1].replace("\n", " ")}


if __name__ == "__main__":
    import json
    import sys
    import tempfile

    print(json.dumps(measure_auth_overhead(tempfile.mkdtemp(), quick="--quick" in sys.argv)))
