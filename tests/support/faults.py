"""Faults injected into a real worker from outside (tests only): a failing device, NaN gradients,
failing forwards, a stalled or poisoning averaging peer, a SparseLoCo replica that sends garbage
or dies mid-round, slow state chunks, other initial weights, a worker too old to chain. The
shipped code has no flag, option or hook for any of them: `install` wraps the product's own
methods and functions in this process, before the node starts, and tests/support/faults_node.py
is the launcher a test starts a node through (`faults_prefix`).

Wrapped on the class or module, as the adversary harness does (tests/support/adversary.py), so
every instance built afterwards has the fault, and the averager process, forked from the worker
after `install`, inherits the averaging faults with the rest of the worker's memory.

    device_fault_after_batches=N  after N batches every batch raises a CUDA-like error
    nan_gradients_after_steps=N   from local step N on, every step's accumulated gradients are NaN
    fail_forwards=N               the first N forward requests are answered with an internal error
    without_chain=1               act as a worker older than worker-to-worker routing (no agora/v1/chain)
    init_seed_offset=K            start from other initial weights than the run's seed gives
    averaging_stall_s=S           stall mid-round in every all-reduce for S seconds
    averaging_poison=nan|huge     send NaN or huge parts to the other reducers in every all-reduce
    sparseloco_poison=huge|garbage  send fragments scaled 1e4, or with a flipped byte
    sparseloco_exit=before_send:N|after_send:N  SIGKILL in SparseLoCo round N, before or after the
                                  fragment left
    state_chunk_delay_s=S         pause S seconds before serving each state chunk (a slow download)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import posixpath
import re
import signal
import time
from typing import Callable

import torch

logger = logging.getLogger(__name__)

_ORIGINALS: dict[tuple[object, str], object] = {}


def _wrap(owner, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace `owner.name` (a class's method or a module's function) with `make(original)`."""
    original = owner.__dict__[name]
    _ORIGINALS[(owner, name)] = original
    setattr(owner, name, functools.wraps(original)(make(original)))


def _device_fault(after: str) -> None:
    from roles.worker.serving.runtime import StageRuntime

    limit = int(after)

    def make(observed):
        def faulty_observed(self, compute, payloads):
            def faulty(batch):
                if 0 < limit <= self.counters["forward_batches"] + self.counters["backward_batches"]:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered (test fault: "
                                       "device_fault_after_batches)")
                return compute(batch)
            return observed(self, faulty, payloads)
        return faulty_observed

    _wrap(StageRuntime, "_observed", make)


def _nan_gradients(after: str) -> None:
    from roles.worker.steps.optimizer import StageOptimizer

    first = int(after)

    def make(step):
        def nan_step(self, *args, **kwargs):
            # The runtime steps with the optimizer's lock held; the lock is re-entrant.
            if self.samples_accumulated > 0 and 0 < first <= self.local_step:
                with self.lock, torch.no_grad():
                    for p in self._params:
                        if p.grad is not None:
                            p.grad.fill_(float("nan"))
            return step(self, *args, **kwargs)
        return nan_step

    _wrap(StageOptimizer, "step", make)


def _fail_forwards(count: str) -> None:
    from protocol.errors import ErrorCode, ProtocolError
    from roles.worker.serving.handlers import WorkerHandlers

    left = [int(count)]

    def make(forward):
        async def failing_forward(self, peer_id, body):
            if left[0] > 0:
                left[0] -= 1
                raise ProtocolError("test fault: this forward fails on purpose", ErrorCode.INTERNAL)
            return await forward(self, peer_id, body)
        return failing_forward

    _wrap(WorkerHandlers, "_forward", make)


def _without_chain(value: str) -> None:
    from protocol import version
    from protocol.transport import RpcServer
    from roles.worker.role import WorkerRole

    if value not in ("1", "true", "yes"):
        return

    def make_record(record):
        def old_record(self):
            return record(self).model_copy(update={"chain": False})
        return old_record

    def make_add(add_handler):
        async def add_but_chain(self, name, *args, **kwargs):
            if name == version.CHAIN:
                return None
            return await add_handler(self, name, *args, **kwargs)
        return add_but_chain

    _wrap(WorkerRole, "_record", make_record)
    _wrap(RpcServer, "add_handler", make_add)


def _init_seed_offset(offset: str) -> None:
    from roles.worker import role

    def make(build):
        def build_other(run, stage, **kwargs):
            return build(run.model_copy(update={"seed": run.seed + int(offset)}), stage, **kwargs)
        return build_other

    _wrap(role, "build_stage_model", make)


def _averaging_stall(seconds: str) -> None:
    from roles.worker.averaging.allreduce import InstrumentedRunner

    stall_s = float(seconds)

    def make(after, where):
        async def stalled(self):
            await after(self)
            if not getattr(self, "_stall_logged", False):
                self._stall_logged = True
                logger.warning("test fault: stalling this peer mid-round %s (while %s) for %.0fs",
                               self.label, where, stall_s)
            await asyncio.sleep(stall_s)
        return stalled

    _wrap(InstrumentedRunner, "after_part_sent", lambda after: make(after, "sending"))
    _wrap(InstrumentedRunner, "after_part_reduced", lambda after: make(after, "reducing"))


POISONS = {
    "nan": lambda part: part.fill_(float("nan")),
    "huge": lambda part: part.mul_(1e6).add_(1e3),
}
"""What a poisoning averaging sender sends instead of a part."""


def _averaging_poison(poison: str) -> None:
    from roles.worker.averaging.allreduce import InstrumentedRunner

    if poison not in POISONS:
        raise ValueError(f"averaging_poison: one of {sorted(POISONS)}, not {poison!r}")

    def make(init):
        def poisoning_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            logger.warning("test fault: sending %s parts to the other reducers in %s", poison, self.label)
            self.map_outgoing_parts(POISONS[poison])
        return poisoning_init

    _wrap(InstrumentedRunner, "__init__", make)


def _sparseloco_poison(poison: str) -> None:
    from roles.worker.sparseloco import service
    from roles.worker.sparseloco.codec import Compressed

    if poison not in ("huge", "garbage"):
        raise ValueError(f"sparseloco_poison: huge or garbage, not {poison!r}")

    def make(encode):
        def poisoned_encode(own, envelope, identity):
            if poison == "huge":
                logger.warning("test fault: sending a fragment scaled 1e4")
                own = Compressed(own.indices, own.codes, own.scales * 1e4, own.bits)
            data = encode(own, envelope, identity)
            if poison == "garbage":
                data = data[:-40] + bytes([data[-40] ^ 0xFF]) + data[-39:]
            return data
        return poisoned_encode

    _wrap(service, "encode_fragment", make)


def _kill(when: str) -> None:
    """Die as a machine dies, with nothing flushed."""
    logger.warning("test fault: SIGKILL %s", when)
    os.kill(os.getpid(), signal.SIGKILL)


def _sparseloco_exit(spec: str) -> None:
    """Die in round N before anything of its fragment left, or once it has: pushed to every replica
    (swarm transport, as far as the round's deadline allows) or put in the store."""
    from roles.worker.sparseloco.transport import StoreTransport, SwarmTransport

    match = re.fullmatch(r"(before|after)_send:([0-9]+)", spec)
    if match is None:
        raise ValueError(f"sparseloco_exit: before_send:N or after_send:N, not {spec!r}")
    when, at = match.group(1), int(match.group(2))

    async def send_swarm(transport, key, data, deadline):
        expected = sorted(set(transport.members()) - {transport.self_id})
        pushes = [asyncio.create_task(transport.push(peer, key, data, deadline)) for peer in expected]
        if pushes:
            await asyncio.wait(pushes, timeout=max(0.0, deadline - time.monotonic()))

    async def send_store(transport, key, data, deadline):
        path = posixpath.join(transport._dir(key), f"{transport.self_id}.frag")
        try:
            await transport._timed(deadline, transport._put, path, data)
        except Exception:  # noqa: BLE001 - dying anyway
            pass

    def make(exchange, send):
        async def dying_exchange(self, key, data, deadline, *args, **kwargs):
            if key.round == at:
                if when == "after":
                    await send(self, key, data, deadline)
                _kill(f"{'before' if when == 'before' else 'after'} sending round {at}")
            return await exchange(self, key, data, deadline, *args, **kwargs)
        return dying_exchange

    _wrap(SwarmTransport, "exchange", lambda exchange: make(exchange, send_swarm))
    _wrap(StoreTransport, "exchange", lambda exchange: make(exchange, send_store))


class SlowBucket:
    """A donor's upload bucket (StateDonor.bucket) that takes `delay_s` longer per chunk: the pause
    falls where a slow disk or link would, after the chunk was admitted (it counts among the
    donor's chunks in progress) and before its bytes are read. The bucket's own wait is returned."""

    def __init__(self, bucket, delay_s: float):
        self.bucket = bucket
        self.delay_s = delay_s

    async def take(self, n: int) -> float:
        await asyncio.sleep(self.delay_s)
        return await self.bucket.take(n)

    def __getattr__(self, name):
        return getattr(self.bucket, name)


def _state_chunk_delay(seconds: str) -> None:
    from roles.worker.state.state_donor import StateDonor
    from roles.worker.state.state_server import StateServer

    delay_s = float(seconds)

    def make_init(init):
        def slow_init(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.bucket = SlowBucket(self.bucket, delay_s)
        return slow_init

    def make_read(read):
        def slow_read(self, offset, count):  # in a thread of its own (asyncio.to_thread)
            time.sleep(delay_s)
            return read(self, offset, count)
        return slow_read

    _wrap(StateDonor, "__init__", make_init)
    _wrap(StateServer, "_read", make_read)


FAULTS: dict[str, Callable[[str], None]] = {
    "device_fault_after_batches": _device_fault,
    "nan_gradients_after_steps": _nan_gradients,
    "fail_forwards": _fail_forwards,
    "without_chain": _without_chain,
    "init_seed_offset": _init_seed_offset,
    "averaging_stall_s": _averaging_stall,
    "averaging_poison": _averaging_poison,
    "sparseloco_poison": _sparseloco_poison,
    "sparseloco_exit": _sparseloco_exit,
    "state_chunk_delay_s": _state_chunk_delay,
}


def parse_fault(spec: str) -> tuple[str, str]:
    """(name, value) of a `NAME=VALUE` spec; ValueError naming the faults there are."""
    name, sep, value = spec.partition("=")
    if not sep or name not in FAULTS:
        raise ValueError(f"fault '{spec}': NAME=VALUE with NAME one of {', '.join(FAULTS)}")
    return name, value


def install(specs: list[str]) -> None:
    """Wrap the product with every fault of `specs` (`NAME=VALUE`), in this process."""
    if _ORIGINALS:
        raise RuntimeError("faults are already installed; uninstall them first")
    for spec in specs:
        name, value = parse_fault(spec)
        FAULTS[name](value)


def uninstall() -> None:
    for (owner, name), original in _ORIGINALS.items():
        setattr(owner, name, original)
    _ORIGINALS.clear()
