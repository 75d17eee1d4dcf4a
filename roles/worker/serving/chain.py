"""Worker-to-worker routing: the `agora/v1/chain` handler.

A trainer hands a training sample to a head worker with a route: the stages after it, each with
the workers to try, its balancer's choice first (protocol/messages.py ChainRequest). Each worker
that is not the tail runs its forward, passes its output coordinates to the next stage's worker
and waits for that worker's reply, which carries the gradient at its output and the step tag;
then it runs its own backward, on the forward's worker by construction (pinned), through its kept
activations when it kept them. The tail fuses loss forward and backward as for a trainer's
backward request. So a sample crosses one network hop per stage and direction instead of two,
and no boundary's coordinates pass through the trainer.

Failures: a next worker that cannot be reached, is busy, or refuses for a passing reason
(unavailable, overloaded, not ready, wrong stage) is replaced by the route's next candidate for
its stage; the reply names the ones that failed, so the trainer's balancer bans them. When none
takes the sample, or a later stage dropped it, the reply says `dropped` with the reason and this
worker forgets the forward (its kept activations are released, the forward gate slot freed); a
sample already tagged with a step is reported abandoned to this stage at once, so its step does
not wait for a gradient that will not come. A worker that dies mid-chain breaks it for the
workers before it, which see it unavailable and drop the sample the same way; a tagged sample
lost that way is closed short by its step's timeout, as for a sample that died with a trainer
(roles/worker/steps/step_ledger.py). A worker only dials workers that the DHT lists for the route's
stage (signed records), never an address a caller made up.

Spot checks: every result passed on travels signed, as in a ForwardReply or BackwardReply; each
worker checks that the signatures it gets bind what it knows before it uses them (a sample whose
do not stops here, `bad_signature`: chain_signatures.py), and keeps what it sent and got for a
short while (hop_records.py), so that the sample's trainer can check a worker's hops with what
its neighbours kept (roles/trainer/chain_checks.py). With `verification.spot_check_rate: 0`
nothing is kept or checked.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Awaitable, Callable, Optional

from hivemind.p2p import PeerID

from protocol import version
from protocol.dht_schema import Phase, WorkerRecord, workers_key
from protocol.errors import AgoraError, ErrorCode, PeerTimeout, PeerUnavailable, ProtocolError, RemoteError
from protocol.evidence import loss_tensor, sign_hop
from protocol.messages import (
    BackwardRequest,
    ChainHop,
    ChainReply,
    ChainRequest,
    ChainStage,
    ForwardRequest,
    SignedHop,
    parse_model,
)
from protocol.transport import RpcClient, dial
from roles.worker.serving.chain_signatures import check_reply, check_request
from roles.worker.serving.handlers import WorkerHandlers
from roles.worker.serving.hop_records import HopRecords
from roles.worker.serving.queues import TaskKind

logger = logging.getLogger(__name__)

PASSING_CODES = frozenset({ErrorCode.OVERLOADED, ErrorCode.NOT_READY, ErrorCode.INTERNAL, ErrorCode.WRONG_STAGE,
                           ErrorCode.RATE_LIMITED})
"""Errors of a next worker that say "not now, not me": its stage's next candidate is tried."""
LOOKUP_MIN_INTERVAL_S = 1.0
"""A route naming a worker the stage's records do not list reads them again at most this often."""


class StageDirectory:
    """Peer id -> announced addresses of the workers of each later stage, from their signed DHT
    records; read again when a route names a worker not seen yet (at most once a second per stage)."""

    def __init__(self, get: Callable[[str, type], Awaitable[dict]], run_id: str):
        self._get = get
        self.run_id = run_id
        self._workers: dict[int, dict[str, list[str]]] = {}
        self._read_at: dict[int, float] = {}
        self._reading: dict[int, asyncio.Future] = {}

    async def addresses(self, stage: int, peer: str) -> Optional[list[str]]:
        """The worker's addresses, or None when it is no live worker of `stage`."""
        known = self._workers.get(stage, {})
        if peer in known:
            return known[peer]
        if time.monotonic() - self._read_at.get(stage, float("-inf")) >= LOOKUP_MIN_INTERVAL_S:
            await self._read(stage)
        return self._workers.get(stage, {}).get(peer)

    def forget(self, stage: int, peer: str) -> None:
        """`peer` could not be reached at the addresses listed: the next route naming it reads the
        stage's records again (it may have restarted elsewhere with the same identity)."""
        self._workers.get(stage, {}).pop(peer, None)

    async def _read(self, stage: int) -> None:
        reading = self._reading.get(stage)
        if reading is None:
            reading = asyncio.ensure_future(self._get(workers_key(self.run_id, stage), WorkerRecord))
            self._reading[stage] = reading
        try:
            records = await asyncio.shield(reading)
        finally:
            if self._reading.get(stage) is reading and reading.done():
                del self._reading[stage]
        self._read_at[stage] = time.monotonic()
        self._workers[stage] = {peer: list(record.maddrs) for peer, record in records.items()
                                if record.stage == stage and record.phase != Phase.LEAVING}


class ChainHandler:
    """Serves `agora/v1/chain` for one worker: its stage's part of a chained sample, and the call
    to the next stage's worker."""

    def __init__(self, handlers: WorkerHandlers, client: RpcClient, p2p, directory: StageDirectory, *,
                 peer_id: str, num_stages: int, records: Optional[HopRecords] = None, run_id: str = "",
                 sign: Optional[Callable[[bytes], bytes]] = None, checked: bool = True):
        self.handlers = handlers
        self.checked = checked
        """Whether the run's trainers spot-check (`verification.spot_check_rate` > 0): only then is
        anything kept for them, and the neighbours' signatures checked; results are signed always."""
        self.run_id = run_id
        self._sign = sign
        """This node's identity key, signing what it passes along a chain (chain_signatures.py)."""
        self.records = records if records is not None else HopRecords()
        """What this worker sent and got of its chained samples, signed, for the trainers' spot
        checks of its neighbours (roles/worker/serving/hop_records.py)."""
        self.runtime = handlers.runtime
        self.client = client
        self.p2p = p2p
        self.directory = directory
        self.peer_id = peer_id
        self.num_stages = num_stages
        self._dialled: set[str] = set()
        self.counters: collections.Counter[str] = collections.Counter()
        """completed, dropped_<reason>, next_failed (a next worker that did not take a sample)."""

    async def chain(self, peer_id: PeerID, body: dict) -> ChainReply:
        return await self.handlers._counted("chain", self._chain(peer_id, body))

    def _check_route(self, request: ChainRequest) -> None:
        stage, tail = self.runtime.stage, self.num_stages - 1
        stages = [hop.stage for hop in request.route]
        if stage == tail:
            if stages:
                raise ProtocolError("the tail is the last stage: its route must be empty", ErrorCode.INVALID_REQUEST)
            return
        if not stages or stages[-1] != tail or any(b <= a for a, b in zip([stage, *stages], stages)):
            raise ProtocolError(f"a route from stage {stage} must name later stages in order and end at the "
                                f"tail (stage {tail}); got {stages}", ErrorCode.INVALID_REQUEST)

    async def _chain(self, peer_id: PeerID, body: dict) -> ChainReply:
        started = time.monotonic()
        request = parse_model(ChainRequest, body)
        self._check_route(request)
        caller = peer_id
        refused = check_request(request, caller.to_base58(), self.run_id) if self.checked else None
        if refused is not None:
            self.counters["refused_bad_signature"] += 1
            return ChainReply(stages=[ChainStage(stage=request.stage, worker=self.peer_id,
                                                 elapsed_s=time.monotonic() - started)],
                              dropped="bad_signature", detail=refused)
        if self.runtime.kind == "tail":
            backward = BackwardRequest(stage=request.stage, sample_id=request.sample_id, tokens=request.tokens,
                                       coords=request.coords)
            self.runtime.check_backward(backward)
            self._keep(request.sample_id, "coords_received", request.coords, request.signed)
            result = await self.handlers._run(TaskKind.BACKWARD, backward, caller)
            self.counters["completed"] += 1
            version = None if result.version is None else int(result.version)
            loss = None if result.loss is None else float(result.loss)
            signed_grad = self._signed(version, "gradient", request, None, result.grad_input)
            self._keep(request.sample_id, "gradient_sent", result.grad_input, signed_grad)
            return ChainReply(
                stages=[ChainStage(stage=request.stage, worker=self.peer_id, version=version,
                                   elapsed_s=time.monotonic() - started)],
                loss=loss, step=None if result.step is None else int(result.step), grad_input=result.grad_input,
                signed_grad=signed_grad,
                signed_loss=self._signed(version, "loss", request, None, None if loss is None else loss_tensor(loss)))
        forward = ForwardRequest(stage=request.stage, sample_id=request.sample_id, tokens=request.tokens,
                                 coords=request.coords)
        self.runtime.check_forward(forward)
        if request.stage > 0:
            self._keep(request.sample_id, "coords_received", request.coords, request.signed)
        coords = await self.handlers._run(TaskKind.FORWARD, forward, caller)
        # Beside an older worker that sent its input unsigned, an output signature would bind
        # nothing the next worker can check, and it would refuse it: the output goes unsigned.
        signed = (self._signed(self.runtime.forwarded.peek(request.sample_id), "output", request, None, coords)
                  if request.stage == 0 or request.signed is not None else None)
        self._keep(request.sample_id, "coords_sent", coords, signed)
        passed_at = time.monotonic()
        try:
            later = await self._pass_on(request, list(request.route), coords, deadline=started + request.budget_s,
                                        signed=signed, signed_input=request.signed)
        except BaseException:
            self.runtime.forget_forward(request.sample_id)  # our caller left, or we stop
            raise
        downstream_s = time.monotonic() - passed_at

        def me(version: Optional[int] = None) -> ChainStage:
            return ChainStage(stage=request.stage, worker=self.peer_id, version=version,
                              elapsed_s=max(0.0, time.monotonic() - started - downstream_s))

        if later.dropped is not None:
            return self._drop(request, later.dropped, later.detail, later.step, [me(), *later.stages])
        if later.grad_input is None or later.step is None:
            return self._drop(request, "bad_reply", f"stage {request.route[0].stage} sent no gradient or step tag",
                              later.step, [me(), *later.stages])
        callee = next((done.worker for done in later.stages if done.worker and not done.skipped), "")
        refused = check_reply(later, callee, coords, request.tokens, self.run_id) if self.checked else None
        if refused is not None:
            return self._drop(request, "bad_signature", refused, later.step, [me(), *later.stages])
        backward = BackwardRequest(stage=request.stage, sample_id=request.sample_id, tokens=request.tokens,
                                   coords=request.coords, grad_output=later.grad_input, step=later.step)
        try:
            self.runtime.check_backward(backward)
        except ProtocolError as exc:
            return self._drop(request, "bad_reply", f"stage {request.route[0].stage}'s gradient: {exc}",
                              later.step, [me(), *later.stages])
        try:
            # Withdrawn unrun when our caller leaves: the gradient of this tagged sample will not
            # come, so its step must not wait for it.
            result = await self.handlers._run(TaskKind.BACKWARD, backward, caller,
                                              on_withdrawn=lambda: self._release(request.sample_id, later.step))
        except AgoraError as exc:  # shutting down, or the computation failed
            return self._drop(request, "backward_failed", f"stage {request.stage}: {exc}", later.step,
                              [me(), *later.stages])
        self.counters["completed"] += 1
        self._keep(request.sample_id, "gradient_received", later.grad_input, later.signed_grad)
        if request.stage == 0:
            return ChainReply(stages=[me(result.version), *later.stages], loss=later.loss, step=later.step,
                              signed_loss=later.signed_loss)
        version = None if result.version is None else int(result.version)
        # Likewise a gradient taken from an older worker's unsigned one (the caller could not bind
        # it), or sent back to an older worker, which checks nothing (chain_signatures.py).
        signed_grad = (self._signed(version, "gradient", request, later.grad_input, result.grad_input)
                       if signed is not None and later.signed_grad is not None else None)
        self._keep(request.sample_id, "gradient_sent", result.grad_input, signed_grad)
        return ChainReply(stages=[me(result.version), *later.stages], loss=later.loss, step=later.step,
                          grad_input=result.grad_input, signed_grad=signed_grad, signed_loss=later.signed_loss,
                          signed_output=signed, signed_grad_output=later.signed_grad)

    def _keep(self, sample_id: str, which: str, tensor, signed: Optional[SignedHop]) -> None:
        if self.checked:
            self.records.keep(sample_id, which, tensor, signed)

    def _signed(self, version: Optional[int], kind: str, request: ChainRequest, grad_output,
                result) -> Optional[SignedHop]:
        """This worker's signature over a result it passes along the chain, as it would sign it in a
        ForwardReply or BackwardReply (protocol/evidence.py), with what it covers."""
        weights = None if version is None else self.runtime.fingerprints.get(version)
        return sign_hop(self._sign, self.run_id, self.peer_id, request.stage, version, weights, kind,
                        request.tokens, request.coords, grad_output, result)

    def _drop(self, request: ChainRequest, reason: str, detail: str, step: Optional[int],
              stages: list[ChainStage]) -> ChainReply:
        """The sample ends here: forget its forward and, when it was tagged, close it out of its step."""
        self.counters[f"dropped_{reason}"] += 1
        self._release(request.sample_id, step)
        return ChainReply(stages=stages, dropped=reason, detail=detail[:2048], step=step)

    def _release(self, sample_id: str, step: Optional[int]) -> None:
        self.runtime.forget_forward(sample_id)
        if step is not None:
            self.runtime.abandon(step, sample_id)

    async def _pass_on(self, request: ChainRequest, route: list[ChainHop], coords, *, deadline: float,
                       signed: Optional[SignedHop] = None, signed_input: Optional[SignedHop] = None) -> ChainReply:
        """Call the route's next stage, candidate after candidate, until one takes the sample;
        its reply, with the candidates that failed named on its stage. When none did: a
        `dropped` reply, or, if the stage may be skipped and every candidate was unreachable,
        the reply of the stage after it, which gets these coordinates unchanged."""
        hop, rest = route[0], route[1:]
        failed: list[str] = []
        unreachable = True
        last = "no candidate tried"
        for peer in dict.fromkeys(hop.workers):
            budget = deadline - time.monotonic()
            if budget <= 0:
                last, unreachable = "the sample's time ran out", False
                break
            addresses = await self.directory.addresses(hop.stage, peer)
            if addresses is None:
                failed.append(peer)
                last = f"{peer[-8:]} is no worker of stage {hop.stage}"
                continue
            onward = ChainRequest(stage=hop.stage, sample_id=request.sample_id, tokens=request.tokens, coords=coords,
                                  route=rest, budget_s=budget, signed=signed, signed_input=signed_input)
            try:
                await self._dial(peer, addresses)
                reply = await self.client.request(PeerID.from_base58(peer), version.CHAIN, onward, ChainReply,
                                                  timeout_s=budget)
            except RemoteError as exc:
                failed.append(peer)
                if exc.code not in PASSING_CODES:
                    return self._failed_hop(hop, failed, "rejected", f"stage {hop.stage} worker {peer[-8:]}: {exc}")
                last, unreachable = f"{peer[-8:]}: {exc}", False
                self.counters["next_failed"] += 1
                continue
            except PeerTimeout as exc:
                failed.append(peer)
                return self._failed_hop(hop, failed, "worker_failures",
                                        f"stage {hop.stage} worker {peer[-8:]} timed out: {exc}")
            except (PeerUnavailable, asyncio.TimeoutError) as exc:  # dial's own timeout included
                self._dialled.discard(peer)  # dial it again next time, at the addresses then listed
                self.directory.forget(hop.stage, peer)
                failed.append(peer)
                last = f"{peer[-8:]}: {exc}"
                self.counters["next_failed"] += 1
                continue
            except ProtocolError as exc:  # its reply did not parse
                return self._failed_hop(hop, failed, "bad_reply", f"stage {hop.stage} worker {peer[-8:]}: {exc}")
            if failed and reply.stages:  # the trainer bans the candidates that did not take it
                named = reply.stages[0].model_copy(update={"failed": failed[:8]})
                reply = reply.model_copy(update={"stages": [named, *reply.stages[1:]]})
            return reply
        if hop.skippable and unreachable and failed and rest:
            # As the trainer routes around a body stage it cannot reach (roles/trainer/skipping.py):
            # the same coordinates go to the stage after it, and that one is not skipped as well.
            self.counters["skipped"] += 1
            if rest[0].skippable:
                rest = [rest[0].model_copy(update={"skippable": False}), *rest[1:]]
            later = await self._pass_on(request, rest, coords, deadline=deadline, signed=signed,
                                        signed_input=signed_input)
            passed = ChainStage(stage=hop.stage, elapsed_s=0.0, failed=failed[:8], skipped=True)
            return later.model_copy(update={"stages": [passed, *later.stages]})
        return self._failed_hop(hop, failed, "worker_failures",
                                f"stage {hop.stage}: none of {len(hop.workers)} worker(s) took it; last: {last}")

    @staticmethod
    def _failed_hop(hop: ChainHop, failed: list[str], reason: str, detail: str) -> ChainReply:
        stage = ChainStage(stage=hop.stage, elapsed_s=0.0, failed=failed[:8])
        return ChainReply(stages=[stage], dropped=reason, detail=detail)

    async def _dial(self, peer: str, addresses: list[str]) -> None:
        """Give libp2p the worker's listed addresses once (again after it could not be reached)."""
        if peer in self._dialled:
            return
        await dial(self.p2p, PeerID.from_base58(peer), addresses)
        self._dialled.add(peer)
