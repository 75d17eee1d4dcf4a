"""`agora-node preempt`: order peers to preempt themselves, from outside the run [report 3.5.3.1].

The operator's failure injection, as the report describes it: a temporary node attaches to the
run's DHT and writes the signal. Here the run's authorizer signs the order with the root key
(POST /v1/admin/preempt, behind the admin token), and this command writes it under the run's
control key from a temporary DHT node admitted as the operator's own (role `monitor`, the admin
token as its account token: an authenticated run's DHT answers admitted nodes only). The target
worker reads it within a couple of seconds and dies at the named moment (roles/worker/health/preemption.py);
with --wait-s this command waits until the target's worker record is gone from the DHT (the
record outlives a killed worker by up to three announce periods).

Output: one line `preempt order_id=<id> peer=<peer> at=<moment> expires_in_s=<n>` per order once
it is stored, and with --wait-s one `gone peer=<peer> after_s=<n>` per target. Every failure is one
line on stderr and an exit code from protocol/exit_codes.py: 2 bad flags, authorizer or DHT
unreachable, admin token refused; 4 the authorizer refused the temporary node; 7 --wait-s ran out
with the target still announced; 1 the authorizer failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from typing import Optional

from node.flags import OneLineErrorParser
from protocol.control_orders import MAX_ORDER_TTL_S, PreemptMoment, PreemptOrderOut, SignedPreemptOrder
from protocol.errors import AgoraError, ConfigError
from protocol.exit_codes import ExitCode

PROG = "agora-node preempt"
USAGE = """
  agora-node preempt --authorizer URL --admin-token TOKEN --peer PEER_ID [PEER_ID ...] --at MOMENT
                     [--initial-peers MADDR ...] [--ttl-s N] [--wait-s N]"""
STORE_RETRY_S = 0.5


class PreemptFailed(AgoraError):
    """The authorizer answered with a failure of its own (exit 1)."""

    exit_code = ExitCode.FAILURE


class WaitTimedOut(AgoraError):
    exit_code = ExitCode.WAIT_TIMED_OUT


def preempt_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog=PROG, usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Order one peer of an authenticated run to preempt itself (simulated spot preemption, for\n"
                    "failure injection): the authorizer signs the order with the run's root key and this command\n"
                    "writes it into the run's DHT. The worker dies by SIGKILL at the named moment.",
        epilog="moments: now; chunk_send (sending its parameter parts to the reducers in an averaging round);\n"
               "reduced_send (sending averaged parts back, as a reducer; a non-reducer dies at chunk_send);\n"
               "forward / backward (mid compute of its next forward / backward batch).\n"
               "exit codes: 0 order written (and with --wait-s the peer gone); 2 bad flags, authorizer or DHT\n"
               "unreachable, admin token refused; 4 the authorizer turned the temporary node away; 7 --wait-s ran\n"
               "out with the peer still announced; 1 the authorizer failed.",
    )
    p.add_argument("--authorizer", required=True, metavar="URL", help="the run's authorizer, e.g. http://host:8000")
    p.add_argument("--admin-token", required=True, metavar="TOKEN", help="the run owner's admin token")
    p.add_argument("--peer", required=True, nargs="+", metavar="PEER_ID",
                   help="the targets' base58 peer ids (peer= in a node's readiness line, or /v1/admin/participants); "
                        "several are ordered at once, from one temporary node")
    p.add_argument("--at", required=True, choices=[m.value for m in PreemptMoment], metavar="MOMENT",
                   help="when it dies: " + ", ".join(m.value for m in PreemptMoment))
    p.add_argument("--initial-peers", nargs="+", default=[], metavar="MADDR",
                   help="DHT peers to join through, besides the bootstrap peers the authorizer hands out")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/0"], metavar="MADDR",
                   help="where the temporary node listens (the authorizer dials it once; default: /ip4/0.0.0.0/tcp/0)")
    p.add_argument("--ttl-s", type=float, default=300.0, metavar="SECONDS",
                   help=f"how long the order stays valid, at most {MAX_ORDER_TTL_S:.0f} (default: 300)")
    p.add_argument("--wait-s", type=float, default=0.0, metavar="SECONDS",
                   help="wait up to this long for the target's worker record to leave the DHT (default: 0, no wait)")
    p.add_argument("--timeout-s", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for the authorizer, admission and the DHT (default: 60)")
    return p


def _check(args: argparse.Namespace) -> None:
    if not 0 < args.ttl_s <= MAX_ORDER_TTL_S:
        raise ConfigError(f"--ttl-s must lie in (0, {MAX_ORDER_TTL_S:.0f}]")
    if args.wait_s < 0 or args.timeout_s <= 0:
        raise ConfigError("--wait-s must not be negative and --timeout-s must be positive")


def request_order(url: str, admin_token: str, peer: str, moment: str, ttl_s: float,
                  timeout_s: float) -> PreemptOrderOut:
    """POST /v1/admin/preempt; every failure becomes ConfigError (exit 2) or PreemptFailed (exit 1)."""
    import httpx

    base = url.rstrip("/")
    try:
        response = httpx.post(f"{base}/v1/admin/preempt", json={"peer_id": peer, "moment": moment, "ttl_s": ttl_s},
                              headers={"Authorization": f"Bearer {admin_token}"}, timeout=timeout_s)
    except httpx.InvalidURL:
        raise ConfigError(f"--authorizer {url[:120]!r} is not a URL; expected e.g. http://host:8000") from None
    except httpx.HTTPError as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"cannot reach the authorizer at {base} ({reason}); check --authorizer") from None
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code == 200 and isinstance(body, dict):
        try:
            return PreemptOrderOut.model_validate_json(response.content)
        except ValueError:
            raise PreemptFailed(f"the authorizer at {base} answered an order this node cannot read; upgrade "
                                f"agora-node to the authorizer's version") from None
    error = body.get("error", {}) if isinstance(body, dict) else {}
    message = str(error.get("message", "")) if isinstance(error, dict) else ""
    if response.status_code == 401:
        raise ConfigError(f"the authorizer at {base} refused the admin token; pass the run owner's --admin-token")
    if response.status_code == 404:
        raise ConfigError(f"{base} has no /v1/admin/preempt: not an agora-node authorizer, or an older version")
    if 400 <= response.status_code < 500:
        raise ConfigError(f"the authorizer refused the order ({response.status_code}: {message[:200]})")
    raise PreemptFailed(f"the authorizer at {base} failed ({response.status_code}: {message[:200]}); retry")


def preempt_main(argv: list[str]) -> int:
    """`agora-node preempt ...`; returns the exit code, printing one line on any failure."""
    from node.lifecycle import begin_process

    args = preempt_parser().parse_args(argv)
    life = begin_process()  # the watchdog reaps the temporary DHT node however this ends
    logging.basicConfig(level=logging.ERROR)
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)  # its retries are not the operator's business
    try:
        _check(args)
        orders = [request_order(args.authorizer, args.admin_token, peer, args.at, args.ttl_s, args.timeout_s)
                  for peer in dict.fromkeys(args.peer)]
        return asyncio.run(_write(args, orders, life))
    except (ConfigError, AgoraError) as exc:
        code = ExitCode.USAGE if isinstance(exc, ConfigError) else getattr(exc, "exit_code", ExitCode.FAILURE)
        print(f"{PROG}: error: {exc}", file=sys.stderr, flush=True)
        return int(code)
    except KeyboardInterrupt:
        return ExitCode.INTERRUPTED


async def _write(args: argparse.Namespace, orders: list[PreemptOrderOut], life) -> int:
    from node.lifecycle import reap_children
    from pydantic import SecretStr

    from node.monitor_cli import MonitorTrustSettings
    from node.swarm import join_swarm_until_stopped
    from node.trust import establish_trust
    from protocol.identity import load_or_create_identity

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    unregister = life.on_stop(lambda: loop.call_soon_threadsafe(stop.set))
    identity = load_or_create_identity(None)
    life.remove_on_exit(identity.path)
    settings = MonitorTrustSettings(authorizer=[args.authorizer], account_token=SecretStr(args.admin_token),
                                    admission_timeout_s=args.timeout_s, revocation_refresh_s=3600.0,
                                    initial_peers=list(args.initial_peers), host_maddrs=list(args.host_maddrs))
    trust = membership = None
    try:
        trust = await _bounded(establish_trust(settings, identity, "cpu"), stop, args.timeout_s,  # type: ignore[arg-type]
                               "admission of the temporary DHT node")
        life.remove_on_exit(trust.trust_dir)
        membership = await join_swarm_until_stopped(
            identity=identity, run_id=trust.run.run_id, num_stages=trust.run.num_stages,
            initial_peers=trust.initial_peers, host_maddrs=trust.host_maddrs, announce_maddrs=[],
            bootstrap_timeout_s=args.timeout_s, stop=stop, client_mode=True, auth_state=trust.auth_state,
            authorizer=trust.dht_authorizer)
        life.note_resources()
        for out in orders:
            await _store(membership.dht, out, stop, args.timeout_s)
            print(f"preempt order_id={out.order_id} peer={out.peer_id} at={out.moment.value} "
                  f"expires_in_s={max(0, out.expires_at - time.time()):.0f}", flush=True)
        if args.wait_s > 0:
            deadline = time.monotonic() + args.wait_s
            for out in orders:
                await _wait_gone(membership.dht, identity, out, trust.run.num_stages,
                                 max(0.0, deadline - time.monotonic()), stop)
        return ExitCode.OK
    finally:
        unregister()
        if trust is not None:
            await trust.close()
        if membership is not None:
            await asyncio.to_thread(membership.shutdown)
        if os.path.exists(identity.path):
            os.unlink(identity.path)
        reap_children(timeout_s=3)


async def _bounded(coro, stop: asyncio.Event, timeout_s: float, what: str):
    task = asyncio.ensure_future(coro)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({task, stopping}, timeout=timeout_s + 5, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    if stop.is_set():
        raise KeyboardInterrupt
    raise ConfigError(f"{what} took longer than {timeout_s:g}s; retry with a larger --timeout-s")


async def _store(dht, out: PreemptOrderOut, stop: asyncio.Event, timeout_s: float) -> None:
    """Store the order under its target's subkey until a DHT peer accepts it: a node that has just
    joined may not know its neighbours yet."""
    from hivemind.utils import get_dht_time

    value = SignedPreemptOrder.from_dht_value(out.record).to_dht_value()
    deadline = time.monotonic() + timeout_s
    while True:
        future = dht.store(out.key, value, expiration_time=min(out.expires_at, get_dht_time() + MAX_ORDER_TTL_S),
                           subkey=out.subkey, return_future=True)
        try:
            if await asyncio.wait_for(asyncio.wrap_future(future), 10):
                return
        except asyncio.TimeoutError:
            future.cancel()
        if stop.is_set():
            raise KeyboardInterrupt
        if time.monotonic() > deadline:
            raise ConfigError(f"no DHT peer accepted order {out.order_id} within {timeout_s:g}s; check that the run's "
                              f"nodes are up (--initial-peers) and retry")
        await asyncio.sleep(STORE_RETRY_S)


async def _wait_gone(dht, identity, out: PreemptOrderOut, num_stages: int, wait_s: float,
                     stop: asyncio.Event) -> None:
    from protocol.dht import SwarmDHT
    from protocol.dht_schema import WorkerRecord, workers_key

    swarm = SwarmDHT(dht, identity.peer_id.to_base58(), timeout_s=5)
    started = time.monotonic()
    while True:
        found = await asyncio.gather(*(swarm.get(workers_key(out.run_id, s), WorkerRecord)
                                       for s in range(num_stages)), return_exceptions=True)
        present: Optional[bool] = None
        if not any(isinstance(f, BaseException) for f in found):
            present = any(out.peer_id in records for records in found)
        elapsed = time.monotonic() - started
        if present is False:
            print(f"gone peer={out.peer_id} after_s={elapsed:.1f}", flush=True)
            return
        if elapsed > wait_s:
            raise WaitTimedOut(f"peer {out.peer_id} still announces a worker record {wait_s:g}s after order "
                               f"{out.order_id} ({out.moment.value}); it may not have reached that moment yet "
                               f"(no averaging round or batch since), or is not a worker of this run")
        if stop.is_set():
            raise KeyboardInterrupt
        await asyncio.sleep(0.5)
