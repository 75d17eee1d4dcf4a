"""Who may average with a replica (roles/worker/averaging/access.py): a current, unrevoked worker
of its stage, proven by the credential in its gathered metadata; every refusal counted by reason
across the fork to the averager process; and a group with anyone else in it refused."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

import hivemind
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from protocol.auth_state import SharedAuthState
from protocol.credentials import Credential, root_public_key_bytes, sign_credential, sign_revocation_list
from protocol.identity import Identity
from protocol.run_config import AveragingConfig
from roles.worker.averaging.access import CREDENTIAL_KEY, AveragingAccess, AveragingRefused, Refusal, RefusalCounts
from roles.worker.averaging.averager import SpartaAverager

ROOT = Ed25519PrivateKey.generate()
RUN = "run-a"


def identity() -> Identity:
    return Identity(Ed25519PrivateKey.generate(), path="")


def credential(who: Identity, *, role="worker", stage=0, root=ROOT, run_id=RUN, ttl_s=600, serial=1,
               issued_at=None) -> bytes:
    issued = int(time.time()) if issued_at is None else issued_at
    cred = Credential(run_id=run_id, peer_id=who.peer_id.to_base58(), public_key=who.public_key, role=role,
                      stage=None if role == "trainer" else stage, issued_at=issued, expires_at=issued + ttl_s,
                      serial=serial)
    return sign_credential(root, cred).to_bytes()


@pytest.fixture
def state(tmp_path):
    return SharedAuthState(str(tmp_path / "trust"), run_id=RUN, root_public_key=root_public_key_bytes(ROOT))


def test_only_a_current_worker_of_our_stage_is_admitted(state):
    access = AveragingAccess(state, stage=0)
    worker, other = identity(), identity()
    peer = worker.peer_id.to_base58()
    assert access.verify(peer, {CREDENTIAL_KEY: credential(worker)}).stage == 0
    assert access.is_verified(peer)
    cases = {
        Refusal.NO_CREDENTIAL: (peer, {"kind": "step"}),
        Refusal.MALFORMED: (peer, {CREDENTIAL_KEY: b"\x93garbage"}),
        Refusal.BAD_SIGNATURE: (peer, {CREDENTIAL_KEY: credential(worker, root=Ed25519PrivateKey.generate())}),
        Refusal.EXPIRED: (peer, {CREDENTIAL_KEY: credential(worker, issued_at=int(time.time()) - 7200)}),
        Refusal.WRONG_PEER: (other.peer_id.to_base58(), {CREDENTIAL_KEY: credential(worker)}),
        Refusal.WRONG_RUN: (peer, {CREDENTIAL_KEY: credential(worker, run_id="run-b")}),
        Refusal.WRONG_ROLE: (peer, {CREDENTIAL_KEY: credential(worker, role="trainer")}),
        Refusal.WRONG_STAGE: (peer, {CREDENTIAL_KEY: credential(worker, stage=1)}),
    }
    for reason, (who, metadata) in cases.items():
        with pytest.raises(AveragingRefused) as caught:
            access.verify(who, metadata)
        assert caught.value.reason == reason, (reason, caught.value)
    assert not access.is_verified(other.peer_id.to_base58()), "a refused peer is not remembered"
    with pytest.raises(AveragingRefused, match="no_credential"):
        access.verify(peer, None)


def test_a_verified_peer_is_forgotten_when_its_credential_expires_or_is_revoked(state):
    access = AveragingAccess(state, stage=0)
    worker, banned = identity(), identity()
    access.verify(worker.peer_id.to_base58(), {CREDENTIAL_KEY: credential(worker, serial=7, ttl_s=600)})
    assert not access.is_verified(worker.peer_id.to_base58(), now=time.time() + 700), "expired (beyond the skew)"
    access.verify(worker.peer_id.to_base58(), {CREDENTIAL_KEY: credential(worker, serial=7)})
    access.verify(banned.peer_id.to_base58(), {CREDENTIAL_KEY: credential(banned, serial=8)})
    state.publish_revocations(sign_revocation_list(ROOT, run_id=RUN, serials=[7],
                                                   peer_ids=[banned.peer_id.to_base58()]))
    assert not access.is_verified(worker.peer_id.to_base58()), "its serial was revoked"
    assert not access.is_verified(banned.peer_id.to_base58()), "its peer id was banned"
    with pytest.raises(AveragingRefused, match="revoked"):
        access.verify(banned.peer_id.to_base58(), {CREDENTIAL_KEY: credential(banned, serial=9)})


def test_refusals_counted_in_a_forked_child_reach_the_parent():
    counts = RefusalCounts()

    def child():
        for _ in range(3):
            counts.add(Refusal.WRONG_STAGE)
        counts.add(Refusal.UNVERIFIED)

    process = mp.get_context("fork").Process(target=child)
    process.start()
    process.join(30)
    assert process.exitcode == 0
    assert counts.snapshot() == {"wrong_stage": 3, "unverified": 1}


@pytest.fixture(scope="module")
def dht():
    node = hivemind.DHT(start=True)
    yield node
    node.shutdown()


def _averager(dht, access) -> SpartaAverager:
    config = AveragingConfig()
    return SpartaAverager(torch.zeros(8), dht, access=access, prefix="access_test", admission_wait_s=0.3,
                          target_group_size=2, min_matchmaking_time=config.matchmaking_time_s, daemon=True)


def test_the_averager_refuses_strangers_and_groups_with_a_non_worker_in_them(dht, state):
    """The hooks the averager process runs (called here in the test's process)."""
    access = AveragingAccess(state, stage=0)
    averager = _averager(dht, access)
    worker, trainer, stranger = identity(), identity(), identity()
    me = averager.peer_id.to_base58()
    honest = {me: {"kind": "clock"}, worker.peer_id.to_base58(): {CREDENTIAL_KEY: credential(worker)}}

    async def scene():
        assert not await averager.admit_part(worker.peer_id.to_base58()), "not verified yet: waits, then refuses"
        assert not await averager.admit_state_request(stranger.peer_id.to_base58())
        assert not await averager.admit_join(stranger.peer_id.to_base58(), None)
        assert not await averager.admit_join(trainer.peer_id.to_base58(),
                                             {CREDENTIAL_KEY: credential(trainer, role="trainer")})
        # a part that arrives just before our check of its group waits for it
        waiting = asyncio.create_task(averager.admit_part(worker.peer_id.to_base58()))
        await asyncio.sleep(0.05)
        assert averager.check_group(honest) is None
        assert await waiting
        assert await averager.admit_state_request(worker.peer_id.to_base58())
        led_by_trainer = {**honest, trainer.peer_id.to_base58(): {CREDENTIAL_KEY: credential(trainer, role="trainer")}}
        refusal = averager.check_group(led_by_trainer)
        assert refusal is not None and "wrong_role" in refusal and "1 of its 3 members" in refusal

    asyncio.run(scene())
    assert access.refusals() == {"no_credential": 1, "wrong_role": 1, "unverified": 2, "group": 1}


def test_in_an_open_run_everyone_is_admitted(dht):
    averager = _averager(dht, None)

    async def scene():
        assert await averager.admit_join("anyone", None)
        assert await averager.admit_part("anyone")
        assert await averager.admit_state_request("anyone")
        assert averager.check_group({"anyone": {}}) is None

    asyncio.run(scene())
