"""The node's metrics port: `/metrics` (Prometheus text format), `/healthz` (200 while the process
serves HTTP at all) and `/readyz` (200 once the node serves: admitted, announced, and a worker in
its active sync phase; 503 with the reason before that and while draining).

It runs on the node's event loop, not in a thread of its own: the node starts it before
admission, so /healthz answers while the node waits in the queue or loads state, and hivemind
forks its DHT and averager processes later, which must happen before the node has threads
(docs/architecture.md, 'Processes and threads'). A forked child gets a copy of the listening
socket; an at-fork hook points that copy at /dev/null, so the port is released with the node and
never held by a child. Sources are read on the loop that owns the role's state.

A scrape costs one pass over the sources (about a millisecond for a worker); requests are
HTTP/1.0 style, one per connection, with a bounded head and a timeout.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import threading
import time
from typing import Optional

from node.metrics.registry import NodeMetrics
from protocol.errors import ConfigError
from protocol.stats import Distribution

logger = logging.getLogger("agora.metrics")

HEAD_MAX_BYTES = 8192
REQUEST_TIMEOUT_S = 10.0
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_listening_fds: set[int] = set()
_fds_lock = threading.Lock()


def _release_in_child() -> None:
    """In a forked child: the listening sockets belong to the parent. Point their descriptors at
    /dev/null instead of closing them, so a stale socket object closing its number later in the
    child cannot close an unrelated file that reused it."""
    with _fds_lock:
        fds = list(_listening_fds)
        _listening_fds.clear()
    if not fds:
        return
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            try:
                os.dup2(null, fd)
            except OSError:
                pass
    finally:
        os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_release_in_child)


class MetricsServer:
    def __init__(self, metrics: NodeMetrics, host: str, port: int):
        self.metrics = metrics
        self.host = host
        self.port = port
        self._server: Optional[asyncio.base_events.Server] = None
        self.scrape_seconds = Distribution()
        """CPU time the loop's thread spent building each /metrics reply: what being scraped costs
        this node (thread time, so a busy machine's preemptions do not count)."""
        metrics.add("scrapes", lambda f: [f.histogram(
            "agora_metrics_scrape_seconds", "CPU time this node spent building each /metrics reply (earlier scrapes)",
            {(): self.scrape_seconds.snapshot()})])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> None:
        """Listen, or raise ConfigError saying what to change (port taken, address not ours)."""
        try:
            self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=HEAD_MAX_BYTES,
                                                      reuse_address=True)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"--metrics-port {self.port} is already in use on {self.host}; pick another port "
                                  f"or pass --metrics-port 0 for any free one") from exc
            raise ConfigError(f"cannot serve metrics on {self.host}:{self.port} ({exc.strerror or exc}); check "
                              f"--metrics-host and --metrics-port") from exc
        sockets = self._server.sockets
        self.port = sockets[0].getsockname()[1]
        with _fds_lock:
            _listening_fds.update(sock.fileno() for sock in sockets)
        logger.info("metrics on %s/metrics (health %s/healthz, readiness %s/readyz)", self.url, self.url, self.url)

    async def close(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        with _fds_lock:
            _listening_fds.difference_update(sock.fileno() for sock in server.sockets)
        server.close()
        try:
            await asyncio.wait_for(server.wait_closed(), 2.0)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - never hold up the node's exit
            pass

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            status, body, content_type = self._answer(head)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        except Exception:  # noqa: BLE001 - a bug here answers 500, it does not reach the node
            logger.exception("metrics request failed")
            status, body, content_type = "500 Internal Server Error", b"internal error\n", "text/plain"
        try:
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
                         f"Connection: close\r\n\r\n".encode() + body)
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, head: bytes) -> tuple[str, bytes, str]:
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(parts) < 2:
            return "400 Bad Request", b"bad request\n", "text/plain"
        method, path = parts[0], parts[1].split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", b"only GET\n", "text/plain"
        if path == "/metrics":
            started = time.thread_time()
            body = self.metrics.exposition()
            self.scrape_seconds.observe(time.thread_time() - started)
            return "200 OK", body if method == "GET" else b"", CONTENT_TYPE
        if path == "/healthz":
            return "200 OK", b"ok\n", "text/plain"
        if path == "/readyz":
            reason = self.metrics.ready_reason()
            if reason is None:
                return "200 OK", b"ready\n", "text/plain"
            return "503 Service Unavailable", f"not ready: {reason}\n".encode(), "text/plain"
        return "404 Not Found", b"not found: try /metrics, /healthz or /readyz\n", "text/plain"
