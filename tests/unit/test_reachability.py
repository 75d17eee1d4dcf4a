"""How a node is reached: the relayed addresses it announces, the p2pd flags it starts with, and
the multiaddr encoding p2pd needs for a relayed address."""

from __future__ import annotations

import pytest

from node.reachability import plan_reach
from protocol.hivemind_adapter import wire_multiaddr
from protocol.relays import circuit_address, is_relayed, peer_of, relay_of, relay_peers, transport_address

RELAY = "/ip4/198.51.100.4/tcp/4001/p2p/12D3KooWJuPgSpvLGMwJrtHkVTZswJgm4m6v52iyyocHMr5VFDJc"
OTHER = "/ip4/198.51.100.5/tcp/4001/p2p/12D3KooWPQXSPcG8acHRPP7qiioNahNJivRPDPhhTJ47G45oSJp6"
NODE = "12D3KooWBB8wdKNBQhZrbKQ15yUArocMNrGdoLwzru5TfQJuzBBr"


def test_a_relayed_address_keeps_its_relay_when_the_target_is_stripped():
    announced = f"{circuit_address(RELAY)}/p2p/{NODE}"
    assert is_relayed(announced) and not is_relayed(RELAY)
    assert peer_of(announced) == NODE
    assert relay_of(announced) == peer_of(RELAY)
    # what p2pd dials: the relay and the circuit, not the relay's address alone
    assert transport_address(announced) == circuit_address(RELAY)
    assert transport_address("/ip4/10.0.0.1/tcp/31337/p2p/" + NODE) == "/ip4/10.0.0.1/tcp/31337"
    assert relay_peers([announced, f"{circuit_address(OTHER)}/p2p/{NODE}", announced]) == [
        peer_of(RELAY), peer_of(OTHER)]
    with pytest.raises(ValueError):
        circuit_address("/ip4/198.51.100.4/tcp/4001")


def test_p2p_components_are_encoded_as_bare_multihashes():
    encoded = wire_multiaddr(circuit_address(RELAY)).to_bytes()
    # /p2p/ is code 421 (0xa5 0x03), then the multihash's length and the multihash (0x00 0x24 ...
    # for an Ed25519 identity hash), never a CIDv1 (0x01 0x72 ...) as hivemind's codec writes it
    at = encoded.index(bytes([0xA5, 0x03]))
    assert encoded[at + 2] == 38 and encoded[at + 3:at + 5] == bytes([0x00, 0x24])
    assert encoded.endswith(bytes([0xA2, 0x02]))  # /p2p-circuit
    assert str(wire_multiaddr(circuit_address(RELAY))) == circuit_address(RELAY)
    assert str(wire_multiaddr("/ip4/10.0.0.1/tcp/1")) == "/ip4/10.0.0.1/tcp/1"


def test_the_plan_follows_the_authorizer_and_the_flag():
    direct = plan_reach("auto", relays=[RELAY], relayed_by_authorizer=False)
    assert not direct.relayed and direct.announce_maddrs == []
    assert direct.daemon_flags() == {"relayService": False}  # a contributor relays for nobody
    relayed = plan_reach("auto", relays=[RELAY, OTHER], relayed_by_authorizer=True)
    assert relayed.relayed and relayed.announce_maddrs == [circuit_address(RELAY), circuit_address(OTHER)]
    flags = relayed.daemon_flags()
    assert flags["autoRelay"] and flags["forceReachabilityPrivate"] and not flags["relayDiscovery"]
    assert flags["trustedRelays"] == f"{RELAY},{OTHER}" and flags["relayService"] is False
    # relayed by the authorizer, but the run lists no relay: nothing to reserve on
    assert not plan_reach("auto", relays=[], relayed_by_authorizer=True).relayed
    assert not plan_reach("off", relays=[RELAY], relayed_by_authorizer=True).relayed
    forced = plan_reach(OTHER, relays=[RELAY], relayed_by_authorizer=False)
    assert forced.relayed and forced.forced and forced.relays == [OTHER, RELAY]
    assert "as --relay asks" in forced.describe([])
    assert "could not dial" in relayed.describe([])
    assert direct.describe(["/ip4/203.0.113.7/tcp/31337/p2p/" + NODE]) == "reachable directly at /ip4/203.0.113.7/tcp/31337"


def test_a_relayed_node_says_once_when_no_relay_accepts_it(caplog):
    import asyncio
    import logging

    from node.reachability import RelayPass

    relays = [RELAY]
    accepts = {"now": False}

    def make(relayed: bool) -> RelayPass:
        relay_pass = RelayPass.__new__(RelayPass)
        relay_pass.relays, relay_pass.relayed, relay_pass._none_left = relays, relayed, False

        async def greet(relay: str) -> bool:
            return accepts["now"]

        relay_pass._greet = greet
        return relay_pass

    relayed, direct = make(True), make(False)
    with caplog.at_level(logging.ERROR, logger="node.reachability"):
        for _ in range(3):
            asyncio.run(relayed.greet_all())
            asyncio.run(direct.greet_all())
        assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
        assert "no relay of the run accepts this node" in caplog.records[0].message
        accepts["now"] = True
        asyncio.run(relayed.greet_all())
        accepts["now"] = False
        asyncio.run(relayed.greet_all())
    assert len(caplog.records) == 2  # said again after relays came back and were lost again


def test_a_relay_listed_at_two_addresses_is_named_once():
    from node.reachability import ReachPlan

    same = RELAY.replace("198.51.100.4", "192.0.2.7")
    line = ReachPlan(relayed=True, relays=[RELAY, same], forced=True).describe([])
    assert line.count(peer_of(RELAY)[:12]) == 1, line
    assert "/ip4/198.51.100.4/tcp/4001, /ip4/192.0.2.7/tcp/4001" in line, line


def test_a_relayed_node_announces_its_own_circuits_on_the_relays_that_answered():
    # p2pd reports no address for such a node behind a public relay: it says them itself
    plan = plan_reach("auto", relays=[RELAY, OTHER], relayed_by_authorizer=True)
    assert plan.own_maddrs(NODE) == [f"{circuit_address(RELAY)}/p2p/{NODE}", f"{circuit_address(OTHER)}/p2p/{NODE}"]
    # a relay that did not accept the credential at admission is left out of the reservations
    # (p2pd takes no slot anywhere while a static relay is down) and of the announcements
    plan = plan_reach("auto", relays=[RELAY, OTHER], relayed_by_authorizer=True, answering=[OTHER])
    assert plan.relays == [OTHER] and plan.daemon_flags()["trustedRelays"] == OTHER
    assert plan.own_maddrs(NODE) == [f"{circuit_address(OTHER)}/p2p/{NODE}"]
    # none answered: all are kept, and the slot check says what is wrong
    assert plan_reach("auto", relays=[RELAY, OTHER], relayed_by_authorizer=True, answering=[]).relays == [
        RELAY, OTHER]
    assert plan_reach("auto", relays=[RELAY], relayed_by_authorizer=False).own_maddrs(NODE) == []


def test_advice_for_a_node_behind_a_router_names_its_public_address():
    from authorizer.admission import Rejection, RejectReason
    from authorizer.reachability import behind_router_advice

    original = Rejection(RejectReason.UNREACHABLE, "open TCP port 31337 on 192.168.1.2")
    lan = [f"/ip4/192.168.1.2/tcp/31337/p2p/{NODE}", f"/ip4/127.0.0.1/tcp/31337/p2p/{NODE}"]
    advice = behind_router_advice(original, lan, "203.0.113.9", relay_ok=True)
    assert advice.reason == RejectReason.UNREACHABLE
    assert "--announce-maddrs /ip4/203.0.113.9/tcp/31337" in advice.message
    assert "forward TCP port 31337" in advice.message and "run a relay" in advice.message
    refused_relays = behind_router_advice(original, lan, "203.0.113.9", relay_ok=False).message
    assert "without --relay off" in refused_relays
    # a public address announced: the dial-back's own message (which port to open) stands
    public = [f"/ip4/203.0.113.9/tcp/31337/p2p/{NODE}"]
    assert behind_router_advice(original, public, "203.0.113.9", relay_ok=True) is original
    # the authorizer on the node's own machine or LAN, or no source seen: the dial-back's message stands
    for source in ("127.0.0.1", "192.168.1.1", "unknown"):
        assert behind_router_advice(original, lan, source, relay_ok=True) is original
