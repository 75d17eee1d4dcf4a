"""Who this node trusts, set up before it joins the swarm.

With `--authorizer URL` (one or more) the node proves it is reachable, is admitted, and receives
its credential, stage, run config and bootstrap peers; it then authenticates every RPC and DHT
message with that credential (protocol/auth.py, protocol/dht_auth.py, protocol/records.py),
renews it in the background and relays the run's signed revocation list. A node that finds itself
on that list (banned, its account or credential revoked) says so in one line and stops with exit
code 5 within one refresh. With `--insecure-open-run` there is no authorizer and every peer is
trusted; the node says so loudly.

On disk an authenticated node keeps one directory, `agora-trust-<pid>-*` in the system temp
directory (its credential and the revocation list, shared with hivemind's DHT process); `close()`
removes it, and the pid in its name lets a crash clean-up find the one a dead node left. Where
that clean-up died too (a SIGKILL to the node's whole process group takes its watchdog with it),
the next node to start on the machine removes the directories of pids no longer alive.
"""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from node.admission import (
    Admission, AuthorizerClient, CredentialKeeper, CredentialLost, authorizer_urls,
    join_run, leave_quietly, measured_hardware,
)
from node.reachability import greet_relays
from node.settings import NodeSettings
from node.timefmt import duration, until
from protocol.authorizer_api import TicketOut
from protocol.auth import PeerAuthenticator
from roles.periodic import every
from protocol.auth_state import SharedAuthState
from protocol.credentials import RevocationList
from protocol.dht_auth import CredentialDHTAuthorizer
from protocol.dht_schema import MAX_RECORD_TTL_S, control_key
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode
from protocol.identity import Identity
from protocol.records import REVOKED_SUBKEY
from protocol.run_config import RunConfig, load_run_config, parse_run_config

logger = logging.getLogger(__name__)

OPEN_RUN_WARNING = ("WARNING: --insecure-open-run: no authorizer; this node trusts every peer and any peer can "
                    "join, read and write this run. Use it only for local experiments.")


TRUST_DIR_PREFIX = "agora-trust-"


def trust_dir_prefix(pid: Optional[int] = None) -> str:
    """`agora-trust-<pid>-`: the temp directory of the node with that pid starts so."""
    return f"{TRUST_DIR_PREFIX}{os.getpid() if pid is None else pid}-"


@dataclass
class Trust:
    run: RunConfig
    stage: Optional[int]
    initial_peers: list[str]
    host_maddrs: list[str]
    identity: Identity
    auth_state: Optional[SharedAuthState] = None
    authenticator: Optional[PeerAuthenticator] = None
    dht_authorizer: Optional[CredentialDHTAuthorizer] = None
    client: Optional[AuthorizerClient] = None
    keeper: Optional[CredentialKeeper] = None
    revocation_refresh_s: float = 30.0
    trust_dir: Optional[str] = None
    failure: Optional[CredentialLost] = None
    """Set when the node learns from the revocation list that it was banned or revoked."""
    reducer: bool = False
    """The authorizer designated this worker a reducer of its stage at placement."""
    relays: list[str] = field(default_factory=list)
    """The run's relays the authorizer listed (multiaddrs with /p2p/<id>)."""
    relayed: bool = False
    answering_relays: Optional[list[str]] = None
    """The relays that accepted this node's credential at admission (None: none were greeted)."""
    """The authorizer could not dial this node back and admitted it to serve through the relays."""
    _relay_pass: Optional[object] = None
    _tasks: list[asyncio.Task] = field(default_factory=list)
    _revocations_seen: Optional[tuple] = None
    _closed: bool = False

    @property
    def authenticated(self) -> bool:
        return self.authenticator is not None

    def start_background(self, stop: asyncio.Event, swarm) -> None:
        """Credential renewal and revocation refresh, for as long as the node runs."""
        if self.keeper is not None:
            self._tasks.append(asyncio.create_task(self.keeper.run(stop), name="credential-keeper"))
            self._tasks.append(asyncio.create_task(self._refresh_revocations(stop, swarm), name="revocations"))

    def start_relay_pass(self, stop: asyncio.Event, p2p, relays: list[str], *, relayed: bool = False) -> None:
        """Keep showing `relays` this node's credential from the node's own daemon (node/reachability.py);
        `relayed`: the node is reached through them."""
        if self.authenticator is None or not relays:
            return
        from node.reachability import RelayPass

        self._relay_pass = RelayPass(p2p, relays, self.authenticator, relayed=relayed)
        self._tasks.append(asyncio.create_task(self._relay_pass.run(stop), name="relay-pass"))

    async def greet_relays(self) -> int:
        """Show every relay this node's credential again now; returns how many accepted."""
        return 0 if self._relay_pass is None else await self._relay_pass.greet_all()

    def reach_plan(self, mode: str):
        """How this node is reached (node/reachability.py), from --relay `mode` and its admission."""
        from node.reachability import plan_reach

        return plan_reach(mode, relays=self.relays, relayed_by_authorizer=self.relayed,
                          answering=self.answering_relays)

    def _apply(self, revocations: RevocationList) -> bool:
        """Keep `revocations` if it is valid and newer; log it only when its content changed."""
        if not self.auth_state.publish_revocations(revocations):
            return False
        content = (tuple(revocations.serials), tuple(revocations.peer_ids))
        if content != self._revocations_seen:
            self._revocations_seen = content
            logger.info("revocation list applied: %d credential(s) and %d peer(s) revoked",
                        len(revocations.serials), len(revocations.peer_ids))
        return True

    def _check_self(self, stop: asyncio.Event) -> bool:
        """Stop the node (exit 5) if the list in force revokes its own peer id or credential."""
        current = self.auth_state.revocations()
        credential = self.keeper.credential.credential
        if current is None or not current.is_revoked(credential):
            return False
        what = (f"peer {credential.peer_id} is banned" if credential.peer_id in current.peer_ids
                else f"its credential (serial {credential.serial}) was revoked (its account was revoked, or "
                     f"another process with this identity joined since)")
        self.failure = CredentialLost(
            f"this node was banned or revoked by the run's owner: {what}; contact the run's operator",
            ExitCode.REVOKED)
        logger.error("%s; stopping (exit code %d)", self.failure, self.failure.exit_code)
        stop.set()
        return True

    async def _refresh_revocations(self, stop: asyncio.Event, swarm) -> None:
        """Take the newest valid list from the authorizer or the DHT, apply it, and relay it: it is
        signed by the root key, so any node may store it for the others."""
        key = control_key(self.run.run_id)

        async def refresh_once() -> None:
            candidates: list[RevocationList] = []
            try:
                candidates.append(await self.client.revocations())
            except Exception as exc:  # unreachable authorizer: the DHT copy still works
                logger.debug("revocations from the authorizer unavailable: %s", exc)
            try:
                found = await asyncio.wait_for(
                    asyncio.wrap_future(swarm.dht.get(key, latest=True, return_future=True)), 10)
                item = found.value.get(REVOKED_SUBKEY) if found is not None and isinstance(found.value, dict) else None
                if item is not None:
                    candidates.append(RevocationList.model_validate(item.value))
            except Exception as exc:
                logger.debug("revocations from the DHT unavailable: %s", exc)
            for revocations in sorted(candidates, key=lambda r: r.issued_at):
                try:
                    if self._apply(revocations):
                        await swarm.dht_store_raw(key, REVOKED_SUBKEY, revocations.model_dump(), MAX_RECORD_TTL_S)
                except Exception as exc:
                    logger.debug("revocation list ignored: %s", exc)
            self.authenticator.revocations = self.auth_state.revocations()
            self._check_self(stop)  # a banned node sets `stop`, which ends the loop

        await every(self.revocation_refresh_s, refresh_once, stop, name="revocation refresh")

    def failure_exit_code(self) -> Optional[int]:
        """The exit code the node must end with because of its credential (5 banned or revoked,
        6 expired), or None; the reason was logged when it happened."""
        if self.failure is not None:
            return int(self.failure.exit_code)
        if self.keeper is not None and self.keeper.failure is not None:
            return int(self.keeper.failure.exit_code)
        return None

    async def close(self) -> None:
        """Stop the background tasks, leave the run (best effort, at most 2 s), close the client
        and remove the trust directory. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._relay_pass is not None:
            await self._relay_pass.close()
        try:
            if self.client is not None:
                if self.failure_exit_code() is None:
                    await leave_quietly(self.client, self.identity, self.run.run_id)
                await self.client.close()
        finally:
            remove_trust_dir(self.trust_dir)


def remove_trust_dir(path: Optional[str]) -> None:
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)


def remove_dead_nodes_trust_dirs(temp_dir: Optional[str] = None) -> int:
    """Remove the trust directories whose node's pid is no longer alive; how many. A pid alive
    again (reused) keeps its directory: it may be a node's."""
    import psutil

    removed = 0
    for path in glob.glob(os.path.join(temp_dir or tempfile.gettempdir(), f"{TRUST_DIR_PREFIX}*-*")):
        pid = os.path.basename(path)[len(TRUST_DIR_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or psutil.pid_exists(int(pid)) or not os.path.isdir(path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += not os.path.exists(path)
    return removed


async def _listen_for_probe(identity: Identity, settings: NodeSettings):
    """Listen with our identity while we wait for admission, so the authorizer's reachability
    probe dials a live node at the concrete addresses (ports) we announce; the DHT listens on the
    same ports afterwards."""
    from hivemind.p2p import P2P

    p2p = await P2P.create(identity_path=identity.path, host_maddrs=settings.host_maddrs,
                           announce_maddrs=settings.announce_maddrs or None, check_if_identity_free=False)
    visible = [str(m) for m in await p2p.get_visible_maddrs()]
    host = [m.split("/p2p/")[0] for m in visible] if not settings.announce_maddrs else settings.host_maddrs
    return p2p, visible, host


def _requested_stage(settings: NodeSettings) -> Optional[int]:
    return settings.worker.stage if settings.role == "worker" else None


async def establish_trust(settings: NodeSettings, identity: Identity, device: str) -> Trust:
    """Admission through the authorizer(s), or an open run when explicitly asked for.

    Cancellation-safe: cancelled while waiting for admission (the node is stopping), it tells the
    authorizer `leave` (join_run does), closes its client and listener, removes what it wrote, and
    re-raises."""
    urls = authorizer_urls(settings.authorizer)
    if not urls:
        if not settings.insecure_open_run:
            raise ConfigError("no --authorizer given: pass --authorizer URL to join a run, or --insecure-open-run "
                              "for a local run in which every peer is trusted")
        logger.warning(OPEN_RUN_WARNING.removeprefix("WARNING: "))
        return Trust(run=load_run_config(settings.config), stage=_requested_stage(settings), identity=identity,
                     initial_peers=settings.initial_peers, host_maddrs=settings.host_maddrs)
    client = AuthorizerClient(urls)
    probe = None
    trust_dir = None
    answering = None
    try:
        probe, visible, host_maddrs = await _listen_for_probe(identity, settings)

        def on_wait(ticket: TicketOut) -> None:
            logger.info("waiting for admission: queue position %s, about %s (stage %s)", ticket.queue_position,
                        duration(ticket.estimated_wait_s or 0), "-" if ticket.stage is None else ticket.stage)

        admission: Admission = await join_run(
            client, identity, settings.role, hardware=measured_hardware(device), announce_maddrs=visible,
            account_token=settings.account_token.get_secret_value(), preferred_stage=_requested_stage(settings), on_wait=on_wait,
            timeout_s=settings.admission_timeout_s, relay_ok=getattr(settings, "relay", "off") != "off")
        run = parse_run_config(admission.run_config, "the authorizer's run config")
        requested = _requested_stage(settings)
        if requested is not None and admission.stage is not None and requested != admission.stage:
            logger.warning("the authorizer placed this worker on stage %d, not the requested %d", admission.stage,
                           requested)
        remove_dead_nodes_trust_dirs()
        trust_dir = tempfile.mkdtemp(prefix=trust_dir_prefix())
        auth_state = SharedAuthState(trust_dir, run_id=run.run_id, root_public_key=admission.root_public_key)
        auth_state.publish_credential(admission.credential)
        keeper = CredentialKeeper(client, identity, run.run_id, admission.credential, auth_state.publish_credential)
        authenticator = PeerAuthenticator(identity=identity, run_id=run.run_id,
                                          root_public_key=admission.root_public_key,
                                          credential=lambda: keeper.credential)
        relays = _relays_for(settings, admission)
        if relays:
            # before the node's own daemon starts and reserves: the relays know this peer id by then
            answering = await greet_relays(probe, relays, authenticator)
    except BaseException:
        remove_trust_dir(trust_dir)
        await client.close()
        raise
    finally:
        if probe is not None:
            await probe.shutdown()
    logger.info("admitted to run %s as %s%s by %s; credential valid %s", run.run_id, settings.role,
                f" of stage {admission.stage}" if admission.stage is not None else "", client.url,
                until(admission.credential.credential.expires_at))
    return Trust(
        run=run, stage=admission.stage, identity=identity, host_maddrs=host_maddrs,
        initial_peers=list(dict.fromkeys([*settings.initial_peers, *admission.bootstrap_peers])),
        auth_state=auth_state, authenticator=authenticator,
        dht_authorizer=CredentialDHTAuthorizer(identity, auth_state), client=client, keeper=keeper,
        revocation_refresh_s=settings.revocation_refresh_s, trust_dir=trust_dir, reducer=admission.reducer,
        relays=relays, relayed=admission.relayed, answering_relays=answering,
    )


def _relays_for(settings, admission: Admission) -> list[str]:
    """The relays this node greets: the authorizer's list, plus the one named by --relay ADDR."""
    if settings.role not in ("worker", "trainer"):
        return []  # monitors and relays open no circuit
    mode = getattr(settings, "relay", "off")
    named = [mode] if mode not in ("auto", "off") else []
    return list(dict.fromkeys([*named, *admission.relays]))
