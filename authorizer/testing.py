"""Real processes for tests and benchmarks: a throwaway PostgreSQL 15, an authorizer subprocess,
and node identities that can join, renew and leave.

Shared by tests/authorizer and scripts/bench_authorizer.py so both exercise the real thing: the
authorizer is started as `agora-node --role authorizer ... --port 0` and its URL read from its
readiness line; PostgreSQL is initdb'd in a temporary directory, listens on 127.0.0.1 with its
unix socket inside that directory, and is stopped with `pg_ctl stop -m fast`. PostgreSQL cannot
report a port it picked, so it alone gets a port found by binding port 0 (retried if taken).
"""

from __future__ import annotations

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

from protocol.readiness import parse_ready_line

PG_BIN = os.environ.get("AGORA_PG_BIN", "/usr/lib/postgresql/15/bin")


def postgres_missing() -> Optional[str]:
    """Why PostgreSQL cannot be started here, or None if it can."""
    for tool in ("initdb", "pg_ctl", "postgres"):
        if not os.access(os.path.join(PG_BIN, tool), os.X_OK):
            return f"PostgreSQL binaries not found in {PG_BIN} (set AGORA_PG_BIN)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root but runuser is missing (postgres refuses to run as root)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'agora-node[postgres]')"
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    """A private PostgreSQL instance; use as a context manager."""

    def __init__(self, *, fsync: bool = False):
        self.fsync = fsync
        self.root: Optional[str] = None
        self.port: Optional[int] = None
        self._as_postgres = os.geteuid() == 0

    def _run(self, *args: str, timeout_s: float = 120) -> subprocess.CompletedProcess:
        prefix = ["runuser", "-u", "postgres", "--"] if self._as_postgres else []
        return subprocess.run(prefix + list(args), capture_output=True, text=True, timeout=timeout_s, check=False)

    @property
    def data_dir(self) -> str:
        return os.path.join(self.root, "data")

    def start(self) -> PostgresServer:
        self.root = tempfile.mkdtemp(prefix="agora-pg-")
        os.makedirs(os.path.join(self.root, "sock"))
        if self._as_postgres:
            shutil.chown(self.root, "postgres", "postgres")
            shutil.chown(os.path.join(self.root, "sock"), "postgres", "postgres")
        done = self._run(f"{PG_BIN}/initdb", "-D", self.data_dir, "-U", "postgres", "-A", "trust",
                         "--no-sync", "-E", "UTF8", "--locale=C")
        if done.returncode != 0:
            raise RuntimeError(f"initdb failed: {done.stderr[-2000:]}")
        last = ""
        for _ in range(5):
            self.port = _free_port()
            options = (f"-p {self.port} -k {self.root}/sock -c listen_addresses=127.0.0.1 -c max_connections=200"
                       + ("" if self.fsync else " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"))
            done = self._run(f"{PG_BIN}/pg_ctl", "-D", self.data_dir, "-l", f"{self.root}/log", "-w", "-t", "60",
                             "-o", options, "start")
            if done.returncode == 0:
                return self
            last = done.stdout[-1000:] + done.stderr[-1000:]
        raise RuntimeError(f"PostgreSQL did not start: {last}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True, connect_timeout=10) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        if self.root is None:
            return
        try:
            if os.path.exists(os.path.join(self.data_dir, "postmaster.pid")):
                self._run(f"{PG_BIN}/pg_ctl", "-D", self.data_dir, "-m", "fast", "-w", "-t", "30", "stop", timeout_s=60)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class AuthorizerProcess:
    """`agora-node --role authorizer` in its own process group, with its URL from the readiness line."""

    def __init__(self, args: list[str], *, log_path: str, env: Optional[dict] = None,
                 popen: Callable[..., subprocess.Popen] = subprocess.Popen):
        """`popen` starts the process (subprocess.Popen's signature; node/launcher.py says why another)."""
        self.popen = popen
        self.args = list(args)
        self.log_path = log_path
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.url: Optional[str] = None
        self.stdout_lines: list[str] = []
        self._ready = threading.Event()

    def start(self, timeout_s: float = 60) -> AuthorizerProcess:
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(self.log_path, "ab") as log:
            self.proc = self.popen(
                [sys.executable, "-m", "node.cli", "--role", "authorizer", *self.args], stdout=subprocess.PIPE, stderr=log,
                text=True, env=env, start_new_session=True,
            )
        threading.Thread(target=self._read_stdout, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"authorizer not ready (exit {self.proc.returncode}):\n{self.log_tail()}")
        return self

    def _read_stdout(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.stdout_lines.append(line.rstrip("\n"))
            fields = parse_ready_line(line)
            if fields is not None and not self._ready.is_set():
                if fields.get("role") == "authorizer":
                    self.url = fields.get("url")
                    self._ready.set()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as log:
                return log.read()[-chars:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the authorizer and everything it started (its libp2p daemon): a crash."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM and wait; returns the exit code (killing the group if it overstays)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of the group, if any
        except (ProcessLookupError, PermissionError):
            pass
        return self.proc.returncode


@dataclass
class NodeKey:
    """A node identity for tests: an Ed25519 key (as protocol.identity), raw public key, peer id."""

    private_key: object
    public_key: bytes
    peer_id: str

    @classmethod
    def generate(cls) -> NodeKey:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        from protocol.identity import Identity

        identity = Identity(Ed25519PrivateKey.generate(), path="")
        return cls(identity.private_key, identity.public_key, identity.peer_id.to_base58())

    @classmethod
    def from_identity(cls, identity) -> NodeKey:
        """From a protocol.identity.Identity (e.g. one whose file a hivemind P2P listens with)."""
        return cls(identity.private_key, identity.public_key, identity.peer_id.to_base58())

    def sign(self, data: bytes) -> bytes:
        return self.private_key.sign(data)  # type: ignore[attr-defined]

    def join_body(self, *, role: str = "worker", account_token: str = "account-0", client_version: str = "0.1.0",
                  package_digest: str = "", announce_maddrs: Optional[list[str]] = None, run_id: Optional[str] = "tiny",
                  signed_at: Optional[float] = None, preferred_stage: Optional[int] = None, **hardware) -> dict:
        """A join request, signed for `run_id` (the proof that lets it replace this peer's stale
        ticket); `run_id=None` leaves the proof out, as clients before it did."""
        hw = dict(device_name="NVIDIA RTX 4090", vram_bytes=24 << 30, ram_bytes=64 << 30,
                  bandwidth_mbps=1000.0, latency_ms=20.0)
        hw.update(hardware)
        body = dict(peer_id=self.peer_id, public_key=base64.b64encode(self.public_key).decode(), role=role,
                    hardware=hw, client_version=client_version, package_digest=package_digest,
                    announce_maddrs=announce_maddrs or [], account_token=account_token)
        if preferred_stage is not None:
            body["preferred_stage"] = preferred_stage
        if run_id is not None:
            body.update(self.proof_body("join", run_id, signed_at))
        return body

    def proof_body(self, action: str, run_id: str, signed_at: Optional[float] = None) -> dict:
        from protocol.credentials import proof_bytes

        signed_at = time.time() if signed_at is None else signed_at
        data = proof_bytes(action, run_id=run_id, peer_id=self.peer_id, signed_at=signed_at)  # type: ignore[arg-type]
        return dict(peer_id=self.peer_id, signed_at=signed_at, signature=base64.b64encode(self.sign(data)).decode())


class KeepAliveClient:
    """One raw HTTP/1.1 keep-alive connection, for floods and benchmarks: httpx costs more CPU per
    request than the authorizer does, and both share the machine. Just enough protocol for the
    authorizer's answers (Content-Length framed); `request` returns status, headers (names in
    lower case) and body. `headers` are sent with every request (e.g. X-Forwarded-For, which the
    authorizer takes from 127.0.0.1 as the client's address)."""

    def __init__(self, url: str, headers: Optional[dict[str, str]] = None):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host.strip("[]"), int(port)
        self.extra = "".join(f"{name}: {value}\r\n" for name, value in (headers or {}).items())
        self.reader = self.writer = None

    async def connect(self) -> KeepAliveClient:
        import asyncio

        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n{self.extra}"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        self.writer.write(head + body)  # type: ignore[union-attr]
        status_line = await self.reader.readline()  # type: ignore[union-attr]
        headers: dict[str, str] = {}
        while True:
            line = await self.reader.readline()  # type: ignore[union-attr]
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        payload = await self.reader.readexactly(int(headers.get("content-length", "0")))  # type: ignore[union-attr]
        return int(status_line.split(b" ", 2)[1]), headers, payload

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except Exception:  # noqa: BLE001 - the server may have closed first
                pass


async def paced_requests(url: str, method: str, path: str, bodies: list[bytes], duration_s: float, *,
                         connections: int = 4, headers: Optional[dict[str, str]] = None,
                         ) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `bodies` spread evenly over `duration_s` (request i leaves at i * duration_s / n) on
    `connections` keep-alive connections; the answers in order. A flood's shape for tests and
    benchmarks: the pace is the load, not a wait for a condition."""
    import asyncio

    clients = [await KeepAliveClient(url, headers).connect() for _ in range(connections)]
    answers: list = [None] * len(bodies)
    started = time.monotonic()

    async def send(index: int) -> None:
        for i in range(index, len(bodies), connections):
            await asyncio.sleep(max(0.0, started + i * duration_s / len(bodies) - time.monotonic()))
            answers[i] = await clients[index].request(method, path, bodies[i])

    try:
        await asyncio.gather(*(send(i) for i in range(connections)))
    finally:
        for client in clients:
            await client.close()
    return answers


async def steady_renewals(url: str, keys: list[NodeKey], run_id: str, every_s: float,
                          duration_s: float) -> list[tuple[int, float]]:
    """Each node renews every `every_s` for `duration_s`, each on its own keep-alive connection, as
    admitted nodes do (sooner than agora-node would, to have many samples); (status, seconds) of
    every renewal."""
    import asyncio
    import json

    results: list[tuple[int, float]] = []
    started = time.monotonic()

    async def node(key: NodeKey) -> None:
        client = await KeepAliveClient(url).connect()
        try:
            beat = 0
            while (beat + 1) * every_s <= duration_s:
                beat += 1
                await asyncio.sleep(max(0.0, started + beat * every_s - time.monotonic()))
                body = json.dumps(key.proof_body("renew", run_id)).encode()
                sent = time.perf_counter()
                status, _, _ = await client.request("POST", "/v1/renew", body)
                results.append((status, time.perf_counter() - sent))
        finally:
            await client.close()

    await asyncio.gather(*(node(key) for key in keys))
    return results


def row_counts(db_url: str) -> dict[str, int]:
    """Rows in each of the authorizer's tables (`db_url` as given to --db)."""
    from sqlalchemy import create_engine, func, select

    from authorizer.schema import metadata

    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            return {name: conn.execute(select(func.count()).select_from(table)).scalar_one()
                    for name, table in metadata.tables.items()}
    finally:
        engine.dispose()
