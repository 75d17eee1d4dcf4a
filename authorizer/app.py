"""The FastAPI application: routes, the admission queue's lifetime, and typed JSON errors.

Every input is hostile, so nothing a client sends can produce a 500: bodies over 64 KiB (evidence
reports: over protocol.evidence.EVIDENCE_MAX_BYTES) are refused before they are read, validation
failures become 400 `invalid_request` naming the field, unknown routes 404 and wrong methods 405,
all in the one shape `{"error": {"code": "...", "message": "<what to do>"}}`. A 500 `internal`
means a bug of ours.

Joins, polls, renewals, leaves and evidence reports pass the rate limits first (RateLimit, below;
the decisions are authorizer.ratelimit's): a request over its limit is answered 429 `rate_limited`
with `Retry-After` before its body is validated and before any database work, so a flood costs a
dictionary lookup a request. The body limit wraps the rate limit, so the renewal bodies it reads
are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from authorizer.errors import AuthorizerError, InternalError, InvalidRequest, MethodNotAllowed, NotFound, PayloadTooLarge
from authorizer.metrics_push import MAX_PUSH_BODY_BYTES, PUSH_PATH_PREFIX, close_push_front
from authorizer.queue import AdmissionQueue
from authorizer.ratelimit import Limiter, source_of
from authorizer.service import Authorizer
from protocol.evidence_report import EVIDENCE_MAX_BYTES, EVIDENCE_PATH
from protocol.version import client_version

logger = logging.getLogger("agora.authorizer.app")

MAX_BODY_BYTES = 64 * 1024


def _error(exc: AuthorizerError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers() or None)


def _describe_validation(exc: RequestValidationError) -> str:
    errors = exc.errors()
    if not errors:
        return "the request is invalid; check it against /openapi.json"
    first = errors[0]
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    message = str(first.get("msg", "is invalid")).removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problem(s))" if len(errors) > 1 else ""
    return f"{where[:120]}: {message[:300]}{more}; fix the request (schema at /openapi.json) and retry"


class BodyLimit:
    """Pure ASGI middleware refusing request bodies over `limit` bytes before the app reads them."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = MAX_PUSH_BODY_BYTES if scope["path"].startswith(PUSH_PATH_PREFIX) else self.limit  # metrics pushes
        if scope["path"] == EVIDENCE_PATH:  # an input and three results
            limit = EVIDENCE_MAX_BYTES
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _send(send, InvalidRequest("Content-Length is not a number; send a valid request"))
            if int(length) > limit:
                return await _send(send, self._too_large(limit))
            return await self.app(scope, receive, send)
        chunks, size = [], 0  # no Content-Length (chunked): buffer up to the limit, then replay
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            size += len(message.get("body", b""))
            if size > limit:
                return await _send(send, self._too_large(limit))
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        return await self.app(scope, _replay(b"".join(chunks), receive), send)

    def _too_large(self, limit: int) -> PayloadTooLarge:
        return PayloadTooLarge(f"request body exceeds {limit} bytes; send a smaller request")


async def _send(send, exc: AuthorizerError) -> None:
    import json

    body = json.dumps(exc.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in exc.headers().items()]
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


_JOIN, _POLL_PREFIX, _PROOF_PATHS = "/v1/join", "/v1/join/", {"/v1/renew": "renew", "/v1/leave": "leave"}


class RateLimit:
    """Pure ASGI middleware spending a token of the limiter for each join, poll, renewal, leave and
    evidence report, and answering 429 itself when there is none. Renewals and leaves are read here
    (their proof says whose bucket pays) and handed on as read; nothing else is read (an evidence
    report's source pays here, its reporter once authorizer.evidence has checked its signature)."""

    def __init__(self, app, limiter: Limiter):
        self.app, self.limiter = app, limiter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        client = scope.get("client")
        if method == "POST" and path == _JOIN:
            refusal = self.limiter.check_join(source_of(client[0] if client else None))
        elif method == "GET" and path.startswith(_POLL_PREFIX):
            refusal = self.limiter.check_poll(source_of(client[0] if client else None), path[len(_POLL_PREFIX):])
        elif method == "POST" and path == EVIDENCE_PATH:
            refusal = self.limiter.check_evidence_source(source_of(client[0] if client else None))
        elif method == "POST" and path in _PROOF_PATHS:
            body = await _read_body(receive)
            if body is None:  # the client went away
                return None
            refusal = self.limiter.check_proof(source_of(client[0] if client else None), _PROOF_PATHS[path], body)
            receive = _replay(body, receive)
        else:
            return await self.app(scope, receive, send)
        if refusal is not None:
            return await _send(send, refusal)
        return await self.app(scope, receive, send)


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    replayed = False

    async def replay():
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def create_app(authorizer: Authorizer, admin_token: str, *, pushgateway_url: str | None = None) -> FastAPI:
    """The authorizer's ASGI app; the admission queue runs for the app's lifetime."""
    from authorizer.admin import admin_router
    from authorizer.dashboard import dashboard_router
    from authorizer.metrics_push import push_router
    from authorizer.monitor.api import monitor_router
    from authorizer.routes import router

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        stop = asyncio.Event()
        queue = AdmissionQueue(authorizer)
        task = asyncio.create_task(queue.run(stop), name="admission-queue")
        try:
            yield
        finally:
            stop.set()
            try:
                await asyncio.wait_for(task, timeout=10)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                task.cancel()
            await authorizer.dialer.shutdown()
            await close_push_front(app)
            logger.info("admission queue and dialer stopped")

    app = FastAPI(
        title="agora-node authorizer", version=client_version(), lifespan=lifespan,
        description="Admits nodes to a training run, places them on stages and issues credentials.",
    )
    app.state.authorizer = authorizer
    app.state.admin_token = admin_token
    app.state.pushgateway_url = pushgateway_url  # authorizer.metrics_push forwards pushes there
    app.include_router(router)
    app.include_router(admin_router)
    app.include_router(monitor_router)
    app.include_router(push_router)
    app.include_router(dashboard_router)

    @app.exception_handler(AuthorizerError)
    async def _authorizer_error(_: Request, exc: AuthorizerError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(InvalidRequest(_describe_validation(exc)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return _error(NotFound(f"there is no endpoint {request.url.path[:120]}; see /openapi.json"))
        if exc.status_code == 405:
            return _error(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path[:120]}; see /openapi.json"))
        if 400 <= exc.status_code < 500:
            error: Any = InvalidRequest(f"{exc.detail}; fix the request and retry")
            error.status = exc.status_code
            return _error(error)
        return _error(InternalError("the authorizer failed; retry, and report it to the operator if it persists"))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error(InternalError("the authorizer failed; retry, and report it to the operator if it persists"))

    app.add_middleware(RateLimit, limiter=authorizer.limiter)
    app.add_middleware(BodyLimit, limit=MAX_BODY_BYTES)  # added last: the outer one
    return app
