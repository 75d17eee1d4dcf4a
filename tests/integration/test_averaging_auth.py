"""Averaging behind credentials, in an authenticated run on 127.0.0.1 with a real authorizer
(roles/worker/averaging/access.py): a peer with no credential, a credentialed worker of another
stage and a trainer are refused by a reducer's averager before hivemind reads their requests, and
counted by reason; a worker of the stage gets hivemind's own answer; the stage's credentialed
replicas average with each other as before. A worker of an account the policy lists in
`reducer_accounts` is designated a reducer at placement, without --reducer."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import uuid

import pytest

from authorizer.testing import AuthorizerProcess
from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

TWO_STAGES = [{"first_layer": 0, "last_layer": 2}, {"first_layer": 2, "last_layer": 3}]
IDLE_ROUNDS = {"average_every": 2, "segments": 4, "matchmaking_time_s": 1.5, "request_timeout_s": 0.7,
               "sender_timeout_s": 2.0, "allreduce_timeout_s": 20.0, "part_size_bytes": 4096, "idle_period_s": 3.0}


@pytest.fixture
def authorizer(tmp_path, run_config_path):
    config = run_config_path(stages=TWO_STAGES, run_id=f"avg-{uuid.uuid4().hex[:6]}", averaging=IDLE_ROUNDS)
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"reducer_accounts: [{hashlib.sha256(b'alice').hexdigest()}]\n")
    process = AuthorizerProcess(
        ["--run-config", config, "--data-dir", str(tmp_path / "authorizer"), "--port", "0",
         "--credential-ttl-s", "600", "--admin-token", "test-admin-token-0123456789", "--stage-capacity", "4",
         "--policy-file", str(policy)],
        log_path=str(tmp_path / "authorizer.log"))
    process.start()
    yield process
    process.stop()


def _log_has(node, text: str) -> bool:
    try:
        with open(node.log_path, errors="replace") as f:
            return text in f.read()
    except OSError:
        return False


async def _admitted(authorizer_url: str, path: str, account: str, role: str):
    """A fresh identity admitted with `role`, listening (the authorizer dials it back)."""
    from hivemind.p2p import P2P

    from node.admission import AuthorizerClient, join_run, measured_hardware
    from protocol.identity import load_or_create_identity

    identity = load_or_create_identity(path)
    p2p = await P2P.create(identity_path=identity.path, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                           check_if_identity_free=False)
    client = AuthorizerClient(authorizer_url)
    try:
        visible = [str(m) for m in await p2p.get_visible_maddrs()]
        admission = await join_run(client, identity, role, announce_maddrs=visible, account_token=account,
                                   hardware=measured_hardware("cpu"))
    finally:
        await client.close()
    return p2p, admission


async def _ask(p2p, worker, prefix: str, credential: bytes | None, *, admitted: bool = False
               ) -> tuple[int, int, int]:
    """`_ask_once`, again if hivemind's client lost the race it has with a server that answers and
    closes a stream before the client finished writing to it (BrokenPipeError on the read, or a
    part answered with nothing). A refused part may end so by design; an `admitted` caller's part
    is answered by hivemind, so an empty answer there is that race too, and is asked again."""
    from hivemind.proto import averaging_pb2

    for attempt in range(3):
        try:
            join, part, state = await _ask_once(p2p, worker, prefix, credential)
        except (BrokenPipeError, ConnectionResetError):
            if attempt == 2:
                raise
            continue
        if part is None and admitted and attempt < 2:
            continue
        # hivemind itself always answers a part, so an empty reply is a refusal
        return join, averaging_pb2.PROTOCOL_VIOLATION if part is None else part, state
    raise AssertionError("unreachable")


async def _ask_once(p2p, worker, prefix: str, credential: bytes | None) -> tuple[int, int | None, int]:
    """Call a worker's three averaging RPCs as hivemind would: (join reply code, first reply code to
    a part or None if the part stream ended without one, number of state messages)."""
    from hivemind.p2p import PeerID
    from hivemind.proto import averaging_pb2
    from hivemind.utils import MSGPackSerializer, get_dht_time
    from hivemind.utils.asyncio import aiter_with_timeout, as_aiter

    from protocol.hivemind_adapter import connect
    from roles.worker.averaging.averager import SpartaAverager

    peer = PeerID.from_base58(worker.peer_id)
    await connect(p2p, peer, [m.split("/p2p/")[0] for m in worker.maddrs])
    metadata = {"kind": "clock", "round": 0} if credential is None else {"kind": "clock", "credential": credential}
    gather = MSGPackSerializer.dumps([0.0, 0, MSGPackSerializer.dumps(metadata)])
    stub = SpartaAverager.get_stub(p2p, peer, namespace=prefix)

    async def replies(stream):
        return [message async for message in aiter_with_timeout(await stream, 15)]

    # one after the other: a part or state request may only follow the join that verified us
    join = await replies(stub.rpc_join_group(averaging_pb2.JoinRequest(
        schema_hash=b"x", expiration=get_dht_time() + 5, gather=gather, group_key=f"{prefix}.0b0")))
    part = await replies(stub.rpc_aggregate_part(as_aiter(averaging_pb2.AveragingData(
        code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"a group of mine"))))
    state = await replies(stub.rpc_download_state(averaging_pb2.DownloadRequest()))
    # a refused part may reach us as a closed stream (answered before it was read, then reset)
    return join[0].code, part[0].code if part else None, len(state)


@pytest.mark.timeout(300)
def test_only_credentialed_workers_of_the_stage_reach_the_averager(make_swarm, authorizer, tmp_path):
    from hivemind.p2p import P2P, PeerID
    from hivemind.proto import averaging_pb2

    from protocol import version
    from protocol.auth import PeerAuthenticator
    from protocol.identity import load_or_create_identity
    from protocol.transport import RpcClient
    from roles.worker.averaging.averager import averaging_prefix

    refused = (averaging_pb2.PROTOCOL_VIOLATION, averaging_pb2.PROTOCOL_VIOLATION, 0)
    swarm = make_swarm(None, common_args=["--announce-period-s", "1"])
    workers = [swarm.start("worker", args=["--authorizer", authorizer.url, "--account-token", name]
                           + ([] if name == "alice" else ["--reducer"]), wait_ready=False)
               for name in ("alice", "bob", "carol")]
    for worker in workers:
        swarm.wait_ready(worker)
    stages = [w.stage for w in workers]
    paired = max(set(stages), key=stages.count)
    pair = [w for w in workers if w.stage == paired]
    [lone] = [w for w in workers if w.stage != paired]
    assert len(pair) == 2, stages
    # the stage's credentialed replicas average with each other, credentials and all
    poll_until(lambda: all(_log_has(w, "complete, group 2/2") for w in pair), 120,
               "a complete round of the two replicas of one stage", period_s=0.5)

    async def attacks():
        stranger = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        # the next worker goes to the stage with one replica: a worker of the *other* stage for the pair
        other_stage, other_admission = await _admitted(authorizer.url, str(tmp_path / "w.key"), "dave", "worker")
        trainer, trainer_admission = await _admitted(authorizer.url, str(tmp_path / "t.key"), "erin", "trainer")
        run_id = other_admission.credential.credential.run_id
        try:
            assert other_admission.stage == lone.stage != paired
            target, prefix = pair[0], averaging_prefix(run_id, paired)
            results = {
                "no_credential": await _ask(stranger, target, prefix, None),
                "other_stage": await _ask(other_stage, target, prefix, other_admission.credential.to_bytes()),
                "trainer": await _ask(trainer, target, prefix, trainer_admission.credential.to_bytes()),
                "same_stage": await _ask(other_stage, lone, averaging_prefix(run_id, lone.stage),
                                         other_admission.credential.to_bytes(), admitted=True),
            }
            identity = load_or_create_identity(str(tmp_path / "t.key"))
            auth = PeerAuthenticator(identity=identity, run_id=run_id,
                                     root_public_key=trainer_admission.root_public_key,
                                     credential=lambda: trainer_admission.credential)
            client = RpcClient(trainer, authenticator=auth, timeout_s=10)
            try:
                info = await client.call(PeerID.from_base58(target.peer_id), version.INFO, {})
            finally:
                await client.close()
            return results, info
        finally:
            for p2p in (stranger, other_stage, trainer):
                await p2p.shutdown()

    results, info = asyncio.run(asyncio.wait_for(attacks(), 90))
    print(f"averaging RPCs answered: {results}")
    assert results["no_credential"] == refused, results
    assert results["other_stage"] == refused, results
    assert results["trainer"] == refused, results
    # a worker of the lone replica's stage passes the check and gets hivemind's own answers: not
    # looking for a group, no such group, and no state (state sharing is off in our averagers)
    assert results["same_stage"] == (averaging_pb2.NOT_LOOKING_FOR_GROUP, averaging_pb2.BAD_GROUP_ID, 0), results
    counters = info["counters"]
    assert counters.get("averaging_refused_no_credential", 0) >= 1, counters
    assert counters.get("averaging_refused_wrong_stage", 0) >= 1, counters
    assert counters.get("averaging_refused_wrong_role", 0) >= 1, counters
    assert counters.get("averaging_refused_unverified", 0) >= 6, "3 part and 3 state requests"

    assert swarm.stop(pair[0], signal.SIGTERM) == 0, pair[0].log_tail()
    averaging = pair[0].summary()["averaging"]
    assert {"no_credential", "wrong_stage", "wrong_role", "unverified"} <= set(averaging["refused"]), averaging
    assert averaging["counters"].get("rounds_complete", 0) >= 1, averaging["counters"]
    assert swarm.stop(lone, signal.SIGTERM) == 0, lone.log_tail()
    assert lone.summary()["averaging"]["refused"] == {}, ("the worker of its stage was admitted throughout",
                                                          lone.summary()["averaging"])
    alice = workers[0]  # no --reducer, but her account is in the policy's reducer_accounts
    assert swarm.stop(alice, signal.SIGTERM) == 0, alice.log_tail()
    designated = alice.summary()["averaging"]
    assert designated["reducer"] and not designated["elected"], designated
    assert _log_has(alice, "the authorizer designated this worker a reducer"), alice.log_tail()
