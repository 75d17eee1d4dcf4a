"""A relay of the run: p2pd's circuit-relay-v2 service with the owner's limits, behind our gate.

hivemind's p2pd registers two relay services when relaying is on: libp2p's limited one (128 KiB
and two minutes per circuit, meant for hole punching), right after the host is built, and the one
configured by its `-relay*` flags, from the relay manager's goroutine once the host is public (at
once here: reachability is forced). Both claim the hop protocol; the last to register serves. With
p2pd's default threads the limited one came last in 8 of 9 starts on this machine, and a relayed
connection is then reset after 128 KiB. The relay starts its daemon with one Go thread
(`RELAY_GOMAXPROCS`), which orders the two the right way (10 of 10), and still checks: a
reservation made by a throwaway local peer must be counted in p2pd's `libp2p_relaysvc_*` metrics,
which only the configured service writes; when it is not, the daemon is started again.

The relay joins no DHT and serves one RPC, `agora/v1/relay_hello`, which hands an admitted node a
pass (roles/relay/gate.py). Its metrics: the gate's counts, and p2pd's own relay service metrics
(reservations, circuits, relayed bytes) re-exported as they are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import urllib.request
from typing import Optional

from hivemind.p2p import P2P, PeerID

from protocol import hivemind_adapter
from protocol.errors import AgoraError
from protocol.relays import is_relayed
from protocol.transport import RpcServer
from protocol.version import RELAY_HELLO
from roles.relay.config import RelayConfig
from roles.relay.gate import RelayGate, address_of

logger = logging.getLogger("agora.relay")

GATE_EVERY_S = 0.5
SELF_TEST_TIMEOUT_S = 15.0
SELF_TEST_ATTEMPTS = 3
RESERVATIONS_OPENED = 'libp2p_relaysvc_reservations_total{type="opened"}'


RELAY_GOMAXPROCS = 1
"""p2pd's Go threads for the relay's daemon. It makes the configured relay service win the race at
start: with one thread the daemon's main goroutine registers libp2p's limited service before the
relay manager's goroutine gets to register the configured one, which then replaces it. Measured
here: the configured service took the test reservation in 10 of 10 starts with one thread, 1 of 9
without. The relay then relays on one core at most; in the NAT bench each relay used under 3% of
one (docs/figures/bench_nat.json). A relay for many fast links may want more: not measured."""


@contextlib.contextmanager
def _go_threads(count: int):
    """The daemon started inside gets GOMAXPROCS=`count` (hivemind passes it our environment)."""
    saved = os.environ.get("GOMAXPROCS")
    os.environ["GOMAXPROCS"] = str(count)
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("GOMAXPROCS", None)
        else:
            os.environ["GOMAXPROCS"] = saved


class RelayUnavailable(AgoraError):
    """The relay's daemon did not come up with the configured relay service."""

    exit_code = 1


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _scrape(url: str, timeout_s: float = 2.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - our own daemon, loopback
        return response.read().decode()


def relay_metric(text: str, name: str) -> float:
    """The value of sample `name` (with its labels, as p2pd writes it) in Prometheus text, or 0."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


class RelayService:
    def __init__(self, config: RelayConfig, identity_path: str, host_maddrs: list[str], authenticator):
        self.config = config
        self.identity_path = identity_path
        self.host_maddrs = host_maddrs
        self.authenticator = authenticator
        self.p2p: Optional[P2P] = None
        self.server: Optional[RpcServer] = None
        self.metrics_url = ""
        self.gate = RelayGate(grace_s=config.pass_grace_s)
        self.maddrs: list[str] = []
        self.started_at = time.monotonic()

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58() if self.p2p is not None else "-"

    # -- start ---------------------------------------------------------------------------------

    async def start(self) -> list[str]:
        """Start the daemon until its configured relay service is the one serving; serve the pass
        RPC. Returns the relay's announced multiaddrs (with /p2p/<id>)."""
        for attempt in range(1, SELF_TEST_ATTEMPTS + 1):
            await self._start_daemon()
            if await self._self_test():
                break
            if attempt == SELF_TEST_ATTEMPTS:
                # a loaded machine can take longer than the check allows; serving unconfirmed beats
                # not serving (the limited service still carries small exchanges), and the operator
                # is told. This daemon is as likely to serve right as a fresh one: keep it.
                logger.error("could not confirm in %d starts that p2pd's configured relay service serves (the test "
                             "reservation was not counted within %g s); serving anyway: relayed connections may "
                             "be reset after 128 KiB. Restart the relay when the machine is less loaded",
                             SELF_TEST_ATTEMPTS, SELF_TEST_TIMEOUT_S)
                break
            logger.warning("p2pd's configured relay service did not take the test reservation within %g s (libp2p's "
                           "limited one may serve instead; attempt %d of %d); starting it again", SELF_TEST_TIMEOUT_S,
                           attempt, SELF_TEST_ATTEMPTS)
            await self._stop_daemon()
        self.server = RpcServer(self.p2p, authenticator=self.authenticator)
        await self.server.add_handler(RELAY_HELLO, self._on_hello, roles=frozenset({"worker", "trainer"}))
        return self.maddrs

    async def _start_daemon(self) -> None:
        port = _free_port()
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        hivemind_adapter.set_daemon_flags(**self.config.daemon_flags(), metricsAddr=f"127.0.0.1:{port}",
                                          autoRelay=None, trustedRelays=None, relayDiscovery=None,
                                          forceReachabilityPrivate=None)
        with _go_threads(RELAY_GOMAXPROCS):
            self.p2p = await P2P.create(identity_path=self.identity_path, host_maddrs=self.host_maddrs,
                                        announce_maddrs=list(self.config.announce_maddrs) or None,
                                        check_if_identity_free=False, dht_mode="client", startup_timeout=30)
        self.maddrs = [str(m) for m in await self.p2p.get_visible_maddrs()]

    async def _stop_daemon(self) -> None:
        if self.p2p is not None:
            p2p, self.p2p = self.p2p, None
            await p2p.shutdown()

    async def _self_test(self) -> bool:
        """A throwaway local peer behind no NAT reserves a slot; True if the configured relay
        service counted the reservation."""
        before = relay_metric(await asyncio.to_thread(_scrape, self.metrics_url), RESERVATIONS_OPENED)
        local = next((m for m in self.maddrs if not is_relayed(m)), None)
        if local is None:
            return False
        hivemind_adapter.set_daemon_flags(relayService=False, autoRelay=True, trustedRelays=local,
                                          relayDiscovery=False, forceReachabilityPrivate=True, metricsAddr=None,
                                          forceReachabilityPublic=None, relayMaxReservations=None,
                                          relayMaxCircuits=None, relayDataLimit=None, relayTimeLimit=None,
                                          relayBufferSize=None)
        probe = None
        try:
            probe = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], dht_mode="client", startup_timeout=30)
            self.gate.exempt.add(probe.peer_id.to_base58())
            deadline = time.monotonic() + SELF_TEST_TIMEOUT_S
            while time.monotonic() < deadline:
                text = await asyncio.to_thread(_scrape, self.metrics_url)
                if relay_metric(text, RESERVATIONS_OPENED) > before:
                    logger.info("relay service checked: a test reservation was taken by the configured service")
                    return True
                await asyncio.sleep(0.2)
            return False
        finally:
            hivemind_adapter.set_daemon_flags(**self.config.daemon_flags(), autoRelay=None, trustedRelays=None,
                                              relayDiscovery=None, forceReachabilityPrivate=None)
            if probe is not None:
                self.gate.exempt.discard(probe.peer_id.to_base58())
                await probe.shutdown()

    # -- serving -------------------------------------------------------------------------------

    async def _on_hello(self, peer_id: PeerID, body: dict) -> dict:
        ttl = self.gate.grant(peer_id.to_base58())
        return {"pass_ttl_s": ttl}

    async def run(self, stop: asyncio.Event) -> None:
        """Drop connections without a pass, every GATE_EVERY_S, until `stop`."""
        from roles.periodic import every

        await every(GATE_EVERY_S, self.sweep, stop, name="relay gate")

    async def sweep(self) -> None:
        peers = await self.p2p.list_peers()
        connected = {info.peer_id.to_base58(): address_of(info.addrs) for info in peers}
        self.connected = connected
        for peer, reason in self.gate.sweep(connected):
            logger.info("dropped %s from %s: %s", peer, connected.get(peer) or "?", {
                "no_pass": f"no credential within {self.gate.grace_s:g} s",
                "shunned": "dropped before for showing no credential",
                "address_crowded": "too many connections without a credential from its address",
            }[reason])
            try:
                await asyncio.wait_for(hivemind_adapter.disconnect(self.p2p, PeerID.from_base58(peer)), 2.0)
            except Exception as exc:  # gone already, or the daemon is busy: the next sweep retries
                logger.debug("disconnect of %s failed: %s", peer, exc)

    def p2pd_metrics(self) -> str:
        """p2pd's own metrics text (blocking; for the scrape thread)."""
        try:
            return _scrape(self.metrics_url)
        except Exception:  # noqa: BLE001 - a scrape must not fail because p2pd is busy
            return ""

    async def close(self) -> None:
        if self.server is not None:
            await self.server.shutdown()
        await self._stop_daemon()
