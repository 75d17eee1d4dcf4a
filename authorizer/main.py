"""Run the authorizer: open the store and root key, serve HTTP, print one readiness line, and
exit 0 on SIGTERM/SIGINT.

`run_authorizer(config)` is what `agora-node --role authorizer` calls (node/authorizer_cli.py
builds the config from flags and the data directory). The authorizer listens on port 8000 unless `--port` says otherwise; with
`--port 0` the OS picks a free port, which is printed in the readiness line and kept in the data
directory for the next start (authorizer.config), so nothing has to guess a free port:

    agora-node ready role=authorizer stage=- peer=- url=http://127.0.0.1:<port>

The listening socket is bound here, before anything slow, so a port in use is one sentence and
exit code 2 (protocol.exit_codes), never uvicorn's own bind error and its traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import os
import signal
import socket
import sys
from typing import Optional, Sequence

from pydantic import ValidationError

from authorizer.config import AuthorizerConfig, save_stored_settings
from authorizer.policy import Policy, default_policy, load_policy_file, merge_policy
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode
from protocol.readiness import ready_line

logger = logging.getLogger("agora.authorizer")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = ExitCode.OK, ExitCode.FAILURE, ExitCode.USAGE
"""Kept importable for older callers; protocol.exit_codes.ExitCode is the table."""


def bind_socket(host: str, port: int) -> socket.socket:
    """The authorizer's listening socket, bound (not yet listening); a ConfigError sentence if the
    address cannot be had. SO_REUSEADDR only (never SO_REUSEPORT): a second authorizer on the same
    port must fail, not share it."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host} is not an address of this machine ({exc.strerror}); "
                          f"pass e.g. --host 127.0.0.1, or --host 0.0.0.0 to listen on every interface") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"{host}:{port} is already in use (another authorizer, or another program); stop "
                              f"it, or pass --port N to serve on another port") from exc
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another --host/--port") from exc
    return sock


def build_policy(config: AuthorizerConfig, run, stored: Optional[dict]) -> Policy:
    """Stored policy (or the run's defaults), then the policy file, then explicit flags."""
    policy = default_policy(run)
    if stored is not None:
        try:
            policy = Policy.model_validate(stored).for_run(run)
        except (ValidationError, ConfigError) as exc:
            logger.warning("stored policy is unusable (%s); starting from defaults", exc)
    if config.policy_file:
        policy = merge_policy(policy, load_policy_file(config.policy_file), source=f"policy file {config.policy_file}")
    policy = merge_policy(policy, config.policy_overrides(run.num_stages), source="command line")
    return policy.for_run(run)


def rate_limits(config: AuthorizerConfig):
    """The config's rate limits as authorizer.ratelimit takes them."""
    from authorizer.ratelimit import RateLimits

    return RateLimits(
        join_rate_per_s=config.source_join_rate_per_s, join_burst=config.source_join_burst,
        request_rate_per_s=config.source_request_rate_per_s, request_burst=config.source_request_burst,
        node_rate_per_s=config.node_request_rate_per_s, node_burst=config.node_request_burst,
        max_sources=config.rate_limit_sources,
        evidence_rate_per_s=config.evidence_rate_per_min / 60, evidence_burst=config.evidence_burst,
    )


def _admin_token(config: AuthorizerConfig) -> str:
    from authorizer.keys import load_or_create_admin_token

    if config.admin_token is not None:
        token = config.admin_token.get_secret_value()
        if len(token) < 16:
            raise ConfigError("--admin-token must be at least 16 characters; use a long random token")
        return token
    path = config.admin_token_file or os.path.join(config.data_dir, "admin.token")
    token = load_or_create_admin_token(path)
    logger.info("admin token in %s", path)
    return token


def _uvicorn_server(config):
    """uvicorn's Server without its own signal capture: it re-raises the signal after shutdown,
    which would turn a clean SIGTERM into exit status -15. We handle the signals ourselves."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server(config)


async def _serve(config: AuthorizerConfig) -> int:
    # Everything a bad flag or file can break is checked before the heavy imports (hivemind
    # pulls in torch: seconds), so a mistake is reported at once.
    from authorizer.keys import load_or_create_root_key
    from protocol.run_config import load_run_config

    run = load_run_config(config.run_config)
    config.policy_overrides(run.num_stages)
    if config.policy_file:
        load_policy_file(config.policy_file)
    db_url = config.db_url()
    sock = bind_socket(config.host, config.port)
    try:
        return await _serve_on(config, run, db_url, sock, load_or_create_root_key)
    finally:
        sock.close()


async def _serve_on(config: AuthorizerConfig, run, db_url: str, sock: socket.socket, load_or_create_root_key) -> int:
    key, created = load_or_create_root_key(config.resolved_key_path())
    if created:
        logger.warning("created a new root key at %s; back it up: peers trust credentials it signs",
                       config.resolved_key_path())
    admin_token = _admin_token(config)

    from authorizer.issuer import CredentialIssuer

    issuer = CredentialIssuer(key, run.run_id, config.credential_ttl_s)
    # The health monitor's DHT forks now, before the store's threads and uvicorn exist
    # (authorizer.monitor.seat); it is stopped, with its children, however this function ends.
    seat = _start_monitor_seat(config, run, db_url, issuer)
    try:
        return await _serve_with(config, run, db_url, sock, issuer, admin_token, seat)
    finally:
        if seat is not None:
            await asyncio.to_thread(seat[0].shutdown)


def _start_monitor_seat(config: AuthorizerConfig, run, db_url: str, issuer):
    """(seat, self-signed credential) of the in-process health monitor, or None with --no-monitor."""
    if config.no_monitor:
        logger.info("health monitor off (--no-monitor)")
        return None
    from authorizer.monitor.seat import remembered_peers, start_in_process

    # the caller (node/authorizer_cli.py) has installed node.lifecycle.guard_children, so a SIGKILLed
    # authorizer leaves no DHT process, p2pd or socket behind
    return start_in_process(data_dir=config.data_dir, issuer=issuer, run_id=run.run_id, num_stages=run.num_stages,
                            host_maddrs=config.monitor_host_maddrs, initial_peers=remembered_peers(db_url))


def _health_monitor(config: AuthorizerConfig, run, seat, store, authorizer):
    """The in-process monitor's loop on the authorizer's database, renewing its own credential and
    taking the revocation list from the authorizer itself before each snapshot."""
    from authorizer.monitor.notify import Notifier
    from authorizer.monitor.service import HealthMonitor
    from authorizer.monitor.store import MonitorStore

    seat, credential = seat
    monitor_store = MonitorStore(store.write_engine, store.read_engine)
    monitor_store.open(run.run_id)

    async def before_snapshot() -> None:
        credential.refresh()
        try:
            seat.auth_state.publish_revocations(await authorizer.revocations())
        except Exception as exc:  # a database hiccup: the list in force stays, the next snapshot retries
            logger.debug("revocations for the monitor not refreshed: %s", exc)

    return HealthMonitor(run_id=run.run_id, num_stages=run.num_stages, interval_s=config.monitor_interval_s,
                         seat=seat, store=monitor_store, notifier=Notifier(run.run_id, config.alert_webhook),
                         before_snapshot=before_snapshot)


async def _run_health_monitor(monitor, authorizer, stop: asyncio.Event) -> None:
    """Wait for the monitor's DHT, hand its addresses to admitted nodes, then snapshot until `stop`."""
    try:
        maddrs = await monitor.seat.wait_ready()
    except Exception as exc:
        logger.error("the health monitor's DHT did not start (%s); the authorizer runs without a monitor "
                     "(check --monitor-host-maddrs, or pass --no-monitor)", exc)
        authorizer.monitor = None
        return
    authorizer.monitor_maddrs = maddrs
    logger.info("health monitor %s listening on %s, a snapshot every %g s", monitor.seat.peer_id,
                " ".join(maddrs), monitor.interval_s)
    await monitor.run(stop)


async def _serve_with(config: AuthorizerConfig, run, db_url: str, sock: socket.socket, issuer, admin_token: str,
                      seat) -> int:
    import uvicorn

    from authorizer.admission import accounts_line
    from authorizer.app import create_app
    from authorizer.ratelimit import Limiter
    from authorizer.reachability import Dialer
    from authorizer.rejections import RejectionLedger
    from authorizer.service import PROOF_WINDOW_S, Authorizer
    from authorizer.store import Store

    store = Store(db_url, sqlite_synchronous=config.sqlite_synchronous)
    monitor_task: Optional[asyncio.Task] = None
    monitor_stop = asyncio.Event()
    try:
        store.open(run.run_id, run.num_stages)
        policy = build_policy(config, run, store.load_policy())
        store.save_policy_now(policy.model_dump(mode="json"))
        authorizer = Authorizer(
            run=run, store=store, issuer=issuer, policy=policy, admin_token=admin_token,
            dialer=Dialer(config.reachability_timeout_s), bootstrap_peers=config.bootstrap_peers,
            limiter=Limiter(rate_limits(config), run_id=run.run_id, proof_window_s=PROOF_WINDOW_S),
            rejections=RejectionLedger(detail_rate_per_s=config.rejection_detail_rate_per_s,
                                       detail_burst=config.rejection_detail_burst,
                                       max_sources=config.rate_limit_sources),
        )
        monitor = None
        if seat is not None:
            monitor = authorizer.monitor = _health_monitor(config, run, seat, store, authorizer)
            authorizer.monitor_store = monitor.store
            await monitor.load()
        server = _uvicorn_server(uvicorn.Config(
            create_app(authorizer, admin_token, pushgateway_url=config.pushgateway), log_config=None,
            access_log=False, lifespan="on", timeout_graceful_shutdown=10, server_header=False,
        ))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if not server.started:
            with contextlib.suppress(BaseException):
                task.result()  # retrieved, so asyncio never prints it as "never retrieved"
            raise ConfigError(f"the authorizer could not start serving on {config.host}:{config.port}; "
                              f"see the lines above, then fix --host/--port or the data directory")
        # Start-up leaves a large heap (hivemind imports torch); a full garbage collection over it
        # stalled every request for ~250 ms. Frozen objects are never scanned again.
        if os.environ.get("AGORA_NO_GC_FREEZE") is None:
            gc.collect()
            gc.freeze()
        host, port = sock.getsockname()[:2]
        save_stored_settings(config.data_dir, {"host": config.host, "port": port, "db": config.db,
                                               "run_config": config.run_config})
        shown = f"[{host}]" if ":" in host else host
        print(ready_line("authorizer", url=f"http://{shown}:{port}"), flush=True)
        logger.info("authorizer of run %s serving on http://%s:%d (db %s; settings kept in %s)", run.run_id, shown,
                    port, db_url.split("@")[-1], os.path.join(config.data_dir, "authorizer.json"))
        logger.info("%s", accounts_line(policy))
        if monitor is not None:
            monitor_task = asyncio.create_task(_run_health_monitor(monitor, authorizer, monitor_stop),
                                               name="health-monitor")
        await task
        logger.info("stopped")
        return ExitCode.OK
    finally:
        if monitor_task is not None:
            monitor_stop.set()
            try:
                await asyncio.wait_for(monitor_task, timeout=10)
            except (asyncio.TimeoutError, Exception):  # a snapshot stuck on the DHT, stopped next anyway
                monitor_task.cancel()
        await store.aclose()


def run_authorizer(config: AuthorizerConfig) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code. ConfigError propagates (exit 2)."""
    # The event loop shares the GIL with the threads that run reads and PostgreSQL writes. Each
    # socket call of the loop releases the GIL and then waits out another thread's switch interval
    # (5 ms by default) to get it back, which under load put responses behind 5 ms waits.
    sys.setswitchinterval(float(os.environ.get("AGORA_SWITCH_INTERVAL_S", "0.0005")))
    try:
        import uvloop

        runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except (ImportError, AttributeError):
        runner = asyncio.Runner()
    with runner:
        try:
            return runner.run(_serve(config))
        except SystemExit as exc:  # uvicorn exits on other startup failures
            raise ConfigError(f"cannot serve on {config.host}:{config.port} (exit {exc.code}); "
                              f"see the lines above and choose another --host/--port") from exc
