"""`agora-node --role relay`: one of the run's relays, for contributors behind NAT.

It is admitted through the ordinary HTTP admission path (role `relay`, the run owner's admin
token as its account token; node/trust.py), and the authorizer then lists it to every node it
admits. It starts p2pd's circuit-relay-v2 service with the limits of its flags
(roles/relay/service.py), hands passes to nodes that show a credential and drops everyone else
(roles/relay/gate.py), renews its own credential and follows the revocation list.

Start-up order: signals and the watchdog first (node/lifecycle.py), admission (the authorizer
dials it back like any node), then its daemon. The readiness line names its peer id and the
addresses nodes dial it at. SIGINT/SIGTERM stop it within seconds; nodes that held a slot on it
keep the ones they hold on the run's other relays.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import Sequence

from node.flags import OneLineErrorParser, add_model_flags, model_from_args
from node.monitor_cli import MonitorTrustSettings, _until_stopped
from protocol.exit_codes import ExitCode, exit_code_table

logger = logging.getLogger("agora.relay")


def relay_parser() -> argparse.ArgumentParser:
    from roles.relay.config import RelayConfig

    p = OneLineErrorParser(
        prog="agora-node --role relay", formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="\n  agora-node --role relay --authorizer URL --account-token ADMIN_TOKEN "
              "[--host-maddrs /ip4/0.0.0.0/tcp/4001] [--identity PATH] [...]",
        description="Run one of a training run's relays: a public node through which contributors behind a home\n"
                    "router (NAT) serve. Only the run's admitted nodes may reserve a slot or open a connection\n"
                    "through it. Run it on a machine with a public address and an open TCP port\n"
                    "(docs/operations.md, 'Relays'), and keep its --identity: the circuit addresses nodes\n"
                    "announce name its peer id.",
        epilog=f"exit codes:\n{exit_code_table()}",
    )
    add_model_flags(p.add_argument_group("relay"), RelayConfig, RelayConfig.model_fields)
    return p


def config_from_args(args: argparse.Namespace):
    from roles.relay.config import RelayConfig

    return model_from_args(RelayConfig, args)


def relay_main(argv: Sequence[str]) -> int:
    """Run until SIGINT/SIGTERM; returns the exit code. ConfigError propagates (exit 2)."""
    from node.lifecycle import begin_process

    life = begin_process()
    config = config_from_args(relay_parser().parse_args(list(argv)))
    from node.logs import setup_logging

    setup_logging(config.log_level, config.log_format, "relay")
    return asyncio.run(_run(config, life))


async def _refresh_revocations(trust, stop: asyncio.Event) -> None:
    """The relay joins no DHT: it reads the revocation list from the authorizer alone."""
    from roles.periodic import every

    async def refresh() -> None:
        try:
            trust._apply(await trust.client.revocations())
        except Exception as exc:  # an authorizer outage: keep the list in force
            logger.debug("revocations unavailable: %s", exc)
        trust.authenticator.revocations = trust.auth_state.revocations()

    await every(trust.revocation_refresh_s, refresh, stop, name="revocation refresh")


async def _run(config, life) -> int:
    from node.lifecycle import reap_children
    from node.swarm import check_ports_free
    from node.trust import establish_trust
    from protocol.identity import load_or_create_identity
    from protocol.readiness import ready_line
    from roles.relay.metrics import RelayCollector
    from roles.relay.service import RelayService

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    unregister = life.on_stop(lambda: loop.call_soon_threadsafe(stop.set))
    check_ports_free(list(config.host_maddrs))  # a second relay on a live one's port: a clear error, not "unreachable"
    identity = load_or_create_identity(config.identity)
    if config.identity is None:
        life.remove_on_exit(identity.path)
    settings = MonitorTrustSettings(authorizer=list(config.authorizer),
                                    account_token=config.account_token,
                                    admission_timeout_s=config.admission_timeout_s,
                                    revocation_refresh_s=config.revocation_refresh_s,
                                    host_maddrs=list(config.host_maddrs),
                                    announce_maddrs=list(config.announce_maddrs), role="relay")
    trust = await _until_stopped(establish_trust(settings, identity, "cpu"), stop)  # type: ignore[arg-type]
    if trust is None:
        unregister()
        return ExitCode.OK
    service = None
    tasks: list[asyncio.Task] = []
    try:
        life.remove_on_exit(trust.trust_dir)
        service = RelayService(config, identity.path, trust.host_maddrs, trust.authenticator)
        maddrs = await _until_stopped(service.start(), stop)
        if maddrs is None:
            return ExitCode.OK
        metrics_url = None
        if config.metrics_port is not None:
            from prometheus_client import CollectorRegistry, start_http_server

            registry = CollectorRegistry()
            registry.register(RelayCollector(service))
            server, _ = start_http_server(config.metrics_port, config.metrics_host, registry)
            metrics_url = f"http://{config.metrics_host}:{server.server_port}/metrics"
        if trust.keeper is not None:
            tasks.append(asyncio.create_task(trust.keeper.run(stop), name="credential-keeper"))
            tasks.append(asyncio.create_task(_refresh_revocations(trust, stop), name="revocations"))
        print(ready_line("relay", peer=service.peer_id, maddrs=maddrs, metrics=metrics_url), flush=True)
        logger.info("relay of run %s at %s: at most %d reservations, %d circuits per node, %s and %g s per "
                    "circuit; peers without a credential are dropped after %g s", trust.run.run_id,
                    ", ".join(maddrs), config.max_reservations, config.max_circuits_per_peer,
                    _size(config.circuit_max_bytes), config.circuit_max_duration_s, config.pass_grace_s)
        await service.run(stop)
        return trust.failure_exit_code() or ExitCode.OK
    finally:
        unregister()
        stop.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if service is not None:
            await service.close()
        await trust.close()
        reap_children(timeout_s=3)
        logger.info("relay stopped")


def _size(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"
