"""The push front: contributor nodes push their metrics here, and only their own [report 3.6.3.1].

A contributor node cannot be scraped, so it pushes (node.metrics.push) to
`--metrics-push http://authorizer:8000/v1/metrics/push`; prometheus_client appends the
Pushgateway's own path, so what arrives is

    PUT|POST|DELETE /v1/metrics/push/metrics/job/agora-node/instance/<peer id>

with `Authorization: Bearer <push token>` (protocol.metrics_token). The front checks, cheapest
first: a Pushgateway is configured (`--pushgateway`, else 404), the token verifies against this
run's root key, clock and revocation list (401, the reason in the message), the grouping is
exactly job `agora-node` and instance = the credential's peer id (403: nobody overwrites another
node's series), the peer's push rate (429), and that no sample in the body claims another peer,
run, role, job or instance in its labels (403; Prometheus scrapes the gateway with
honor_labels, so a label is taken at its word). Then it forwards the body, with its
Content-Type, to the gateway under the same grouping and answers with the gateway's status
(502 if the gateway fails).

Bodies may be up to MAX_PUSH_BODY_BYTES (the app's BodyLimit allows this path more than the 64 KiB
of every other route). A push that fails authentication spends a token of its source address's
request bucket (authorizer.ratelimit), like a renewal that proves nothing; a verified push spends
from its peer's own push bucket, never from the bucket its renewals use. Every push is counted in
`agora_metrics_push_front_total{outcome}` (in PUSH_REGISTRY).

Errors (authorizer.errors.AuthorizerError, the app's JSON shape), besides 400/404/413/429:

    PushUnauthorized       401 push_unauthorized       no token, or it does not verify
    PushForbidden          403 push_forbidden          another node's grouping or labels
    UnsupportedMediaType   415 unsupported_media_type  not the text exposition format, or compressed
    PushgatewayUnavailable 502 pushgateway_unavailable the Pushgateway failed or is unreachable
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from typing import Awaitable, Callable, Optional

import httpx
from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from authorizer.buckets import BucketTable
from authorizer.errors import AuthorizerError, InvalidRequest, NotFound, RateLimited
from authorizer.models import ErrorBody
from authorizer.ratelimit import source_of
from authorizer.service import MAX_REVOKED
from protocol.credentials import Credential, RevocationList
from protocol.metrics_token import PushTokenError, verify_push_token

logger = logging.getLogger("agora.authorizer.metrics_push")

PUSH_PATH_PREFIX = "/v1/metrics/push/"
MAX_PUSH_BODY_BYTES = 4 * 1024 * 1024
JOB = "agora-node"
REVOCATIONS_TTL_S = 5.0
"""How long a read of the revoked serials and peers serves pushes before it is read again."""
PUSH_RATE_PER_S, PUSH_BURST = 1.0, 10
"""Per peer: --metrics-push-interval-s is at least 1 s, and a restart may push a few at once."""
GATEWAY_TIMEOUT_S = 10.0

PUSH_REGISTRY = CollectorRegistry()
"""The front's own metrics; the authorizer's /metrics serves them by registering this registry
(a registry is a collector) beside its own."""
PUSHES = Counter("agora_metrics_push_front", "pushes to the authorizer's push front, by outcome", ["outcome"],
                 registry=PUSH_REGISTRY)


class PushUnauthorized(AuthorizerError):
    status, code = 401, "push_unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class PushForbidden(AuthorizerError):
    status, code = 403, "push_forbidden"


class UnsupportedMediaType(AuthorizerError):
    status, code = 415, "unsupported_media_type"


class PushgatewayUnavailable(AuthorizerError):
    status, code = 502, "pushgateway_unavailable"


class PushFront:
    """The checks and the forwarding, given what they need (the app builds one from its
    Authorizer; tests give their own)."""

    def __init__(self, *, gateway_url: str, root_public_key: bytes, run_id: str,
                 revoked: Callable[[float], Awaitable[tuple[list[int], list[str]]]],
                 charge_source: Callable[[str], float] = lambda source: 0.0,
                 clock: Callable[[], float] = time.monotonic, max_peers: int = 100_000):
        self.gateway_url = gateway_url.rstrip("/")
        self.root_public_key = root_public_key
        self.run_id = run_id
        self.revoked = revoked
        self.charge_source = charge_source
        self.clock = clock
        self.buckets = BucketTable(rate_per_s=PUSH_RATE_PER_S, burst=PUSH_BURST, max_entries=max_peers)
        self._revocations: Optional[RevocationList] = None
        self._revocations_at = float("-inf")
        self._revocations_lock = asyncio.Lock()
        self._client: Optional[httpx.AsyncClient] = None

    async def handle(self, request: Request, job: str, grouping: str) -> Response:
        try:
            response = await self._handle(request, job, grouping)
        except _Refusal as exc:
            PUSHES.labels(outcome=exc.outcome).inc()
            raise exc.error from None
        except AuthorizerError:  # the store, while no revocation list was read yet
            PUSHES.labels(outcome="error").inc()
            raise
        PUSHES.labels(outcome="ok").inc()
        return response

    async def _handle(self, request: Request, job: str, grouping: str) -> Response:
        source = request.client.host if request.client else "unknown"
        credential = await self._authenticate(request, source)
        instance = _instance_of(grouping)
        if job != JOB or instance != credential.peer_id:
            raise _Refusal("wrong_grouping", PushForbidden(
                f"this credential may push only to /metrics/job/{JOB}/instance/{credential.peer_id}; "
                f"push with grouping key {{'job': '{JOB}', 'instance': <this node's peer id>}}"))
        wait = self.buckets.take(credential.peer_id, self.clock())
        if wait:
            raise _Refusal("rate_limited", RateLimited(
                f"node {credential.peer_id} pushes more than {PUSH_RATE_PER_S:g} a second; raise "
                f"--metrics-push-interval-s", wait))
        body, content_type = b"", "text/plain; version=0.0.4; charset=utf-8"
        if request.method != "DELETE":
            body, content_type = await self._body(request, credential)
        return await self._forward(request.method, credential.peer_id, body, content_type)

    async def _authenticate(self, request: Request, source: str) -> Credential:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        try:
            if scheme.lower() != "bearer" or not token.strip():
                raise PushTokenError("missing_token", (
                    "send Authorization: Bearer <token>, the token made by protocol.metrics_token.make_push_token "
                    "from the node's credential (agora-node does this for --metrics-push)"))
            return verify_push_token(token.strip(), root_public_key=self.root_public_key, run_id=self.run_id,
                                     revocations=await self._revocation_list())
        except PushTokenError as exc:
            wait = self.charge_source(source)  # what proves no node pays as its address, like a bad renewal
            if wait:
                raise _Refusal("rate_limited", RateLimited(
                    f"too many unauthenticated pushes from {source}; retry after the Retry-After seconds",
                    wait)) from None
            raise _Refusal(exc.reason, PushUnauthorized(f"{exc.reason}: {exc}")) from None

    async def _revocation_list(self) -> Optional[RevocationList]:
        """The revoked serials and banned peers, read at most every REVOCATIONS_TTL_S; the last
        read serves while the store is down (a revocation is then late by the outage)."""
        if self.clock() - self._revocations_at < REVOCATIONS_TTL_S:
            return self._revocations
        async with self._revocations_lock:
            if self.clock() - self._revocations_at < REVOCATIONS_TTL_S:
                return self._revocations
            now = time.time()
            try:
                serials, peers = await self.revoked(now)
            except AuthorizerError:
                if self._revocations is None:
                    raise
                logger.warning("revocations unreadable; pushes are checked against the list of %.0f s ago",
                               self.clock() - self._revocations_at)
                return self._revocations
            self._revocations = RevocationList(run_id=self.run_id, serials=tuple(serials), peer_ids=tuple(peers),
                                               issued_at=now)
            self._revocations_at = self.clock()
            return self._revocations

    async def _body(self, request: Request, credential: Credential) -> tuple[bytes, str]:
        content_type = request.headers.get("content-type", "text/plain; version=0.0.4")
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if not content_type.lower().startswith("text/plain") or encoding not in ("", "identity"):
            raise _Refusal("unsupported_media", UnsupportedMediaType(
                f"push the text exposition format uncompressed (got {content_type[:60]!r}, encoding "
                f"{encoding[:20]!r}); prometheus_client's push_to_gateway does by default"))
        body = await request.body()
        problem = await asyncio.to_thread(_foreign_labels, body, {
            "peer": credential.peer_id, "instance": credential.peer_id, "run": self.run_id,
            "role": credential.role, "job": JOB})
        if problem is not None:
            outcome, error = problem
            raise _Refusal(outcome, error)
        return body, content_type

    async def _forward(self, method: str, peer_id: str, body: bytes, content_type: str) -> Response:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=GATEWAY_TIMEOUT_S)
        url = f"{self.gateway_url}/metrics/job/{JOB}/instance/{peer_id}"
        try:
            answer = await self._client.request(method, url, content=body, headers={"Content-Type": content_type})
        except httpx.HTTPError as exc:
            logger.warning("Pushgateway %s failed: %s", self.gateway_url, exc)
            raise _Refusal("gateway_failed", PushgatewayUnavailable(
                "the run's Pushgateway did not answer; retry later (the operator is told by the pushes-failing "
                "alert)")) from exc
        if answer.status_code == 400:  # the gateway refuses the body itself: inconsistent with what it holds
            raise _Refusal("invalid_body", InvalidRequest(
                f"the Pushgateway refused the metrics: {' '.join(answer.text.split())[:300]}; fix the pushed series"))
        if answer.status_code >= 300:
            logger.warning("Pushgateway %s answered %d to a push of %s", self.gateway_url, answer.status_code, peer_id)
            raise _Refusal("gateway_failed", PushgatewayUnavailable(
                f"the run's Pushgateway answered {answer.status_code}; retry later"))
        return Response(status_code=answer.status_code)

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()


class _Refusal(Exception):
    """A refusal and the outcome it is counted under; `handle` counts it and raises its error."""

    def __init__(self, outcome: str, error: AuthorizerError):
        super().__init__(outcome)
        self.outcome, self.error = outcome, error


def _instance_of(grouping: str) -> Optional[str]:
    """The instance of a grouping path `instance/<value>` (or `instance@base64/<value>`); None if
    the path holds anything else, so extra labels cannot open a second group per node."""
    parts = grouping.strip("/").split("/")
    if len(parts) != 2:
        return None
    name, value = parts
    if name == "instance@base64":
        try:
            return base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
    return value if name == "instance" else None


def _foreign_labels(body: bytes, expected: dict[str, str]) -> Optional[tuple[str, AuthorizerError]]:
    """A refusal if the body does not parse or a sample's label names another node; else None."""
    try:
        for family in text_string_to_metric_families(body.decode("utf-8")):
            for sample in family.samples:
                for name, value in sample.labels.items():
                    if name in expected and value != expected[name]:
                        return "wrong_labels", PushForbidden(
                            f"{sample.name} has {name}={value[:80]!r}, but this node's is {expected[name]!r}; "
                            f"a node pushes only its own series")
    except (ValueError, TypeError, KeyError, IndexError, UnicodeDecodeError) as exc:
        return "invalid_body", InvalidRequest(
            f"the body is not the Prometheus text exposition format ({str(exc)[:200]}); push with prometheus_client")
    return None


def push_front(request: Request) -> PushFront:
    """The app's front, built on first use from its Authorizer; 404 if no --pushgateway."""
    app = request.app
    front = getattr(app.state, "metrics_push", None)
    if front is not None:
        return front
    gateway_url = getattr(app.state, "pushgateway_url", None)
    if not gateway_url:
        PUSHES.labels(outcome="no_gateway").inc()
        raise NotFound("this authorizer forwards no metrics (started without --pushgateway); push to the URL "
                       "the operator gives, or run the node with --metrics-port for scraping")
    authorizer = app.state.authorizer
    limiter = authorizer.limiter
    front = PushFront(
        gateway_url=gateway_url, root_public_key=authorizer.issuer.public_key, run_id=authorizer.run.run_id,
        revoked=lambda now: authorizer.read(authorizer.store.revoked, now, MAX_REVOKED),
        charge_source=lambda source: limiter.requests.take(source_of(source), limiter.clock()),
    )
    app.state.metrics_push = front
    return front


async def close_push_front(app) -> None:
    """Close the front's connections to the gateway (the app's lifespan calls this at shutdown)."""
    front = getattr(app.state, "metrics_push", None)
    if front is not None:
        await front.aclose()


push_router = APIRouter(prefix="/v1/metrics", tags=["metrics"])

_RESPONSES = {
    200: {"description": "forwarded; the Pushgateway took the metrics"},
    202: {"description": "forwarded; the Pushgateway accepted the deletion"},
    400: {"model": ErrorBody, "description": "not the text exposition format, or refused by the Pushgateway"},
    401: {"model": ErrorBody, "description": "missing or invalid push token (the reason leads the message)"},
    403: {"model": ErrorBody, "description": "the grouping or a label names another node"},
    404: {"model": ErrorBody, "description": "no Pushgateway configured (--pushgateway)"},
    413: {"model": ErrorBody, "description": "body over 4 MiB"},
    415: {"model": ErrorBody, "description": "not text/plain, or compressed"},
    429: {"model": ErrorBody, "description": "too many pushes; wait Retry-After"},
    502: {"model": ErrorBody, "description": "the Pushgateway failed"},
}


@push_router.api_route("/push/metrics/job/{job}/{grouping:path}", methods=["PUT", "POST", "DELETE"],
                       responses=_RESPONSES, response_class=Response)
async def push(job: str, grouping: str, request: Request) -> Response:
    """A node's metrics, as prometheus_client's push_to_gateway sends them with
    `gateway=<this authorizer>/v1/metrics/push` and grouping key `{"instance": <peer id>}`:
    PUT replaces the node's group, POST replaces the series it names, DELETE removes the group.
    Needs `Authorization: Bearer <push token>` (protocol.metrics_token)."""
    return await push_front(request).handle(request, job, grouping)
