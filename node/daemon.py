"""One `agora-node` process from start to exit: load config, check the memory plan, join the
swarm, print the readiness line, run the role until a signal, and leave cleanly."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
from typing import Optional

from node.devices import pick_device
from node.lifecycle import reap_children
from node.settings import NodeSettings
from protocol.errors import ConfigError
from protocol.identity import load_or_create_identity
from roles.model.config import RunConfig, load_run_config
from roles.model.memory_plan import plan_memory
from roles.worker.errors import WorkerLeftStage

logger = logging.getLogger("agora.node")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_LEFT_STAGE = 3
"""A worker failed 2 of its last 3 averaging rounds and left its stage [report 3.3.1.6]."""


def _check_stage(settings: NodeSettings, run: RunConfig) -> int:
    if settings.stage is None:
        raise ConfigError(f"a worker needs --stage N with N in 0..{run.num_stages - 1}")
    if not 0 <= settings.stage < run.num_stages:
        raise ConfigError(
            f"--stage {settings.stage} is out of range: run {run.run_id} has stages 0..{run.num_stages - 1}"
        )
    return settings.stage


def check_memory(settings: NodeSettings, run: RunConfig, stage: int, device: str) -> str:
    """Compute the worker's memory plan before loading anything; refuse to start if it cannot fit."""
    import psutil

    from node.devices import device_free_bytes

    plan = plan_memory(run, stage, device, settings.max_batch)
    host_free = psutil.virtual_memory().available
    device_free = device_free_bytes(device)
    fits = plan.fits(device_free, host_free)
    lines = [plan.describe(), f"free: device {_gib(device_free)}, host {_gib(host_free)} -> "
             f"{'fits' if fits else 'does NOT fit'}"]
    report = "\n".join(lines)
    if settings.dry_run:
        return report
    if not fits:
        best = plan.max_batch_that_fits(device_free, host_free)
        hint = (f"pass --max-batch {best}" if best >= 1 else
                "this stage does not fit this device at any batch size; choose another --stage or --device")
        free = (f"{_gib(device_free)} on {device} and {_gib(host_free)} host RAM are free" if device_free is not None
                else f"{_gib(host_free)} host RAM is free (the CPU computes in host RAM)")
        raise ConfigError(
            f"stage {stage} at --max-batch {settings.max_batch} needs {_gib(plan.device_bytes)} on {device} "
            f"and {_gib(plan.host_bytes)} host RAM, but {free}; {hint}"
        )
    return report


def _gib(n: Optional[int]) -> str:
    return "unknown" if n is None else f"{n / 2**30:.2f} GiB"


def run_node(settings: NodeSettings) -> int:
    """Run one node; returns the process exit code. ConfigError propagates to the CLI (exit 2)."""
    device = pick_device(settings.device) if settings.role == "worker" else "cpu"
    if settings.config is not None and (settings.authorizer is None or settings.dry_run):
        run = load_run_config(settings.config)
        stage = _check_stage(settings, run) if settings.role == "worker" else None
        if stage is not None:
            report = check_memory(settings, run, stage, device)
            if settings.dry_run:
                print(report)
                return EXIT_OK
            logger.info("memory plan for stage %d on %s:\n%s", stage, device, report)
    elif settings.dry_run:
        raise ConfigError("--dry-run needs --config and --stage (the authorizer is not asked)")
    identity = load_or_create_identity(settings.identity)
    temporary_identity = settings.identity is None
    try:
        return asyncio.run(_serve(settings, device, identity))
    finally:
        if temporary_identity and os.path.exists(identity.path):
            os.unlink(identity.path)
        reap_children()


async def _serve(settings: NodeSettings, device: str, identity) -> int:
    import torch

    from node.swarm import join_swarm
    from node.trust import establish_trust
    from protocol.dht import SwarmDHT

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    trust = await establish_trust(settings, identity, device)
    run = trust.run
    stage = None
    try:
        if settings.role == "worker":
            stage = trust.stage if trust.authenticated else _check_stage(settings, run)
            if trust.authenticated:
                logger.info("memory plan for stage %d on %s:\n%s", stage, device,
                            check_memory(settings, run, stage, device))
        membership = await asyncio.to_thread(
            join_swarm, identity=identity, run_id=run.run_id, num_stages=run.num_stages,
            initial_peers=trust.initial_peers, host_maddrs=trust.host_maddrs,
            announce_maddrs=settings.announce_maddrs, bootstrap_timeout_s=settings.bootstrap_timeout_s,
            auth_state=trust.auth_state, authorizer=trust.dht_authorizer,
        )
    except BaseException:
        await trust.close()
        raise
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    role = None
    code = EXIT_OK
    try:
        p2p = await membership.dht.replicate_p2p()
        swarm = SwarmDHT(membership.dht, identity.peer_id.to_base58())
        role = _build_role(settings, run, stage, device, swarm, p2p, membership.maddrs, trust.authenticator)
        trust.start_background(stop, swarm)
        if hasattr(role, "start"):
            await role.start()
        print(f"agora-node ready role={settings.role} stage={stage if stage is not None else '-'} "
              f"peer={swarm.peer_id} maddrs={','.join(membership.maddrs)}", flush=True)
        await role.run(stop)
    except WorkerLeftStage as exc:
        logger.error("%s; exiting with code %d", exc, EXIT_LEFT_STAGE)
        code = EXIT_LEFT_STAGE
    except Exception:
        logger.exception("%s failed", settings.role)
        code = EXIT_FAILURE
    finally:
        if role is not None:
            try:
                await asyncio.wait_for(role.shutdown(), 60)
            except Exception:
                logger.exception("shutdown of the %s was not clean", settings.role)
            print(json.dumps({"summary": role.summary()}), flush=True)
        await trust.close()
        await asyncio.to_thread(membership.shutdown)
    return trust.failure_exit_code() or code


def _build_role(settings, run, stage, device, swarm, p2p, maddrs, authenticator):
    if settings.role == "worker":
        from roles.worker.config import WorkerConfig
        from roles.worker.role import WorkerRole

        config = WorkerConfig(stage=stage, device=device, max_batch=settings.max_batch,
                              announce_period_s=settings.announce_period_s,
                              reducer=settings.reducer, state_source=settings.state_source,
                              checkpoint_dir=settings.checkpoint_dir, checkpoint_period_s=settings.checkpoint_period_s,
                              test_init_seed_offset=settings.test_init_seed_offset,
                              test_averaging_stall_s=settings.test_averaging_stall_s)
        return WorkerRole(config, run, swarm, p2p, maddrs, authenticator)
    from roles.trainer.config import TrainerConfig
    from roles.trainer.role import TrainerRole

    config = TrainerConfig(
        lanes=settings.lanes, data=settings.data, tokenizer=settings.tokenizer, max_samples=settings.max_samples,
        shard_index=settings.shard_index, num_shards=settings.num_shards,
        discovery_period_s=settings.discovery_period_s, announce_period_s=settings.announce_period_s,
        request_timeout_s=settings.request_timeout_s,
    )
    return TrainerRole(config, run, swarm, p2p, authenticator)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("hivemind", "asyncio", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, getattr(logging, level.upper())))
