"""The public `/v1` endpoints nodes call: join, poll, renew, leave, run info, revocations, evidence.

Nodes talk to the authorizer only to join, to poll the queue, and to renew their credential
[report 3.6.1.1], and trainers to report evidence against a worker (authorizer.evidence); nothing
on the training path comes here. Each route only parses and delegates to
`authorizer.service.Authorizer`. Join, poll, renew and leave are rate limited before they get here
(authorizer.app RateLimit): 429 `rate_limited` with `Retry-After`; so is evidence, by its source
and then by its reporter.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request

from authorizer.models import TICKET_PATTERN, ErrorBody, JoinRequest, LeaveOut, Proof, RenewOut, RunInfo, TicketOut
from authorizer.ratelimit import source_of
from authorizer.service import Authorizer
from protocol.authorizer_api import EvidenceOut, EvidenceRejectedBody
from protocol.credentials import RevocationList
from protocol.evidence_report import EVIDENCE_CONTENT_TYPE, EVIDENCE_PATH

router = APIRouter(prefix="/v1", tags=["nodes"])

_ERRORS = {
    400: {"model": ErrorBody, "description": "invalid request"},
    413: {"model": ErrorBody, "description": "body too large"},
    503: {"model": ErrorBody, "description": "database or reachability dialer unavailable; retry"},
}
_LIMITED = {
    **_ERRORS,
    429: {"model": ErrorBody, "description": "rate limited: retry after the Retry-After header's seconds",
          "headers": {"Retry-After": {"description": "whole seconds to wait", "schema": {"type": "integer"}}}},
}
_PROOF_ERRORS = {
    **_LIMITED,
    401: {"model": ErrorBody, "description": "proof signature or time is wrong"},
    403: {"model": ErrorBody, "description": "not admitted, banned, or left"},
    404: {"model": ErrorBody, "description": "no live ticket for this peer"},
}


def _authorizer(request: Request) -> Authorizer:
    return request.app.state.authorizer


@router.post("/join", response_model=TicketOut, responses={
    **_LIMITED, 401: {"model": ErrorBody, "description": "join proof wrong, or missing where it replaces a ticket"}})
async def join(body: JoinRequest, request: Request) -> TicketOut:
    """Ask to join the run. The answer is a ticket: queued (with the placed stage, so the node can
    start fetching that stage's state), or rejected with a reason and what to do. A join signed
    with the peer's key (signed_at, signature) replaces a live ticket of the same peer, which
    then ends as `replaced` (a node restarted after a crash gets back in at once); the same
    signed join sent again returns the same ticket."""
    return await _authorizer(request).join(body, source_of(request.client.host if request.client else None))


@router.get("/join/{ticket}", response_model=TicketOut,
            responses={**_LIMITED, 404: {"model": ErrorBody, "description": "unknown ticket"}})
async def poll(ticket: Annotated[str, Path(pattern=TICKET_PATTERN)], request: Request) -> TicketOut:
    """Queue position and estimated wait; once admitted, the credential, stage, run config,
    bootstrap peers and the authorizer's public key. Poll at least every minute while queued."""
    return await _authorizer(request).poll(ticket)


@router.post("/renew", response_model=RenewOut, responses=_PROOF_ERRORS)
async def renew(body: Proof, request: Request) -> RenewOut:
    """A fresh credential for an admitted node that proves it holds its libp2p key."""
    return await _authorizer(request).renew(body)


@router.post("/leave", response_model=LeaveOut, responses=_PROOF_ERRORS)
async def leave(body: Proof, request: Request) -> LeaveOut:
    """Leave the run: the slot is freed and the node's credentials are revoked."""
    return await _authorizer(request).leave(body)


@router.get("/run", response_model=RunInfo, responses={503: _ERRORS[503]})
async def run_info(request: Request) -> RunInfo:
    """Public run facts: stages with counts and targets, the root public key, accepted versions."""
    return await _authorizer(request).run_info()


@router.get("/revocations", response_model=RevocationList, responses={503: _ERRORS[503]})
async def revocations(request: Request) -> RevocationList:
    """Serials and peer ids revoked and not yet expired, signed by the run's root key."""
    return await _authorizer(request).revocations()


@router.post(EVIDENCE_PATH.removeprefix("/v1"), response_model=EvidenceOut, responses={
    **_LIMITED,
    400: {"model": EvidenceRejectedBody, "description": "evidence_rejected: the evidence proves nothing (reason in "
                                                        "the error; recorded, the reporter flagged); or "
                                                        "invalid_request: the body is malformed"},
    401: {"model": ErrorBody, "description": "the report's signature or signed_at is wrong"},
    403: {"model": ErrorBody, "description": "reporter_not_admitted: the reporter holds no live credential"},
}, openapi_extra={"requestBody": {"required": True, "content": {EVIDENCE_CONTENT_TYPE: {"schema": {
    "type": "string", "format": "binary",
    "description": "msgpack {evidence, reporter, signed_at, signature}: protocol.evidence_report"}}}}})
async def evidence(request: Request) -> EvidenceOut:
    """Report evidence that a worker lied (protocol/evidence.py), signed by an admitted node. Upheld,
    the accused's account is banned and its credentials revoked; against an account banned or revoked
    already, `already_revoked`. Evidence that proves nothing is answered 400 `evidence_rejected`."""
    return await _authorizer(request).evidence.report(await request.body())
