"""How peers reach this node: directly at the addresses it announces, or through the run's relays.

Most contributors sit behind a home router that lets nothing in. The authorizer dials every joining
node back [report 3.6.1.2]; a node it cannot dial is admitted as *relayed* when the run has relays
(`--relay auto`, the default). Such a node then starts its libp2p daemon with a circuit-relay-v2
reservation on every relay the authorizer listed (libp2p's autorelay with those as its only,
static, relays) and announces `<relay>/p2p/<relay id>/p2p-circuit` for each of them, signed in its
DHT records like any address. It keeps its outbound connections, so peers it dialled reach it
directly over them; only a new connection to it goes through a relay. When a relay dies, the
reservations on the others still carry it; autorelay renews them.

Every node of an authenticated run also shows each relay its credential (`RelayPass`): a relay
drops the connection of any peer that has not, within a few seconds (roles/relay/gate.py), so an
outsider can hold no reservation and open no circuit there.

And no contributor relays for others: hivemind's p2pd would turn on a full relay service as soon
as it believes itself public (`-relayService`, on by default); every node but a relay starts it
off. (p2pd still answers relay requests with libp2p's built-in limits, 128 KiB and two minutes per
circuit, meant for hole punching: too little to carry training traffic, and nobody here asks.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional

from protocol import hivemind_adapter
from protocol.errors import ConfigError
from protocol.relays import circuit_address, peer_of

logger = logging.getLogger(__name__)

RELAY_PASS_EVERY_S = 60.0
"""How often a node shows the relays its credential again; a relay forgets a peer after
roles/relay/gate.py's PASS_TTL_S without one."""


@dataclass(frozen=True)
class ReachPlan:
    """What the node announces and how its libp2p daemon is started."""

    relayed: bool
    relays: list[str] = field(default_factory=list)
    """The run's relays (multiaddrs with /p2p/<id>) this node knows of."""
    forced: bool = False
    """Relayed because --relay named a relay, not because the authorizer could not dial it."""

    @property
    def announce_maddrs(self) -> list[str]:
        """A relayed node's announced addresses: one circuit address per relay."""
        return [circuit_address(relay) for relay in self.relays] if self.relayed else []

    def own_maddrs(self, peer_id: str) -> list[str]:
        """A relayed node's full addresses (with its /p2p/<id>), as peers dial them. Its daemon
        cannot say them: p2pd's autorelay keeps only private-class addresses of the announced set
        until its own relay list fills, so behind a relay on a public address it reports none."""
        return [f"{address}/p2p/{peer_id}" for address in self.announce_maddrs]

    def daemon_flags(self) -> dict:
        """p2pd flags for the node's libp2p daemon (set before hivemind starts it)."""
        flags: dict = {"relayService": False}
        if self.relayed:
            flags.update(autoRelay=True, trustedRelays=",".join(self.relays), relayDiscovery=False,
                         forceReachabilityPrivate=True)
        return flags

    def describe(self, maddrs: list[str]) -> str:
        """The one line a node logs about how it is reached."""
        if self.relayed:
            addresses: dict[str, list[str]] = {}  # one relay may be listed at several addresses
            for relay in self.relays:
                addresses.setdefault(peer_of(relay) or relay, []).append(relay.split("/p2p/")[0])
            names = "; ".join(f"{peer[:12]}… at {', '.join(at)}" for peer, at in addresses.items())
            if self.forced:
                return f"reachable through the relays ({names}), as --relay asks"
            return (f"reachable through the run's relays ({names}): the authorizer could not dial this node, so "
                    f"peers that have no connection to it open one through a relay; forwarding a TCP port and "
                    f"passing --announce-maddrs makes it reachable directly (faster)")
        direct = [m.split("/p2p/")[0] for m in maddrs]
        return f"reachable directly at {', '.join(direct) or 'no address'}"


def plan_reach(mode: str, *, relays: list[str], relayed_by_authorizer: bool,
               answering: Optional[list[str]] = None) -> ReachPlan:
    """`mode` is --relay: auto, off or a relay's multiaddr. `answering`: the relays that accepted
    the node's credential at admission; a relayed node reserves and announces only those when any
    did. p2pd's autorelay takes no slot anywhere while one of its static relays is down (measured
    on the NAT lab: a restarted node behind NAT with one dead relay of two listed stayed unreachable
    through the live one for the whole minute it waited)."""
    if answering:
        relays = [relay for relay in relays if relay in answering] or relays
    if mode == "off":
        return ReachPlan(relayed=False, relays=list(relays))
    if mode != "auto":  # a relay named by hand: always through it (and the run's others)
        return ReachPlan(relayed=True, relays=list(dict.fromkeys([mode, *relays])), forced=True)
    return ReachPlan(relayed=relayed_by_authorizer and bool(relays), relays=list(relays))


def apply_daemon_flags(plan: ReachPlan) -> None:
    """Flags for every libp2p daemon this process starts from now on (hivemind's DHT forks after)."""
    hivemind_adapter.set_daemon_flags(**plan.daemon_flags())


RELAY_SLOT_PROGRESS_EVERY_S = 5.0

RELAY_SLOT_PROBE_TIMEOUT_S = 3.0


class NoRelaySlot(ConfigError):
    """No relay of the run carries this node: nobody without a connection to it can reach it."""


async def wait_for_relay_slot(peer_id: str, relays: list[str], stop: asyncio.Event, *,
                              greet: Optional[Callable[[], Awaitable[object]]] = None,
                              timeout_s: float = 60.0,
                              progress_every_s: float = RELAY_SLOT_PROGRESS_EVERY_S) -> None:
    """Wait until a relay carries this node. That is tried as a stranger would: a throwaway libp2p
    peer (one cannot dial oneself) opens a connection to this node at its circuit addresses, which
    works only once a relay holds a slot for it. Meanwhile a progress line every
    `progress_every_s`, and `greet` shows the relays the node's credential again (a relay drops a
    peer that has not). Raises NoRelaySlot after `timeout_s`, StopRequested if `stop` is set."""
    from hivemind.p2p import PeerID

    from node.lifecycle import StopRequested
    from protocol.hivemind_adapter import create_plain_p2p, disconnect
    from protocol.transport import dial
    from roles.periodic import wait_any

    began = time.monotonic()
    me = PeerID.from_base58(peer_id)
    circuits = [circuit_address(relay) for relay in relays]
    probe = await create_plain_p2p(host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client")
    try:
        next_progress = began + progress_every_s
        while True:
            try:  # p2pd dials every circuit at once: any relay holding a slot answers
                await dial(probe, me, circuits, RELAY_SLOT_PROBE_TIMEOUT_S)
            except Exception as exc:  # no slot anywhere yet, or no relay can be reached
                reason = "no answer" if isinstance(exc, asyncio.TimeoutError) else _first_line(exc)
            else:
                logger.info("a relay of the run carries this node (checked through a circuit after %.1f s)",
                            time.monotonic() - began)
                return
            finally:
                try:
                    await asyncio.wait_for(disconnect(probe, me), 2.0)
                except Exception:  # not connected: nothing to close
                    pass
            waited = time.monotonic() - began
            if time.monotonic() >= next_progress:
                logger.info("waiting for a slot on the run's relays: none of %d carries this node yet (%.0f s of at "
                            "most %.0f s)", len(relays), waited, timeout_s)
                next_progress += progress_every_s
                if greet is not None:
                    await greet()
            if waited >= timeout_s:
                raise NoRelaySlot(
                    f"no relay of the run gave this node a slot within {timeout_s:.0f} s (through "
                    f"{', '.join(relays)}: {reason}), so no peer could reach it; check that this machine can open "
                    f"outbound TCP connections to the relays' ports, or ask the run's owner whether the relays are "
                    f"up; or forward a TCP port on your router and start the node with --host-maddrs "
                    f"/ip4/0.0.0.0/tcp/PORT --announce-maddrs /ip4/<public IP>/tcp/PORT")
            if await wait_any(stop, timeout=1.0):
                raise StopRequested("while waiting for a relay slot")
    finally:
        await probe.shutdown()


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


class RelayPass:
    """Shows every relay of the run this node's credential, now and every RELAY_PASS_EVERY_S, over
    an authenticated stream (protocol/transport.py), so the relays keep its connections."""

    def __init__(self, p2p, relays: list[str], authenticator, *, timeout_s: float = 10.0, relayed: bool = False):
        from protocol.transport import RpcClient

        self.p2p = p2p
        self.relays = list(relays)
        self.timeout_s = timeout_s
        self.client = RpcClient(p2p, authenticator=authenticator, timeout_s=timeout_s)
        self.failures: dict[str, str] = {}
        """Relays that did not accept the last pass, by peer id, with the reason."""
        self.relayed = relayed
        """The node is reached through these relays: losing them all is worth an error."""
        self._none_left = False

    async def greet_all(self) -> int:
        """Greet every relay at once; returns how many accepted."""
        return len(await self.greet_each())

    async def greet_each(self) -> list[str]:
        """Greet every relay at once; returns those that accepted."""
        results = await asyncio.gather(*(self._greet(relay) for relay in self.relays))
        accepted = sum(results)
        if self.relayed and self.relays and not accepted and not self._none_left:
            logger.error("no relay of the run accepts this node now: a peer with no connection to it cannot "
                         "reach it (the ones connected still can); it greets the relays again every %.0f s",
                         RELAY_PASS_EVERY_S)
        self._none_left = bool(self.relays) and not accepted
        return [relay for relay, ok in zip(self.relays, results) if ok]

    async def _greet(self, relay: str) -> bool:
        from hivemind.p2p import PeerID

        from protocol.transport import dial
        from protocol.version import RELAY_HELLO

        peer = peer_of(relay)
        try:
            await dial(self.p2p, PeerID.from_base58(peer), [relay], self.timeout_s)
            await self.client.call(PeerID.from_base58(peer), RELAY_HELLO, {}, timeout_s=self.timeout_s)
        except Exception as exc:  # an unreachable or refusing relay: the others still carry the node
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if self.failures.get(peer) != reason:
                logger.warning("relay %s did not accept this node's credential: %s", relay, reason)
            self.failures[peer] = reason
            return False
        if peer in self.failures:
            logger.info("relay %s accepts this node again", relay)
            del self.failures[peer]
        return True

    async def run(self, stop: asyncio.Event, every_s: float = RELAY_PASS_EVERY_S) -> None:
        from roles.periodic import every

        await every(every_s, self.greet_all, stop, name="relay pass")

    async def close(self) -> None:
        await self.client.close()


async def greet_relays(p2p, relays: list[str], authenticator, timeout_s: float = 3.0) -> Optional[list[str]]:
    """One pass over `relays` from `p2p` (the admission listener, which has the node's identity),
    before the node's own daemon starts and reserves: the relay then knows its peer id already.
    Returns the relays that accepted (None when there was nobody to greet)."""
    if not relays or authenticator is None:
        return None
    relay_pass = RelayPass(p2p, relays, authenticator, timeout_s=timeout_s)
    try:
        return await relay_pass.greet_each()
    finally:
        await relay_pass.close()
