"""Operator endpoints under `/v1/admin`, behind `Authorization: Bearer <admin token>`.

The operator issues and revokes account tokens (`/v1/admin/accounts`; the same operations as
`agora-node --role authorizer accounts add|list|revoke`), bans peers or whole accounts
(identities), changes the live policy (capacities,
join rate, hardware floors, accepted builds and which checks run [report 3.6.1.1]) and reads the
rejected joins that were counted rather than stored (`/v1/admin/rejections`), reads the evidence
reports trainers sent and their verdicts (`/v1/admin/evidence`), and signs operator
preempt orders with the run's root key (`/v1/admin/preempt`, protocol/control_orders.py; the
`agora-node preempt` CLI writes them into the DHT). A policy change is
stored before it is answered and applies to the next request; lowering a capacity never evicts a
node, it only stops admissions until the stage drains below it.
"""

from __future__ import annotations

import collections
import hmac
import logging
import time
from typing import Annotated, Literal, Optional

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from authorizer import admission
from authorizer.errors import AdminAuthRequired, InvalidRequest, NotFound
from authorizer.evidence import finite_or_none
from authorizer.models import (
    ACCOUNT_ID_PATTERN, PEER_ID_PATTERN, AccountCreate, AccountCreated, AccountOut, AccountRevokeOut, AccountsOut,
    BanOut, BanRequest, ErrorBody, EvidenceRecordOut, EvidenceRecordsOut, ParticipantOut, ParticipantsOut,
    PolicyUpdate, RejectionCountOut, RejectionCountsOut, TicketStatus, UnbanOut,
)
from authorizer.policy import Policy, merge_policy
from authorizer.service import Authorizer
from protocol.control_orders import PreemptOrderOut, PreemptRequest, new_order, sign_order_as_root
from protocol.dht_schema import control_key
from protocol.errors import ConfigError
from protocol.identity import public_key_from_peer_id

logger = logging.getLogger("agora.authorizer.admin")
_bearer = HTTPBearer(auto_error=False, description="the admin token (--admin-token or its file)")


def require_admin(
    request: Request, credentials: Annotated[Optional[HTTPAuthorizationCredentials], Depends(_bearer)]
) -> None:
    expected = request.app.state.admin_token.encode()
    given = (credentials.credentials if credentials is not None else "").encode()
    if not hmac.compare_digest(given, expected):
        raise AdminAuthRequired("this endpoint needs 'Authorization: Bearer <admin token>'; use the operator's token")


_ERRORS = {
    400: {"model": ErrorBody, "description": "invalid request"},
    401: {"model": ErrorBody, "description": "missing or wrong admin token"},
    503: {"model": ErrorBody, "description": "database unavailable; retry"},
}
admin_router = APIRouter(prefix="/v1/admin", tags=["admin"], dependencies=[Depends(require_admin)], responses=_ERRORS)


def _authorizer(request: Request) -> Authorizer:
    return request.app.state.authorizer


def _target(body: BanRequest) -> tuple[str, str, dict]:
    if body.peer_id is not None:
        return "peer", body.peer_id, {"peer_id": body.peer_id}
    account = body.account_id or admission.account_id(body.account_token or "")
    return "account", account, {"account_id": account}


@admin_router.post("/bans", response_model=BanOut)
async def ban(body: BanRequest, request: Request) -> BanOut:
    """Ban a peer id or an account: its joins are refused, its live tickets end, its credentials
    are revoked (listed in /v1/revocations until they expire) and renewal is refused."""
    authorizer = _authorizer(request)
    kind, target, where = _target(body)
    message = (f"the operator banned this {kind}" + (f" ({body.reason})" if body.reason else "")
               + "; contact the operator if you think this is a mistake")
    ended = await authorizer.stored(authorizer.store.ban(**where, reason=body.reason, now=time.time(), message=message))
    logger.warning("banned %s %s (%s): %d live ticket(s) ended", kind, target, body.reason, ended)
    authorizer.queue_wakeup.set()
    return BanOut(target=target, kind=kind, ended_tickets=ended)  # type: ignore[arg-type]


@admin_router.post("/unban", response_model=UnbanOut)
async def unban(body: BanRequest, request: Request) -> UnbanOut:
    """Lift a ban; the peer or account may join again (its ended tickets stay ended)."""
    authorizer = _authorizer(request)
    kind, target, where = _target(body)
    was = await authorizer.stored(authorizer.store.unban(**where))
    return UnbanOut(target=target, kind=kind, was_banned=was)  # type: ignore[arg-type]


@admin_router.get("/policy", response_model=Policy)
async def get_policy(request: Request) -> Policy:
    return _authorizer(request).policy


@admin_router.patch("/policy", response_model=Policy)
async def patch_policy(body: PolicyUpdate, request: Request) -> Policy:
    """Change any subset of the policy; it is stored, then applies to the next request."""
    authorizer = _authorizer(request)
    try:
        policy = merge_policy(authorizer.policy, body.changes(), source="policy update").for_run(authorizer.run)
    except ConfigError as exc:
        raise InvalidRequest(f"{exc}; fix the update and retry") from exc
    await authorizer.stored(authorizer.store.save_policy(policy.model_dump(mode="json")))
    authorizer.policy = policy
    authorizer.queue_wakeup.set()
    logger.warning("policy changed: %s", body.changes())
    return policy


@admin_router.get("/participants", response_model=ParticipantsOut)
async def participants(
    request: Request,
    status: Annotated[Optional[TicketStatus], Query()] = None,
    after_id: Annotated[int, Query(ge=0, le=1 << 62)] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> ParticipantsOut:
    """Participant records in join order, a page at a time (account ids are token hashes)."""
    authorizer = _authorizer(request)
    rows = await authorizer.read(authorizer.store.list_participants,
                                  status.value if status else None, after_id, limit)
    out = [ParticipantOut(
        id=r.id, ticket=r.ticket, peer_id=r.peer_id, account_id=r.account_id, role=r.role,
        stage=None if r.pool is None or r.pool < 0 else r.pool, status=r.status, reason=r.reason,
        client_version=r.client_version, announce_maddrs=r.announce_maddrs or [], created_at=r.created_at,
        admitted_at=r.admitted_at, serial=r.serial, expires_at=r.expires_at,
    ) for r in rows]
    return ParticipantsOut(participants=out, next_after_id=rows[-1].id if len(rows) == limit else None)


@admin_router.get("/rejections", response_model=RejectionCountsOut)
async def rejections(
    request: Request,
    since: Annotated[float, Query(ge=0, le=1e11, description="unix seconds; minutes starting before are left out")] = 0,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> RejectionCountsOut:
    """Rejected joins that were counted instead of stored as tickets (a source past its detailed
    rejections, or joins answered 429 as rate_limited), per source, reason and minute: newest
    minute first. Rejections stored as tickets are in /v1/admin/participants?status=rejected."""
    authorizer = _authorizer(request)
    await authorizer.flush_rejections()
    rows = await authorizer.read(authorizer.store.list_rejection_counts, since, limit)
    return RejectionCountsOut(rejections=[
        RejectionCountOut(source=r.source, reason=r.reason, minute=r.minute, refused=r.refused) for r in rows])


@admin_router.get("/evidence", response_model=EvidenceRecordsOut)
async def evidence_reports(
    request: Request,
    verdict: Annotated[Optional[Literal["upheld", "already_revoked", "rejected", "pending"]], Query()] = None,
    reporter: Annotated[Optional[str], Query(pattern=PEER_ID_PATTERN, description="one reporter's peer id")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> EvidenceRecordsOut:
    """Evidence reports trainers sent (POST /v1/evidence), newest first: upheld ones with the ban
    they caused, rejected ones with their reason and the reporter they flag."""
    authorizer = _authorizer(request)
    rows = await authorizer.read(authorizer.store.list_evidence, limit, verdict, reporter)
    return EvidenceRecordsOut(reports=[EvidenceRecordOut(
        id=r.id, received_at=r.received_at, reporter_peer_id=r.reporter_peer_id,
        reporter_account_id=r.reporter_account_id, accused_peer_id=r.accused_peer_id,
        accused_account_id=r.accused_account_id, witness_peer_ids=list(r.witness_peer_ids or []),
        stage=r.stage, version=r.version, kind=r.kind, verdict=r.verdict, reason=r.reason,
        distances=None if r.distance_1 is None else [
            finite_or_none(d) for d in ((r.distance_1,) if r.distance_2 is None else (r.distance_1, r.distance_2))],
        message=r.message, body_sha256=r.body_sha256,
    ) for r in rows])


def account_out(row) -> AccountOut:
    return AccountOut(id=row.id, label=row.label or "", created_at=row.created_at, revoked_at=row.revoked_at,
                      banned=bool(row.banned))


@admin_router.post("/accounts", response_model=AccountCreated)
async def create_account(body: AccountCreate, request: Request) -> AccountCreated:
    """Issue an account token. The answer is the only place the token appears: the authorizer
    keeps its SHA-256 (the account id). Give the token to the contributor (--account-token)."""
    authorizer = _authorizer(request)
    token = admission.new_account_token()
    row = await authorizer.stored(authorizer.store.create_account(admission.account_id(token), body.label, time.time()))
    logger.warning("account %s created (%s)", row.id[:12], body.label or "no label")
    return AccountCreated(**account_out(row).model_dump(), token=token)


@admin_router.get("/accounts", response_model=AccountsOut)
async def list_accounts(request: Request) -> AccountsOut:
    """Issued accounts, oldest first (ids are token hashes; tokens are not kept)."""
    authorizer = _authorizer(request)
    return AccountsOut(accounts=[account_out(r) for r in await authorizer.read(authorizer.store.list_accounts)])


@admin_router.post("/accounts/{account_id}/revoke", response_model=AccountRevokeOut,
                   responses={404: {"model": ErrorBody, "description": "no such issued account"}})
async def revoke_account(account_id: Annotated[str, Path(pattern=ACCOUNT_ID_PATTERN)],
                         request: Request) -> AccountRevokeOut:
    """Revoke an account token: its joins are refused (revoked_account), its nodes' tickets end
    and their credentials are revoked, as with a ban."""
    authorizer = _authorizer(request)
    row = await authorizer.read(authorizer.store.account, account_id)
    if row is None or not row.issued:
        raise NotFound(f"no issued account {account_id}; GET /v1/admin/accounts lists them")
    was_active, ended = await authorizer.stored(authorizer.store.revoke_account(account_id, time.time()))
    logger.warning("account %s revoked: %d live ticket(s) ended", account_id[:12], ended)
    authorizer.queue_wakeup.set()
    return AccountRevokeOut(id=account_id, was_active=was_active, ended_tickets=ended)


def _order_counts(request: Request) -> collections.Counter:
    """Preempt orders signed by this authorizer, by moment, and refused ones as `refused_<why>`."""
    counts = getattr(request.app.state, "preempt_orders", None)
    if counts is None:
        counts = request.app.state.preempt_orders = collections.Counter()
    return counts


@admin_router.post("/preempt", response_model=PreemptOrderOut)
async def preempt(body: PreemptRequest, request: Request) -> PreemptOrderOut:
    """Sign an order for one peer to preempt itself at a moment (failure injection, report
    3.5.3.1). The authorizer does not write it anywhere: the caller stores `record` under `subkey`
    of `key` in the run's DHT (`agora-node preempt` does), where every node checks the root
    key's signature. An order for a peer that is not in the run harms nothing: nobody reads it."""
    authorizer = _authorizer(request)
    counts = _order_counts(request)
    if public_key_from_peer_id(body.peer_id) is None:
        counts["refused_peer_id"] += 1
        raise InvalidRequest(f"peer_id {body.peer_id[:60]!r} is not an Ed25519 libp2p peer id; copy the worker's "
                             f"peer= from its readiness line or from /v1/admin/participants")
    order = new_order(run_id=authorizer.run.run_id, peer_id=body.peer_id, moment=body.moment, ttl_s=body.ttl_s)
    signed = sign_order_as_root(authorizer.issuer.root_key, order)
    counts[order.moment.value] += 1
    logger.warning("preempt order %s signed: peer %s at %s, valid %.0fs", order.order_id, order.peer_id,
                   order.moment.value, body.ttl_s)
    return PreemptOrderOut(order_id=order.order_id, run_id=order.run_id, peer_id=order.peer_id, moment=order.moment,
                           issued_at=order.issued_at, expires_at=order.expires_at, key=control_key(order.run_id),
                           subkey=order.subkey, record=signed.to_bytes())


@admin_router.get("/preempt")
async def preempt_counts(request: Request) -> dict[str, int]:
    """Preempt orders signed so far by moment, and refused requests as `refused_<why>`."""
    return dict(_order_counts(request))
