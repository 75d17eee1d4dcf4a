"""Joining the swarm: start hivemind's DHT with our record validators, reach the initial peers,
and get a P2P handle on the same libp2p daemon for our own streams; and the two checks that a
second live process with our identity is not already out there (its port, its peer id).

hivemind forks its DHT process. The fork happens on the event loop's thread, the process's main
thread, so the child's parent-death signal is tied to a thread that lives as long as the node
(node/lifecycle.py); only the wait for the bootstrap runs beside it, and a stop signal ends that
wait at once by killing the half-started DHT.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import hivemind
from hivemind.utils.auth import AuthorizerBase

from node.lifecycle import StopRequested, kill_tree
from protocol.auth_state import SharedAuthState
from protocol.dht_schema import Phase, WorkerRecord, schema_for_run, workers_key
from protocol.errors import ConfigError
from protocol.identity import Identity
from protocol.records import SignedRecordValidator
from roles.periodic import wait_any

logger = logging.getLogger(__name__)

JOIN_GRACE_S = 10.0
"""How long past its bootstrap timeout one join attempt may take (the DHT process's own start
included) before it is given up: hivemind's timeouts run inside that process, and a DHT whose
initial peer dialled our peer id back and reached another process with the same key was seen
waiting for good (a copied key, on a loaded machine)."""
LIVE_PROBE_TIMEOUT_S = 3.0
"""How long to try dialing an address our own peer id was announced at: a live process answers
in milliseconds, a dead one never."""


@dataclass
class SwarmMembership:
    dht: hivemind.DHT
    validator: SignedRecordValidator
    maddrs: list[str]

    def shutdown(self) -> None:
        if self.dht.is_alive():
            self.dht.shutdown()
        self.dht.join(timeout=10)
        if self.dht.is_alive():
            self.dht.kill()


def _new_dht(*, identity: Identity, run_id: str, num_stages: int, initial_peers: list[str], host_maddrs: list[str],
             announce_maddrs: list[str], bootstrap_timeout_s: float, client_mode: bool,
             auth_state: Optional[SharedAuthState], authorizer: Optional[AuthorizerBase], start: bool
             ) -> tuple[hivemind.DHT, SignedRecordValidator]:
    if mp.get_start_method(allow_none=True) != "fork":
        mp.set_start_method("fork", force=True)  # hivemind requires fork
    validator = SignedRecordValidator(identity, schema_for_run(run_id, num_stages), run_id=run_id, auth=auth_state)
    dht = hivemind.DHT(
        initial_peers=initial_peers or None,
        start=start,
        record_validators=[validator],
        identity_path=identity.path,
        # hivemind's duplicate-identity probe only understands RSA keys; ours are Ed25519
        check_if_identity_free=False,
        host_maddrs=host_maddrs,
        announce_maddrs=announce_maddrs or None,
        client_mode=client_mode,
        authorizer=authorizer,
        bootstrap_timeout=bootstrap_timeout_s,
        startup_timeout=bootstrap_timeout_s,
        daemon=True,
    )
    return dht, validator


def _bootstrap_failed(error: BaseException, initial_peers: list[str], host_maddrs: list[str],
                      bootstrap_timeout_s: float, earlier: tuple[str, ...] = ()) -> ConfigError:
    """The error for a join that gave up; `earlier`: what the attempts before the last one said
    (the hint about a duplicate identity holds if any of them could not be dialled back)."""
    message = _first_line(error)
    if initial_peers:
        hint = ""
        if any("can't access this node" in m for m in (message, *earlier)):
            # The initial peer could not dial us back: a firewall, or our peer id answers elsewhere
            # (seen when a copy of a live node's key joins before the duplicate check can run).
            hint = ("; or another process already runs with this identity: stop it or start this one with "
                    "another --identity")
        return ConfigError(
            f"could not reach any initial peer within {bootstrap_timeout_s:.0f}s ({message}); "
            "check the --initial-peers multiaddrs (they must include /p2p/<peer id>) and that those nodes are up"
            f"{hint}")
    return ConfigError(f"could not start the libp2p node on {host_maddrs}: {message}; check --host-maddrs")


def _membership(dht: hivemind.DHT, validator: SignedRecordValidator,
                own_maddrs: Optional[list[str]] = None) -> SwarmMembership:
    """`own_maddrs`: the node's addresses when it knows them better than its daemon (a relayed
    node: node/reachability.py)."""
    if own_maddrs is not None:
        maddrs = list(own_maddrs)
    else:
        try:
            maddrs = [str(m) for m in dht.get_visible_maddrs()]
        except ValueError:  # hivemind's "No multiaddrs found": the caller says what that means
            maddrs = []
    logger.info("joined the swarm as %s (pid %d)", dht.peer_id, os.getpid())
    return SwarmMembership(dht=dht, validator=validator, maddrs=maddrs)


def join_swarm(*, identity: Identity, run_id: str, num_stages: int, initial_peers: list[str],
               host_maddrs: list[str], announce_maddrs: list[str], bootstrap_timeout_s: float,
               client_mode: bool = False, auth_state: Optional[SharedAuthState] = None,
               authorizer: Optional[AuthorizerBase] = None) -> SwarmMembership:
    """Start the DHT and bootstrap, blocking (for tools such as the demo; a node uses
    `join_swarm_until_stopped`). Raises ConfigError (exit 2) if no initial peer answers."""
    try:
        dht, validator = _new_dht(identity=identity, run_id=run_id, num_stages=num_stages,
                                  initial_peers=initial_peers, host_maddrs=host_maddrs,
                                  announce_maddrs=announce_maddrs, bootstrap_timeout_s=bootstrap_timeout_s,
                                  client_mode=client_mode, auth_state=auth_state, authorizer=authorizer, start=True)
    except Exception as exc:
        raise _bootstrap_failed(exc, initial_peers, host_maddrs, bootstrap_timeout_s) from exc
    return _membership(dht, validator)


async def join_swarm_until_stopped(*, identity: Identity, run_id: str, num_stages: int, initial_peers: list[str],
                                   host_maddrs: list[str], announce_maddrs: list[str], bootstrap_timeout_s: float,
                                   stop: asyncio.Event, client_mode: bool = False,
                                   auth_state: Optional[SharedAuthState] = None,
                                   authorizer: Optional[AuthorizerBase] = None,
                                   before_fork: Optional[Callable[[], Awaitable[None]]] = None,
                                   after_fork: Optional[Callable[[], None]] = None,
                                   own_maddrs: Optional[list[str]] = None) -> SwarmMembership:
    """Start the DHT and bootstrap. Raises ConfigError (exit 2) if no initial peer answers within
    `bootstrap_timeout_s` and StopRequested if `stop` is set first (the half-started DHT is killed
    with its p2pd). Peers that refuse connections are retried until the deadline: nodes admitted
    together are handed each other as bootstrap peers and may still be starting. `before_fork` is
    awaited right before each fork of the DHT process and `after_fork` called right after it (the
    node's preload thread stops across the fork: node/preload.py). `own_maddrs`: the addresses the
    node is reached at, where its daemon cannot tell them (a relayed node)."""
    deadline = time.monotonic() + bootstrap_timeout_s
    delay_s = 1.0
    earlier: list[str] = []
    while True:
        left = deadline - time.monotonic()
        try:
            return await _join_once(
                identity=identity, run_id=run_id, num_stages=num_stages, initial_peers=initial_peers,
                host_maddrs=host_maddrs, announce_maddrs=announce_maddrs, bootstrap_timeout_s=max(left, 1.0),
                stop=stop, client_mode=client_mode, auth_state=auth_state, authorizer=authorizer,
                before_fork=before_fork, after_fork=after_fork, own_maddrs=own_maddrs)
        except _BootstrapFailed as failed:
            left = deadline - time.monotonic()
            if not initial_peers or left <= delay_s:
                raise _bootstrap_failed(failed.error, initial_peers, host_maddrs, bootstrap_timeout_s,
                                        tuple(earlier)) from failed.error
            earlier.append(_first_line(failed.error))
            logger.warning("initial peers not reachable yet (%s); retrying in %.0f s, giving up in %.0f s",
                           _first_line(failed.error), delay_s, left)
            if await wait_any(stop, timeout=delay_s):
                raise StopRequested("while joining the swarm") from None
            delay_s = min(delay_s * 2, 8.0)


def _done_event(task: asyncio.Future) -> asyncio.Event:
    done = asyncio.Event()
    task.add_done_callback(lambda _: done.set())
    return done


class _BootstrapFailed(Exception):
    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _first_line(error: BaseException) -> str:
    return str(error).splitlines()[0] if str(error) else type(error).__name__


async def _join_once(*, identity: Identity, run_id: str, num_stages: int, initial_peers: list[str],
                     host_maddrs: list[str], announce_maddrs: list[str], bootstrap_timeout_s: float,
                     stop: asyncio.Event, client_mode: bool, auth_state: Optional[SharedAuthState],
                     authorizer: Optional[AuthorizerBase],
                     before_fork: Optional[Callable[[], Awaitable[None]]] = None,
                     after_fork: Optional[Callable[[], None]] = None,
                     own_maddrs: Optional[list[str]] = None) -> SwarmMembership:
    dht, validator = _new_dht(identity=identity, run_id=run_id, num_stages=num_stages, initial_peers=initial_peers,
                              host_maddrs=host_maddrs, announce_maddrs=announce_maddrs,
                              bootstrap_timeout_s=bootstrap_timeout_s, client_mode=client_mode,
                              auth_state=auth_state, authorizer=authorizer, start=False)
    if before_fork is not None:
        pausing = asyncio.ensure_future(before_fork())
        if await wait_any(stop, _done_event(pausing)) and stop.is_set():
            pausing.cancel()
            raise StopRequested("while joining the swarm")
    dht.start()
    if after_fork is not None:
        after_fork()
    loop = asyncio.get_running_loop()
    ready: asyncio.Future = loop.create_future()

    def settle(error: Optional[BaseException]) -> None:
        if not ready.done():
            ready.set_result(error)

    def wait_until_ready() -> None:  # a daemon thread: it may block forever on a killed DHT
        try:
            dht.wait_until_ready()
            error = None
        except BaseException as exc:
            error = exc
        try:
            loop.call_soon_threadsafe(settle, error)
        except RuntimeError:  # the loop is gone: the node stopped meanwhile
            pass

    threading.Thread(target=wait_until_ready, name="dht-bootstrap", daemon=True).start()
    loop.add_reader(dht.sentinel, settle, RuntimeError("the DHT process died during bootstrap"))
    stopping = asyncio.ensure_future(stop.wait())
    limit_s = bootstrap_timeout_s + JOIN_GRACE_S
    try:
        await asyncio.wait({ready, stopping}, timeout=limit_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
        loop.remove_reader(dht.sentinel)
    if stop.is_set():
        error: Optional[BaseException] = StopRequested("while joining the swarm")
    elif not ready.done():
        error = _BootstrapFailed(TimeoutError(f"the DHT process did not finish joining within {limit_s:.0f}s"))
    else:
        failure = ready.result()
        error = None if failure is None else _BootstrapFailed(failure)
    if error is None:
        return _membership(dht, validator, own_maddrs)
    await asyncio.to_thread(kill_tree, dht.pid)
    dht.join(1)
    raise error


# ---- duplicate identity ----


def claim_identity(path: str, life) -> None:
    """Hold an exclusive lock on the identity file for as long as this process lives: a second
    live process with the same key on this machine is refused at once, while the kernel drops
    the lock of a dead one (SIGKILL included), so a restart is never mistaken for a duplicate."""
    import fcntl

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"duplicate identity: {path} is in use by another live agora-node on this machine; "
                          "stop it or start this one with another --identity") from None
    life.keep_from_children(fd)  # held until exit; children must not keep it past the node


def _fixed_ports(maddrs: list[str]) -> list[tuple[str, str, int]]:
    """(transport, ip, port) of every listen address with a fixed port."""
    found = []
    for maddr in maddrs:
        parts = maddr.strip("/").split("/")
        for i in range(len(parts) - 3):
            family, ip, transport, port = parts[i:i + 4]
            if family in ("ip4", "ip6") and transport in ("tcp", "udp") and port.isdigit() and int(port) > 0:
                found.append((transport, ip, int(port)))
    return found


def check_ports_free(host_maddrs: list[str]) -> None:
    """Refuse a listen port another process holds. libp2p binds with SO_REUSEPORT, so a second node
    on a live node's port would silently share it (and its connections); a bind without it fails
    while any listener is there, and succeeds over the remains of a dead one."""
    for transport, ip, port in _fixed_ports(host_maddrs):
        family = socket.AF_INET6 if ":" in ip else socket.AF_INET
        kind = socket.SOCK_STREAM if transport == "tcp" else socket.SOCK_DGRAM
        with socket.socket(family, kind) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT of a dead node is no owner
            try:
                sock.bind((ip, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"duplicate node: {transport} port {port} on {ip} is already in use by another process "
                        f"(another agora-node with this --host-maddrs?); stop it or choose another port") from None
                if exc.errno == errno.EADDRNOTAVAIL:
                    raise ConfigError(f"--host-maddrs: {ip} is not an address of this machine") from None
                raise ConfigError(f"--host-maddrs: cannot listen on {transport} {ip}:{port}: {exc.strerror}") from None


async def read_worker_records(swarm, run_id: str, num_stages: int) -> list[dict[str, WorkerRecord]]:
    """Every stage's worker records, read once for the checks a node makes before it joins (a
    stage whose read failed counts as having none)."""
    found = await asyncio.gather(*(swarm.get(workers_key(run_id, s), WorkerRecord) for s in range(num_stages)),
                                 return_exceptions=True)
    return [records if isinstance(records, dict) else {} for records in found]


async def check_identity_not_live(me: str, records: list[dict[str, WorkerRecord]], own_maddrs: list[str]) -> None:
    """Refuse to serve if another live process holds our key: a worker record under our own peer
    id whose addresses answer a dial, made from a throwaway libp2p identity (one cannot dial
    oneself). A dead process's record does not answer, and our new records supersede it."""
    from hivemind.p2p import P2P, PeerID

    from protocol.relays import transport_address
    from protocol.transport import dial

    own = {transport_address(m) for m in own_maddrs}
    addresses: list[str] = []
    for found in records:
        if me in found:
            addresses += [m for m in found[me].maddrs if transport_address(m) not in own]
    if not addresses:
        return
    probe = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        await dial(probe, PeerID.from_base58(me), addresses, LIVE_PROBE_TIMEOUT_S)
    except Exception as exc:  # no answer: the remains of a dead process, superseded by our records
        logger.info("an earlier process with this identity announced %s and does not answer (%s); replacing "
                    "its records", addresses, type(exc).__name__)
        return
    finally:
        await probe.shutdown()
    raise ConfigError(f"duplicate identity: peer {me} is already live in the run at {', '.join(addresses)}; "
                      "stop that node or start this one with another --identity")


def check_same_model(run, records: list[dict[str, WorkerRecord]], me: str) -> None:
    """Refuse to join a run whose workers train another model than this node's run config
    describes: in an open run every node loads its own file, and two constructions or subspace
    seeds exchange coordinates of the same shape. Refused when more live workers announce one
    other model digest than announce ours; a minority of others is only logged (trainers keep
    them off their routes), so one misconfigured node cannot lock the run's own nodes out."""
    ours, others, constructions = 0, collections.Counter(), {}
    for stage_records in records:
        for peer, record in stage_records.items():
            if peer == me or record.phase == Phase.LEAVING or not record.model_digest:
                continue
            if record.trains_other_model(run.model_digest):
                others[record.model_digest] += 1
                constructions[record.model_digest] = record.construction
            else:
                ours += 1
    if not others:
        return
    digest, count = others.most_common(1)[0]
    theirs = constructions[digest]
    what = (f"construction {theirs!r}, this config {run.model.construction!r}"
            if theirs and theirs != run.model.construction else "the model section or the stage layout differs")
    if count <= ours:
        logger.warning("%d live worker(s) of run %s train another model (digest %s: %s); %d train this one (%s), "
                       "so this node joins, and trainers keep the others off their routes",
                       sum(others.values()), run.run_id, digest, what, ours, run.model_digest)
        return
    raise ConfigError(f"run {run.run_id}: {count} live worker(s) train another model than this node's run config "
                      f"describes (model digest {digest} against this config's {run.model_digest}: {what}); every "
                      f"node of a run must load the same run config, so start this node with the run owner's file")
