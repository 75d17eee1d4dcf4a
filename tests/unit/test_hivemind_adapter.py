"""Every private or undocumented hivemind name agora-node relies on (protocol/hivemind_adapter.py),
exercised on real objects: a hivemind upgrade that moves one of them fails here, naming it,
instead of somewhere deep in an averaging round or a dial."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import aiter_with_timeout, as_aiter

from protocol import hivemind_adapter
from protocol.hivemind_adapter import (
    ADMITTED_RPCS,
    PRIVATE_API,
    TESTED_VERSIONS,
    AdaptedAverager,
    AdaptedRunner,
    HivemindIncompatible,
    HoldingReducer,
    connect,
    decode_gather,
    disconnect,
    missing_attributes,
    missing_private_api,
    rpc_names,
    version_problem,
)
from protocol.identity import load_or_create_identity


def test_the_installed_hivemind_is_the_tested_one():
    assert version_problem() is None, version_problem()
    problem = version_problem("1.2.0")
    assert "hivemind 1.2.0 is installed" in problem and f"hivemind=={TESTED_VERSIONS[1]}" in problem


def test_class_level_private_names_exist_with_the_signatures_we_override():
    assert missing_private_api() == [], "hivemind changed under protocol/hivemind_adapter.py"


def test_a_missing_name_is_reported_by_name(monkeypatch):
    monkeypatch.delattr(AllReduceRunner, "_accumulate_parts_streaming")
    assert "AllReduceRunner._accumulate_parts_streaming: missing" in missing_private_api()
    with pytest.raises(HivemindIncompatible, match=r"no P2P\._client, which agora-node relies on"):
        asyncio.run(connect(object(), None, []))
    with pytest.warns(hivemind_adapter.HivemindVersionWarning, match="_accumulate_parts_streaming: missing"):
        monkeypatch.setattr(hivemind_adapter, "version_problem", lambda: "hivemind 9 is installed")
        hivemind_adapter._check_at_import()


class CountingRunner(AdaptedRunner):
    def __init__(self, **kwargs):
        self.sent = self.reduced = 0
        super().__init__(**kwargs)

    async def after_part_sent(self) -> None:
        self.sent += 1

    async def after_part_reduced(self) -> None:
        self.reduced += 1


@pytest.mark.timeout(60)
def test_dial_and_an_instrumented_all_reduce_between_two_real_daemons():
    async def scene():
        a = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        b = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        try:
            for p2p in (a, b):
                assert missing_attributes(p2p, "P2P") == []
            address = [str(m).split("/p2p/")[0] for m in await b.get_visible_maddrs()]
            await connect(a, b.peer_id, address)
            assert b.peer_id in {info.peer_id for info in await a.list_peers()}

            peers = [a.peer_id, b.peer_id]
            tensors = {a.peer_id: torch.arange(100, dtype=torch.float32), b.peer_id: torch.zeros(100)}
            runners = [CountingRunner(p2p=p2p, servicer_type=CountingRunner, prefix="adapter-test", group_id=b"g",
                                      tensors=[tensors[p2p.peer_id].clone()], ordered_peer_ids=peers,
                                      peer_fractions=(0.5, 0.5), part_size_bytes=64) for p2p in (a, b)]
            for p2p, runner in zip((a, b), runners):
                await runner.add_p2p_handlers(p2p, namespace="adapter-test")
                assert missing_attributes(runner, "AllReduceRunner") == []
                assert missing_attributes(runner.tensor_part_container, "TensorPartContainer") == []
                assert missing_attributes(runner.tensor_part_reducer, "TensorPartReducer") == []
            sizes = [runner.slice_sizes() for runner in runners]  # the parts are consumed by the round
            assert sizes[0] == sizes[1] and sum(sizes[0]) == 100

            async def run(runner):
                return [delta async for delta in runner]

            deltas = await asyncio.gather(*(run(r) for r in runners))
            mean = (tensors[a.peer_id] + tensors[b.peer_id]) / 2
            for p2p, delta in zip((a, b), deltas):
                assert torch.allclose(tensors[p2p.peer_id] + delta[0], mean)
            for runner in runners:
                assert runner.peers == [p.to_base58() for p in peers] and runner.mode_names() == ["node", "node"]
                assert runner.values_received() == {p.to_base58(): sizes[0][runner.index] for p in peers}
                assert runner.banned() == []
                assert runner.sent > 0 and runner.reduced > 0, "the per-part hooks ran"
            await disconnect(a, b.peer_id)
        finally:
            await a.shutdown()
            await b.shutdown()

    asyncio.run(scene())


@pytest.mark.timeout(60)
def test_the_averager_process_has_what_the_adapter_reaches_into():
    dht = hivemind.DHT(start=True)
    averager = AdaptedAverager([torch.zeros(8)], dht, prefix="adapter_test", target_group_size=2, start=False,
                               daemon=True)
    try:
        assert missing_attributes(averager, "DecentralizedAverager") == []
        averager.start()  # not run_in_background: it would make this process ignore SIGINT
        averager.wait_until_ready(30)
        assert averager.probe_private_api().result(30) == [], "names gone from hivemind's averager process"
        averager.set_round_group("0110", 3).result(30)
        assert averager.get_group_bits() == "0110"
        with averager.tensors_locked(5) as acquired:
            assert acquired
            with averager.tensors_locked(0.1) as again:
                assert not again, "the buffer lock is not re-entrant across the averager's users"
    finally:
        averager.shutdown()
        dht.shutdown()


@pytest.mark.timeout(90)
def test_two_senders_find_no_group_until_one_is_promoted_to_reducer():
    first = hivemind.DHT(start=True)
    second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True)
    averagers = [AdaptedAverager([torch.full((16,), float(i))], dht, prefix="promote_test", target_group_size=2,
                                 min_matchmaking_time=2.0, request_timeout=1.0, client_mode=True, start=False,
                                 daemon=True)
                 for i, dht in enumerate((first, second))]
    try:
        for averager in averagers:
            averager.start()
            averager.wait_until_ready(30)
        controls = [a.step(wait=False, timeout=4, allow_retries=False) for a in averagers]
        for control in controls:
            with pytest.raises(AllreduceException, match="could not find a group"):  # clients lead no group
                control.result(30)
        assert averagers[0].promote_to_reducer().result(30) is True
        assert averagers[0].promote_to_reducer().result(30) is False, "promoting twice changes nothing"
        assert averagers[0].mode.name == "NODE" and not averagers[0].client_mode
        controls = [a.step(wait=False, timeout=10, allow_retries=False) for a in averagers]
        for control in controls:
            control.result(60)
        tensors = []
        for averager in averagers:
            with averager.get_tensors() as local:
                tensors.append(local[0].clone())
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
    assert all(torch.allclose(t, torch.full((16,), 0.5)) for t in tensors), tensors


def test_the_admission_wrapper_covers_every_rpc_the_averager_serves(monkeypatch):
    assert rpc_names(DecentralizedAverager) == set(ADMITTED_RPCS)

    async def rpc_new_thing(self, request: averaging_pb2.DownloadRequest, context) -> averaging_pb2.DownloadData:
        return averaging_pb2.DownloadData()

    class Unstarted(AdaptedAverager):
        def __del__(self):
            pass

    monkeypatch.setattr(DecentralizedAverager, "rpc_new_thing", rpc_new_thing, raising=False)
    assert any("rpc_new_thing would be served without the admission check" in p for p in missing_private_api())
    with pytest.raises(HivemindIncompatible, match="rpc_new_thing"):
        asyncio.run(object.__new__(Unstarted).add_p2p_handlers(None))


class GuardedAverager(AdaptedAverager):
    """Admits to a join only a request whose metadata says so, to parts and state only `friend`."""

    friend = ""

    async def admit_join(self, peer_id, gathered):
        return gathered == {"let": "me in"}

    async def admit_part(self, peer_id):
        return peer_id == self.friend

    async def admit_state_request(self, peer_id):
        return peer_id == self.friend


@pytest.mark.timeout(90)
def test_every_averaging_rpc_asks_the_admission_hooks_first(tmp_path):
    """On a real averager process, called from a plain hivemind P2P: a refused peer gets a refusal
    (or, for state, an empty stream) before hivemind reads its request; an admitted one gets
    hivemind's own answer."""
    friend_identity = load_or_create_identity(str(tmp_path / "friend.key"))
    dht = hivemind.DHT(start=True)
    GuardedAverager.friend = friend_identity.peer_id.to_base58()
    averager = GuardedAverager([torch.arange(8, dtype=torch.float32)], dht, prefix="guarded", start=False, daemon=True)
    serializer = averager.serializer

    async def ask(p2p, gather):
        stub = GuardedAverager.get_stub(p2p, dht.peer_id, namespace="guarded")
        join = await stub.rpc_join_group(averaging_pb2.JoinRequest(
            schema_hash=b"x", expiration=get_dht_time() + 5, gather=gather, group_key="guarded.0b"))
        part = await stub.rpc_aggregate_part(as_aiter(averaging_pb2.AveragingData(
            code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"no such group")))
        state = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        replies = [[m async for m in aiter_with_timeout(join, 10)]]
        for stream in (part, state):
            try:
                replies.append([m async for m in aiter_with_timeout(stream, 10)])
            except (BrokenPipeError, ConnectionResetError, asyncio.IncompleteReadError):
                replies.append([])  # closed under our unread bytes: see below
        # a refusal of a part may reach us as a closed stream: the averager answers before reading
        # our part, and libp2p can reset a stream closed under unread bytes (hivemind itself always
        # answers a part, so an empty reply is a refusal too)
        part_code = replies[1][0].code if replies[1] else None  # None: closed before we read the answer
        return replies[0][0].code, part_code, len(replies[2])

    async def scene():
        friend = await P2P.create(identity_path=friend_identity.path, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        stranger = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        address = [str(m).split("/p2p/")[0] for m in dht.get_visible_maddrs()]
        try:
            for p2p in (friend, stranger):
                await connect(p2p, dht.peer_id, address)
            welcome = serializer.dumps([0.0, 0, serializer.dumps({"let": "me in"})])
            refused = await ask(stranger, serializer.dumps([0.0, 0, serializer.dumps({"let": "no"})]))
            admitted = await ask(friend, welcome)
            return refused, admitted
        finally:
            await friend.shutdown()
            await stranger.shutdown()

    try:
        averager.start()
        averager.wait_until_ready(30)
        refused, admitted = asyncio.run(scene())
    finally:
        averager.shutdown()
        dht.shutdown()
    assert refused[0] == averaging_pb2.PROTOCOL_VIOLATION and refused[2] == 0, refused
    assert refused[1] in (averaging_pb2.PROTOCOL_VIOLATION, None), refused
    # hivemind's own answers: not looking for a group, no such group, the state. The part's
    # answer can be lost the same way (CI once read a reset there), so it may be None too.
    assert admitted[0] == averaging_pb2.NOT_LOOKING_FOR_GROUP and admitted[2] > 0, admitted
    assert admitted[1] in (averaging_pb2.BAD_GROUP_ID, None), admitted
    assert decode_gather(serializer, serializer.dumps([0.0, 0, serializer.dumps({"a": 1})])) == {"a": 1}
    assert decode_gather(serializer, b"\x00" * 70_000) is None and decode_gather(serializer, b"\xc1") is None


class PickyAverager(AdaptedAverager):
    """Refuses any group in which a member's metadata lacks {"worker": True}."""

    def check_group(self, gathered):
        strangers = sorted(peer[-6:] for peer, data in gathered.items() if data.get("worker") is not True)
        return f"not a worker: {', '.join(strangers)}" if strangers else None


@pytest.mark.timeout(90)
def test_a_peer_refuses_the_group_before_the_all_reduce_starts():
    first = hivemind.DHT(start=True)
    second = hivemind.DHT(initial_peers=first.get_visible_maddrs(), start=True)
    averagers = [PickyAverager([torch.full((16,), float(i))], dht, prefix="picky", target_group_size=2,
                               min_matchmaking_time=2.0, request_timeout=1.0, start=False, daemon=True)
                 for i, dht in enumerate((first, second))]
    stranger = second.peer_id.to_base58()[-6:]
    try:
        for averager in averagers:
            averager.start()
            averager.wait_until_ready(30)
        controls = [averagers[0].step(gather={"worker": True}, wait=False, timeout=10, allow_retries=False),
                    averagers[1].step(gather={"worker": False}, wait=False, timeout=10, allow_retries=False)]
        errors = []
        for control in controls:
            with pytest.raises(MatchmakingException) as caught:
                control.result(60)
            errors.append(str(caught.value))
        tensors = []
        for averager in averagers:
            with averager.get_tensors() as local:
                tensors.append(local[0].clone())
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()
    assert all(f"not a worker: {stranger}" in error for error in errors), errors
    assert torch.equal(tensors[0], torch.zeros(16)) and torch.equal(tensors[1], torch.ones(16)), "nothing averaged"


class ScreeningRunner(AdaptedRunner):
    """Leaves out senders whose parts are not finite; `poison` sends NaN to the other reducers."""

    def __init__(self, *, poison: bool = False, **kwargs):
        super().__init__(**kwargs)
        if poison:
            self.map_outgoing_parts(lambda part: part.fill_(float("nan")))

    def screen_parts(self, part_index, held):
        return {part.sender: "not finite" for part in held if not bool(torch.isfinite(part.tensor).all())}


@pytest.mark.timeout(60)
def test_a_reducer_leaves_a_poisoning_sender_out_and_the_round_completes_for_the_others():
    async def scene():
        daemons = [await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]) for _ in range(3)]
        try:
            for i, p2p in enumerate(daemons):
                for other in daemons[i + 1:]:
                    address = [str(m).split("/p2p/")[0] for m in await other.get_visible_maddrs()]
                    await connect(p2p, other.peer_id, address)
            peers = [p2p.peer_id for p2p in daemons]
            tensors = [torch.full((300,), float(i)) for i in range(3)]  # the poisoner is the third
            runners = [ScreeningRunner(p2p=p2p, servicer_type=ScreeningRunner, prefix="screen-test", group_id=b"g",
                                       tensors=[tensors[i].clone()], ordered_peer_ids=peers,
                                       peer_fractions=(1 / 3, 1 / 3, 1 / 3), part_size_bytes=256, poison=i == 2,
                                       sender_timeout=5.0, reducer_timeout=10.0)
                       for i, p2p in enumerate(daemons)]
            for p2p, runner in zip(daemons, runners):
                await runner.add_p2p_handlers(p2p, namespace="screen-test")
                assert isinstance(runner.tensor_part_reducer, HoldingReducer)
                assert missing_attributes(runner.tensor_part_reducer, "TensorPartReducer") == []
            sizes = runners[0].slice_sizes()

            async def run(runner):
                return [delta async for delta in runner]

            deltas = await asyncio.gather(*(run(r) for r in runners), return_exceptions=True)
            return runners, sizes, tensors, deltas, peers
        finally:
            for p2p in daemons:
                await p2p.shutdown()

    runners, sizes, tensors, deltas, peers = asyncio.run(scene())
    poisoner = peers[2].to_base58()
    honest_mean = (tensors[0] + tensors[1]) / 2
    for i in (0, 1):
        result = tensors[i] + deltas[i][0]
        assert torch.isfinite(result).all(), "no NaN reached an honest replica"
        start = sum(sizes[:i])
        own_slice = slice(start, start + sizes[i])
        assert torch.allclose(result[own_slice], honest_mean[own_slice]), "its own slice: the mean without the poisoner"
        assert runners[i].rejected() == {poisoner: "not finite"}
        assert poisoner in runners[i].banned()
        received = runners[i].values_received()
        assert received[poisoner] == 0 and received[peers[1 - i].to_base58()] == sizes[i]
    assert runners[2].rejected() == {}, "the poisoner's own slice was reduced from honest parts"

    """The adapter is the only place: a private name anywhere else is a seam that breaks silently."""
    root = Path(hivemind_adapter.__file__).resolve().parent.parent
    private = sorted({part for name in PRIVATE_API for part in name.path.split(".") if part.startswith("_")})
    # `self._p2p` of our own classes is fine; subclassing hivemind's internals outside the adapter is not.
    pattern = re.compile(r"(?<!\bself)\.(" + "|".join(map(re.escape, private)) + r")\b"
                         r"|class \w+\((DecentralizedAverager|AllReduceRunner)\)")
    offenders = []
    for package in ("protocol", "roles", "node", "authorizer"):
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "hivemind_adapter.py":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert offenders == [], "use protocol/hivemind_adapter.py instead:\n" + "\n".join(offenders)
