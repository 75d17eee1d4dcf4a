"""The monitor's remembered bootstrap peers after an authorizer restart: only addresses that still
accept a connection, so a run that went down whole restarts with a fresh DHT instead of a monitor
(and nodes) stuck on the dead."""

from __future__ import annotations

import socket

from authorizer.monitor.seat import _accepts_connections


def test_only_addresses_that_accept_a_connection_count():
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        open_port = listening.getsockname()[1]
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            closed_port = probe.getsockname()[1]  # bound, never listening: refuses connections
            assert _accepts_connections(f"/ip4/127.0.0.1/tcp/{open_port}/p2p/12D3KooWPeer")
            assert not _accepts_connections(f"/ip4/127.0.0.1/tcp/{closed_port}/p2p/12D3KooWPeer")
    assert _accepts_connections("/ip4/127.0.0.1/udp/4001/quic/p2p/12D3KooWPeer"), "other transports are kept"
