"""The relay's gate: who keeps a connection to a relay (roles/relay/gate.py)."""

from __future__ import annotations

from roles.relay.gate import PASS_TTL_S, SHUN_S, RelayGate, address_of


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_peer_without_a_credential_is_dropped_after_the_grace_and_at_once_when_it_returns():
    clock = Clock()
    gate = RelayGate(grace_s=5, clock=clock)
    assert gate.sweep({"outsider": "10.0.0.9", "node": "10.0.0.2"}) == []
    gate.grant("node")
    clock.now += 5
    assert gate.sweep({"outsider": "10.0.0.9", "node": "10.0.0.2"}) == [("outsider", "no_pass")]
    clock.now += 1
    assert gate.sweep({"outsider": "10.0.0.9"}) == [("outsider", "shunned")]  # came back: no new grace
    clock.now += SHUN_S + 1
    assert gate.sweep({"outsider": "10.0.0.9"}) == []  # the shun lapsed: a grace again
    assert gate.counts.dropped == {"no_pass": 1, "shunned": 1}


def test_a_pass_lapses_unless_renewed_and_exempt_peers_are_never_dropped():
    clock = Clock()
    gate = RelayGate(grace_s=5, exempt={"self-test"}, clock=clock)
    gate.grant("node")
    clock.now += PASS_TTL_S - 1
    assert gate.sweep({"node": "a", "self-test": "b"}) == []
    clock.now += 2  # lapsed: the grace starts again, as for a stranger
    assert gate.sweep({"node": "a", "self-test": "b"}) == []
    clock.now += 5
    assert gate.sweep({"node": "a", "self-test": "b"}) == [("node", "no_pass")]
    gate.grant("node")  # a renewed credential lifts the shun
    assert gate.sweep({"node": "a"}) == []


def test_one_address_cannot_crowd_the_relay_with_throwaway_peer_ids():
    clock = Clock()
    gate = RelayGate(grace_s=5, max_pending_per_address=3, clock=clock)
    connected = {"honest": "10.0.0.7"}
    dropped = []
    for index in range(5):
        connected[f"sybil{index}"] = "10.0.0.66"
        clock.now += 0.1
        for peer, reason in gate.sweep(connected):
            dropped.append((peer, reason))
            del connected[peer]  # the relay disconnects it
    # the newest go at once, the three oldest keep their grace; the other address is untouched
    assert dropped == [("sybil3", "address_crowded"), ("sybil4", "address_crowded")]
    assert sorted(connected) == ["honest", "sybil0", "sybil1", "sybil2"]
    gate.grant("honest")
    clock.now += 5
    assert sorted(gate.sweep(connected)) == [("sybil0", "no_pass"), ("sybil1", "no_pass"), ("sybil2", "no_pass")]


def test_the_source_address_is_read_from_the_connection():
    assert address_of(["/ip4/10.0.0.9/tcp/4001"]) == "10.0.0.9"
    assert address_of(["/ip6/2001:db8::1/tcp/4001"]) == "2001:db8::1"
    assert address_of([]) is None


def test_the_relay_daemon_gets_one_go_thread_and_the_environment_is_restored(monkeypatch):
    import os

    from roles.relay.service import RELAY_GOMAXPROCS, _go_threads

    monkeypatch.setenv("GOMAXPROCS", "8")
    with _go_threads(RELAY_GOMAXPROCS):
        assert os.environ["GOMAXPROCS"] == "1"
    assert os.environ["GOMAXPROCS"] == "8"
    monkeypatch.delenv("GOMAXPROCS")
    with _go_threads(RELAY_GOMAXPROCS):
        assert os.environ["GOMAXPROCS"] == "1"
    assert "GOMAXPROCS" not in os.environ
