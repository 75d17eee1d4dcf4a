"""What a node says when it cannot join the swarm (node/swarm.py)."""

from __future__ import annotations

from node.swarm import _bootstrap_failed

PEERS = ["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWN52zaqzzbiDgHDHXqpCCboZTZ3fpdk5ig5beiwoZStnz"]
DIAL_BACK = "Peer 12D3KooW... can't access this node. Probably, libp2p has failed to bypass the firewall"


def test_a_join_whose_initial_peer_could_not_dial_back_names_a_duplicate_identity_as_a_cause():
    assert "another process already runs with this identity" in str(
        _bootstrap_failed(RuntimeError(DIAL_BACK), PEERS, [], 30))
    # Seen under load: the first attempts could not be dialled back, the last one's DHT process
    # died; the hint still holds (CI simulation, the copied-key case of test_node_lifecycle).
    last = _bootstrap_failed(RuntimeError("the DHT process died during bootstrap"), PEERS, [], 30,
                             earlier=(DIAL_BACK, DIAL_BACK))
    assert "the DHT process died" in str(last) and "another process already runs with this identity" in str(last)
    plain = _bootstrap_failed(RuntimeError("connection refused"), PEERS, [], 30, earlier=("connection refused",))
    assert "identity" not in str(plain) and "check the --initial-peers" in str(plain)
