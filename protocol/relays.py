"""Relayed addresses: how a node behind NAT is reached through one of the run's relays.

A relay is a public libp2p node that the run owner runs (`agora-node --role relay`). A node that
accepts no inbound connection holds a circuit-relay-v2 reservation on it and is dialled at
`<relay address>/p2p/<relay id>/p2p-circuit`: the dialer connects to the relay, which splices the
connection onto the one the node keeps open to it. Those addresses are announced, signed, in the
node's DHT records like any other.
"""

from __future__ import annotations

from typing import Iterable, Optional

CIRCUIT = "/p2p-circuit"


def is_relayed(maddr: str) -> bool:
    return CIRCUIT + "/" in maddr + "/"


def peer_of(maddr: str) -> Optional[str]:
    """The peer id a multiaddr ends with (`.../p2p/<id>`), or None."""
    parts = maddr.rstrip("/").split("/")
    if len(parts) >= 2 and parts[-2] in ("p2p", "ipfs"):
        return parts[-1]
    return None


def transport_address(maddr: str) -> str:
    """`maddr` without its final /p2p/<target>: what p2pd dials. A relayed address keeps its relay's
    /p2p/<relay>/p2p-circuit (splitting at the first /p2p/ would dial the relay as the target)."""
    if peer_of(maddr) is not None:
        return maddr.rstrip("/").rsplit("/", 2)[0]
    return maddr


def circuit_address(relay_maddr: str) -> str:
    """The address a node reserved on `relay_maddr` (which ends with /p2p/<relay id>) is dialled
    at, without the node's own /p2p/ suffix."""
    if peer_of(relay_maddr) is None:
        raise ValueError(f"relay address {relay_maddr!r} must end with /p2p/<relay peer id>")
    return relay_maddr.rstrip("/") + CIRCUIT


def relay_of(maddr: str) -> Optional[str]:
    """The relay's peer id in a relayed address, or None for a direct one."""
    if not is_relayed(maddr):
        return None
    head = maddr.split(CIRCUIT, 1)[0]
    return peer_of(head)


def relay_peers(maddrs: Iterable[str]) -> list[str]:
    """The relays' peer ids, in order, without repeats."""
    return list(dict.fromkeys(peer for peer in (relay_of(m) for m in maddrs) if peer is not None))
