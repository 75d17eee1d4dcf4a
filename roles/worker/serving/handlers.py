"""The worker's `agora/v1/*` handlers: parse, validate, queue, await the compute thread, reply
with the typed reply the trainer parses (protocol/messages.py). A held-out evaluation skips the
queues: it runs in a thread of its own beside the compute thread (StageRuntime.evaluate).

Every failure here becomes a typed error reply through the RPC server; nothing a remote peer
sends can reach the compute thread without passing the runtime's checks first.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Awaitable, Callable, Optional, TypeVar

import torch
from hivemind.p2p import PeerID

from protocol.errors import AgoraError, ErrorCode, ProtocolError
from protocol.evidence import loss_tensor, result_signing_bytes
from protocol.messages import (
    AbandonReply,
    AbandonRequest,
    BackwardReply,
    BackwardRequest,
    EvaluateReply,
    EvaluateRequest,
    ForwardReply,
    ForwardRequest,
    InfoReply,
    RetractReply,
    RetractRequest,
    parse_model,
)
from roles.worker.serving.queues import QueueClosed, QueueFull, TaskKind, loop_future
from roles.worker.serving.batches import BackwardResult
from roles.worker.serving.retractions import Retractions
from roles.worker.serving.runtime import StageRuntime

T = TypeVar("T")

EVALUATIONS_AT_ONCE = 2
"""Held-out forwards computing at once (each in a thread of its own, beside the compute thread)."""
EVALUATIONS_WAITING_MAX = 16
"""Held-out forwards that may wait for a slot; beyond that a caller is told the worker is overloaded."""


class NotServing(AgoraError):
    code = ErrorCode.NOT_READY


class WorkerHandlers:
    """Binds a StageRuntime to the RPC server. `serving()` gates requests while starting or leaving."""

    def __init__(self, runtime: StageRuntime, info: Callable[[], InfoReply], serving: Callable[[], bool],
                 *, run_id: str = "", sign: Optional[Callable[[bytes], bytes]] = None):
        self.runtime = runtime
        self._run_id = run_id
        self._sign = sign
        """This node's identity key, signing every result it sends (protocol/evidence.py); None: unsigned."""
        self.info_fn = info
        self.serving = serving
        self.outcomes: collections.Counter[tuple[str, str]] = collections.Counter()
        """Forward, backward and evaluate requests by (pass, outcome): `ok`, or the error code the
        request was answered with (`overloaded`, `not_ready`, `invalid_tensor`, ...). Streams
        refused before a request was read are counted by the RPC server instead."""
        self.retractions = Retractions(runtime)
        """`agora/v1/retract`: a sample taken back out of a step still open here (retractions.py)."""
        self._evaluation_slots = asyncio.Semaphore(EVALUATIONS_AT_ONCE)
        self._evaluations_waiting = 0

    async def _counted(self, kind: str, call: Awaitable[T]) -> T:
        try:
            result = await call
        except AgoraError as exc:
            self.outcomes[(kind, ErrorCode(getattr(exc, "code", ErrorCode.NOT_READY)).name.lower())] += 1
            raise
        except Exception:
            self.outcomes[(kind, "internal")] += 1
            raise
        self.outcomes[(kind, "ok")] += 1
        return result

    async def _run(self, kind: TaskKind, request, caller: PeerID,
                   on_withdrawn: Optional[Callable[[], None]] = None) -> object:
        """Queue one request for the compute thread and wait for its result. If the caller leaves
        first, the request is withdrawn when it has not run yet, and then `on_withdrawn` is called."""
        if not self.serving():
            raise NotServing("worker is not serving requests right now; retry on another worker")
        future, on_done = loop_future()
        try:
            task = self.runtime.submit(kind, request, on_done, caller=caller.to_base58())
        except QueueFull as exc:
            raise ProtocolError(str(exc), ErrorCode.OVERLOADED) from exc
        except QueueClosed as exc:
            raise NotServing("worker is shutting down; retry on another worker") from exc
        try:
            return await future
        except asyncio.CancelledError:
            # the caller left (protocol/transport.py): nobody waits for it
            if self.runtime.withdraw(task) and on_withdrawn is not None:
                on_withdrawn()
            raise
        except AgoraError:
            raise
        except Exception as exc:
            raise ProtocolError(f"stage computation failed: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL) from exc

    async def forward(self, peer_id: PeerID, body: dict) -> ForwardReply:
        return await self._counted(TaskKind.FORWARD.value, self._forward(peer_id, body))

    async def _forward(self, peer_id: PeerID, body: dict) -> ForwardReply:
        request = parse_model(ForwardRequest, body)
        self.runtime.check_forward(request)
        coords = await self._run(TaskKind.FORWARD, request, peer_id)
        version = self.runtime.forwarded.peek(request.sample_id)
        weights = self.runtime.fingerprints.get(version)
        return ForwardReply(coords=coords, version=version, weights=weights,
                            attestation=self._attest(version, weights, "output", request.tokens, request.coords, None,
                                                     coords))

    async def backward(self, peer_id: PeerID, body: dict) -> BackwardReply:
        return await self._counted(TaskKind.BACKWARD.value, self._backward(peer_id, body))

    async def _backward(self, peer_id: PeerID, body: dict) -> BackwardReply:
        request = parse_model(BackwardRequest, body)
        self.runtime.check_backward(request)
        result: BackwardResult = await self._run(TaskKind.BACKWARD, request, peer_id)
        version = None if result.version is None else int(result.version)
        weights = None if version is None else self.runtime.fingerprints.get(version)
        loss = None if result.loss is None else float(result.loss)
        return BackwardReply(
            grad_input=result.grad_input, loss=loss,
            step=None if result.step is None else int(result.step), version=version, weights=weights,
            attestation=self._attest(version, weights, "gradient", request.tokens, request.coords,
                                     request.grad_output, result.grad_input),
            loss_attestation=self._attest(version, weights, "loss", request.tokens, request.coords, None,
                                          None if loss is None else loss_tensor(loss)),
        )

    def _attest(self, version: Optional[int], weights: Optional[bytes], kind: str, tokens: torch.Tensor,
                coords: Optional[torch.Tensor], grad_output: Optional[torch.Tensor],
                result: Optional[torch.Tensor]) -> Optional[bytes]:
        """This worker's signature over one result, so that a replica's contradiction of it is
        evidence anyone can check (protocol/evidence.py); None when unsigned or nothing to sign."""
        if self._sign is None or version is None or result is None:
            return None
        return self._sign(result_signing_bytes(self._run_id, self.runtime.stage, version, kind, tokens, coords,
                                               grad_output, result, weights))

    async def evaluate(self, peer_id: PeerID, body: dict) -> EvaluateReply:
        return await self._counted("evaluate", self._evaluate(body))

    async def _evaluate(self, body: dict) -> EvaluateReply:
        """A held-out forward (StageRuntime.evaluate) in a thread of its own: at most
        EVALUATIONS_AT_ONCE compute, at most EVALUATIONS_WAITING_MAX wait, so no caller can pile up
        threads. A slot stays taken until its thread ends, even if the caller left meanwhile."""
        request = parse_model(EvaluateRequest, body)
        self.runtime.check_evaluate(request)
        if not self.serving():
            raise NotServing("worker is not serving requests right now; retry on another worker")
        if self._evaluations_waiting >= EVALUATIONS_WAITING_MAX:
            raise ProtocolError(f"{EVALUATIONS_WAITING_MAX} held-out evaluations already wait here; retry later or "
                                "on another worker", ErrorCode.OVERLOADED)
        self._evaluations_waiting += 1
        try:
            await self._evaluation_slots.acquire()
        finally:
            self._evaluations_waiting -= 1
        work = asyncio.ensure_future(asyncio.to_thread(self.runtime.evaluate, request))
        work.add_done_callback(self._evaluation_done)
        try:
            reply: EvaluateReply = await asyncio.shield(work)
        except AgoraError:
            raise
        except Exception as exc:
            raise ProtocolError(f"evaluation failed: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL) from exc
        wants_grad = request.grad_output is not None or request.input_grad
        kind, result = (("gradient", reply.grad_input) if wants_grad else
                        ("loss", None if reply.loss is None else loss_tensor(reply.loss)) if reply.coords is None else
                        ("output", reply.coords))
        attestation = self._attest(reply.version, reply.weights, kind, request.tokens, request.coords,
                                   request.grad_output if wants_grad else None, result)
        return reply if attestation is None else reply.model_copy(update={"attestation": attestation})

    def _evaluation_done(self, work: asyncio.Future) -> None:
        self._evaluation_slots.release()
        if not work.cancelled():
            work.exception()  # retrieved: a caller that left does not make asyncio log it as lost

    async def abandon(self, peer_id: PeerID, body: dict) -> AbandonReply:
        request = parse_model(AbandonRequest, body)
        if request.stage != self.runtime.stage:
            raise ProtocolError(f"this worker serves stage {self.runtime.stage}, not {request.stage}",
                                ErrorCode.WRONG_STAGE)
        return AbandonReply(taken=self.runtime.abandon(request.step, request.sample_id))

    async def retract(self, peer_id: PeerID, body: dict) -> RetractReply:
        return await self._counted("retract", self._retract(body))

    async def _retract(self, body: dict) -> RetractReply:
        request = parse_model(RetractRequest, body)
        if not self.serving():
            raise NotServing("worker is not serving requests right now")
        return await self.retractions.handle(request)

    async def info(self, peer_id: PeerID, body: dict) -> InfoReply:
        return self.info_fn()
