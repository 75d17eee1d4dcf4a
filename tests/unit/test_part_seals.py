"""Sealed all-reduce parts on real hivemind daemons (no agora-node processes): every part a signing
sender streams carries its seal in the message (protocol/hivemind_adapter.py), a reducer refuses a
part whose seal does not verify like a bad part, averages an older build's unsealed parts as before
and counts them, and turns a sealed part it refused for its norm into evidence that holds
(roles/worker/averaging/allreduce.py, evidence.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.p2p import P2P

from protocol.hivemind_adapter import connect
from protocol.identity import load_or_create_identity
from protocol.messages import parse_model
from protocol.part_evidence import PartEvidence, PartSigning, check_part_evidence
from roles.worker.averaging.allreduce import InstrumentedRunner
from roles.worker.averaging.screening import PartScreen

RUN, STAGE, GROUP = "seals", 0, b"a-group-id"
SCREEN = PartScreen(max_norm_ratio=10.0, max_sender_weight=1e9)
NAMES = ("a", "b", "liar", "forger", "legacy")
"""Two honest reducers; three senders: one seals parts 1000x too large, one seals with a key that
is not its peer id's, one of an older build seals nothing."""


@pytest.mark.timeout(90)
def test_a_reducer_refuses_a_bad_seal_counts_unsealed_parts_and_proves_a_sealed_lie(tmp_path):
    identities = {name: load_or_create_identity(str(tmp_path / f"{name}.key")) for name in NAMES}
    stranger = load_or_create_identity(str(tmp_path / "stranger.key"))
    base = torch.randn(600, generator=torch.Generator().manual_seed(1))
    tensors = {name: base + torch.randn(600, generator=torch.Generator().manual_seed(i)) * 0.01
               for i, name in enumerate(NAMES)}

    async def scene():
        daemons = {name: await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=identities[name].path)
                   for name in NAMES}
        try:
            ordered = list(daemons.values())
            for i, p2p in enumerate(ordered):
                for other in ordered[i + 1:]:
                    address = [str(m).split("/p2p/")[0] for m in await other.get_visible_maddrs()]
                    await connect(p2p, other.peer_id, address)
            peers = [p2p.peer_id for p2p in ordered]
            assert [p.to_base58() for p in peers] == [identities[n].peer_id.to_base58() for n in NAMES]
            signers = frozenset(p.to_base58() for p, name in zip(peers, NAMES) if name != "legacy")
            runners = {}
            for name, p2p in daemons.items():
                key = stranger if name == "forger" else identities[name]
                signing = None if name == "legacy" else PartSigning(RUN, STAGE, p2p.peer_id.to_base58(), key.sign)
                runners[name] = InstrumentedRunner(
                    p2p=p2p, servicer_type=InstrumentedRunner, prefix="seal-test", group_id=GROUP,
                    tensors=[tensors[name].clone()], ordered_peer_ids=peers, peer_fractions=(0.5, 0.5, 0, 0, 0),
                    part_size_bytes=256, sender_timeout=5.0, reducer_timeout=10.0, screen=SCREEN, signing=signing,
                    signers=signers, round_id=7, collect_evidence=True)
                if name == "liar":
                    runners[name].map_outgoing_parts(lambda part: part.mul_(1000.0))
            for name in ("a", "b"):
                await runners[name].add_p2p_handlers(daemons[name], namespace="seal-test")
            sizes = runners["a"].slice_sizes()

            async def run(runner):
                return [delta async for delta in runner]

            deltas = await asyncio.gather(*(run(r) for r in runners.values()), return_exceptions=True)
            return runners, sizes, dict(zip(NAMES, deltas)), peers
        finally:
            for p2p in daemons.values():
                await p2p.shutdown()

    runners, sizes, deltas, peers = asyncio.run(scene())
    ids = dict(zip(NAMES, (p.to_base58() for p in peers)))
    honest_mean = (tensors["a"] + tensors["b"] + tensors["legacy"]) / 3
    for index, name in enumerate(("a", "b")):
        runner = runners[name]
        result = tensors[name] + deltas[name][0]
        own = slice(sum(sizes[:index]), sum(sizes[:index + 1]))
        assert torch.allclose(result[own], honest_mean[own], atol=1e-6), "its slice: the liar and forger left out"
        rejected = runner.rejected()
        assert set(rejected) == {ids["liar"], ids["forger"]}, rejected
        assert rejected[ids["forger"]] == "a part whose signature does not verify"
        assert "norm" in rejected[ids["liar"]]
        telemetry = runner.telemetry()
        assert telemetry["reducer"]["unsigned"] == {ids["legacy"]: runner.tensor_part_reducer.num_parts}
        [wire] = telemetry["part_evidence"]
        evidence = parse_model(PartEvidence, wire)
        assert evidence.accused.peer_id == ids["liar"] and evidence.round == 7 and evidence.group_id == GROUP
        assert [w.peer_id for w in evidence.witnesses] == [ids[name], ids["b" if name == "a" else "a"]]
        norms = check_part_evidence(evidence, run_id=RUN, max_norm_ratio=SCREEN.max_norm_ratio)
        assert norms.ratio == pytest.approx(1000.0, rel=0.02)
