"""Every error agora-node raises on purpose, and the wire codes remote failures travel as.

    AgoraError
    ├── ConfigError          bad flags, environment or config file; the message names the fix
    ├── ProtocolError        a peer sent something we cannot accept (bad frame, schema, tensor)
    │   └── RemoteError      a peer answered with a typed error reply (carries its ErrorCode)
    ├── AuthError            credentials or signatures that do not check out
    ├── PeerUnavailable      no route to the peer, or it closed the stream
    ├── PeerTimeout          the peer did not answer in time
    └── NoWorkersError       a stage has no usable worker right now

A remote failure arrives locally as `RemoteError` with its `ErrorCode`, never as a bare string.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.IntEnum):
    """Codes of the typed error reply. Never renumber; add new codes at the end."""

    MALFORMED_FRAME = 1  # frame length, msgpack or envelope could not be decoded
    UNSUPPORTED_VERSION = 2  # envelope protocol version is not one we speak
    INVALID_REQUEST = 3  # body failed schema validation
    INVALID_TENSOR = 4  # dtype, shape or byte length of a tensor is wrong
    WRONG_STAGE = 5  # request addressed to a stage this worker does not serve
    UNKNOWN_HANDLER = 6  # no handler of that name
    OVERLOADED = 7  # queue full; retry elsewhere
    NOT_READY = 8  # worker is starting, syncing or shutting down
    INTERNAL = 9  # the computation failed on the worker (its bug, not the caller's)
    UNAUTHENTICATED = 10  # missing or invalid credential or signature
    FRAME_TOO_LARGE = 11  # frame exceeds the handler's size limit
    RATE_LIMITED = 12  # the peer holds too many streams or buffered bytes; close idle streams or retry later
    STATE_GONE = 13  # the state snapshot a chunk was asked of is no longer held; fetch the manifest again
    NOT_KEPT = 14  # the worker holds no record of that chained sample (evicted, never seen, or another trainer's),
    # or no longer holds the weights of that version


class AgoraError(Exception):
    """Base of every error agora-node raises on purpose."""


class ConfigError(AgoraError):
    """Invalid configuration or command-line input. The message tells the user what to change."""


class ProtocolError(AgoraError):
    """A peer sent bytes we cannot accept."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST):
        super().__init__(message)
        self.code = code


class RemoteError(ProtocolError):
    """A peer replied with a typed error."""


class AuthError(AgoraError):
    """A credential or signature did not verify."""


class PeerUnavailable(AgoraError):
    """The peer cannot be reached or dropped the connection."""


class PeerTimeout(AgoraError):
    """The peer did not answer within the deadline."""


class NoWorkersError(AgoraError):
    """A stage currently has no worker that may be used."""
