"""What a node says when it cannot join the swarm (node/swarm.py)."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from node.swarm import _bootstrap_failed
from protocol.errors import ConfigError

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


class _StuckDht:
    """A DHT process that neither becomes ready nor dies: how a copied key's join was seen to end."""

    pid = 0

    def __init__(self):
        self._read, self._write = os.pipe()  # the sentinel: never readable while "alive"
        self.sentinel = self._read
        self.released = threading.Event()

    def start(self):
        pass

    def wait_until_ready(self):
        self.released.wait()
        raise RuntimeError("released by the test")

    def join(self, timeout=None):
        self.released.set()
        os.close(self._read)
        os.close(self._write)


@pytest.mark.timeout(60)  # without the deadline the join waits for good
def test_a_join_attempt_that_never_ends_is_given_up_at_its_deadline(monkeypatch):
    import node.swarm as swarm

    stuck, killed = [], []

    def new_dht(**kwargs):
        stuck.append(_StuckDht())
        return stuck[-1], None

    monkeypatch.setattr(swarm, "_new_dht", new_dht)
    monkeypatch.setattr(swarm, "kill_tree", killed.append)
    monkeypatch.setattr(swarm, "JOIN_GRACE_S", 0.5)

    async def join():
        return await swarm.join_swarm_until_stopped(
            identity=None, run_id="r", num_stages=2, initial_peers=PEERS, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            announce_maddrs=[], bootstrap_timeout_s=1.0, stop=asyncio.Event())

    with pytest.raises(ConfigError) as raised:
        asyncio.run(join())
    assert "could not reach any initial peer within 1s" in str(raised.value)
    assert "did not finish joining" in str(raised.value)
    assert len(killed) == len(stuck) >= 1, "each stuck attempt's DHT process tree is killed"
