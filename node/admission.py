"""Joining a run through its authorizer and keeping the credential alive (report 3.6.1).

The node asks to join with its peer id, key and hardware (signed, so that after a crash its
restart replaces its own stale ticket), waits in the queue (showing its position), and receives a
short-lived credential, its stage, the run config and bootstrap peers. A keeper renews the
credential at two thirds of its life, rides out an authorizer outage with retries until the
credential expires, and stops the node with a documented exit code (protocol.exit_codes) when
renewal is refused or the credential lapses.

A node may be given several authorizer URLs (authorizers sharing one PostgreSQL database). The
client sticks to the one that answered last and moves on to the next on a connection error or a
5xx answer, for every request: join, poll, renew, leave, revocations, and evidence reports against
a worker (a trainer's spot checks, a SparseLoCo replica's poisoned fragments: authorizer.evidence).

An authorizer that is rate limiting (429 `rate_limited`, e.g. a fleet behind one NAT address
joining at once, or a neighbour flooding it) names a wait in `Retry-After`; the client waits that
long (plus a little jitter, so a fleet told the same wait does not come back in one burst) and
sends again: joins and polls until `--admission-timeout-s`, renewals until the credential expires.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import platform
import random
import socket
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, TypeVar, Union

import httpx
import psutil
from pydantic import BaseModel, ValidationError

from node.timefmt import duration, until
from node.settings import parse_authorizer_url as settings_parse_authorizer_url
from protocol import version
from roles.periodic import wait_any
from protocol.authorizer_api import (
    LIVE_TICKET_STATUSES, RATE_LIMITED, ErrorBody, EvidenceOut, EvidenceRejectedBody, Hardware, JoinRequest, LeaveOut,
    Proof, RenewOut, RunInfo, TicketOut, TicketStatus, retry_after_s,
)
from protocol.credentials import RevocationList, SignedCredential, proof_bytes, renew_at
from protocol.errors import AgoraError, ConfigError
from protocol.evidence_report import EVIDENCE_CONTENT_TYPE, EVIDENCE_PATH, AnyEvidence, evidence_report_body
from protocol.exit_codes import ExitCode
from protocol.identity import Identity

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

EXIT_ADMISSION_REJECTED = ExitCode.ADMISSION_REJECTED
EXIT_RENEWAL_REFUSED = ExitCode.REVOKED
EXIT_CREDENTIAL_EXPIRED = ExitCode.CREDENTIAL_EXPIRED
"""Kept importable for older callers; protocol.exit_codes.ExitCode is the table."""

DEFAULT_ADMISSION_TIMEOUT_S = 300.0
LEAVE_TIMEOUT_S = 2.0
"""How long a node that stops gives `leave`: a courtesy that frees its slot at once."""


class AdmissionRejected(AgoraError):
    """The authorizer refused a request: a rejected ticket, or a 4xx answer with its error code."""

    exit_code = ExitCode.ADMISSION_REJECTED

    def __init__(self, reason: str, message: str):
        super().__init__(f"the authorizer rejected this node ({reason}): {message}")
        self.reason = reason


class EvidenceRefused(AgoraError):
    """The authorizer refused an evidence report (a 4xx answer other than 429): `code` is its error
    code; for `evidence_rejected` (protocol.authorizer_api.EVIDENCE_REJECTED), `reason` (an
    EvidenceReason value) and `evidence_id` say why and under which id it was recorded."""

    def __init__(self, status: int, code: str, message: str, *, reason: Optional[str] = None,
                 evidence_id: Optional[int] = None):
        super().__init__(f"the authorizer refused the evidence ({reason or code}): {message}")
        self.status, self.code, self.reason, self.evidence_id = status, code, reason, evidence_id

    @classmethod
    def of(cls, response: httpx.Response) -> EvidenceRefused:
        if response.status_code == 400:
            try:
                error = EvidenceRejectedBody.model_validate_json(response.content).error
                return cls(400, error.code, error.message, reason=error.reason, evidence_id=error.evidence_id)
            except ValidationError:
                pass  # another 400: a malformed body
        return cls(response.status_code, *_error_of(response))


class CredentialLost(AgoraError):
    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class AuthorizerUnavailable(ConnectionError):
    """No authorizer URL answered (connection failed, timed out, or answered 5xx)."""


class RateLimited(AgoraError):
    """The authorizer answered 429 `rate_limited`: send again after `retry_after_s`."""

    def __init__(self, url: str, message: str, retry_after_s: float):
        super().__init__(f"authorizer {url} is rate limiting this node ({message})")
        self.retry_after_s = retry_after_s

    def wait_s(self) -> float:
        """The wait to take: the authorizer's, plus up to a quarter of it, drawn at random."""
        return max(0.5, self.retry_after_s) * random.uniform(1.0, 1.25)


def parse_authorizer_url(text: str) -> str:
    """node.settings.parse_authorizer_url, failing as a one-sentence ConfigError."""
    try:
        return settings_parse_authorizer_url(text)
    except ValueError as exc:
        raise ConfigError(f"--authorizer {exc}") from None


def authorizer_urls(value: Union[str, Sequence[str], None]) -> list[str]:
    """Settings' `authorizer` (one URL, or several) as a list of parsed URLs."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else list(value)
    return list(dict.fromkeys(parse_authorizer_url(item) for item in items))


@dataclass
class Admission:
    credential: SignedCredential
    stage: Optional[int]
    run_config: dict
    bootstrap_peers: list[str]
    root_public_key: bytes
    reducer: bool = False
    """The authorizer designated this worker a reducer of its stage."""
    relays: list[str] = field(default_factory=list)
    """The run's relays (multiaddrs with /p2p/<id>), for a node behind NAT and for dialling one."""
    relayed: bool = False
    """The authorizer could not dial this node back and admitted it to serve through the relays."""


def measured_hardware(device: str) -> Hardware:
    """What the node tells the authorizer about itself. Bandwidth and latency to the run are not
    measured yet: the values are the operator's claims from AGORA_BANDWIDTH_MBPS/AGORA_LATENCY_MS."""
    vram, name = 0, platform.processor() or "cpu"
    if device.startswith("cuda"):
        import torch

        props = torch.cuda.get_device_properties(torch.device(device))
        vram, name = int(props.total_memory), props.name
    return Hardware(
        device_name=(name or "cpu")[:128], vram_bytes=vram, ram_bytes=int(psutil.virtual_memory().total),
        bandwidth_mbps=float(os.environ.get("AGORA_BANDWIDTH_MBPS", "1000")),
        latency_ms=float(os.environ.get("AGORA_LATENCY_MS", "1")),
    )


def _describe(exc: Exception, timeout_s: float) -> str:
    """A few words on why a request got no answer: 'connection refused', 'no answer within 10 s'."""
    if isinstance(exc, httpx.TimeoutException):
        return f"no answer within {duration(timeout_s)}"
    cause: Optional[BaseException] = exc
    while cause is not None:  # httpx wraps the OS error ("All connection attempts failed")
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, socket.gaierror):
            return "its host name does not resolve"
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror.lower()
        cause = cause.__cause__ or cause.__context__
    return (str(exc) or exc.__class__.__name__)[:200]


class AuthorizerClient:
    """The node's side of the authorizer's /v1 HTTP API, over one or more authorizer URLs."""

    def __init__(self, urls: Union[str, Sequence[str]], *, timeout_s: float = 10.0):
        self.urls = authorizer_urls(urls)
        if not self.urls:
            raise ConfigError("no authorizer URL given; pass --authorizer URL")
        self.timeout_s = timeout_s
        self._current = 0
        self._http = httpx.AsyncClient(timeout=timeout_s)
        self._run_id: Optional[str] = None

    @property
    def url(self) -> str:
        """The authorizer that answered last (the one requests go to first)."""
        return self.urls[self._current]

    @property
    def run_id(self) -> Optional[str]:
        """The run the authorizers serve, once one of them has said (before that, None)."""
        return self._run_id

    async def close(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, reply: type[M], body: Optional[BaseModel] = None, *,
                       raw: Optional[tuple[bytes, str]] = None,
                       refused: Callable[[httpx.Response], Exception] = lambda r: AdmissionRejected(*_error_of(r)),
                       ) -> M:
        """Send to the current authorizer, failing over to the next ones on connection errors
        and 5xx answers; 4xx answers are the authorizer's word and raise `refused(answer)`
        (AdmissionRejected by default). `raw` is a body other than JSON: (bytes, content type)."""
        if raw is not None:
            content, headers = raw[0], {"content-type": raw[1]}
        else:
            content = body.model_dump_json(exclude_none=True) if body is not None else None
            headers = {"content-type": "application/json"} if content is not None else None
        problems = []
        for step in range(len(self.urls)):
            index = (self._current + step) % len(self.urls)
            url = self.urls[index]
            try:
                response = await self._http.request(method, url + path, content=content, headers=headers)
            except httpx.HTTPError as exc:
                problems.append(f"authorizer {url} unreachable ({_describe(exc, self.timeout_s)})")
                continue
            if response.status_code >= 500:
                problems.append(f"authorizer {url} failed ({response.status_code}: {_error_message(response)})")
                continue
            if index != self._current:
                logger.warning("authorizer %s answered; using it from now on", url)
                self._current = index
            if response.status_code == 429:  # the authorizer's (or its proxy's) word: wait, then ask it again
                raise RateLimited(url, _error_message(response), retry_after_s(response.headers.get("retry-after")))
            if response.status_code >= 400:
                raise refused(response)
            try:
                return reply.model_validate_json(response.content)
            except ValidationError as exc:
                raise AdmissionRejected("bad_reply", f"{url}{path} answered something this node does not "
                                                     f"understand ({exc.errors()[0]['msg']}); is it an agora "
                                                     f"authorizer of a compatible version?") from exc
        raise AuthorizerUnavailable("; ".join(problems))

    def _proof(self, identity: Identity, action: str, run_id: str) -> Proof:
        peer_id = identity.peer_id.to_base58()
        signed_at = time.time()
        signature = identity.sign(proof_bytes(action, run_id=run_id, peer_id=peer_id, signed_at=signed_at))
        return Proof(peer_id=peer_id, signed_at=signed_at, signature=signature)

    async def run_info(self) -> RunInfo:
        info = await self._request("GET", "/v1/run", RunInfo)
        self._run_id = info.run_id
        return info

    async def join(self, identity: Identity, role: str, *, hardware: Hardware, announce_maddrs: list[str],
                   account_token: str = "", preferred_stage: Optional[int] = None,
                   relay_ok: bool = False) -> TicketOut:
        """Ask to join, signed with the node's key for the run (whose id GET /v1/run gives)."""
        if self._run_id is None:
            await self.run_info()
        proof = self._proof(identity, "join", self._run_id)
        request = JoinRequest(
            peer_id=proof.peer_id, public_key=identity.public_key, role=role, hardware=hardware,  # type: ignore[arg-type]
            client_version=version.client_version(), announce_maddrs=list(announce_maddrs),
            account_token=account_token, preferred_stage=preferred_stage, signed_at=proof.signed_at,
            signature=proof.signature, relay_ok=relay_ok,
        )
        return await self._request("POST", "/v1/join", TicketOut, request)

    async def poll(self, ticket: str) -> TicketOut:
        return await self._request("GET", f"/v1/join/{ticket}", TicketOut)

    async def renew(self, identity: Identity, run_id: str) -> RenewOut:
        return await self._request("POST", "/v1/renew", RenewOut, self._proof(identity, "renew", run_id))

    async def leave(self, identity: Identity, run_id: str) -> LeaveOut:
        return await self._request("POST", "/v1/leave", LeaveOut, self._proof(identity, "leave", run_id))

    async def revocations(self) -> RevocationList:
        """The signed revocation list (verified by the caller against the root key)."""
        return await self._request("GET", "/v1/revocations", RevocationList)

    async def report_evidence(self, evidence: AnyEvidence, identity: Identity) -> EvidenceOut:
        """Report `evidence` (a trainer's spot check or a SparseLoCo replica's poisoned fragment)
        against a worker, signed with this node's key. EvidenceOut when it
        holds (`upheld`, `already_revoked`, or `pending` for a two-replica contradiction
        waiting for reporters of more accounts); EvidenceRefused when the authorizer refuses it
        (`reason` says why rejected evidence proves nothing), RateLimited (wait `wait_s()`) or
        AuthorizerUnavailable as for a renewal."""
        body = evidence_report_body(evidence, identity)
        return await self._request("POST", EVIDENCE_PATH, EvidenceOut, raw=(body, EVIDENCE_CONTENT_TYPE),
                                   refused=EvidenceRefused.of)


def _error_of(response: httpx.Response) -> tuple[str, str]:
    try:
        error = ErrorBody.model_validate_json(response.content).error
        return error.code, error.message
    except ValidationError:
        return str(response.status_code), response.text[:300] or f"HTTP {response.status_code}"


def _error_message(response: httpx.Response) -> str:
    return _error_of(response)[1][:200]


async def leave_quietly(client: AuthorizerClient, identity: Identity, run_id: Optional[str],
                        timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Tell the authorizer this node leaves (its queued or admitted slot is freed at once); a
    courtesy bounded by `timeout_s`: a ticket nobody renews or polls lapses by itself."""
    if run_id is None:
        return False
    try:
        await asyncio.wait_for(client.leave(identity, run_id), timeout_s)
        logger.info("left the run at the authorizer; its slot is free")
        return True
    except (Exception, asyncio.TimeoutError) as exc:  # not live any more, or unreachable
        logger.debug("leave not acknowledged: %s", exc)
        return False


async def join_run(client: AuthorizerClient, identity: Identity, role: str, *,
                   hardware: Union[Hardware, dict], announce_maddrs: list[str], account_token: str = "",
                   preferred_stage: Optional[int] = None, timeout_s: float = DEFAULT_ADMISSION_TIMEOUT_S,
                   on_wait: Callable[[TicketOut], None] = lambda ticket: None, relay_ok: bool = False) -> Admission:
    """Join and wait in the queue until admitted; AdmissionRejected says why not.

    While no authorizer answers, retries with exponential backoff and a countdown line on stderr,
    for at most `timeout_s` of continuous silence; then a ConfigError sentence (exit 2). Cancelled
    (the node is stopping) after asking to join, it tells the authorizer `leave`, so a queued or
    admitted slot is freed at once, and re-raises."""
    hardware = hardware if isinstance(hardware, Hardware) else Hardware.model_validate(hardware)
    asked = False
    try:
        ticket = await _retrying(client, lambda: client.join(
            identity, role, hardware=hardware, announce_maddrs=announce_maddrs, account_token=account_token,
            preferred_stage=preferred_stage, relay_ok=relay_ok),
            timeout_s)
        asked = True
        last_position: Optional[int] = None
        while True:
            if ticket.status == TicketStatus.ADMITTED and ticket.admission is not None:
                admission = ticket.admission
                return Admission(
                    credential=admission.signed(), stage=ticket.stage, run_config=ticket.run_config or {},
                    bootstrap_peers=list(admission.bootstrap_peers),
                    root_public_key=base64.b64decode(admission.authorizer_public_key),
                    reducer=ticket.reducer, relays=list(admission.relays),
                    relayed=ticket.reachability == "relayed",
                )
            if ticket.status not in LIVE_TICKET_STATUSES:
                rejection = ticket.rejection
                raise AdmissionRejected(rejection.reason if rejection else ticket.status.value,
                                        rejection.message if rejection else f"ticket ended as {ticket.status.value}; "
                                                                            f"join again")
            if ticket.status == TicketStatus.QUEUED:
                if ticket.queue_position != last_position:
                    last_position = ticket.queue_position
                    on_wait(ticket)
                await asyncio.sleep(min(2.0, max(0.2, (ticket.estimated_wait_s or 1.0) / 4)))
            # an admitted join reply carries no credential (only polls do): poll for it at once
            ticket = await _retrying(client, lambda: client.poll(ticket.ticket), timeout_s)
    except asyncio.CancelledError:
        if asked or client.run_id is not None:
            await leave_quietly(client, identity, client.run_id)
        raise


async def _retrying(client: AuthorizerClient, call, timeout_s: float) -> TicketOut:
    """`call()` until an authorizer answers; backoff 1, 2, 4 ... 30 s with a countdown line; a
    ConfigError after `timeout_s` without an answer. A rate-limited answer is waited out as long
    as it asks (a countdown line too), and AdmissionRejected when `timeout_s` passes that way."""
    deadline = time.monotonic() + timeout_s
    delay_s = 1.0
    while True:
        try:
            return await call()
        except RateLimited as exc:
            left, wait = deadline - time.monotonic(), exc.wait_s()
            if wait > left:  # not welcome again before the deadline: say so now
                raise AdmissionRejected(RATE_LIMITED, (
                    f"{exc}; gave up after {duration(timeout_s)} (--admission-timeout-s): start fewer nodes at "
                    f"once from this address, or wait and start this one again")) from None
            logger.warning("%s; retrying in %s, giving up in %s", exc, duration(wait), duration(left))
            await asyncio.sleep(wait)
        except AuthorizerUnavailable as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(
                    f"{exc}; gave up after {duration(timeout_s)} (--admission-timeout-s): check --authorizer and "
                    f"that the authorizer is running and reachable from here") from None
            wait = min(delay_s, left)
            logger.warning("%s; retrying in %s, giving up in %s", exc, duration(wait), duration(left))
            await asyncio.sleep(wait)
            delay_s = min(delay_s * 2, 30.0)


class CredentialKeeper:
    """Renews the credential at two thirds of its life; publishes each new one via `on_renewed`.
    A refusal (banned, revoked, or replaced by a newer process of this identity) or an expiry
    during an outage ends the node: `failure` is set, logged once, and `stop` is set."""

    def __init__(self, client: AuthorizerClient, identity: Identity, run_id: str, credential: SignedCredential,
                 on_renewed: Callable[[SignedCredential], None], *, retry_s: float = 5.0):
        self.client = client
        self.identity = identity
        self.run_id = run_id
        self.credential = credential
        self.on_renewed = on_renewed
        self.retry_s = retry_s
        self.failure: Optional[CredentialLost] = None

    def fail(self, failure: CredentialLost, stop: asyncio.Event) -> None:
        if self.failure is None:
            self.failure = failure
            logger.error("%s; stopping (exit code %d)", failure, failure.exit_code)
        stop.set()

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            if await wait_any(stop, timeout=max(0.0, renew_at(self.credential.credential) - time.time())):
                return
            await self._renew(stop)
            if self.failure is not None:
                return

    async def _renew(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                renewed = await self.client.renew(self.identity, self.run_id)
            except AdmissionRejected as exc:
                self.fail(CredentialLost(
                    f"this node was banned or its credential revoked: renewal refused ({exc.reason}: "
                    f"{str(exc).split(': ', 1)[-1]})", ExitCode.REVOKED), stop)
                return
            except RateLimited as exc:
                expires_at = self.credential.credential.expires_at
                left = expires_at - time.time()
                if left <= 0:
                    self.fail(CredentialLost(f"the credential expired while renewal was rate limited ({exc})",
                                             ExitCode.CREDENTIAL_EXPIRED), stop)
                    return
                wait = min(exc.wait_s(), max(left / 2, 0.1))  # a retry always falls before the expiry
                logger.warning("%s; retrying renewal in %s (credential valid %s)", exc, duration(wait),
                               until(expires_at))
                await wait_any(stop, timeout=wait)
                continue
            except AuthorizerUnavailable as exc:
                expires_at = self.credential.credential.expires_at
                left = expires_at - time.time()
                if left <= 0:
                    self.fail(CredentialLost(
                        f"the credential expired while every authorizer was unreachable ({exc})",
                        ExitCode.CREDENTIAL_EXPIRED), stop)
                    return
                wait = min(self.retry_s, max(left, 0.1))
                logger.warning("%s; retrying renewal in %s (credential valid %s)", exc, duration(wait),
                               until(expires_at))
                await wait_any(stop, timeout=wait)
                continue
            self.credential = renewed.signed()
            self.on_renewed(self.credential)
            logger.info("credential renewed, valid %s", until(self.credential.credential.expires_at))
            return
