"""Contributors behind NAT serve through the run's relays, on 127.0.0.1: an outsider gets no slot on
a relay, and a worker serving through one authenticates every stream as a direct one does. (The
NAT lab's test, with real masquerading routers, is in test_netlab.py: test files run two at a time,
and two labs at once starve each other's shaping.)"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import yaml

pytestmark = pytest.mark.integration

STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
AVERAGING = {"average_every": 2, "segments": 2, "matchmaking_time_s": 2.0, "request_timeout_s": 1.0,
             "sender_timeout_s": 3.0, "allreduce_timeout_s": 20.0, "part_size_bytes": 16384, "idle_period_s": 4.0}


def _run_config(tmp_path) -> str:
    from protocol.run_presets import PRESETS

    config = dict(PRESETS["tiny"])
    config.update(run_id=f"relay-{uuid.uuid4().hex[:6]}", stages=STAGES, averaging=AVERAGING,
                  evaluation={"every_steps": 0})
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def _log(node) -> str:
    with open(node.log_path, errors="replace") as f:
        return f.read()


def test_an_outsider_gets_no_slot_and_a_relayed_worker_authenticates_every_stream(make_swarm, tmp_path):
    """On 127.0.0.1: a stock libp2p peer with no credential reserves a slot on the run's relay and
    is dropped with it; a worker serving through the relay (`--relay ADDR`) refuses a stream
    without a credential exactly as a direct one does, and serves an admitted caller."""
    from authorizer.testing import AuthorizerProcess

    token = "test-admin-token-0123456789"
    authorizer = AuthorizerProcess(["--run-config", _run_config(tmp_path), "--data-dir", str(tmp_path / "auth"),
                                    "--port", "0", "--admin-token", token, "--no-monitor"],
                                   log_path=str(tmp_path / "authorizer.log"))
    authorizer.start()
    try:
        swarm = make_swarm(None)
        relay = swarm.start_relay(["--authorizer", authorizer.url, "--account-token", token,
                                   "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--pass-grace-s", "2"])
        node_args = ["--authorizer", authorizer.url, "--account-token", "alice"]
        swarm.start("worker", stage=0, args=node_args)
        worker = swarm.start("worker", stage=1, args=[*node_args, "--relay", relay.maddrs[0]])
        assert all("/p2p-circuit/" in m for m in worker.maddrs), worker.maddrs
        outcome = asyncio.run(asyncio.wait_for(_probe_relay(authorizer.url, relay, worker, tmp_path), 120))
    finally:
        authorizer.stop()
    assert outcome["outsider_reachable_before_grace"] in (True, False)  # a race with the grace, either way
    assert outcome["outsider_reachable_after_grace"] is False, outcome["probes_after_grace"]
    # the relay's own limits serve, not libp2p's 128 KiB ones (roles/relay/service.py)
    assert "relay service checked" in _log(relay), _log(relay)[-3000:]
    assert "no credential within 2 s" in _log(relay) and outcome["outsider"] in _log(relay)
    assert "no_credential" in outcome["no_credential"], outcome
    assert outcome["admitted"] == "served", outcome


async def _probe_relay(authorizer_url: str, relay, worker, tmp_path) -> dict:
    from hivemind.p2p import P2P, PeerID

    from node.reachability import RelayPass
    from protocol import hivemind_adapter, version
    from protocol.auth import PeerAuthenticator
    from protocol.errors import RemoteError
    from protocol.relays import circuit_address
    from protocol.transport import RpcClient, dial
    from tests.integration.test_auth_swarm import _admitted_identity

    outcome: dict = {}
    relay_maddr = relay.maddrs[0]
    hivemind_adapter.set_daemon_flags(autoRelay=True, trustedRelays=relay_maddr, relayDiscovery=False,
                                      forceReachabilityPrivate=True, relayService=False)
    try:
        # it listens nowhere, as behind NAT: the relay is the only way to it
        outsider = await P2P.create(no_listen=True, dht_mode="client")
    finally:
        hivemind_adapter.set_daemon_flags(autoRelay=None, trustedRelays=None, relayDiscovery=None,
                                          forceReachabilityPrivate=None, relayService=None)
    outcome["outsider"] = outsider.peer_id.to_base58()
    me, p2p, admission = await _admitted_identity(authorizer_url, str(tmp_path / "caller.key"), "carol")
    authenticator = PeerAuthenticator(identity=me, run_id=admission.credential.credential.run_id,
                                      root_public_key=admission.root_public_key, credential=lambda: admission.credential)
    relay_pass = RelayPass(p2p, [relay_maddr], authenticator)
    try:
        assert await relay_pass.greet_all() == 1, relay_pass.failures

        async def reaches_outsider() -> bool:
            try:
                await dial(p2p, outsider.peer_id, [circuit_address(relay_maddr)], 5)
                await hivemind_adapter.disconnect(p2p, outsider.peer_id)
                return True
            except Exception:  # noqa: BLE001 - no reservation, no circuit
                return False

        outcome["outsider_reachable_before_grace"] = await reaches_outsider()
        await asyncio.sleep(4)  # past the 2 s grace and the next gate sweep
        # Its daemon reserves again at once when dropped (autoRelay), and the gate drops it again
        # (shunned) at its next sweep, 0.5 s later: a probe can land in that window (a CI
        # simulation's did). No lasting slot means: unreachable again within a few probes.
        probes = []
        for _ in range(5):
            probes.append(await reaches_outsider())
            if not probes[-1]:
                break
            await asyncio.sleep(1.0)
        outcome["outsider_reachable_after_grace"] = all(probes)
        outcome["probes_after_grace"] = probes

        peer = PeerID.from_base58(worker.peer_id)
        await dial(p2p, peer, worker.maddrs, 10)  # through the relay: the worker announces nothing else
        try:
            await RpcClient(p2p, timeout_s=10).call(peer, version.INFO, {})
            outcome["no_credential"] = "accepted"
        except RemoteError as exc:
            outcome["no_credential"] = str(exc)
        try:
            await RpcClient(p2p, authenticator=authenticator, timeout_s=10).call(peer, version.INFO, {})
            outcome["admitted"] = "served"
        except RemoteError as exc:
            outcome["admitted"] = str(exc)
        return outcome
    finally:
        await relay_pass.close()
        await p2p.shutdown()
        await outsider.shutdown()
