"""What the replicas of one stage say to each other directly, over the swarm's authenticated
streams, so that several workers of a stage train as one:

- the tail's step tags come from one tagger (`agora/v1/tags`, roles/worker/steps/step_tagger.py), so
  every step holds exactly `target_batch_size` samples in total over the replicas;
- with `averaging.gradients` on, the replicas add up their gradients before every step
  (`agora/v1/step_gradients`, roles/worker/steps/gradient_exchange.py), so they apply one update.

The compute thread asks for tags and waits for the exchange through the hooks this module gives
the runtime; the requests themselves run on the event loop. Who the other replicas are comes from
the stage's progress records (roles/worker/steps/progress.py), which their owners sign.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import secrets
import time
from typing import Awaitable, Callable, Optional

import torch
from hivemind.p2p import P2P, PeerID

from protocol import version
from protocol.dht import SwarmDHT
from protocol.dht_schema import WorkerRecord, workers_key
from protocol.errors import AgoraError, ErrorCode, PeerTimeout, PeerUnavailable, ProtocolError
from protocol.messages import (
    StepCountsReply,
    StepCountsRequest,
    StepCorrection,
    StepGradientsReply,
    StepGradientsRequest,
    TagReply,
    TagRequest,
    parse_model,
)
from protocol.run_config import RunConfig
from protocol.transport import RpcClient, RpcServer, dial
from roles.model.traffic_plan import gradient_exchange_on
from roles.periodic import every
from roles.worker.steps.gradient_exchange import Contribution, Correction, GradientExchange, StepSum
from roles.worker.serving.runtime import StageRuntime
from roles.worker.steps.step_tagger import AnsweredAsks, ForwardSlots, StepTagger, TagGrant, Unreachable, elect_tagger

logger = logging.getLogger(__name__)

_WORKER_ONLY = frozenset({"worker"})
MEMBER_REFRESH_S = 2.0
"""The most a request from a replica not known yet waits for a fresh read of the stage's records."""
SETTLE_S = 2.0
"""How long a replica reads its stage's progress before it may claim the tagging."""
TAG_ASK_TIMEOUTS = (1.0, 2.0, 2.0)
"""One tag ask's attempts, as multiples of the request timeout. A retry carries the same ask id,
so it claims the tags of an attempt whose reply was lost; the later attempts have room for a new
connection (through a relay, several round trips) when the one the ask used died under it."""


async def _nothing() -> None:
    return None


class StageReplicas:
    """One worker's side of its stage's tagging and gradient exchange."""

    def __init__(self, run: RunConfig, stage: int, swarm: SwarmDHT, p2p: P2P, runtime: StageRuntime):
        self.run_config = run
        self.stage = stage
        self.swarm = swarm
        self.p2p = p2p
        self.runtime = runtime
        self.ledger = runtime.ledger
        self.self_id = swarm.peer_id
        self.request_timeout_s = max(run.averaging.request_timeout_s, 1.0)
        self.tagger: Optional[StepTagger] = None
        if runtime.kind == "tail":
            self.tagger = StepTagger(run.target_batch_size, ahead=0 if run.staleness.max_delayed_per_step == 0 else 1)
        self.slots: Optional[ForwardSlots] = None
        if runtime.kind == "head" and runtime.max_delayed_per_step is not None:
            self.slots = ForwardSlots(run.target_batch_size, runtime.max_delayed_per_step,
                                      runtime.forward_gate_timeout_s)
        self.tagging = False
        """This replica tags for the stage (published in its progress record)."""
        self.tagger_id: Optional[str] = None
        self._unreachable = Unreachable()
        self.exchange: Optional[GradientExchange] = None
        if gradient_exchange_on(run, stage):
            self.exchange = GradientExchange(
                self.self_id, numel=runtime.optimizer.gradient_numel, target=run.target_batch_size,
                timeout_s=run.averaging.gradient_timeout_s, push=self._push,
                members=lambda: list(self.ledger.peers.members), on_peer_due=self._peer_due)
        self._client: Optional[RpcClient] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._dialed: set[str] = set()
        self.tag_asks_failed = 0
        self.tag_asks_retried = 0
        self._answered = AnsweredAsks()
        self.counters: collections.Counter[str] = collections.Counter()
        self._pushed_counts: Optional[tuple[int, int, int]] = None
        self._first_read: Optional[float] = None
        self.refresh_members: Callable[[], Awaitable[None]] = _nothing
        """Reads the stage's progress records now (StageProgress.read_soon; set by the role)."""

    async def start(self, server: RpcServer) -> None:
        """Register the handlers and give the runtime its hooks (before the compute thread starts)."""
        self._loop = asyncio.get_running_loop()
        self._client = RpcClient(self.p2p, timeout_s=self.request_timeout_s, authenticator=server.authenticator)
        if self.tagger is not None or self.slots is not None:
            await server.add_handler(version.TAGS, self.serve_tags, roles=_WORKER_ONLY)
        if self.tagger is not None:
            self.runtime.tagging = self.take_tags
        if self.slots is not None:
            self.runtime.forward_slots = self.take_slots
        await server.add_handler(version.STEP_COUNTS, self.serve_step_counts, roles=_WORKER_ONLY)
        if self.exchange is not None:
            await server.add_handler(version.STEP_GRADIENTS, self.serve_step_gradients, roles=_WORKER_ONLY)
            self.runtime.exchange_step = self.exchange_step
        if self.exchange is not None:
            logger.info("stage %d: replicas add up their gradients before every step (averaging.gradients %s)",
                        self.stage, self.run_config.averaging.gradients)

    async def run(self, stop: asyncio.Event) -> None:
        """Push this replica's counts to the stage's other replicas whenever they change."""
        await every(None, self._push_counts, stop, name="step counts", wake=self.runtime.changed.listen(),
                    min_interval_s=0.005)

    async def _push_counts(self) -> None:
        members = self.ledger.peers.members
        if not members:
            return
        step = self.runtime.optimizer.local_step
        open_samples, next_samples = self.runtime.arrived()
        counts = (step, open_samples, next_samples)
        if counts == self._pushed_counts:
            return
        self._pushed_counts = counts
        request = StepCountsRequest(stage=self.stage, local_step=step, open_samples=open_samples,
                                    next_samples=next_samples)

        async def push(peer: str) -> None:
            try:
                await self._client.request(await self._peer(peer), version.STEP_COUNTS, request, StepCountsReply,
                                           timeout_s=self.request_timeout_s)
            except AgoraError:
                self.counters["count_pushes_failed"] += 1  # the DHT record still carries the counts

        await asyncio.gather(*(push(peer) for peer in members))

    async def serve_step_counts(self, peer_id: PeerID, body: dict) -> StepCountsReply:
        request = parse_model(StepCountsRequest, body)
        if request.stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {request.stage}", ErrorCode.WRONG_STAGE)
        limit = 4 * self.run_config.target_batch_size
        if request.open_samples > limit or request.next_samples > limit:
            raise ProtocolError(f"counts above {limit} do not fit a step of {self.run_config.target_batch_size}",
                                ErrorCode.INVALID_REQUEST)
        peer = peer_id.to_base58()
        if peer in self.ledger.peers.members:  # others: not (yet) a replica of this stage, ignored
            self.ledger.update_direct(peer, request.local_step, request.open_samples, request.next_samples)
            self.runtime.wake()
        return StepCountsReply()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    # ---- who tags (event loop, after every read of the stage's progress) ----

    def on_peers(self) -> None:
        if self.tagger is None and self.slots is None:
            return
        view = self.ledger.peers
        now = time.monotonic()
        if self._first_read is None:
            self._first_read = now
        unreachable = self._unreachable.current(view.members)
        chosen = elect_tagger(self.self_id, self.tagging, [(p, p in view.taggers) for p in view.members], unreachable)
        if chosen == self.self_id and not self.tagging and now - self._first_read < SETTLE_S:
            # A replica that just arrived may not see the tagger's record yet: two taggers would
            # split a step's count, so it claims nothing until its view had time to settle.
            self.tagger_id = None
            return
        if chosen == self.self_id and not self.tagging:
            self.tagging = True
            logger.info("stage %d: this replica tags the stage's steps (%d other replica(s))", self.stage,
                        len(view.members))
            self.runtime.changed.fire()  # publish the claim
        elif chosen != self.self_id and self.tagging:
            self.tagging = False
            (self.tagger or self.slots).reset()
            logger.info("stage %d: replica %s tags the stage's steps now", self.stage, chosen[-8:])
            self.runtime.changed.fire()
        self.tagger_id = chosen

    def _known(self, step: int) -> int:
        """What the stage is known to hold for `step`: this replica's count and its peers' published ones."""
        opt = self.runtime.optimizer
        open_samples, next_samples = self.runtime.arrived()
        own = open_samples if step == opt.local_step else next_samples if step == opt.local_step + 1 else 0
        return own + self.ledger.peers.counts.get(step, 0)

    # ---- tags (compute thread asks, event loop serves) ----

    def take_tags(self, n: int) -> Optional[list[TagGrant]]:
        """Compute thread: tags for `n` untagged samples, from this replica if it tags, else from the tagger."""
        tagger = self.tagger_id
        if tagger is None:
            return None
        if tagger == self.self_id:
            return self.tagger.take(n, self.runtime.optimizer.local_step, self._known)
        return self._wait(self._ask_tags(tagger, n), self._ask_budget_s)

    @property
    def _ask_budget_s(self) -> float:
        return self.request_timeout_s * sum(TAG_ASK_TIMEOUTS) + 1.0

    def take_slots(self, n: int) -> Optional[int]:
        """Compute thread, head: how many of `n` forwards may start, from this replica's gate if it
        keeps it, else from the replica that does."""
        keeper = self.tagger_id
        if keeper is None:
            return None
        if keeper == self.self_id:
            return self._take_slots(n)
        grants = self._wait(self._ask_tags(keeper, n), self._ask_budget_s)
        return None if grants is None else sum(g.count for g in grants)

    def _take_slots(self, n: int, for_peer: bool = False) -> int:
        opt = self.runtime.optimizer
        step = opt.local_step
        open_known = self._known(step)
        back = opt.samples_consumed + open_known + self._known(step + 1)
        return self.slots.take(n, back_total=back, open_known=open_known, for_peer=for_peer)

    async def _ask_tags(self, tagger: str, n: int) -> Optional[list[TagGrant]]:
        request = TagRequest(stage=self.stage, count=n, open_step=self.runtime.optimizer.local_step,
                             ask_id=secrets.randbits(63))
        reply: Optional[TagReply] = None
        for attempt, factor in enumerate(TAG_ASK_TIMEOUTS):
            timeout_s = self.request_timeout_s * factor
            try:
                peer = await self._peer(tagger)
                reply = await self._client.request(peer, version.TAGS, request, TagReply, timeout_s=timeout_s)
                break
            except (PeerUnavailable, PeerTimeout) as exc:
                # The ask may have been served and its reply lost: the same id again claims those tags.
                failure: AgoraError = exc
                if attempt + 1 < len(TAG_ASK_TIMEOUTS):
                    self.tag_asks_retried += 1
                    logger.debug("stage %d: tag ask to %s failed (%s); asking again", self.stage, tagger[-8:], exc)
            except AgoraError as exc:  # a typed refusal: asking again gets the same
                failure = exc
                break
        if reply is None:
            self.tag_asks_failed += 1
            self._unreachable.mark(tagger)
            logger.warning("stage %d: the stage's tagger %s did not answer (%s); looking for another", self.stage,
                           tagger[-8:], failure)
            self.on_peers()
            return None
        if not reply.tagger:
            return None  # its view moved on: ours follows at the next read of the stage's progress
        grants = [TagGrant(s, c) for s, c in zip(reply.steps, reply.counts)]
        if any(g.count < 1 for g in grants) or sum(g.count for g in grants) > n:
            logger.warning("stage %d: the tagger %s answered %s for %d samples; ignored", self.stage, tagger[-8:],
                           grants, n)
            return None
        return grants

    async def serve_tags(self, peer_id: PeerID, body: dict) -> TagReply:
        request = parse_model(TagRequest, body)
        if request.stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {request.stage}", ErrorCode.WRONG_STAGE)
        if not await self._is_member(peer_id.to_base58()):
            raise ProtocolError("only a replica of this stage with a progress record may ask for its tags",
                                ErrorCode.NOT_READY)
        if not self.tagging:
            return TagReply(tagger=False)
        open_step = self.runtime.optimizer.local_step

        def serve() -> TagReply:
            if request.open_step is not None and request.open_step != open_step:
                return TagReply(tagger=True)  # not at the same step yet: ask again once it is
            if self.slots is not None:  # the head's "tags" are forward slots: how many may start
                given = self._take_slots(request.count, for_peer=True)
                return TagReply(tagger=True, steps=[open_step] if given else [], counts=[given] if given else [])
            grants = self.tagger.take(request.count, open_step, self._known, for_peer=True)
            return TagReply(tagger=True, steps=[g.step for g in grants], counts=[g.count for g in grants])

        return self._answered.answer(peer_id.to_base58(), request.ask_id, serve)

    # ---- gradients (compute thread waits, event loop exchanges and serves) ----

    def exchange_step(self, own: Contribution) -> Optional[StepSum]:
        """Compute thread: this replica's contribution in, the stage's total out (None: stopping)."""
        own = dataclasses.replace(own, peer=self.self_id)
        return self._wait(self.exchange.exchange(own), None)

    def _peer_due(self, step: int) -> None:
        self.ledger.peer_due(step)
        self.runtime.wake()

    async def _push(self, peer: str, c: Contribution) -> Optional[StepSum]:
        request = StepGradientsRequest(stage=self.stage, step=c.step, samples=c.samples, abandoned=c.abandoned,
                                       grad=c.grad, consumed=c.consumed,
                                       corrections=[StepCorrection(peer=f.peer, samples=f.samples, grad=f.grad)
                                                    for f in c.corrections])
        reply = await self._client.request(await self._peer(peer), version.STEP_GRADIENTS, request,
                                           StepGradientsReply, timeout_s=self.exchange.timeout_s)
        if not reply.closed:
            return None
        grad = reply.grad
        if (grad is None) != (reply.samples == 0) or (grad is not None and (
                grad.dtype != torch.float32 or grad.numel() != self.exchange.numel
                or not bool(torch.isfinite(grad).all()))):
            raise ProtocolError(f"{peer} answered a step sum that does not fit this stage", ErrorCode.INVALID_TENSOR)
        return StepSum(step=c.step, grad=None if grad is None else grad.reshape(-1), samples=reply.samples,
                       stage_samples=reply.stage_samples, members=tuple(reply.members), consumed=reply.consumed)

    async def serve_step_gradients(self, peer_id: PeerID, body: dict) -> StepGradientsReply:
        request = parse_model(StepGradientsRequest, body)
        if request.stage != self.stage:
            raise ProtocolError(f"this worker serves stage {self.stage}, not {request.stage}", ErrorCode.WRONG_STAGE)
        peer = peer_id.to_base58()
        if not await self._is_member(peer):
            raise ProtocolError("only a replica of this stage with a progress record may send its gradients",
                                ErrorCode.NOT_READY)
        grad = None if request.grad is None else request.grad.reshape(-1)
        corrections = tuple(Correction(peer=f.peer, samples=f.samples, grad=f.grad.reshape(-1))
                            for f in request.corrections)
        contribution = Contribution(peer=peer, step=request.step, samples=request.samples,
                                    abandoned=request.abandoned, grad=grad, consumed=request.consumed,
                                    corrections=corrections)
        total = self.exchange.receive(contribution, self.runtime.optimizer.local_step)
        if total is None:
            return StepGradientsReply()
        return StepGradientsReply(closed=True, samples=total.samples, stage_samples=total.stage_samples,
                                  grad=total.grad, members=list(total.members), consumed=total.consumed)

    # ---- plumbing (also what the stage's SparseLoCo fragments travel over) ----

    @property
    def client(self) -> RpcClient:
        return self._client

    @property
    def loop(self) -> Optional[asyncio.AbstractEventLoop]:
        return self._loop

    async def peer(self, peer: str) -> PeerID:
        return await self._peer(peer)

    async def is_member(self, peer: str) -> bool:
        return await self._is_member(peer)

    async def _is_member(self, peer: str) -> bool:
        """Whether `peer` is a replica of this stage, reading the stage's records once more if it
        is not known yet: a replica that has just joined (or found us first) asks before our next
        periodic read would list it, and turning it away costs the step its gradients."""
        if peer in self.ledger.peers.members:
            return True
        try:
            await asyncio.wait_for(self.refresh_members(), min(MEMBER_REFRESH_S, self.request_timeout_s / 2))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - unreadable now: the peer counts as unknown, as before
            return False
        return peer in self.ledger.peers.members

    async def _peer(self, peer: str) -> PeerID:
        """The peer's id, dialled once at its announced addresses (the DHT need not have met it)."""
        peer_id = PeerID.from_base58(peer)
        if peer not in self._dialed:
            workers = await self.swarm.get(workers_key(self.run_config.run_id, self.stage), WorkerRecord)
            record = workers.get(peer)
            if record is not None and record.maddrs:
                await dial(self.p2p, peer_id, record.maddrs, self.request_timeout_s)
            self._dialed.add(peer)
        return peer_id

    def _wait(self, coro, timeout_s: Optional[float]):
        """Run `coro` on the event loop from the compute thread; None if the worker stops meanwhile
        or it fails past `timeout_s`."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        waited = 0.0
        while True:
            try:
                return future.result(timeout=0.2)
            except concurrent.futures.TimeoutError:
                waited += 0.2
                if self.runtime.stopping or (timeout_s is not None and waited >= timeout_s):
                    future.cancel()
                    return None
            except (concurrent.futures.CancelledError, AgoraError):
                return None

    def summary(self) -> dict:
        out: dict = {"gradient_exchange": None if self.exchange is None else self.exchange.summary()}
        if self.counters:
            out["replica_messages"] = dict(self.counters)
        keeper = self.tagger or self.slots
        if keeper is not None:
            out["tagging"] = {**keeper.summary(), "tagger": self.tagging, "asks_failed": self.tag_asks_failed,
                              "asks_retried": self.tag_asks_retried, "asks_repeated": self._answered.repeated}
        return out
