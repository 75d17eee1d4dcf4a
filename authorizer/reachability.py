"""The reachability check: the authorizer dials a joining node back over libp2p [report 3.6.1.2].

A node that others cannot reach contributes nothing to a network built on direct exchange, and
the commonest cause is a closed port, which the node's owner can fix in a minute if told which
one. So the authorizer opens a real libp2p connection to the announced addresses, with a deadline,
and a failure names the addresses and ports to open. The libp2p handshake also authenticates the
remote peer id, so a node that passes has proven it holds the key behind the peer id it joined with.

The dialer is a `hivemind.p2p.P2P` (its own p2pd, listening nowhere) started on first use, so an
authorizer with the check switched off never starts one. Loopback and private addresses may be
refused by policy: a public authorizer should not be usable to probe its own network.

Dial-backs are bounded in time and number: 64 at a time, and a join beyond `max_pending_per_source`
dial-backs of its source address (in progress or waiting) or `max_pending` in all is answered 429
at once. Measured before the bound (scripts/_join_flood_dialback.py): joins announcing an address
that accepts TCP and never speaks each held a slot for the whole timeout, so dial-backs drained at
64 / 5 s, about the per-source join refill (10 a second), and no join was refused; every join from
any address waited in one queue behind the flood's, including joins whose clients had given up
(the server does not cancel them), so a 2,000-join burst kept the door shut for minutes (an honest
join waited 26 s with 300 flood joins in flight).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
from typing import Optional

from authorizer.admission import Rejection, RejectReason
from authorizer.errors import RateLimited

logger = logging.getLogger("agora.authorizer.reachability")

_DIALABLE_TRANSPORTS = ("tcp", "udp")
_HOST_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6")


class ReachabilityUnavailable(RuntimeError):
    """The authorizer could not start its own libp2p dialer."""


def strip_peer_suffix(maddr: str) -> tuple[str, Optional[str]]:
    """Split '/ip4/../tcp/N/p2p/<id>' into the transport address and the peer id, if any."""
    for marker in ("/p2p/", "/ipfs/"):
        if marker in maddr:
            head, _, tail = maddr.partition(marker)
            return head, tail.split("/", 1)[0]
    return maddr, None


def _describe(maddr: str) -> tuple[str, Optional[str], Optional[str]]:
    """(host, transport, port) of a multiaddr string, best effort."""
    from hivemind.utils.multiaddr import Multiaddr

    host = transport = port = None
    for proto, value in Multiaddr(maddr).items():
        if proto.name in _HOST_PROTOCOLS and host is None:
            host = value
        elif proto.name in _DIALABLE_TRANSPORTS and transport is None:
            transport, port = proto.name, value
    return host or "?", transport, port


def dialable(maddrs: list[str], *, allow_private: bool) -> tuple[list[str], list[str]]:
    """The announced addresses the authorizer may dial (without /p2p), and why the others not."""
    accepted, refused = [], []
    for maddr in maddrs:
        address, _ = strip_peer_suffix(maddr)
        host, transport, port = _describe(address)
        if transport is None or port in (None, "0"):
            refused.append(f"{maddr} has no TCP or UDP port")
            continue
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            accepted.append(address)  # a DNS name: resolved by the dialer
            continue
        if ip.is_unspecified or ip.is_multicast:
            refused.append(f"{maddr} is not an address another machine can dial")
        elif not allow_private and (ip.is_private or ip.is_loopback or ip.is_link_local):
            refused.append(f"{maddr} is a private address; announce your public address")
        else:
            accepted.append(address)
    return accepted, refused


_LAN_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7"))
"""Addresses a home or carrier network hands out behind its NAT (RFC 1918, RFC 6598, IPv6 ULA)."""


def _behind_nat(host) -> bool:
    return (host.is_loopback or host.is_link_local or host.is_unspecified
            or any(host.version == net.version and host in net for net in _LAN_NETWORKS))


def _announced_hosts(maddrs: list[str]) -> list[ipaddress._BaseAddress]:
    hosts = []
    for maddr in maddrs:
        try:
            hosts.append(ipaddress.ip_address(_describe(strip_peer_suffix(maddr)[0])[0]))
        except ValueError:  # a DNS name, or no host at all
            pass
    return hosts


def behind_router_advice(rejection: Rejection, announced: list[str], source: str, *, relay_ok: bool) -> Rejection:
    """Advice that works for a node that announced only loopback or LAN addresses, which is a node
    behind a router: opening a port "on 192.168.1.2" is no use to anyone outside. It names the
    router's public address as the authorizer saw it, the port forward and --announce-maddrs that
    make the node reachable directly, and the relay that needs no port at all."""
    hosts = _announced_hosts(announced)
    try:
        seen = ipaddress.ip_address(source)
    except ValueError:  # no address seen: nothing says the node is behind a router
        return rejection
    if not hosts or not all(_behind_nat(h) for h in hosts) or _behind_nat(seen):
        return rejection  # a public address announced, or the authorizer on the node's own LAN
    ports = [port for _, transport, port in map(_describe, (strip_peer_suffix(m)[0] for m in announced))
             if transport == "tcp" and port not in (None, "0")]
    port = ports[0] if ports else "PORT"
    public = str(seen)
    relay = ("ask the run's owner to run a relay (agora-node --role relay): with one, the authorizer admits a node "
             "it cannot dial and the node serves through it, with no port to open" if relay_ok else
             "start the node without --relay off: it then serves through the run's relays, if the run has any")
    return Rejection(rejection.reason, (
        f"this node announced only addresses of its own machine or LAN ({', '.join(map(str, hosts))}), which no "
        f"peer on the internet can dial: it is behind a router (the authorizer saw it come from {public}). Either "
        f"forward TCP port {port} on that router to this machine and start the node with --host-maddrs "
        f"/ip4/0.0.0.0/tcp/{port} --announce-maddrs /ip4/{public}/tcp/{port}; or {relay}"))


class Dialer:
    """Dials nodes back with a lazily started libp2p daemon; bounded fan-out, bounded time."""

    def __init__(self, timeout_s: float, max_concurrent: int = 64, *, max_pending_per_source: int = 16,
                 max_pending: int = 256):
        self.timeout_s = timeout_s
        self.max_concurrent = max_concurrent
        self.max_pending_per_source = max_pending_per_source
        """Dial-backs of one source address (authorizer.ratelimit.source_of), in progress or waiting."""
        self.max_pending = max_pending
        """Dial-backs in progress or waiting in all: an honest join waits at most this many / 64 timeouts."""
        self._p2p = None
        self._lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(max_concurrent)
        self._pending: collections.Counter[str] = collections.Counter()
        self._pending_total = 0

    async def _dialer(self):
        async with self._lock:
            if self._p2p is None:
                from hivemind.p2p import P2P

                try:
                    self._p2p = await P2P.create(
                        host_maddrs=["/ip4/127.0.0.1/tcp/0"], auto_nat=False, nat_port_map=False,
                        use_relay=False, dht_mode="client", startup_timeout=30,
                    )
                except Exception as exc:
                    raise ReachabilityUnavailable(f"cannot start the libp2p dialer: {exc}") from exc
                logger.info("libp2p dialer started for reachability checks")
            return self._p2p

    async def check(self, peer_id: str, maddrs: list[str], *, allow_private: bool,
                    source: str = "unknown") -> Optional[Rejection]:
        """None if the node answers a libp2p dial on one of `maddrs` as `peer_id` in time. Raises
        RateLimited (429) if `source` or everyone has too many dial-backs pending."""
        targets, refused = dialable(maddrs, allow_private=allow_private)
        if not targets:
            why = "; ".join(refused) if refused else "no address was announced"
            return Rejection(RejectReason.NO_DIALABLE_ADDRESS, (
                f"the authorizer has no address to check that peers can reach this node ({why}); "
                f"pass --announce-maddrs /ip4/<your public IP>/tcp/<open port>"))
        self._reserve(source)
        try:
            return await self._dial(peer_id, targets)
        finally:
            self._pending_total -= 1
            self._pending[source] -= 1
            if self._pending[source] <= 0:
                del self._pending[source]

    def _reserve(self, source: str) -> None:
        if self._pending[source] >= self.max_pending_per_source:
            raise RateLimited(
                f"{self._pending[source]} joins from {source} are already waiting for the authorizer to dial them "
                f"back; retry after the Retry-After seconds, or start fewer nodes at once from this address",
                self.timeout_s)
        if self._pending_total >= self.max_pending:
            raise RateLimited(
                f"the authorizer is dialing back {self._pending_total} joining nodes; retry after the Retry-After "
                f"seconds", self.timeout_s * self._pending_total / self.max_concurrent)
        self._pending[source] += 1
        self._pending_total += 1

    async def _dial(self, peer_id: str, targets: list[str]) -> Optional[Rejection]:
        from hivemind.p2p import PeerID

        from protocol.hivemind_adapter import connect, disconnect

        p2p = await self._dialer()
        remote = PeerID.from_base58(peer_id)
        async with self._slots:
            try:
                await asyncio.wait_for(connect(p2p, remote, targets), self.timeout_s)
                return None
            except Exception as exc:  # timeout, ControlFailure (refused, wrong peer id), OSError
                logger.info("dial-back of %s at %s failed: %s", peer_id, targets, exc)
                return self._unreachable(targets, exc)
            finally:
                try:
                    await asyncio.wait_for(disconnect(p2p, remote), 2.0)
                except Exception:  # not connected, or the daemon is busy: nothing to clean up
                    pass

    def _unreachable(self, targets: list[str], exc: Exception) -> Rejection:
        ports = []
        for address in targets:
            host, transport, port = _describe(address)
            ports.append(f"{transport.upper() if transport else '?'} port {port} on {host}")
        cause = "timed out" if isinstance(exc, asyncio.TimeoutError) else "failed"
        return Rejection(RejectReason.UNREACHABLE, (
            f"the authorizer could not open a libp2p connection to {', '.join(targets)} "
            f"(dial {cause} after at most {self.timeout_s:g} s); open {', '.join(ports)} to inbound "
            f"connections (firewall, router port forwarding), or announce a reachable address with "
            f"--announce-maddrs, then rejoin"))

    async def shutdown(self) -> None:
        async with self._lock:
            if self._p2p is not None:
                p2p, self._p2p = self._p2p, None
                try:
                    await p2p.shutdown()
                except Exception:
                    logger.warning("the libp2p dialer did not shut down cleanly", exc_info=True)
