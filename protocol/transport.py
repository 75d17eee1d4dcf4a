"""Request/reply RPC over long-lived libp2p binary streams (hivemind's P2P wrapped behind our API).

A stream is a session. Its first frame is a hello (protocol/messages.py `Hello`, at most
HELLO_MAX_BYTES): the handler it is for and, in authenticated runs, the caller's credential,
signed (protocol/auth.py). The server reads nothing else from the stream until the hello checks
out, answers with an ack (signed in authenticated runs) or a typed error, and then serves
numbered requests on it one at a time. A client keeps a pool of idle streams per (peer, handler),
so concurrent callers (a trainer's lanes) use parallel streams and a stream is reused for the
next request; it sends its hello and first request back to back, so a new stream costs no extra
round trip.

A server handler receives the verified remote peer id and a decoded body and returns its reply,
a wire model (protocol/messages.py) or a plain map. A client sends a wire model with `request`
and gets the reply validated into its model, or a plain map with `call`.

Hostile input never escapes a handler: it is answered with a typed error reply, counted by code,
and the stream keeps serving unless its framing or its authentication is broken. What one peer
may hold (streams, unauthenticated streams, buffered bytes, idle time) is bounded by
protocol/stream_limits.py; a peer that floods streams without a hello is refused as its streams
arrive, before any session or read (protocol/stream_gate.py: strikes, shuns with back-off, one
bucket of new streams for all peers without a valid hello); refusals and closes are counted by
reason.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, TypeVar, Union

from hivemind.p2p import P2P, PeerID

from protocol import hivemind_adapter
from protocol.auth import PeerAuthenticator, RequestRejected
from protocol.codec import pack
from protocol.credentials import Credential
from protocol.errors import AgoraError, ErrorCode, PeerTimeout, PeerUnavailable, ProtocolError, RemoteError
from protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES, encode_frame, read_frame, read_length, read_payload, write_frame,
)
from protocol.messages import (
    ErrorBody,
    Hello,
    HelloAck,
    Reply,
    WireModel,
    parse_frame,
    parse_model,
    parse_reply_frame,
    parse_request_frame,
    to_body,
)
from protocol.relays import is_relayed
from protocol.stream_gate import NEWCOMER_STREAMS, StreamGate
from protocol.stream_limits import HELLO_MAX_BYTES, StreamBudget, StreamLimits, source_key
from protocol.version import PROTOCOL_VERSION

logger = logging.getLogger(__name__)

Handler = Callable[[PeerID, dict], Awaitable[Union[dict, WireModel]]]
M = TypeVar("M", bound=WireModel)
T = TypeVar("T")

HELLOS_IN_FLIGHT_PER_PEER = NEWCOMER_STREAMS
"""New streams a client opens to one peer at once (half the server's default allowance of streams
before their hello): a burst of calls opens streams a few at a time instead of being refused, and
a newcomer's streams pass a server's gate even while a flood has emptied its bucket."""

_CLOSING_CODES = frozenset({ErrorCode.UNAUTHENTICATED, ErrorCode.RATE_LIMITED, ErrorCode.FRAME_TOO_LARGE})
"""Error replies after which the server closes the stream: the client must not pool it."""


LINGER_S = 1.0
LINGER_MAX_BYTES = 1 << 20
"""After refusing a stream, how long and how much the server keeps reading (and dropping) so the
client can read the refusal."""

FRAME_HEADER_BYTES = 4


def frame_bytes(request: WireModel, seq: int = 1) -> int:
    """The bytes `request` takes on a stream as RpcClient writes it (frame header, envelope, body):
    what a sender reports as sent on the wire."""
    return FRAME_HEADER_BYTES + len(pack({"seq": seq, "body": to_body(request)}))
"""The length prefix of every frame (protocol/framing.py), counted in the byte counters."""


async def _within(call: Awaitable[T], timeout_s: float) -> T:
    """`asyncio.wait_for` without its task per call (Python 3.11's `asyncio.timeout` cancels the
    caller's own task at the deadline): the task cost 9-20 us per call here, against a loopback
    forward's ~110 us above a bare stream. Raises asyncio.TimeoutError either way."""
    if _timeout is None:
        return await asyncio.wait_for(call, timeout_s)
    async with _timeout(timeout_s):
        return await call


_timeout = getattr(asyncio, "timeout", None)
"""asyncio.timeout (Python 3.11+); Python 3.10 falls back to wait_for."""


def _caller_gone(reader: Optional[asyncio.StreamReader]) -> bool:
    """Whether the caller closed a stream it awaits an answer on (it timed out, or died). A
    worker then does not compute a forward nobody waits for, which would hold a slot of its
    stage's gate while the caller's retry waits for that slot on another replica."""
    return reader is not None and (reader.at_eof() or reader.exception() is not None)


async def _discard_until_eof(reader: asyncio.StreamReader, limit: int) -> None:
    while limit > 0:
        chunk = await reader.read(min(limit, 65536))
        if not chunk:
            return
        limit -= len(chunk)


def _error(code: ErrorCode, message: str, **fields) -> bytes:
    return pack({"version": PROTOCOL_VERSION, **fields, "ok": False,
                 "error": {"code": int(code), "message": message[:2048]}})


def hello_frame(handler: str, recipient: str, authenticator: Optional[PeerAuthenticator] = None) -> tuple[bytes, bytes]:
    """The first frame of a stream to `recipient` for `handler`, and its nonce (the ack answers it)."""
    if authenticator is not None:
        fields = authenticator.hello(handler, recipient)
    else:
        fields = {"nonce": os.urandom(16), "timestamp": time.time(), "recipient": recipient}
    return pack({"version": PROTOCOL_VERSION, "handler": handler, **fields}), fields["nonce"]


async def dial(p2p: P2P, peer_id: PeerID, maddrs: list[str], timeout_s: float = 10.0) -> None:
    """Open a libp2p connection to `peer_id` at its announced addresses, so a first call does
    not depend on the DHT having introduced the two peers. The daemon wants transport addresses
    without the trailing /p2p/<id> part (a relayed address keeps its relay's). A peer that cannot
    be dialled is `PeerUnavailable` (a state download then resumes on another replica instead of
    ending the node)."""
    from protocol.relays import transport_address

    addresses = [transport_address(m) for m in maddrs if m]
    if not addresses:
        return
    try:
        await asyncio.wait_for(hivemind_adapter.connect(p2p, peer_id, addresses), timeout_s)
    except asyncio.TimeoutError:
        raise
    except Exception as exc:  # the daemon's ControlFailure and friends: the peer is not there
        raise PeerUnavailable(f"cannot reach {peer_id} at {', '.join(addresses)}: {exc}") from exc


@dataclass(eq=False)
class _Session:
    """One incoming stream, as the server tracks it."""

    peer: str
    source: str
    """Whom its silent time is counted against (protocol/stream_limits.py `source_key`)."""
    writer: asyncio.StreamWriter
    deadline: Optional[float]
    """Monotonic time by which the next thing must happen, or None while a request is in flight."""
    waiting_for: str = "hello_timeout"
    """What the deadline is for, counted when it passes: hello_timeout, idle_timeout or frame_timeout."""
    credential: Optional[Credential] = None
    seq: int = 0
    reserved: int = 0
    """Bytes of the frame being read, reserved against the peer's budget."""
    relayed: bool = False
    """The stream came through one of the run's relays (its connection is a /p2p-circuit one)."""
    reader: Optional[asyncio.StreamReader] = None
    handling: Optional[asyncio.Task] = None
    """The stream's task while it runs a handler: the sweeper cancels it if the caller leaves."""
    caller_left: bool = False


class RpcServer:
    """Serves `agora/v1/*` handlers on a P2P instance and counts every refused request.

    With an authenticator, every stream must open with a valid hello before anything else is
    read, only credentials of the roles a handler allows get through, and the credential is
    re-checked (expiry, revocation) before each request.
    """

    def __init__(self, p2p: P2P, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 authenticator: Optional[PeerAuthenticator] = None, limits: Optional[StreamLimits] = None):
        self.p2p = p2p
        self.max_frame_bytes = max_frame_bytes
        self.authenticator = authenticator
        self.limits = limits or StreamLimits()
        self.budget = StreamBudget(self.limits)
        self.gate = StreamGate(self.limits, now=time.monotonic())
        self.rejected: collections.Counter[str] = collections.Counter()
        """Error replies sent, by error code."""
        self.rejected_calls: collections.Counter[str] = collections.Counter()
        """The same, by handler and error code (`agora/v1/tags not_ready`): which exchange refused."""
        self.auth_rejected: collections.Counter[str] = collections.Counter()
        """Authentication failures, by reason (no_credential, bad_signature, replayed, ...)."""
        self.streams_refused: collections.Counter[str] = collections.Counter()
        """Streams or frames refused by the limits, by reason (too_many_streams, over_byte_budget, ...)."""
        self.streams_closed: collections.Counter[str] = collections.Counter()
        """Streams the server closed on its own, by reason (idle_timeout, hello_timeout, expired, ...)."""
        self.peers_disconnected = 0
        """Connections of shunned peers dropped."""
        self._disconnecting: dict[str, asyncio.Task] = {}
        self._held: dict[str, list[asyncio.StreamWriter]] = {}
        """Streams of shunned peers, held unread until their shun ends."""
        self._held_total = 0
        self.served: collections.Counter[str] = collections.Counter()
        self.bytes_received = 0
        """Bytes of request frames read (length prefixes included), for the node's metrics."""
        self.bytes_sent = 0
        """Bytes of reply frames written."""
        self.relayed_bytes = [0, 0]
        """Of those, (sent, received) on streams that came through a relay."""
        self._names: list[str] = []
        self._sessions: set[_Session] = set()
        self._sweeper: Optional[asyncio.Task] = None

    def counters(self) -> dict[str, int]:
        """Everything refused or closed, flat, for `agora/v1/info`."""
        flat = {f"rejected_{k}": v for k, v in self.rejected.items()}
        flat.update({f"auth_rejected_{k}": v for k, v in self.auth_rejected.items()})
        flat.update({f"streams_refused_{k}": v for k, v in self.streams_refused.items()})
        flat.update({f"streams_closed_{k}": v for k, v in self.streams_closed.items()})
        flat["streams_open"] = len(self._sessions)
        flat["streams_held"] = self._held_total
        flat["peers_shunned"] = self.gate.shuns
        flat["peers_disconnected"] = self.peers_disconnected
        return flat

    async def add_handler(self, name: str, handler: Handler, *, roles: Optional[frozenset[str]] = None) -> None:
        """Serve `name`; `roles` limits which credential roles may call it (authenticated runs)."""
        async def on_stream(info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self._turned_away(info.peer_id, writer):
                return
            try:
                await self._serve_stream(name, handler, roles, info, reader, writer)
            except asyncio.CancelledError:
                # The stream's own task, cancelled as the node shuts down: end it quietly. Python
                # 3.11's StreamReaderProtocol asks a cancelled task for its exception and logs the
                # CancelledError as an unhandled error (fixed in 3.12).
                writer.close()

        await self.p2p.add_binary_stream_handler(name, on_stream)
        self._names.append(name)
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep(), name="rpc-stream-sweeper")

    def _turned_away(self, peer_id: PeerID, writer: asyncio.StreamWriter) -> bool:
        """Refuse a stream of a shunned peer, or one over the rate of new streams from peers
        without a valid hello, as it arrives: nothing read, no session, no timer, no reply.

        A shunned peer's stream is held, unread, until the shun ends (within the allowance of
        silent streams per peer and in total): a flood that re-opens what the node closes then
        has nothing to re-open, where closing at once let it cycle a stream per round trip (and
        dropping the connection, all of them: it re-dials at once). Over that allowance the stream
        is closed at once and the connection dropped (at most once per `shun_disconnect_every_s`)."""
        peer = peer_id.to_base58()
        now = time.monotonic()
        refusal = self.gate.admit(peer, self.budget.unauthenticated[peer], now)
        if refusal is None:
            return False
        if refusal == "shunned":
            held = self._held.setdefault(peer, [])
            if (len(held) < self.limits.max_unauthenticated_per_peer
                    and self._held_total < self.limits.max_unauthenticated_total):
                self.streams_refused["shunned"] += 1
                held.append(writer)
                self._held_total += 1
                return True
            refusal = "shunned_over_allowance"
            if self.gate.should_disconnect(peer, now):
                self._disconnect(peer)
        self.streams_refused[refusal] += 1
        writer.close()
        return True

    def _release_held(self, now: float) -> None:
        """Close the held streams of peers whose shun has ended."""
        for peer in [p for p in self._held if not self.gate.shunned(p, now)]:
            for writer in self._held.pop(peer):
                writer.close()
                self._held_total -= 1

    def _strike(self, peer: str) -> None:
        """A silent stream of `peer` was evicted, timed out or refused."""
        if self.gate.strike(peer, time.monotonic()):
            logger.debug("peer %s shunned: its streams keep going without a hello", peer)

    def _disconnect(self, peer: str) -> None:
        """Drop `peer`'s libp2p connection, in the background (one call to the daemon per peer at a
        time): its open streams go with it, and its next stream costs it a new connection."""
        if peer in self._disconnecting:
            return

        async def drop() -> None:
            try:
                await asyncio.wait_for(hivemind_adapter.disconnect(self.p2p, PeerID.from_base58(peer)), 5.0)
                self.peers_disconnected += 1
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - gone already, or the daemon is stopping
                logger.debug("could not drop the connection of %s: %s", peer, exc)
            finally:
                self._disconnecting.pop(peer, None)

        self._disconnecting[peer] = asyncio.create_task(drop(), name="rpc-drop-shunned-peer")

    async def _serve_stream(self, name, handler, roles, info, reader, writer) -> None:
        peer_id: PeerID = info.peer_id
        peer = peer_id.to_base58()
        session = _Session(peer, source_key(str(info.addr) if info.addr is not None else None, peer), writer,
                           deadline=time.monotonic() + self.limits.hello_timeout_s,
                           relayed=info.addr is not None and is_relayed(str(info.addr)), reader=reader)
        refusal, evicted = self.budget.open(session, peer, session.source)
        for victim in evicted:
            self._evict(victim)
        if refusal is not None:
            self.streams_refused[refusal] += 1
            if refusal == "too_many_unauthenticated":
                self._strike(peer)
            held = (f"{self.limits.max_streams_per_peer} streams" if refusal == "too_many_streams" else
                    f"{self.limits.max_unauthenticated_per_peer} streams that have not sent their hello")
            await self._refuse(writer, ErrorCode.RATE_LIMITED,
                               f"{refusal}: peer {peer} already holds {held} on this node; "
                               f"reuse or close them and retry")
            writer.close()
            return
        self._sessions.add(session)
        try:
            if await self._hello(session, name, roles, reader):
                await self._serve_requests(session, name, handler, peer_id, reader)
        except PeerUnavailable:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not take the node down; the stream is dropped
            logger.exception("stream handler %s crashed", name)
        finally:
            self._sessions.discard(session)
            if session.reserved:
                self.budget.release(peer, session.reserved)
            self.budget.close(session)
            writer.close()

    def _evict(self, session: _Session) -> None:
        """Close a silent stream to make room for a new one (the budget no longer counts it). The
        refusal is written before the close, which sends it first; a silent stream has sent nothing
        we leave unread, so the close does not reset it."""
        self.streams_closed["evicted"] += 1
        self._count("(evicted stream)", ErrorCode.RATE_LIMITED)
        self._strike(session.peer)
        session.deadline = None
        with contextlib.suppress(Exception):  # the stream may be gone already
            session.writer.write(encode_frame(_error(
                ErrorCode.RATE_LIMITED, f"evicted: this stream sent no hello while the node's allowance for such "
                                        f"streams was full, and its source ({session.source}) held the most of "
                                        f"them; send the hello as soon as a stream opens")))
        session.writer.close()

    async def _refuse(self, writer, code: ErrorCode, message: str, reader=None, **fields) -> None:
        """Send one error frame on a stream that is about to be closed.

        With `reader`, linger briefly first, discarding what the client already sent: a client
        pipelines its first request behind its hello, and closing a libp2p stream with unread
        data resets it, which can drop our error frame before the client reads it."""
        self._count("(refused stream)", code)
        try:
            await asyncio.wait_for(write_frame(writer, _error(code, message, **fields)), 5)
            if reader is not None:
                await asyncio.wait_for(_discard_until_eof(reader, LINGER_MAX_BYTES), LINGER_S)
        except (PeerUnavailable, ConnectionError, asyncio.TimeoutError):
            pass

    async def _hello(self, session: _Session, name: str, roles, reader) -> bool:
        """Read and check the stream's hello (nothing over HELLO_MAX_BYTES is read); ack it or refuse."""
        length = await read_length(reader)
        if length > HELLO_MAX_BYTES:
            self.streams_refused["hello_too_large"] += 1
            await self._refuse(session.writer, ErrorCode.FRAME_TOO_LARGE,
                               f"a stream must open with a hello of at most {HELLO_MAX_BYTES} bytes, not {length}; "
                               f"upgrade the calling node", reader)
            return False
        frame = await read_payload(reader, length)
        if session.writer.is_closing():
            return False  # evicted or timed out while its hello arrived
        credential = None
        try:
            hello = parse_frame(Hello, frame)
            if hello.handler != name:
                raise ProtocolError(f"hello names {hello.handler[:128]!r} on a stream for {name}",
                                    ErrorCode.MALFORMED_FRAME)
            ack: dict = {"version": PROTOCOL_VERSION, "ok": True, "idle_timeout_s": self.limits.idle_timeout_s,
                         "max_streams_per_peer": self.limits.max_streams_per_peer}
            if self.authenticator is not None:
                credential = self.authenticator.check_hello(session.peer, hello)
                if roles is not None and credential.role not in roles:
                    raise RequestRejected("wrong_role", f"{credential.role}s may not call {name}")
                ack.update(self.authenticator.ack(name, session.peer, hello.nonce))
        except RequestRejected as exc:
            self.auth_rejected[exc.reason] += 1
            await self._refuse(session.writer, exc.code, str(exc), reader)
            return False
        except ProtocolError as exc:
            await self._refuse(session.writer, exc.code, str(exc), reader)
            return False
        self.budget.authenticated(session)
        self.gate.trust(session.peer)
        session.credential = credential
        await write_frame(session.writer, pack(ack))
        return True

    async def _serve_requests(self, session: _Session, name: str, handler: Handler, peer_id: PeerID, reader) -> None:
        while True:
            session.deadline, session.waiting_for = time.monotonic() + self.limits.idle_timeout_s, "idle_timeout"
            length = await read_length(reader)
            if length > self.max_frame_bytes:
                await self._refuse(session.writer, ErrorCode.FRAME_TOO_LARGE,
                                   f"frame of {length} bytes exceeds the {self.max_frame_bytes}-byte limit", reader,
                                   seq=0)
                return  # the rest of the stream cannot be parsed
            if not self.budget.reserve(session.peer, length):
                self.streams_refused["over_byte_budget"] += 1
                await self._refuse(session.writer, ErrorCode.RATE_LIMITED,
                                   f"over_byte_budget: this peer is sending more than "
                                   f"{self.limits.max_buffered_bytes_per_peer} bytes at once; retry later", reader,
                                   seq=0)
                return
            session.reserved = length
            session.deadline = time.monotonic() + self.limits.frame_deadline_s(length)
            session.waiting_for = "frame_timeout"
            frame = await read_payload(reader, length)
            self.bytes_received += FRAME_HEADER_BYTES + length
            self.budget.release(session.peer, length)
            session.reserved, session.deadline = 0, None
            answered = await self._handle_while_caller_waits(session, name, handler, peer_id, frame)
            if answered is None:
                return  # the caller closed the stream: nobody to answer
            reply, keep_open = answered
            await write_frame(session.writer, reply)
            self.bytes_sent += FRAME_HEADER_BYTES + len(reply)
            if session.relayed:
                self.relayed_bytes[0] += FRAME_HEADER_BYTES + len(reply)
                self.relayed_bytes[1] += FRAME_HEADER_BYTES + length
            if not keep_open:
                with contextlib.suppress(PeerUnavailable, ConnectionError, asyncio.TimeoutError):
                    await asyncio.wait_for(_discard_until_eof(reader, LINGER_MAX_BYTES), LINGER_S)
                return

    async def _handle_while_caller_waits(self, session: _Session, name: str, handler: Handler, peer_id: PeerID,
                                         frame: bytes) -> Optional[tuple[bytes, bool]]:
        """`_handle`, or None if the caller closed the stream meanwhile: the sweeper (`_sweep`) then
        cancelled the handler. It runs in this stream's own task and the sweeper, which visits
        every stream anyway, does the looking: a task or a timer per request costs a busy event
        loop more than the pipeline can spare (+30% and +10% on a loopback round trip)."""
        task = asyncio.current_task()
        session.handling = task
        try:
            answered = await self._handle(session, name, handler, peer_id, frame)
        except asyncio.CancelledError:
            if not session.caller_left:
                raise  # the node is stopping
            answered = None
        finally:
            session.handling = None
        if session.caller_left:
            task.uncancel()
            self.streams_closed["caller_left"] += 1
            return None
        return answered

    async def _handle(self, session: _Session, name: str, handler: Handler, peer_id: PeerID,
                      frame: bytes) -> tuple[bytes, bool]:
        """The reply to one request frame, and whether the stream stays open after it."""
        seq = 0
        try:
            request = parse_request_frame(frame)
            seq = request.seq
            if request.seq != session.seq + 1:
                reason = "replayed" if request.seq <= session.seq else "out_of_order"
                raise RequestRejected(reason, f"request {request.seq} after {session.seq} on this stream")
            session.seq = request.seq
            if session.credential is not None:
                self.authenticator.check_session(session.credential)
            body = await handler(peer_id, request.body)
        except RequestRejected as exc:
            self.auth_rejected[exc.reason] += 1
            self._count(name, exc.code)
            return _error(exc.code, str(exc), seq=seq), False
        except ProtocolError as exc:
            self._count(name, exc.code)
            return _error(exc.code, str(exc), seq=seq), True
        except AgoraError as exc:
            code = getattr(exc, "code", ErrorCode.NOT_READY)
            self._count(name, code)
            return _error(code, str(exc), seq=seq), True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("handler %s failed", name)
            self._count(name, ErrorCode.INTERNAL)
            return _error(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}", seq=seq), True
        self.served[name] += 1
        return pack({"seq": seq, "ok": True, "body": to_body(body) if isinstance(body, WireModel) else body}), True

    def _count(self, name: str, code: ErrorCode) -> None:
        self.rejected[ErrorCode(code).name.lower()] += 1
        self.rejected_calls[f"{name} {ErrorCode(code).name.lower()}"] += 1

    async def _sweep(self) -> None:
        """Close streams whose deadline passed (no hello, idle, a frame stalled) and idle streams
        whose credential expired or was revoked."""
        period = max(0.05, min(1.0, self.limits.hello_timeout_s / 4, self.limits.idle_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            if self._held:
                self._release_held(now)
            for session in list(self._sessions):
                if session.handling is not None and not session.caller_left and _caller_gone(session.reader):
                    session.caller_left = True  # it timed out or died: nobody waits for the answer
                    session.handling.cancel()
                    continue
                if session.deadline is None:
                    continue  # a request is in flight; it is checked again before the next one
                reason = session.waiting_for if now > session.deadline else None
                if reason is None and session.credential is not None:
                    try:
                        self.authenticator.check_session(session.credential)
                    except RequestRejected as exc:
                        reason = exc.reason
                if reason is not None:
                    self.streams_closed[reason] += 1
                    session.deadline = None
                    session.writer.close()
                    if reason == "hello_timeout":
                        self._strike(session.peer)

    async def shutdown(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        for task in list(self._disconnecting.values()):
            task.cancel()
        await asyncio.gather(*self._disconnecting.values(), return_exceptions=True)
        for name in self._names:
            try:
                await self.p2p.remove_binary_stream_handler(name)
            except Exception:  # noqa: BLE001 - the daemon may already be gone
                pass
        for session in list(self._sessions):
            session.writer.close()
        self._release_held(float("inf"))


@dataclass(eq=False)
class _Stream:
    """One outgoing stream in the client's pool."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    credential: Optional[bytes]
    """The credential its hello carried: after a renewal the stream is not reused."""
    hello_nonce: Optional[bytes]
    """Set until the server's ack to our hello was read."""
    seq: int = 0
    idle_timeout_s: Optional[float] = None
    last_used: float = field(default_factory=time.monotonic)
    opening: bool = True
    """Counted against the peer's hellos in flight until the ack is read."""
    relayed: bool = False
    """It goes through one of the run's relays."""
    server: Optional[Credential] = None
    """The server's credential from its ack: checked again before each reuse, as the server checks
    ours before each request, so a peer revoked since the stream opened is not asked again on it."""

    def reusable(self, credential: Optional[bytes], now: float) -> bool:
        if self.writer.is_closing() or self.reader.at_eof() or self.credential != credential:
            return False
        # stop reusing it well before the server's idle timeout closes it under a request
        return self.idle_timeout_s is None or now - self.last_used < 0.75 * self.idle_timeout_s - 0.5


class RpcClient:
    """Calls `agora/v1/*` handlers on remote peers over pooled long-lived streams.

    It keeps no more streams open to a peer (idle or in use, all handlers together) than the
    peer's server accepts (`max_streams_per_peer`, learnt from its ack): a caller that would
    exceed it first closes an idle stream of another handler, else waits for one to be freed."""

    def __init__(self, p2p: P2P, *, timeout_s: float = 30.0, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 max_idle_per_peer: int = 16, max_streams_per_peer: int = StreamLimits.max_streams_per_peer,
                 authenticator: Optional[PeerAuthenticator] = None):
        self.p2p = p2p
        self.authenticator = authenticator
        self.timeout_s = timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.max_idle_per_peer = max_idle_per_peer
        self.max_streams_per_peer = max_streams_per_peer
        self._idle: dict[tuple[PeerID, str], list[_Stream]] = collections.defaultdict(list)
        self._open: collections.Counter[PeerID] = collections.Counter()
        self._opening: collections.Counter[PeerID] = collections.Counter()
        self._limit: dict[PeerID, int] = {}
        """Each peer's own cap, from its ack."""
        self.streams_reopened = 0
        """New streams the server closed before acknowledging their hello, whose request went
        out again on another new stream (once per call)."""
        self._freed = asyncio.Event()
        self.bytes_sent = 0
        """Bytes of request frames written (length prefixes included), for the node's metrics."""
        self.bytes_received = 0
        """Bytes of reply frames read."""
        self.relayed_bytes = [0, 0]
        """Of those, (sent, received) on streams that go through a relay."""

    async def request(self, peer_id: PeerID, handler: str, request: WireModel, reply: type[M], *,
                      timeout_s: Optional[float] = None) -> M:
        """Send a typed request and return the reply validated as `reply`. Raises what `call`
        raises, and ProtocolError for a reply that does not fit its model."""
        body = await self.call(peer_id, handler, to_body(request), timeout_s=timeout_s)
        return parse_model(reply, body, ErrorCode.INVALID_REQUEST)

    async def call(self, peer_id: PeerID, handler: str, body: dict, *, timeout_s: Optional[float] = None) -> dict:
        """Send one request body and return the reply body. Raises RemoteError (typed), PeerTimeout,
        PeerUnavailable, or RequestRejected when the server cannot prove it belongs to the run."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        key = (peer_id, handler)
        held: list[_Stream] = []  # the stream in use, so a failure can discard it

        async def exchange() -> Reply:
            for attempt in range(2):
                stream = await self._acquire(key)
                held.append(stream)
                fresh = stream.hello_nonce is not None
                stream.seq += 1
                frame = pack({"seq": stream.seq, "body": body})
                try:
                    await write_frame(stream.writer, frame)
                    self.bytes_sent += FRAME_HEADER_BYTES + len(frame)
                    if stream.relayed:
                        self.relayed_bytes[0] += FRAME_HEADER_BYTES + len(frame)
                    if fresh:
                        await self._read_ack(peer_id, handler, stream)
                    break
                except PeerUnavailable:
                    # A new stream the server closed before it acknowledged the hello (it evicts
                    # unauthenticated streams when a flood fills its allowance) never reached the
                    # handler, so the request is sent once more on another new stream.
                    if not fresh or attempt:
                        raise
                    self._discard(peer_id, held)
                    held.clear()
                    self.streams_reopened += 1
            answer = await read_frame(stream.reader, self.max_frame_bytes)
            self.bytes_received += FRAME_HEADER_BYTES + len(answer)
            if stream.relayed:
                self.relayed_bytes[1] += FRAME_HEADER_BYTES + len(answer)
            return parse_reply_frame(answer)

        try:
            reply = await _within(exchange(), timeout)  # one deadline for the whole exchange
        except asyncio.TimeoutError as exc:
            self._discard(peer_id, held)
            raise PeerTimeout(f"{handler} on {peer_id} did not answer within {timeout:.1f}s") from exc
        except (AgoraError, asyncio.CancelledError):
            self._discard(peer_id, held)
            raise
        except Exception as exc:
            self._discard(peer_id, held)
            raise PeerUnavailable(f"cannot reach {peer_id} for {handler}: {exc}") from exc
        stream = held[0]
        if reply.seq not in (stream.seq, 0):
            self._discard(peer_id, held)
            raise ProtocolError(f"{peer_id} answered request {reply.seq} to our request {stream.seq} on {handler}",
                                ErrorCode.MALFORMED_FRAME)
        if not reply.ok:
            code = _code(reply.error)
            if code in _CLOSING_CODES:
                self._discard(peer_id, held)
            else:
                self._release(key, stream)
            raise RemoteError(f"{peer_id} rejected {handler}: {code.name.lower()}: {_message(reply.error)}", code)
        self._release(key, stream)
        return reply.body or {}

    async def _read_ack(self, peer_id: PeerID, handler: str, stream: _Stream) -> None:
        try:
            ack = parse_frame(HelloAck, await read_frame(stream.reader, HELLO_MAX_BYTES))
        finally:
            self._opened(peer_id, stream)
        if not ack.ok:
            code = _code(ack.error)
            raise RemoteError(f"{peer_id} refused a stream for {handler}: {code.name.lower()}: {_message(ack.error)}",
                              code)
        if self.authenticator is not None:
            stream.server = self.authenticator.check_ack(peer_id.to_base58(), handler, stream.hello_nonce, ack)
        stream.hello_nonce, stream.idle_timeout_s = None, ack.idle_timeout_s
        if ack.max_streams_per_peer is not None:
            self._limit[peer_id] = ack.max_streams_per_peer

    def _server_current(self, stream: _Stream) -> bool:
        """Whether the server's credential is still current and unrevoked; a new stream's hello
        then says why not (RequestRejected `revoked` or `expired`), or gets the renewed one."""
        if self.authenticator is None or stream.server is None:
            return True
        try:
            self.authenticator.check_session(stream.server)
        except RequestRejected:
            return False
        return True

    async def _acquire(self, key) -> _Stream:
        """An idle stream of ours for `key`, or a new one (its hello sent) once the peer's cap allows."""
        peer_id, handler = key
        credential = self.authenticator.current_credential() if self.authenticator is not None else None
        while True:
            idle, now = self._idle.get(key), time.monotonic()
            while idle:
                stream = idle.pop()
                if stream.reusable(credential, now) and self._server_current(stream):
                    return stream
                self._close(peer_id, stream)
            limit = min(self.max_streams_per_peer, self._limit.get(peer_id, self.max_streams_per_peer))
            if self._open[peer_id] < limit and self._opening[peer_id] < HELLOS_IN_FLIGHT_PER_PEER:
                break
            if self._open[peer_id] < limit or not self._evict_idle(peer_id):
                self._freed.clear()
                await self._freed.wait()
        self._open[peer_id] += 1
        self._opening[peer_id] += 1
        hello, nonce = hello_frame(handler, peer_id.to_base58(), self.authenticator)
        try:
            info, reader, writer = await self.p2p.call_binary_stream_handler(peer_id, handler)
        except BaseException:
            self._opening[peer_id] -= 1
            self._closed(peer_id)
            raise
        stream = _Stream(reader, writer, credential, hello_nonce=nonce,
                         relayed=getattr(info, "addr", None) is not None and is_relayed(str(info.addr)))
        try:
            await write_frame(writer, hello)  # the first request follows without waiting for the ack
        except BaseException:
            self._close(peer_id, stream)
            raise
        return stream

    def _evict_idle(self, peer_id: PeerID) -> bool:
        """Close one idle stream to `peer_id` (any handler) to make room; False if none is idle."""
        for (peer, _), streams in self._idle.items():
            if peer == peer_id and streams:
                self._close(peer_id, streams.pop(0))  # the longest idle
                return True
        return False

    def _release(self, key, stream: _Stream) -> None:
        stream.last_used = time.monotonic()
        idle = self._idle[key]
        if len(idle) < self.max_idle_per_peer:
            idle.append(stream)
            self._freed.set()  # a waiter for this peer may now evict it
        else:
            self._close(key[0], stream)

    def _discard(self, peer_id: PeerID, held: list[_Stream]) -> None:
        if held:
            self._close(peer_id, held[0])

    def _close(self, peer_id: PeerID, stream: _Stream) -> None:
        stream.writer.close()
        self._opened(peer_id, stream)
        self._closed(peer_id)

    def _opened(self, peer_id: PeerID, stream: _Stream) -> None:
        if stream.opening:
            stream.opening = False
            self._opening[peer_id] -= 1
            self._freed.set()

    def _closed(self, peer_id: PeerID) -> None:
        self._open[peer_id] -= 1
        if self._open[peer_id] <= 0:
            del self._open[peer_id]
        self._freed.set()

    async def close(self) -> None:
        for (peer_id, _), streams in self._idle.items():
            for stream in streams:
                self._close(peer_id, stream)
        self._idle.clear()


def _code(error: Optional[ErrorBody]) -> ErrorCode:
    try:
        return ErrorCode(error.code) if error is not None else ErrorCode.INTERNAL
    except ValueError:
        return ErrorCode.INTERNAL


def _message(error: Optional[ErrorBody]) -> str:
    return error.message if error is not None else "error reply without details"
