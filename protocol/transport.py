"""Request/reply RPC over long-lived libp2p binary streams (hivemind's P2P wrapped behind our API).

A server handler receives the verified remote peer id and a decoded body and returns its reply,
a wire model (protocol/messages.py) or a plain map. A client sends a wire model with `request`
and gets the reply validated into its model, or a plain map with `call`. Each stream carries one
request at a time; a client keeps a pool of idle streams per (peer, handler), so concurrent
callers (a trainer's lanes) use parallel streams and a stream is reused for the next request
instead of paying a new libp2p stream per sample.

Hostile input never escapes a handler: it is answered with a typed error reply, counted by
code, and the stream keeps serving unless its framing is broken beyond repair.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Awaitable, Callable, Optional, TypeVar, Union

from hivemind.p2p import P2P, PeerID

from protocol import hivemind_adapter
from protocol.codec import pack, unpack
from protocol.errors import AgoraError, ErrorCode, PeerTimeout, PeerUnavailable, ProtocolError, RemoteError
from protocol.framing import DEFAULT_MAX_FRAME_BYTES, FrameTooLarge, read_frame, write_frame
from protocol.auth import PeerAuthenticator, RequestRejected
from protocol.messages import (
    ErrorBody,
    ReplyEnvelope,
    WireModel,
    make_envelope,
    open_body,
    parse_envelope,
    parse_model,
    to_body,
)
from protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

Handler = Callable[[PeerID, dict], Awaitable[Union[dict, WireModel]]]
M = TypeVar("M", bound=WireModel)


def _error_reply(code: ErrorCode, message: str) -> bytes:
    return pack({"version": PROTOCOL_VERSION, "ok": False, "error": {"code": int(code), "message": message[:2048]}})


async def dial(p2p: P2P, peer_id: PeerID, maddrs: list[str], timeout_s: float = 10.0) -> None:
    """Open a libp2p connection to `peer_id` at its announced addresses, so a first call does
    not depend on the DHT having introduced the two peers. The daemon wants transport addresses
    without the trailing /p2p/<id> part."""
    addresses = [m.split("/p2p/")[0] for m in maddrs if m]
    if addresses:
        await asyncio.wait_for(hivemind_adapter.connect(p2p, peer_id, addresses), timeout_s)


class RpcServer:
    """Serves `agora/v1/*` handlers on a P2P instance and counts every rejected request.

    With an authenticator, every request must pass its checks before the handler sees it, and
    only credentials of the roles a handler allows get through; replies are signed.
    """

    def __init__(self, p2p: P2P, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 authenticator: Optional[PeerAuthenticator] = None):
        self.p2p = p2p
        self.max_frame_bytes = max_frame_bytes
        self.authenticator = authenticator
        self.rejected: collections.Counter[str] = collections.Counter()
        self.auth_rejected: collections.Counter[str] = collections.Counter()
        self.served: collections.Counter[str] = collections.Counter()
        self._names: list[str] = []
        self._streams: set[asyncio.StreamWriter] = set()

    async def add_handler(self, name: str, handler: Handler, *, roles: Optional[frozenset[str]] = None) -> None:
        """Serve `name`; `roles` limits which credential roles may call it (authenticated runs)."""
        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await self._serve_stream(name, handler, roles, info.peer_id, reader, writer)
            except asyncio.CancelledError:
                # The stream's own task, cancelled as the node shuts down: end it quietly. Python
                # 3.11's StreamReaderProtocol asks a cancelled task for its exception and logs the
                # CancelledError as an unhandled error (fixed in 3.12).
                writer.close()

        await self.p2p.add_binary_stream_handler(name, on_stream)
        self._names.append(name)

    async def _serve_stream(self, name, handler, roles, peer_id, reader, writer) -> None:
        self._streams.add(writer)
        try:
            while True:
                try:
                    frame = await read_frame(reader, self.max_frame_bytes)
                except FrameTooLarge as exc:
                    self._count_rejection(exc.code)
                    await write_frame(writer, _error_reply(exc.code, str(exc)))
                    return  # the rest of the stream cannot be parsed
                reply = await self._handle_frame(name, handler, roles, peer_id, frame)
                await write_frame(writer, reply)
        except PeerUnavailable:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not take the node down; the stream is dropped
            logger.exception("stream handler %s crashed", name)
        finally:
            self._streams.discard(writer)
            writer.close()

    async def _handle_frame(self, name: str, handler: Handler, roles, peer_id: PeerID, frame: bytes) -> bytes:
        try:
            raw = unpack(frame)
            envelope = parse_envelope(raw)
            if self.authenticator is not None:
                credential = self.authenticator.check_request(peer_id.to_base58(), name, raw, envelope.body)
                if roles is not None and credential.role not in roles:
                    raise RequestRejected("wrong_role", f"{credential.role}s may not call {name}")
            body = await handler(peer_id, open_body(envelope.body))
        except RequestRejected as exc:
            self._count_rejection(exc.code)
            self.auth_rejected[exc.reason] += 1
            return _error_reply(exc.code, str(exc))
        except ProtocolError as exc:
            self._count_rejection(exc.code)
            return _error_reply(exc.code, str(exc))
        except AgoraError as exc:
            code = getattr(exc, "code", ErrorCode.NOT_READY)
            self._count_rejection(code)
            return _error_reply(code, str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("handler %s failed", name)
            self._count_rejection(ErrorCode.INTERNAL)
            return _error_reply(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        self.served[name] += 1
        packed = pack(to_body(body) if isinstance(body, WireModel) else body)
        reply = {"version": PROTOCOL_VERSION, "ok": True, "body": packed}
        if self.authenticator is not None:
            reply["signature"] = self.authenticator.sign_reply(name, peer_id.to_base58(), envelope.nonce, packed)
        return pack(reply)

    def _count_rejection(self, code: ErrorCode) -> None:
        self.rejected[ErrorCode(code).name.lower()] += 1

    async def shutdown(self) -> None:
        for name in self._names:
            try:
                await self.p2p.remove_binary_stream_handler(name)
            except Exception:  # noqa: BLE001 - the daemon may already be gone
                pass
        for writer in list(self._streams):
            writer.close()


class RpcClient:
    """Calls `agora/v1/*` handlers on remote peers over pooled long-lived streams."""

    def __init__(self, p2p: P2P, *, timeout_s: float = 30.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_idle_per_peer: int = 16, authenticator: Optional[PeerAuthenticator] = None):
        self.p2p = p2p
        self.authenticator = authenticator
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: dict[tuple[PeerID, str], list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = (
            collections.defaultdict(list)
        )

    async def request(self, peer_id: PeerID, handler: str, request: WireModel, reply: type[M], *,
                      timeout_s: Optional[float] = None) -> M:
        """Send a typed request and return the reply validated as `reply`. Raises what `call`
        raises, and ProtocolError for a reply that does not fit its model."""
        body = await self.call(peer_id, handler, to_body(request), timeout_s=timeout_s)
        return parse_model(reply, body, ErrorCode.INVALID_REQUEST)

    async def call(self, peer_id: PeerID, handler: str, body: dict, *, timeout_s: Optional[float] = None) -> dict:
        """Send one request body and return the reply body. Raises RemoteError (typed), PeerTimeout
        or PeerUnavailable."""
        envelope = make_envelope(body)
        if self.authenticator is not None:
            envelope.update(self.authenticator.sign_request(handler, peer_id.to_base58(), envelope["body"]))
        payload = pack(envelope)
        timeout = self.timeout_s if timeout_s is None else timeout_s
        key = (peer_id, handler)
        held: list = []  # the stream in use, so a timeout can discard it

        async def exchange() -> bytes:
            held.append(await self._acquire(key))
            reader, writer = held[0]
            await write_frame(writer, payload)
            return await read_frame(reader, self.max_frame_bytes)

        try:
            frame = await asyncio.wait_for(exchange(), timeout)  # one deadline for the whole exchange
            stream = held[0]
        except asyncio.TimeoutError as exc:
            stream = held[0] if held else None
            self._discard(stream)
            raise PeerTimeout(f"{handler} on {peer_id} did not answer within {timeout:.1f}s") from exc
        except (PeerUnavailable, ProtocolError):
            self._discard(held[0] if held else None)
            raise
        except asyncio.CancelledError:
            self._discard(held[0] if held else None)
            raise
        except Exception as exc:
            self._discard(held[0] if held else None)
            raise PeerUnavailable(f"cannot reach {peer_id} for {handler}: {exc}") from exc
        self._release(key, stream)
        reply = parse_model(ReplyEnvelope, unpack(frame), ErrorCode.MALFORMED_FRAME)
        if not reply.ok:
            error = reply.error or ErrorBody(code=int(ErrorCode.INTERNAL), message="error reply without details")
            try:
                code = ErrorCode(error.code)
            except ValueError:
                code = ErrorCode.INTERNAL
            raise RemoteError(f"{peer_id} rejected {handler}: {code.name.lower()}: {error.message}", code)
        packed = reply.body or pack({})
        if self.authenticator is not None:
            self.authenticator.check_reply(peer_id.to_base58(), handler, envelope["nonce"], reply.signature, packed)
        return open_body(packed)

    async def _acquire(self, key):
        idle = self._idle.get(key)
        while idle:
            reader, writer = idle.pop()
            if not writer.is_closing() and not reader.at_eof():
                return reader, writer
        _, reader, writer = await self.p2p.call_binary_stream_handler(key[0], key[1])
        return reader, writer

    def _release(self, key, stream) -> None:
        idle = self._idle[key]
        if len(idle) < self.max_idle_per_peer:
            idle.append(stream)
        else:
            stream[1].close()

    def _discard(self, stream) -> None:
        if stream is not None:
            stream[1].close()

    async def close(self) -> None:
        for streams in self._idle.values():
            for _, writer in streams:
                writer.close()
        self._idle.clear()
