"""The health monitor's seat in the swarm: a hivemind DHT node with our record validators, a
credential of role `monitor`, and nothing announced [report 3.6.2.1].

Inside the authorizer the monitor's DHT is started first thing, before the store's threads and
uvicorn: hivemind forks its DHT process, and a fork of a process that already runs threads can
inherit a lock some other thread held, forever. The fork returns at once; the authorizer does not
wait for the DHT to be ready (it starts p2pd, about a second), it only hands the DHT's addresses to
nodes once it is, as their first bootstrap peer (authorizer.service): every node then meets the
monitor, and the monitor sees every record. After a restart it bootstraps from the addresses of
recently admitted nodes in the database (they keep running through an authorizer restart), those
that still accept a connection: after the whole run went down with it, none does, and the monitor
starts the run's DHT afresh instead of failing to reach the dead (p2pd refuses to start when no
bootstrap peer answers, and every node would then be handed only dead peers).

Its identity is kept in `<data_dir>/monitor.key`, so it is the same peer (and sits at the same
place in the DHT) after a restart. It needs no admission: the authorizer signs its credential
itself (role monitor, no stage, serial 0: never recorded and never revoked, since it is the
authorizer's own) and signs a new one at two thirds of its life (`SelfCredential`). Children:
the DHT process gets PR_SET_PDEATHSIG so it dies with the authorizer; `shutdown` stops it and kills
whatever of its tree is left (its p2pd); its trust directory `agora-monitor-<pid>-*` in the temp
directory is removed then.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Optional

import psutil

from protocol.auth_state import SharedAuthState
from protocol.credentials import renew_at
from protocol.dht_auth import CredentialDHTAuthorizer
from protocol.dht_schema import schema_for_run
from protocol.identity import Identity, load_or_create_identity
from protocol.records import SignedRecordValidator

logger = logging.getLogger("agora.monitor")

_PR_SET_PDEATHSIG = 1
_hooked = False
_hook_lock = threading.Lock()


def _die_with_parent() -> None:
    """In a forked child: be killed when the forking thread (the authorizer's main thread) exits."""
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _hook_forks() -> None:
    global _hooked
    with _hook_lock:
        if not _hooked:
            os.register_at_fork(after_in_child=_die_with_parent)
            _hooked = True


class MonitorSeat:
    """The monitor's DHT node; `start` forks it, `wait_ready` gives its addresses, `shutdown` ends it."""

    def __init__(self, dht, validator: SignedRecordValidator, identity: Identity,
                 auth_state: Optional[SharedAuthState], trust_dir: Optional[str]):
        self.dht = dht
        self.validator = validator
        self.identity = identity
        self.auth_state = auth_state
        self.trust_dir = trust_dir
        self.maddrs: list[str] = []
        self.peer_id = identity.peer_id.to_base58()
        self._closed = False

    @classmethod
    def start(cls, *, identity: Identity, run_id: str, num_stages: int, initial_peers: list[str],
              host_maddrs: list[str], announce_maddrs: list[str] = (), auth_state: Optional[SharedAuthState],
              trust_dir: Optional[str] = None, bootstrap_timeout_s: float = 30.0) -> MonitorSeat:
        """Fork the DHT process and return at once. Initial peers that do not answer are not an
        error: the monitor may be the first node, or the nodes it remembers may be gone."""
        import hivemind

        if mp.get_start_method(allow_none=True) != "fork":
            mp.set_start_method("fork", force=True)  # hivemind requires fork
        _hook_forks()
        validator = SignedRecordValidator(identity, schema_for_run(run_id, num_stages), run_id=run_id,
                                          auth=auth_state, witness=True)
        dht = hivemind.DHT(
            initial_peers=list(initial_peers) or None, start=False, record_validators=[validator],
            identity_path=identity.path, check_if_identity_free=False, host_maddrs=list(host_maddrs),
            announce_maddrs=list(announce_maddrs) or None, client_mode=False,
            authorizer=CredentialDHTAuthorizer(identity, auth_state) if auth_state is not None else None,
            bootstrap_timeout=bootstrap_timeout_s, startup_timeout=bootstrap_timeout_s,
            ensure_bootstrap_success=False, daemon=True,
        )
        dht.start()
        return cls(dht, validator, identity, auth_state, trust_dir)

    async def wait_ready(self, timeout_s: float = 60.0) -> list[str]:
        """The DHT's visible multiaddrs once it is up; RuntimeError if it fails or dies first."""
        await asyncio.to_thread(self.dht.wait_until_ready, timeout_s)
        self.maddrs = [str(m) for m in await asyncio.to_thread(self.dht.get_visible_maddrs)]
        return self.maddrs

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop the DHT process and whatever it started. Idempotent."""
        if self._closed:
            return
        self._closed = True
        tree = []
        if self.dht.pid is not None:
            try:
                tree = psutil.Process(self.dht.pid).children(recursive=True)
            except psutil.Error:
                tree = []
            if self.dht.is_alive():
                try:
                    self.dht.shutdown()
                except Exception as exc:  # a half-started or dead DHT: killed below
                    logger.debug("DHT shutdown: %s", exc)
            self.dht.join(timeout_s)
            if self.dht.is_alive():
                self.dht.kill()
                self.dht.join(1)
        for child in tree:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(tree, timeout=2)
        if self.trust_dir is not None:
            shutil.rmtree(self.trust_dir, ignore_errors=True)


class SelfCredential:
    """The in-process monitor's credential, signed by the authorizer's issuer and re-signed at two
    thirds of its life (`refresh`, called every snapshot)."""

    def __init__(self, issuer, identity: Identity, auth_state: SharedAuthState):
        self.issuer, self.identity, self.auth_state = issuer, identity, auth_state
        self.renew_at = 0.0

    def refresh(self) -> None:
        if time.time() < self.renew_at:
            return
        signed = self.issuer.issue(serial=0, peer_id=self.identity.peer_id.to_base58(),
                                   public_key=self.identity.public_key, role="monitor", stage=None,
                                   issued_at=int(time.time()))
        self.auth_state.publish_credential(signed)
        self.renew_at = renew_at(signed.credential)


def start_in_process(*, data_dir: str, issuer, run_id: str, num_stages: int, host_maddrs: list[str],
                     initial_peers: list[str]) -> tuple[MonitorSeat, SelfCredential]:
    """The authorizer's own monitor: identity from `<data_dir>/monitor.key`, a credential it signs
    itself, and its DHT forked now (call before any thread is started)."""
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    identity = load_or_create_identity(os.path.join(data_dir, "monitor.key"))
    trust_dir = tempfile.mkdtemp(prefix=f"agora-monitor-{os.getpid()}-")
    try:
        auth_state = SharedAuthState(trust_dir, run_id=run_id, root_public_key=issuer.public_key)
        credential = SelfCredential(issuer, identity, auth_state)
        credential.refresh()
        seat = MonitorSeat.start(identity=identity, run_id=run_id, num_stages=num_stages,
                                 initial_peers=initial_peers, host_maddrs=host_maddrs, auth_state=auth_state,
                                 trust_dir=trust_dir)
    except BaseException:
        shutil.rmtree(trust_dir, ignore_errors=True)
        raise
    return seat, credential


REMEMBERED_PEER_TIMEOUT_S = 0.5
"""How long the monitor waits for each remembered address to accept a connection at start."""


def remembered_peers(db_url: str, limit: int = 8) -> list[str]:
    """Addresses of recently seen admitted nodes that accept a connection, read with a throwaway
    connection (no pool threads) before the monitor forks; [] on a fresh or unreadable database."""
    from sqlalchemy import create_engine, inspect, select
    from sqlalchemy.pool import NullPool

    from authorizer.schema import ADMITTED, participants

    engine = create_engine(db_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            if not inspect(conn).has_table("participants"):
                return []
            rows = conn.execute(select(participants.c.announce_maddrs).where(participants.c.status == ADMITTED)
                                .order_by(participants.c.last_seen_at.desc()).limit(limit)).scalars()
            remembered = [addr for maddrs in rows for addr in (maddrs or [])[:2] if "/p2p/" in addr]
    except Exception as exc:  # a missing file, a server not up yet: the monitor starts alone
        logger.debug("no remembered peers (%s)", exc)
        return []
    finally:
        engine.dispose()
    alive = [addr for addr in remembered if _accepts_connections(addr)]
    if remembered and not alive:
        logger.info("none of the %d remembered node addresses accepts a connection: the run's nodes are gone, so "
                    "the monitor starts the run's DHT afresh", len(remembered))
    return alive


def _accepts_connections(maddr: str, timeout_s: float = REMEMBERED_PEER_TIMEOUT_S) -> bool:
    """Whether a TCP multiaddr's port accepts a connection now (plain sockets: no thread, before the fork).
    Addresses of other transports are kept as they are."""
    import socket

    parts = maddr.split("/")
    try:
        host = parts[parts.index(next(p for p in parts if p in ("ip4", "ip6", "dns", "dns4", "dns6"))) + 1]
        port = int(parts[parts.index("tcp") + 1])
    except (StopIteration, ValueError, IndexError):
        return True
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False
