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
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.p2p import P2P

from protocol import hivemind_adapter
from protocol.hivemind_adapter import (
    PRIVATE_API,
    TESTED_VERSIONS,
    AdaptedAverager,
    AdaptedRunner,
    HivemindIncompatible,
    connect,
    disconnect,
    missing_attributes,
    missing_private_api,
    version_problem,
)


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


def test_no_other_module_of_the_package_touches_them():
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
