"""One `agora-node` process from start to exit: load config, check everything that can be checked
before joining (memory plan, trainer data, listen ports, identity), be admitted, join the swarm,
print the readiness line, run the role until a signal, and leave cleanly.

Every phase waits on the same stop signal (node/lifecycle.py): a first SIGINT/SIGTERM abandons
admission, bootstrap or state loading at once and drains a running role; a second one kills the
children and exits with ExitCode.INTERRUPTED.
"""

from __future__ import annotations

import asyncio
import faulthandler
import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Awaitable, Optional, TypeVar

from node.devices import device_free_bytes, pick_device
from node.lifecycle import ProcessLifecycle, StopRequested, begin_process, exit_now, reap_children
from node.settings import NodeSettings
from node.summary import human_summary, process_uptime_s
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode
from protocol.identity import load_or_create_identity
from protocol.readiness import ready_line
from protocol.run_config import RunConfig, load_run_config
from roles.model.memory_plan import plan_memory
from roles.worker.errors import WorkerLeftStage

logger = logging.getLogger("agora.node")
T = TypeVar("T")

EXIT_OK = ExitCode.OK
EXIT_FAILURE = ExitCode.FAILURE
EXIT_USAGE = ExitCode.USAGE
EXIT_LEFT_STAGE = ExitCode.LEFT_STAGE

SHUTDOWN_TIMEOUT_S = 60.0
"""Longest a role gets to drain; a second signal cuts it short."""
SHUTDOWN_STACKS_AFTER_S = 25.0
"""A drain still running after this long writes every thread's stack to the log (for the report)."""


def _check_stage(settings: NodeSettings, run: RunConfig) -> int:
    if settings.worker.stage is None:
        raise ConfigError(f"a worker needs --stage N with N in 0..{run.num_stages - 1}")
    if not 0 <= settings.worker.stage < run.num_stages:
        raise ConfigError(
            f"--stage {settings.worker.stage} is out of range: run {run.run_id} has stages 0..{run.num_stages - 1}"
        )
    return settings.worker.stage


@dataclass
class MemoryCheck:
    report: str
    """The plan and the free memory, several lines (what --dry-run prints)."""
    problem: Optional[str]
    """One sentence if the plan does not fit, naming the --max-batch that would."""


def check_memory(settings: NodeSettings, run: RunConfig, stage: int, device: str) -> MemoryCheck:
    """Compute the worker's memory plan before loading anything. With --gpu-memory the device's
    free memory is the given size (planning for a card that is not here); with --host-memory the
    host's free RAM is (planning for a machine that is not this one)."""
    import psutil

    plan = plan_memory(run, stage, device, settings.worker.max_batch)
    host_free = settings.worker.host_memory or psutil.virtual_memory().available
    device_free = device_free_bytes(device, settings.worker.gpu_memory)
    fits = plan.fits(device_free, host_free)
    report = "\n".join([plan.describe(), f"free: device {_gib(device_free)}, host {_gib(host_free)} -> "
                                         f"{'fits' if fits else 'does NOT fit'}"])
    if fits:
        return MemoryCheck(report, None)
    best = plan.max_batch_that_fits(device_free, host_free)
    hint = (f"pass --max-batch {best}" if best >= 1 else
            "this stage does not fit this device at any batch size; choose another --stage or --device")
    free = (f"{_gib(device_free)} on {device} and {_gib(host_free)} host RAM are free" if device_free is not None
            else f"{_gib(host_free)} host RAM is free (the CPU computes in host RAM)")
    return MemoryCheck(report, f"stage {stage} at --max-batch {settings.worker.max_batch} needs {_gib(plan.device_bytes)} "
                               f"on {device} and {_gib(plan.host_bytes)} host RAM, but {free}; {hint}")


CPU_MAX_BATCH = 8
"""--max-batch on the CPU when not given: a CPU gains little from coalescing more."""
AUTO_MAX_BATCH_CAP = 256
"""The most a GPU worker coalesces when --max-batch is not given."""


def resolve_max_batch(settings: NodeSettings, run: RunConfig, stage: int, device: str) -> NodeSettings:
    """`settings` with --max-batch set: as given, else 8 on the CPU, else what the stage's memory
    plan fits on the card (MemoryPlan.auto_max_batch), at most target_batch_size (a step's samples
    are all a batch can hold) and 256. Logged, since it decides the worker's memory use."""
    if settings.worker.max_batch is not None:
        return settings
    if not device.startswith("cuda"):
        batch = CPU_MAX_BATCH
    else:
        plan = plan_memory(run, stage, device, 1)
        free = device_free_bytes(device, settings.worker.gpu_memory)
        batch = plan.auto_max_batch(free, min(run.target_batch_size, AUTO_MAX_BATCH_CAP)) or 1
        logger.info("--max-batch not given: stage %d coalesces up to %d sample(s) on %s (%s free; the memory plan's "
                    "largest batch in half of it, at most target_batch_size %d and %d)", stage, batch, device,
                    _gib(free), run.target_batch_size, AUTO_MAX_BATCH_CAP)
    return settings.model_copy(update={"worker": settings.worker.model_copy(update={"max_batch": batch})})


def _require_fit(settings: NodeSettings, run: RunConfig, stage: int, device: str) -> None:
    check = check_memory(settings, run, stage, device)
    if check.problem is not None:
        raise ConfigError(check.problem)
    logger.info("memory plan for stage %d on %s:\n%s", stage, device, check.report)


def _pending_tasks() -> str:
    """The event loop's unfinished tasks and where each waits, for the report of a hung drain."""
    here = asyncio.current_task()
    described = []
    for task in asyncio.all_tasks():
        if task is here or task.done():
            continue
        frames = task.get_stack(limit=1)
        where = f"{frames[-1].f_code.co_filename}:{frames[-1].f_lineno}" if frames else "?"
        described.append(f"{task.get_name()} at {where}")
    return "; ".join(sorted(described)) or "none"


def _gib(n: Optional[int]) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"


def _check_trainer_data(settings: NodeSettings, run: Optional[RunConfig]) -> None:
    """Missing or empty data fails before anything is started; too little for this shard as soon
    as the run's sequence length is known (before admission with --config, else right after)."""
    from roles.trainer.data import trainer_data, validate_data

    if run is None:
        validate_data(settings.trainer.data, settings.trainer.tokenizer, None, settings.trainer.shard_index,
                      settings.trainer.num_shards)
        return
    validate_data(trainer_data(settings.trainer.data, run), settings.trainer.tokenizer, run.seq_len,
                  settings.trainer.shard_index, settings.trainer.num_shards, vocab_size=run.model.vocab_size,
                  manifest_sha256=run.data.manifest_sha256)


def run_node(settings: NodeSettings) -> int:
    """Run one node and end the process with its exit code once everything is closed (a dry run
    returns its code instead). ConfigError propagates to the CLI (exit 2)."""
    life = begin_process()
    role = settings.role
    dry_run = role == "worker" and settings.worker.dry_run
    if settings.worker.host_memory is not None and not dry_run:
        raise ConfigError("--host-memory plans for a machine that is not this one; add --dry-run "
                          "(a running worker checks this machine's free RAM)")
    device = pick_device(settings.worker.device, planning=settings.worker.gpu_memory is not None,
                         dry_run=dry_run) if role == "worker" else "cpu"
    has_authorizer = bool(settings.authorizer)
    run = None
    if settings.config is not None and (not has_authorizer or dry_run):
        run = load_run_config(settings.config)
    if role == "worker" and run is not None:
        stage = _check_stage(settings, run)
        settings = resolve_max_batch(settings, run, stage, device)
        if dry_run:
            check = check_memory(settings, run, stage, device)
            print(check.report, flush=True)
            if check.problem is not None:
                raise ConfigError(check.problem)
            return ExitCode.OK
        _require_fit(settings, run, stage, device)
    elif dry_run:
        raise ConfigError("--dry-run needs --config and --stage (the authorizer is not asked)")
    if role == "trainer":
        _check_trainer_data(settings, run)
    from node.swarm import check_ports_free, claim_identity

    check_ports_free(settings.host_maddrs)
    identity = load_or_create_identity(settings.identity)
    temporary_identity = settings.identity is None
    if temporary_identity:
        life.remove_on_exit(identity.path)
    else:
        claim_identity(identity.path, life)
    try:
        if life.stop.is_set():
            raise StopRequested("before starting")
        code = asyncio.run(_serve(settings, device, identity, life))
    except StopRequested as exc:
        logger.info("stopped %s, %.1fs after %s", exc, time.monotonic() - (life.signal_at or time.monotonic()),
                    life.signal_name or "the signal")
        code = ExitCode.OK
    finally:
        if temporary_identity and os.path.exists(identity.path):
            os.unlink(identity.path)
        reap_children()
    exit_now(code)


async def until_stopped(awaitable: Awaitable[T], stop: asyncio.Event, phase: str,
                        cancel_timeout_s: float = 1.5) -> T:
    """Await `awaitable` unless `stop` is set first: then cancel it, give it `cancel_timeout_s` to
    clean up (a queued admission tells the authorizer it leaves), and raise StopRequested."""
    task = asyncio.ensure_future(awaitable)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        stopping.cancel()
    if task.done():
        return task.result()
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=cancel_timeout_s)
    if not done:
        logger.warning("%s did not stop within %.1fs; leaving it", phase, cancel_timeout_s)
    elif not task.cancelled() and task.exception() is None and hasattr(task.result(), "close"):
        await task.result().close()  # it finished as we cancelled it: release what it holds
    raise StopRequested(phase)


async def _serve(settings: NodeSettings, device: str, identity, life: ProcessLifecycle) -> int:
    import torch

    from node.reachability import apply_daemon_flags
    from node.swarm import join_swarm_until_stopped
    from node.trust import establish_trust

    from node.metrics.service import MetricsService
    from node.preload import Preload

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    unregister = life.on_stop(lambda: loop.call_soon_threadsafe(stop.set))
    metrics = MetricsService.from_settings(settings, identity.peer_id.to_base58(), device)
    # the role's imports run while admission and the DHT bootstrap wait on the network (node/preload.py)
    preload = Preload.for_role(settings.role)
    try:
        preload.resume()
        if metrics is not None:
            await metrics.start()  # a port in use is a ConfigError before anything joins
        trust = await until_stopped(establish_trust(settings, identity, device), stop, "while waiting for admission")
        run = trust.run
        stage = None
        try:
            if settings.role == "worker":
                stage = trust.stage if trust.authenticated else _check_stage(settings, run)
                if trust.authenticated:
                    settings = resolve_max_batch(settings, run, stage, device)
                    _require_fit(settings, run, stage, device)
            elif trust.authenticated:
                _check_trainer_data(settings, run)
            if metrics is not None:
                metrics.admitted(run.run_id, stage, _credential_expiry(trust))
            plan = trust.reach_plan(settings.relay)
            apply_daemon_flags(plan)
            membership = await join_swarm_until_stopped(
                identity=identity, run_id=run.run_id, num_stages=run.num_stages,
                initial_peers=trust.initial_peers, host_maddrs=trust.host_maddrs,
                announce_maddrs=plan.announce_maddrs or settings.announce_maddrs,
                bootstrap_timeout_s=settings.bootstrap_timeout_s,
                stop=stop, auth_state=trust.auth_state, authorizer=trust.dht_authorizer,
                before_fork=preload.pause, after_fork=preload.forked,
                own_maddrs=plan.own_maddrs(identity.peer_id.to_base58()) if plan.relayed else None,
            )
            if not membership.maddrs:
                await asyncio.to_thread(membership.shutdown)
                raise ConfigError(
                    f"libp2p reports no address this node listens at (--host-maddrs {' '.join(trust.host_maddrs)}); "
                    "listen on an address of this machine, e.g. --host-maddrs /ip4/0.0.0.0/tcp/31337")
            logger.info("%s", plan.describe(membership.maddrs))
        except BaseException:
            await trust.close()
            raise
        life.note_resources()
        if settings.torch_threads:
            torch.set_num_threads(settings.torch_threads)
        return await _run_role(settings, run, stage, device, identity, trust, membership, stop, life, metrics,
                               preload)
    finally:
        unregister()
        if metrics is not None:
            await metrics.close()


def _credential_expiry(trust):
    """When the node's current credential expires (it is renewed in place), or None in open runs."""
    if trust.keeper is None:
        return None
    return lambda: trust.keeper.credential.credential.expires_at


def _push_token(identity, trust):
    """A fresh push token per push, derived from the current credential; None in open runs."""
    def token():
        if trust.authenticator is None:
            return None
        credential = trust.authenticator.current_credential()
        if credential is None:
            return None
        from protocol.metrics_token import make_push_token

        return make_push_token(identity, credential)
    return token


async def _run_role(settings, run, stage, device, identity, trust, membership, stop, life, metrics=None,
                    preload=None) -> int:
    from node.priority import lower_priority
    from node.reachability import wait_for_relay_slot
    from node.swarm import check_identity_not_live, check_same_model, read_worker_records
    from protocol.dht import SwarmDHT

    role = live = None
    code = ExitCode.OK
    try:
        p2p = await membership.dht.replicate_p2p()
        life.note_resources()
        plan = trust.reach_plan(settings.relay)
        # every relay of the run, also those down at admission: they may come back
        trust.start_relay_pass(stop, p2p, list(dict.fromkeys([*plan.relays, *trust.relays])),
                               relayed=plan.relayed)
        if plan.relayed:
            # a slot on any relay, before the node announces itself: else nobody could reach it
            await until_stopped(
                wait_for_relay_slot(identity.peer_id.to_base58(), plan.relays, stop, greet=trust.greet_relays,
                                    timeout_s=settings.relay_slot_timeout_s),
                stop, "while waiting for a relay slot")
        swarm = SwarmDHT(membership.dht, identity.peer_id.to_base58())
        if metrics is not None:
            metrics.joined(swarm)
        workers = await until_stopped(read_worker_records(swarm, run.run_id, run.num_stages), stop,
                                      "while reading the run's workers")
        if settings.identity is not None:
            await until_stopped(check_identity_not_live(swarm.peer_id, workers, membership.maddrs),
                                stop, "while checking the identity")
        check_same_model(run, workers, swarm.peer_id)
        if preload is not None:  # before the role forks hivemind's averager, no thread of ours may import
            await until_stopped(preload.finish(), stop, "while importing the role")
        role = _build_role(settings, run, stage, device, swarm, p2p, membership.maddrs, trust.authenticator,
                           trust.auth_state, designated_reducer=trust.reducer, identity=identity,
                           report_evidence=_evidence_reporter(trust.client, identity))
        if metrics is not None:
            metrics.attach(role)
        trust.start_background(stop, swarm)
        if hasattr(role, "start"):
            await until_stopped(role.start(), stop, "while joining the stage")
        life.note_resources()
        print(ready_line(settings.role, stage=stage, peer=swarm.peer_id, maddrs=membership.maddrs,
                         metrics=metrics.url if metrics is not None else None), flush=True)
        lowered = lower_priority(settings.serve_nice)
        if lowered:
            logger.info("serving at a lower CPU priority (%s)", lowered)
        if metrics is not None:
            metrics.serving()
            # after the role started: pushes run in a thread, and hivemind forks before any thread exists
            metrics.start_push(_push_token(identity, trust))
        if settings.role == "trainer":
            from node.live_display import start_trainer_display

            live = start_trainer_display(role)  # a rich view when stdout is a terminal, else None
        await role.run(stop)
    except StopRequested as exc:
        logger.info("stopped %s", exc)
    except ConfigError:
        raise
    except WorkerLeftStage as exc:  # self-termination [report 3.3.1.6]: a rule's sentence, no traceback
        code = getattr(exc, "exit_code", ExitCode.LEFT_STAGE)
        logger.error("%s; leaving cleanly (records withdrawn, queued work handed back), then exiting with code %d",
                     exc, code)
    except Exception:
        logger.exception("%s failed", settings.role)
        code = ExitCode.FAILURE
    finally:
        if live is not None:
            live.stop()
        if metrics is not None:
            metrics.draining()
        if role is not None:
            began = time.monotonic()
            # A drain that hangs says where: every thread's stack goes to the log once it is late.
            faulthandler.dump_traceback_later(SHUTDOWN_STACKS_AFTER_S, exit=False)
            try:
                await asyncio.wait_for(role.shutdown(), SHUTDOWN_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.error("the %s did not drain within %.0fs; leaving anyway; tasks still running: %s",
                             settings.role, SHUTDOWN_TIMEOUT_S, _pending_tasks())
            except Exception:
                logger.exception("shutdown of the %s was not clean", settings.role)
            finally:
                faulthandler.cancel_dump_traceback_later()
            logger.debug("%s drained in %.2fs", settings.role, time.monotonic() - began)
            summary = role.summary()
            print(json.dumps({"summary": summary}), flush=True)
            logger.info("%s", human_summary(settings.role, summary, uptime_s=process_uptime_s()))
        await trust.close()
        await asyncio.to_thread(membership.shutdown)
        if life.signal_at is not None:
            logger.info("left %.1fs after %s", time.monotonic() - life.signal_at, life.signal_name)
    return trust.failure_exit_code() or code


def _evidence_reporter(client, identity):
    """How a trainer (a spot check's evidence) or a worker (a poisoned SparseLoCo fragment's or
    AsyncSPARTA part's) hands signed evidence to the run's authorizer: the verdict, or `rejected`
    with its reason logged (None in an open run: there is nobody to tell)."""
    if client is None:
        return None
    from node.admission import EvidenceRefused

    async def report(evidence) -> str:
        try:
            return (await client.report_evidence(evidence, identity)).verdict
        except EvidenceRefused as exc:
            logger.warning("%s", exc)
            return "rejected" if exc.reason else f"refused_{exc.code}"
    return report


def _build_role(settings, run, stage, device, swarm, p2p, maddrs, authenticator, auth_state=None,
                designated_reducer: bool = False, identity=None, report_evidence=None):
    """The role, given its own settings section with what the node resolved (stage, device, and
    whether the authorizer designated it a reducer)."""
    if settings.role == "worker":
        from roles.worker.role import WorkerRole

        if designated_reducer and not settings.worker.reducer:
            logger.info("the authorizer designated this worker a reducer of stage %s", stage)
        config = settings.worker.model_copy(update={"stage": stage, "device": device,
                                                    "reducer": settings.worker.reducer or designated_reducer})
        return WorkerRole(config, run, swarm, p2p, maddrs, authenticator, auth_state, identity=identity,
                          report_evidence=report_evidence)
    from roles.trainer.role import TrainerRole

    return TrainerRole(settings.trainer, run, swarm, p2p, authenticator, report_evidence=report_evidence)


def configure_logging(level: str, fmt: str = "human", role: str = "node") -> None:
    from node.logs import setup_logging

    setup_logging(level, fmt, role)
