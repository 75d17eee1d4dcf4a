"""`agora-node --role monitor`: the health monitor on its own [report 3.6.2.1].

It is admitted through the ordinary HTTP admission path (role `monitor`, the run owner's admin
token as its account token; node/trust.py), joins the DHT with that credential, renews it and
follows the revocation list like any node, and then runs the same loop as the monitor inside the
authorizer (authorizer.monitor.service), writing to `--db`. Pointed at the authorizer's own
PostgreSQL database, its history is what the authorizer's /v1/monitor API and dashboard show
(run the authorizer with --no-monitor then). It announces nothing and serves no handler.

Start-up order: signals and the watchdog first (node/lifecycle.py), admission, then the DHT's fork
before any thread exists, then the database. The readiness line names its peer id and addresses.
SIGINT/SIGTERM stop it within seconds: it leaves the run at the authorizer and stops its DHT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass, field
from typing import Optional, Sequence

from pydantic import SecretStr

from node.flags import OneLineErrorParser, add_model_flags, model_from_args
from protocol.exit_codes import ExitCode, exit_code_table

logger = logging.getLogger("agora.monitor")


def monitor_parser() -> argparse.ArgumentParser:
    from authorizer.monitor.config import MonitorConfig

    p = OneLineErrorParser(
        prog="agora-node --role monitor", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="\n  agora-node --role monitor --authorizer URL --account-token ADMIN_TOKEN --db URL [--interval-s N] "
              "[...]",
        description="Run a training run's health monitor on its own: it joins the DHT, trains nothing, and every\n"
                    "interval records membership, stage health, training progress and alerts in --db. The\n"
                    "authorizer runs one itself unless started with --no-monitor (docs/operations.md).",
        epilog=f"exit codes:\n{exit_code_table()}",
    )
    add_model_flags(p.add_argument_group("monitor"), MonitorConfig, MonitorConfig.model_fields)
    return p


def config_from_args(args: argparse.Namespace):
    from authorizer.monitor.config import MonitorConfig

    return model_from_args(MonitorConfig, args)


@dataclass(frozen=True)
class MonitorTrustSettings:
    """What node.trust.establish_trust reads of a node's settings, for a monitor (and for the
    temporary node `agora-node preempt` admits with the admin token)."""

    authorizer: list[str]
    account_token: SecretStr
    admission_timeout_s: float
    revocation_refresh_s: float
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=list)
    announce_maddrs: list[str] = field(default_factory=list)
    role: str = "monitor"
    config: Optional[str] = None
    insecure_open_run: bool = False


def monitor_main(argv: Sequence[str]) -> int:
    """Run until SIGINT/SIGTERM; returns the exit code. ConfigError propagates (exit 2)."""
    from node.lifecycle import begin_process

    life = begin_process()  # signals and the watchdog before anything slow
    config = config_from_args(monitor_parser().parse_args(list(argv)))
    config.db_url()  # a bad --db fails now, not after admission
    from node.logs import setup_logging

    setup_logging(config.log_level, config.log_format, "monitor")
    return asyncio.run(_run(config, life))


async def _until_stopped(coro, stop: asyncio.Event):
    """`coro`'s result, or None if `stop` is set first (the coroutine is cancelled)."""
    task = asyncio.ensure_future(coro)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


async def _run(config, life) -> int:
    from authorizer.monitor.notify import Notifier
    from authorizer.monitor.seat import MonitorSeat
    from authorizer.monitor.service import HealthMonitor
    from authorizer.monitor.store import MonitorStore
    from authorizer.store import open_engines
    from node.lifecycle import reap_children
    from node.trust import establish_trust
    from protocol.dht import SwarmDHT
    from protocol.identity import load_or_create_identity
    from protocol.readiness import ready_line

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    unregister = life.on_stop(lambda: loop.call_soon_threadsafe(stop.set))
    identity = load_or_create_identity(config.identity)
    if config.identity is None:
        life.remove_on_exit(identity.path)
    settings = MonitorTrustSettings(authorizer=list(config.authorizer), account_token=config.account_token,
                                    admission_timeout_s=config.admission_timeout_s,
                                    revocation_refresh_s=config.revocation_refresh_s,
                                    initial_peers=list(config.initial_peers), host_maddrs=list(config.host_maddrs),
                                    announce_maddrs=list(config.announce_maddrs))
    trust = await _until_stopped(establish_trust(settings, identity, "cpu"), stop)  # type: ignore[arg-type]
    if trust is None:
        unregister()
        return ExitCode.OK
    seat = None
    engines = None
    try:
        life.remove_on_exit(trust.trust_dir)
        run = trust.run
        seat = MonitorSeat.start(identity=identity, run_id=run.run_id, num_stages=run.num_stages,
                                 initial_peers=trust.initial_peers, host_maddrs=trust.host_maddrs,
                                 announce_maddrs=list(config.announce_maddrs), auth_state=trust.auth_state)
        life.note_resources()
        maddrs = await _until_stopped(seat.wait_ready(), stop)
        if maddrs is None:
            return ExitCode.OK
        engines = open_engines(config.db_url())
        store = MonitorStore(*engines)
        await asyncio.to_thread(store.open, run.run_id)
        trust.start_background(stop, SwarmDHT(seat.dht, seat.peer_id))
        monitor = HealthMonitor(run_id=run.run_id, num_stages=run.num_stages, interval_s=config.interval_s,
                                seat=seat, store=store, notifier=Notifier(run.run_id, config.alert_webhook))
        print(ready_line("monitor", peer=seat.peer_id, maddrs=maddrs), flush=True)
        logger.info("health monitor of run %s: a snapshot every %g s into %s", run.run_id, config.interval_s,
                    config.db_url().split("@")[-1])
        await monitor.run(stop)
        return trust.failure_exit_code() or ExitCode.OK
    finally:
        unregister()
        await trust.close()
        if seat is not None:
            await asyncio.to_thread(seat.shutdown)
        if engines is not None:
            for engine in set(engines):
                engine.dispose()
        reap_children(timeout_s=3)
        logger.info("monitor stopped")
