"""Length-prefixed frames on long-lived libp2p binary streams.

libp2p streams cannot be half-closed, so every message is framed: a 4-byte big-endian length,
then that many bytes. A length above the reader's limit is refused before anything is read, so
a hostile peer cannot make us buffer an arbitrary amount.
"""

from __future__ import annotations

import asyncio
import struct

from protocol.errors import ErrorCode, PeerUnavailable, ProtocolError

_HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 64 << 20


class FrameTooLarge(ProtocolError):
    """The announced frame length exceeds the limit; the stream cannot be resynchronised."""

    def __init__(self, length: int, limit: int):
        super().__init__(f"frame of {length} bytes exceeds the {limit}-byte limit", ErrorCode.FRAME_TOO_LARGE)


async def read_length(reader: asyncio.StreamReader) -> int:
    """Read a frame's length prefix. Raises PeerUnavailable on a clean or unclean close."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise PeerUnavailable("stream closed by peer") from exc
    return _HEADER.unpack(header)[0]


async def read_payload(reader: asyncio.StreamReader, length: int) -> bytes:
    """Read the `length` bytes of a frame whose prefix was read (and checked) already."""
    try:
        return await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        raise PeerUnavailable("stream closed in the middle of a frame") from exc


async def read_frame(reader: asyncio.StreamReader, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """Read one frame. Raises PeerUnavailable on a clean or unclean close, FrameTooLarge on a bad header."""
    length = await read_length(reader)
    if length > max_bytes:
        raise FrameTooLarge(length, max_bytes)
    return await read_payload(reader, length)


def encode_frame(payload: bytes) -> bytes:
    """One small frame as bytes, for a synchronous write just before a close."""
    return _HEADER.pack(len(payload)) + payload


async def write_frame(writer: asyncio.StreamWriter, payload: bytes) -> None:
    """Write one frame and wait until the transport accepted it."""
    try:
        header = _HEADER.pack(len(payload))
        if len(payload) < 65536:
            writer.write(header + payload)  # one small write; large payloads are not copied
        else:
            writer.write(header)
            writer.write(payload)
        await writer.drain()
    except (ConnectionError, RuntimeError) as exc:
        raise PeerUnavailable(f"stream write failed: {exc}") from exc
