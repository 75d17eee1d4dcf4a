"""Who this node trusts, set up before it joins the swarm.

With `--authorizer URL` the node proves it is reachable, is admitted, and receives its
credential, stage, run config and bootstrap peers; it then authenticates every RPC and DHT
message with that credential (protocol/auth.py, protocol/dht_auth.py, protocol/records.py),
renews it in the background and relays the run's signed revocation list. With
`--insecure-open-run` there is no authorizer and every peer is trusted; the node says so loudly.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import dataclass, field
from typing import Optional

from node.admission import Admission, AuthorizerClient, CredentialKeeper, join_run, measured_hardware
from node.settings import NodeSettings
from protocol.auth import PeerAuthenticator
from protocol.auth_state import SharedAuthState
from protocol.credentials import RevocationList
from protocol.dht_auth import CredentialDHTAuthorizer
from protocol.dht_schema import MAX_RECORD_TTL_S, control_key
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.records import REVOKED_SUBKEY
from roles.model.config import RunConfig, load_run_config

logger = logging.getLogger(__name__)

OPEN_RUN_WARNING = ("WARNING: --insecure-open-run: no authorizer; this node trusts every peer and any peer can "
                    "join, read and write this run. Use it only for local experiments.")


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
    _tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def authenticated(self) -> bool:
        return self.authenticator is not None

    def start_background(self, stop: asyncio.Event, swarm) -> None:
        """Credential renewal and revocation refresh, for as long as the node runs."""
        if self.keeper is not None:
            self._tasks.append(asyncio.create_task(self.keeper.run(stop), name="credential-keeper"))
            self._tasks.append(asyncio.create_task(self._refresh_revocations(stop, swarm), name="revocations"))

    async def _refresh_revocations(self, stop: asyncio.Event, swarm) -> None:
        """Take the newest valid list from the authorizer or the DHT, apply it, and relay it: it is
        signed by the root key, so any node may store it for the others."""
        key = control_key(self.run.run_id)
        while not stop.is_set():
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
                    if self.auth_state.publish_revocations(revocations):
                        logger.info("revocation list of %s applied: %d serials, %d peers revoked",
                                    revocations.issued_at, len(revocations.serials), len(revocations.peer_ids))
                        await swarm.dht_store_raw(key, REVOKED_SUBKEY, revocations.model_dump(), MAX_RECORD_TTL_S)
                except Exception as exc:
                    logger.debug("revocation list ignored: %s", exc)
            self.authenticator.revocations = self.auth_state.revocations()
            try:
                await asyncio.wait_for(stop.wait(), self.revocation_refresh_s)
            except asyncio.TimeoutError:
                pass

    def failure_exit_code(self) -> Optional[int]:
        if self.keeper is not None and self.keeper.failure is not None:
            logger.error("%s", self.keeper.failure)
            return self.keeper.failure.exit_code
        return None

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.client is not None:
            try:
                await asyncio.wait_for(self.client.leave(self.identity, self.run.run_id), 5)
            except Exception as exc:  # the credential lapses by itself; leaving is a courtesy
                logger.debug("leave not acknowledged: %s", exc)
            await self.client.close()


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


async def establish_trust(settings: NodeSettings, identity: Identity, device: str) -> Trust:
    """Admission through the authorizer, or an open run when explicitly asked for."""
    if settings.authorizer is None:
        if not settings.insecure_open_run:
            raise ConfigError("no --authorizer given: pass --authorizer URL to join a run, or --insecure-open-run "
                              "for a local run in which every peer is trusted")
        print(OPEN_RUN_WARNING, flush=True, file=__import__("sys").stderr)
        return Trust(run=load_run_config(settings.config), stage=settings.stage, identity=identity,
                     initial_peers=settings.initial_peers, host_maddrs=settings.host_maddrs)
    client = AuthorizerClient(settings.authorizer)
    probe = None
    try:
        probe, visible, host_maddrs = await _listen_for_probe(identity, settings)

        def on_wait(ticket: dict) -> None:
            logger.info("waiting for admission: queue position %s, about %.0fs (stage %s)",
                        ticket.get("queue_position"), ticket.get("estimated_wait_s") or 0, ticket.get("stage"))

        admission: Admission = await join_run(
            client, identity, settings.role, hardware=measured_hardware(device), announce_maddrs=visible,
            account_token=settings.account_token, on_wait=on_wait)
    except BaseException:
        await client.close()
        raise
    finally:
        if probe is not None:
            await probe.shutdown()
    run = RunConfig.model_validate(admission.run_config)
    if settings.stage is not None and admission.stage is not None and settings.stage != admission.stage:
        logger.warning("the authorizer placed this worker on stage %d, not the requested %d", admission.stage,
                       settings.stage)
    auth_state = SharedAuthState(tempfile.mkdtemp(prefix="agora-trust-"), run_id=run.run_id,
                                 root_public_key=admission.root_public_key)
    auth_state.publish_credential(admission.credential)
    keeper = CredentialKeeper(client, identity, run.run_id, admission.credential, auth_state.publish_credential)
    authenticator = PeerAuthenticator(identity=identity, run_id=run.run_id,
                                      root_public_key=admission.root_public_key, credential=lambda: keeper.credential)
    logger.info("admitted to run %s as %s%s; credential valid until %d", run.run_id, settings.role,
                f" of stage {admission.stage}" if admission.stage is not None else "",
                admission.credential.credential.expires_at)
    return Trust(
        run=run, stage=admission.stage, identity=identity, host_maddrs=host_maddrs,
        initial_peers=list(dict.fromkeys([*settings.initial_peers, *admission.bootstrap_peers])),
        auth_state=auth_state, authenticator=authenticator,
        dht_authorizer=CredentialDHTAuthorizer(identity, auth_state), client=client, keeper=keeper,
        revocation_refresh_s=settings.revocation_refresh_s,
    )
