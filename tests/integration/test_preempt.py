"""Failure injection through operator orders [report 3.5.3.1], on 127.0.0.1 with a real authorizer:
`agora-node preempt` kills a replica mid averaging round (it dies by SIGKILL, says so once in its
log, and leaves no process, socket or trust directory behind), its two peers' next round completes
without it, and an order forged by a trainer is refused by the DHT and counted, doing nothing."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from authorizer.testing import AuthorizerProcess
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
IDLE_ROUNDS = {"average_every": 2, "segments": 4, "matchmaking_time_s": 1.5, "request_timeout_s": 0.7,
               "sender_timeout_s": 2.0, "allreduce_timeout_s": 20.0, "part_size_bytes": 4096, "idle_period_s": 3.0}
ADMIN = "test-admin-token-0123456789"


@pytest.fixture
def authorizer(tmp_path, run_config_path):
    config = run_config_path(stages=TWO_STAGES, run_id=f"preempt-{uuid.uuid4().hex[:6]}", averaging=IDLE_ROUNDS)
    process = AuthorizerProcess(
        ["--run-config", config, "--data-dir", str(tmp_path / "authorizer"), "--port", "0",
         "--credential-ttl-s", "600", "--admin-token", ADMIN, "--stage-capacity", "3,0"],
        log_path=str(tmp_path / "authorizer.log"))
    process.start()
    yield process
    process.stop()


def _log(node) -> str:
    try:
        with open(node.log_path, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _unix_sockets(processes: list[psutil.Process]) -> set[str]:
    paths = set()
    for process in processes:
        try:
            paths |= {c.laddr for c in process.net_connections(kind="unix") if isinstance(c.laddr, str) and c.laddr}
        except psutil.Error:
            continue
    return paths


def _group_alive(pgid: int) -> list[int]:
    alive = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
        except (OSError, psutil.Error):
            continue
    return alive


def _forge_order(authorizer_url: str, tmp_path, target: str) -> tuple[bool, list[dict]]:
    """A trainer of the run signs a `now` order for `target` with its own key and credential and
    stores it from its own DHT node: (whether any node accepted it, its own validator's rejections)."""
    import asyncio

    from hivemind.p2p import P2P

    from node.admission import AuthorizerClient, join_run, measured_hardware
    from node.swarm import join_swarm
    from protocol.auth_state import SharedAuthState
    from protocol.control_orders import new_order, sign_order_as_operator
    from protocol.dht_auth import CredentialDHTAuthorizer
    from protocol.dht_schema import control_key
    from protocol.identity import load_or_create_identity
    from protocol.records import drain_observations

    identity = load_or_create_identity(str(tmp_path / "forger.key"))

    async def admitted():
        p2p = await P2P.create(identity_path=identity.path, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                               check_if_identity_free=False)
        client = AuthorizerClient(authorizer_url)
        try:
            visible = [str(m) for m in await p2p.get_visible_maddrs()]
            return await join_run(client, identity, "trainer", announce_maddrs=visible, account_token="mallory",
                                  hardware=measured_hardware("cpu"))
        finally:
            await client.close()
            await p2p.shutdown()

    admission = asyncio.run(asyncio.wait_for(admitted(), 60))
    run_id = admission.credential.credential.run_id
    auth = SharedAuthState(str(tmp_path / "forger-trust"), run_id=run_id, root_public_key=admission.root_public_key)
    auth.publish_credential(admission.credential)
    membership = join_swarm(identity=identity, run_id=run_id, num_stages=len(TWO_STAGES),
                            initial_peers=admission.bootstrap_peers, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                            announce_maddrs=[], bootstrap_timeout_s=20, auth_state=auth,
                            authorizer=CredentialDHTAuthorizer(identity, auth))
    try:
        order = new_order(run_id=run_id, peer_id=target, moment="now", ttl_s=60)
        forged = sign_order_as_operator(identity, admission.credential.to_bytes(), order)
        stored = membership.dht.store(control_key(run_id), forged.to_dht_value(), expiration_time=order.expires_at,
                                      subkey=order.subkey)
        drained = membership.dht.run_coroutine(functools.partial(drain_observations,
                                                                 token=membership.validator.token))
        return bool(stored), drained["rejections"]
    finally:
        membership.shutdown()


@pytest.mark.timeout(180)
def test_preempt_a_replica_mid_round(make_swarm, authorizer, tmp_path):
    swarm = make_swarm(None, common_args=["--announce-period-s", "1"])
    workers = [swarm.start("worker", args=["--authorizer", authorizer.url, "--account-token", name, "--reducer"],
                           wait_ready=False) for name in ("alice", "bob", "carol")]
    for worker in workers:
        swarm.wait_ready(worker)
    assert [w.stage for w in workers] == [0, 0, 0]
    poll_until(lambda: all("complete, group 3/3" in _log(w) for w in workers), 60,
               "a complete round of the three replicas", period_s=0.5)
    victim, survivors = workers[0], workers[1:]

    # a trainer's order is refused by every validator (its own counts it) and kills nobody
    stored, rejections = _forge_order(authorizer.url, tmp_path, survivors[0].peer_id)
    assert not stored
    assert any(r["reason"] == "order_not_operator" and r["role"] == "trainer" for r in rejections), rejections

    tree = _tree(victim.proc.pid)
    sockets = _unix_sockets(tree)
    started = time.monotonic()
    cli = subprocess.run(
        [sys.executable, "-m", "node.cli", "preempt", "--authorizer", authorizer.url, "--admin-token", ADMIN,
         "--peer", victim.peer_id, "--at", "chunk_send", "--wait-s", "40", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert cli.returncode == 0, cli.stderr
    lines = cli.stdout.strip().splitlines()
    assert lines[0].startswith("preempt order_id=") and f"peer={victim.peer_id} at=chunk_send" in lines[0], lines
    assert lines[-1].startswith(f"gone peer={victim.peer_id}"), lines
    order_id = lines[0].split()[1].removeprefix("order_id=")
    print(f"preempted in {time.monotonic() - started:.1f}s: {lines}")

    assert swarm.wait(victim, 30) == -9, victim.log_tail()
    assert _log(victim).count("preempted by operator order") == 1
    assert f"preempted by operator order {order_id} at chunk_send" in _log(victim)
    poll_until(lambda: not _group_alive(victim.proc.pid) and not any(p.is_running() and p.status() != "zombie"
                                                                     for p in tree if _safe(p)), 10,
               "every process of the preempted node to be gone", period_s=0.2)
    poll_until(lambda: not any(os.path.exists(path) for path in sockets), 10,
               f"the preempted node's unix sockets to be removed ({sorted(sockets)})", period_s=0.2)
    from node.lifecycle import trust_dirs

    assert trust_dirs(victim.proc.pid) == []

    # the two survivors' next round completes without it; the forged order never touched them
    marks = {w.name: len(_log(w)) for w in survivors}
    poll_until(lambda: all("complete, group 2/2" in _log(w)[marks[w.name]:] for w in survivors), 60,
               "a complete round of the two survivors", period_s=0.5)
    assert all(w.proc.poll() is None for w in survivors)
    assert all("preempted by operator order" not in _log(w) for w in survivors)


def _safe(process: psutil.Process) -> bool:
    try:
        return process.is_running()
    except psutil.Error:
        return False


def test_preempt_cli_refuses_a_wrong_admin_token(authorizer):
    cli = subprocess.run(
        [sys.executable, "-m", "node.cli", "preempt", "--authorizer", authorizer.url, "--admin-token", "wrong",
         "--peer", "12D3KooWLbCgzGTh5y2pNU3zQz8XVnLSDnoKfBrKp5uAnZGqmNYo", "--at", "now"],
        capture_output=True, text=True, timeout=60)
    assert cli.returncode == 2
    assert cli.stderr.count("\n") == 1 and "admin token" in cli.stderr and "Traceback" not in cli.stderr
