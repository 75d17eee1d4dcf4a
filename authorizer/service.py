"""The authorizer's behaviour behind the HTTP routes: join, poll, renew, leave, run info, admin.

Routes stay thin; this is where a join passes the checks in order of cost: its source's rate
limit (authorizer.ratelimit, before the body is even parsed), request shape and identity (400 if
wrong), then capability and integrity (pure), then bans (one read), then the dial-back (network),
then the store's transaction (account rules, capacity, placement). A refused join is recorded as a
rejected ticket the user can poll, as long as its source has not used up its detailed rejections;
past that it is answered in full and counted per source, reason and minute (authorizer.rejections),
so a flood cannot grow the database a row per request. Database failures become StoreUnavailable
(503) here, at the boundary. Whatever shows a node live tells the rate limiter, so the node's own
polls and renewals are limited per node rather than per address.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import secrets
import time
from typing import Optional

from sqlalchemy.engine import Row
from sqlalchemy.exc import SQLAlchemyError

from authorizer import admission
from authorizer.admission import MAX_MONITORS, MONITOR_ACCOUNT, MONITOR_POOL, OWNER_ROLES, HardwareClaim, RejectReason
from authorizer.errors import (
    DialerUnavailable, IdentityMismatch, NotFound, ProofRejected, ProofRequired, RateLimited, RenewalRefused,
    StoreUnavailable,
)
from authorizer.evidence import EvidenceDesk
from authorizer.issuer import CredentialIssuer
from authorizer.models import (
    AdmissionOut, JoinRequest, LeaveOut, PoolInfo, Proof, RejectionOut, RenewOut, RunInfo, StageInfo,
    TicketOut, TicketStatus,
)
from authorizer.placement import choose_pool
from authorizer.policy import TRAINER_POOL, Policy
from authorizer.ratelimit import RATE_LIMITED_REASON, Limiter
from authorizer.reachability import Dialer, ReachabilityUnavailable, behind_router_advice
from authorizer.rejections import RejectionLedger
from authorizer.schema import ADMITTED, QUEUED
from authorizer.store import NewParticipant, Store, UnrecordedRejection
from protocol.authorizer_api import LIVE_TICKET_STATUSES
from protocol.credentials import MAX_CLOCK_SKEW_S, SignedCredential, proof_bytes, renew_at
from protocol.identity import peer_id_from_public_key, verify_signature
from protocol.run_config import RunConfig

logger = logging.getLogger("agora.authorizer")

PROOF_WINDOW_S = 120.0
"""A renew/leave proof must be signed within this many seconds of the authorizer's clock."""
MAX_REVOKED = 100_000


class Authorizer:
    """One run's admission authority: policy in memory, records in the store, the root key."""

    def __init__(self, *, run: RunConfig, store: Store, issuer: CredentialIssuer, policy: Policy,
                 dialer: Dialer, bootstrap_peers: list[str], limiter: Limiter, rejections: RejectionLedger,
                 admin_token: Optional[str] = None):
        self.run = run
        self.admin_token = admin_token
        """What a joining health monitor must present as its account token (None: monitors refused)."""
        self.monitor = None
        """The in-process health monitor (authorizer.monitor.service.HealthMonitor), if it runs."""
        self.monitor_maddrs: list[str] = []
        """The in-process monitor's DHT addresses: every admitted node gets them as bootstrap peers."""
        self.monitor_store = None
        """The monitor's tables (authorizer.monitor.store.MonitorStore), which the JSON API reads."""
        self.store = store
        self.issuer = issuer
        self.policy = policy
        self.dialer = dialer
        self.bootstrap_peers = list(bootstrap_peers)
        self.public_key_b64 = base64.b64encode(issuer.public_key).decode()
        self.run_config_json = run.model_dump(mode="json")
        self.queue_wakeup = asyncio.Event()
        self.limiter = limiter
        self.rejections = rejections
        limiter.on_join_refused = lambda source: rejections.count(source, RATE_LIMITED_REASON, time.time())
        self.evidence = EvidenceDesk(self, proof_window_s=PROOF_WINDOW_S)
        """Evidence reports against workers (POST /v1/evidence) and their verdicts' counts."""

    async def stored(self, coro):
        try:
            return await coro
        except SQLAlchemyError as exc:
            logger.error("store failure: %s", exc)
            raise StoreUnavailable("the authorizer's database is unavailable; retry in a few seconds") from exc

    async def read(self, fn, *args):
        return await self.stored(asyncio.to_thread(fn, *args))

    # -- join and poll -----------------------------------------------------------------------

    async def join(self, request: JoinRequest, source: str = "unknown") -> TicketOut:
        """`source` is whom the join counts against (authorizer.ratelimit.source_of)."""
        public_key = raw_ed25519_public_key(request.public_key)
        if public_key is None:
            raise IdentityMismatch("public_key must be the node's Ed25519 public key (32 raw bytes, or the libp2p "
                                   "PublicKey protobuf), base64; send the key of the node's identity file")
        key_peer = peer_id_from_public_key(public_key).to_base58()
        if key_peer != request.peer_id:
            raise IdentityMismatch(
                f"peer_id {request.peer_id} does not belong to public_key (whose peer id is {key_peer}); "
                f"send the peer id and public key of the same libp2p identity")
        policy, now = self.policy, time.time()
        if request.signature is not None:
            self._check_join_proof(request, public_key, now)
        monitor = request.role in OWNER_ROLES
        new = NewParticipant(
            ticket=secrets.token_urlsafe(16), peer_id=request.peer_id, public_key=public_key,
            account_id=MONITOR_ACCOUNT if monitor else admission.account_id(request.account_token), role=request.role,
            hardware=request.hardware.model_dump(), client_version=request.client_version,
            package_digest=request.package_digest, announce_maddrs=list(request.announce_maddrs),
            proof_at=request.signed_at,
        )
        hw = HardwareClaim(**request.hardware.model_dump())
        if monitor:  # no stage, no floors: the run owner's own node, proven by the admin token
            eligible, rejection = [], admission.check_monitor_token(request.account_token, self.admin_token,
                                                                    request.role)
        else:
            eligible, rejection = admission.check_capability(self.run, policy, request.role, hw)
            rejection = rejection or admission.check_account_token(policy, request.account_token)
        rejection = rejection or admission.check_integrity(policy, request.client_version, request.package_digest)
        if rejection is None and policy.checks.reachability:
            rejection = await self.read(self.store.is_banned, new.peer_id, new.account_id)
            if rejection is None:
                try:
                    rejection = await self.dialer.check(new.peer_id, new.announce_maddrs,
                                                        allow_private=policy.dial_private_addresses, source=source)
                except RateLimited:
                    self.rejections.count(source, RATE_LIMITED_REASON, now)
                    raise
                except ReachabilityUnavailable as exc:
                    logger.error("%s", exc)
                    raise DialerUnavailable("the authorizer cannot check reachability right now (its libp2p "
                                            "dialer did not start); retry in a minute") from exc
                if rejection is not None and await self._may_relay(request, rejection):
                    logger.info("%s %s cannot be dialled back (%s); admitting it to serve through the run's relays",
                                request.role, request.peer_id, rejection.reason.value)
                    rejection, new = None, dataclasses.replace(new, reachability="relayed")
                elif rejection is not None and rejection.reason in (RejectReason.UNREACHABLE,
                                                                    RejectReason.NO_DIALABLE_ADDRESS):
                    rejection = behind_router_advice(rejection, new.announce_maddrs, source,
                                                     relay_ok=request.relay_ok)
        position = None
        if rejection is not None:
            if self.rejections.keep(source):
                row = await self.stored(self.store.record_rejection(new, now, rejection))
            else:  # answered in full, counted; a live ticket of this peer is not looked up
                row = UnrecordedRejection.of(new, rejection)
        else:
            row, position = await self.stored(self.store.create_ticket(
                new, now, account_rules=policy.checks.accountability and not monitor,
                max_per_account=policy.max_nodes_per_account,
                place=(lambda counts: MONITOR_POOL) if monitor else (
                    lambda counts: choose_pool(self.run, policy, request.role, eligible, counts,
                                                request.preferred_stage)),
                capacity=self.capacity,
                run_full=lambda: admission.run_full_rejection(request.role, eligible),
                keep_rejected=lambda: self.rejections.keep(source),
            ))
        if row == "proof_required":
            raise ProofRequired(
                f"peer {request.peer_id} already holds a live ticket; a join that replaces it (a node restarted "
                f"with the same identity) must prove the key: upgrade agora-node, or stop the other process "
                f"with this identity and wait until its ticket expires")
        if row == "replayed":
            raise ProofRejected("this join proof is older than the one of the peer's live ticket; sign a fresh one")
        if isinstance(row, UnrecordedRejection):
            self.rejections.count(source, row.reason, now)
        elif row.status in (QUEUED, ADMITTED):
            self.limiter.know(row.peer_id, row.public_key, ticket=row.ticket, signed_at=row.last_proof_at)
        if row.status == QUEUED:
            self.queue_wakeup.set()
        return self._ticket_out(row, position=position, detailed=False)

    async def _may_relay(self, request: JoinRequest, rejection) -> bool:
        """A node the dial-back failed for is admitted as relayed if it can serve through relays
        (`relay_ok`) and the run has one; owner nodes (monitors, relays) never."""
        if not request.relay_ok or request.role in OWNER_ROLES:
            return False
        if rejection.reason not in (RejectReason.UNREACHABLE, RejectReason.NO_DIALABLE_ADDRESS):
            return False
        return bool(await self.read(self.store.relay_addresses, 1))

    async def poll(self, ticket: str) -> TicketOut:
        found = await self.read(self.store.ticket, ticket)
        if found is None:
            raise NotFound(f"ticket {ticket} is unknown; join again with POST /v1/join")
        row, ahead = found
        now = time.time()
        if row.status in (QUEUED, ADMITTED):  # its next polls count against the node, not the address
            self.limiter.know(row.peer_id, row.public_key, ticket=row.ticket)
        if row.status == QUEUED and now - row.last_seen_at > self.policy.queue_idle_timeout_s / 4:
            await self.stored(self.store.touch(row.id, now))
        bootstrap = self.bootstrap_peers
        if row.status == ADMITTED and not bootstrap:
            recent = await self.read(self.store.recent_addresses, 8, row.admitted_at or now, row.id)
            # the monitor's DHT node first: it is up before any node is admitted, so every node
            # meets it and it sees every record [report 3.6.2.1]
            bootstrap = self.monitor_maddrs + [addr for addr in recent if row.peer_id not in addr]
        relays = await self.read(self.store.relay_addresses, 16) if row.status == ADMITTED else []
        return self._ticket_out(row, position=ahead, detailed=True, bootstrap=bootstrap, relays=relays)

    def _ticket_out(self, row: Row, *, position: Optional[int], detailed: bool,
                    bootstrap: Optional[list[str]] = None, relays: Optional[list[str]] = None) -> TicketOut:
        status = TicketStatus(row.status)
        fields: dict = {}
        if row.reason and status != TicketStatus.ADMITTED:
            fields["rejection"] = RejectionOut(reason=row.reason, message=row.message or "")
        if status == TicketStatus.QUEUED and position is not None:
            # Releases are paced by the join rate; the estimate shrinks as the tickets ahead leave.
            fields["queue_position"] = position
            fields["estimated_wait_s"] = round((position + 1) / self.policy.join_rate_per_s, 3)
        if detailed and status in LIVE_TICKET_STATUSES:
            fields["run_config"] = self.run_config_json
        if detailed and status == TicketStatus.ADMITTED and row.credential is not None:
            fields["admission"] = AdmissionOut(
                **self._credential_fields(row.credential),
                bootstrap_peers=bootstrap or [],
                relays=relays or [],
                authorizer_public_key=self.public_key_b64,
            )
        reachability = getattr(row, "reachability", None)
        if status in LIVE_TICKET_STATUSES and row.role not in OWNER_ROLES:
            fields["reachability"] = "relayed" if reachability == "relayed" else "direct"
        return TicketOut(ticket=row.ticket, status=status, peer_id=row.peer_id, role=row.role,
                         run_id=self.run.run_id,
                         stage=None if row.pool in (None, TRAINER_POOL, MONITOR_POOL) else row.pool,
                         reducer=self._designated_reducer(row),
                         **fields)

    def _designated_reducer(self, row) -> bool:
        """A worker of an account in the policy's `reducer_accounts` reduces in its stage's rounds.
        (An unrecorded rejection reads like a row but carries no account.)"""
        account = getattr(row, "account_id", None)
        return row.role == "worker" and account is not None and account in self.policy.reducer_accounts

    def _credential_fields(self, blob: bytes) -> dict:
        signed = SignedCredential.from_bytes(blob)
        return dict(credential=signed, credential_msgpack=base64.b64encode(blob).decode(),
                    renew_at=renew_at(signed.credential), expires_at=signed.credential.expires_at)

    def capacity(self, pool: int) -> int:
        """The policy's capacity of a stage or the trainers; monitors have a fixed small one."""
        return MAX_MONITORS if pool == MONITOR_POOL else self.policy.capacity(pool)

    # -- admission (called by authorizer.queue) ------------------------------------------------

    async def admit_next(self, limit: int) -> list[tuple[str, Row]]:
        outcomes = await self.store.admit_next(
            limit, time.time(), self.capacity, self.issuer,
            run_full=lambda role: admission.run_full_rejection(role, []),
        )
        for outcome, row in outcomes:
            logger.info("%s %s %s (stage %s)", outcome, row.role, row.peer_id, row.pool)
            if outcome == "admitted":
                self.limiter.know(row.peer_id, row.public_key, ticket=row.ticket, signed_at=row.last_proof_at)
        return outcomes

    async def flush_rejections(self) -> int:
        """Add the rejections counted in memory to the database; returns how many keys were written.
        On a database failure the counts are kept for the next flush."""
        counts = self.rejections.take()
        try:
            return await self.stored(self.store.add_rejection_counts(counts))
        except Exception:
            self.rejections.restore(counts)
            raise

    # -- renew and leave -----------------------------------------------------------------------

    def _check_join_proof(self, request: JoinRequest, public_key: bytes, now: float) -> None:
        if abs(now - request.signed_at) > PROOF_WINDOW_S:
            raise ProofRejected(
                f"the join's signed_at is {request.signed_at - now:+.0f} s from the authorizer's clock; sign "
                f"with the current time (check NTP) and retry")
        data = proof_bytes("join", run_id=self.run.run_id, peer_id=request.peer_id, signed_at=request.signed_at)
        if not verify_signature(public_key, data, request.signature):
            raise ProofRejected(
                f"the join signature does not verify with the key of {request.peer_id}; sign "
                f"protocol.credentials.proof_bytes('join', run_id={self.run.run_id!r}, ...) with the node's "
                f"identity key (GET /v1/run gives the run id)")

    async def _check_proof(self, action: str, proof: Proof) -> None:
        now = time.time()
        if abs(now - proof.signed_at) > PROOF_WINDOW_S:
            raise ProofRejected(
                f"signed_at is {proof.signed_at - now:+.0f} s from the authorizer's clock; sign with the "
                f"current time (check NTP) and retry")
        live = await self.read(self.store.live, proof.peer_id)
        if live is None:
            self.limiter.forget(proof.peer_id)
            raise RenewalRefused(f"peer {proof.peer_id} has no live ticket; join with POST /v1/join")
        data = proof_bytes(action, run_id=self.run.run_id, peer_id=proof.peer_id, signed_at=proof.signed_at)
        if not verify_signature(live.public_key, data, proof.signature):  # Ed25519: tens of microseconds
            raise ProofRejected(
                f"the signature does not verify with the libp2p key of {proof.peer_id}; sign "
                f"protocol.credentials.proof_bytes('{action}', ...) with the node's identity key")
        self.limiter.know(proof.peer_id, live.public_key, ticket=live.ticket, signed_at=proof.signed_at)

    async def renew(self, proof: Proof) -> RenewOut:
        await self._check_proof("renew", proof)
        result = await self.stored(self.store.renew(proof.peer_id, proof.signed_at, time.time(), self.issuer))
        if isinstance(result, str):
            if result in ("banned", "not_admitted"):
                self.limiter.forget(proof.peer_id)
            raise {
                "banned": RenewalRefused(f"peer {proof.peer_id} is banned from this run; contact the operator"),
                "queued": RenewalRefused(f"peer {proof.peer_id} is still queued; poll your ticket until admitted"),
                "replayed": ProofRejected("this proof is not newer than the last one accepted; sign a fresh one"),
            }.get(result, RenewalRefused(f"peer {proof.peer_id} is not admitted; join with POST /v1/join"))
        stage = None if result.pool in (TRAINER_POOL, MONITOR_POOL) else result.pool
        return RenewOut(**self._credential_fields(result.credential), stage=stage)

    async def leave(self, proof: Proof) -> LeaveOut:
        await self._check_proof("leave", proof)
        result = await self.stored(self.store.leave(proof.peer_id, proof.signed_at, time.time()))
        if result == "replayed":
            raise ProofRejected("this proof is not newer than the last one accepted; sign a fresh one")
        self.limiter.forget(proof.peer_id)
        if isinstance(result, str):
            raise NotFound(f"peer {proof.peer_id} has no live ticket; nothing to leave")
        self.queue_wakeup.set()
        return LeaveOut(peer_id=proof.peer_id, status=TicketStatus.LEFT)

    # -- public views --------------------------------------------------------------------------

    async def run_info(self) -> RunInfo:
        counts = await self.read(self.store.pool_counts)
        policy = self.policy
        stages = []
        for index, layers in enumerate(self.run.stages):
            count = counts.get(index)
            kind = self.run.stage_kind(index)
            stages.append(StageInfo(
                index=index, kind=kind, first_layer=layers.first_layer, last_layer=layers.last_layer,
                admitted=count.admitted if count else 0, queued=count.queued if count else 0,
                target=policy.target(index), capacity=policy.capacity(index),
                floor=policy.floor(kind).model_dump(),
            ))
        trainers = counts.get(TRAINER_POOL)
        return RunInfo(
            run_id=self.run.run_id, stages=stages,
            trainers=PoolInfo(admitted=trainers.admitted if trainers else 0,
                              queued=trainers.queued if trainers else 0, capacity=policy.trainer_capacity),
            authorizer_public_key=self.public_key_b64, client_versions=policy.client_versions,
            join_rate_per_s=policy.join_rate_per_s, credential_ttl_s=self.issuer.ttl_s,
            checks=policy.checks.model_dump(), accounts_required=policy.checks.accountability,
        )

    async def revocations(self):
        now = time.time()
        serials, peers = await self.read(self.store.revoked, now, MAX_REVOKED)
        return self.issuer.revocation_list(serials, peers, now)

    async def sweep(self) -> int:
        return await self.store.sweep(time.time(), self.policy.queue_idle_timeout_s, MAX_CLOCK_SKEW_S)


def raw_ed25519_public_key(blob: bytes) -> Optional[bytes]:
    """The raw 32-byte Ed25519 key in `blob` (raw already, or a libp2p PublicKey protobuf), or None.

    Node identities are Ed25519 (protocol.identity): the peer id embeds the key, and credentials
    carry the raw key, which is what peers verify message signatures with.
    """
    if len(blob) == 32:
        return blob
    from hivemind.proto import crypto_pb2

    try:
        message = crypto_pb2.PublicKey.FromString(blob)
    except Exception:  # protobuf DecodeError on hostile bytes
        return None
    if message.key_type != crypto_pb2.Ed25519 or len(message.data) != 32:
        return None
    return bytes(message.data)
