"""Drives one sample through the pipeline [report 3.3.2.3, 4.2.1]: forward head → bodies through
the balancers, the tail's fused loss forward+backward, then backward tail → head, each stage
pinned to the worker that ran its forward.

Forward calls retry on another worker of the stage, or, when it was the stage's last usable one,
on the same worker after the balancer's backoff. A backward goes to another worker only if
the pinned one is gone, and that fallback is counted: its gradient comes from other weights.
A sample that cannot be completed raises SampleDropped with its reason; it is never lost silently.
A body stage with no reachable worker is skipped instead, when the run config allows it
(roles/trainer/skipping.py): the sample's coordinates go from the stage before it to the stage
after it, and its gradient back the same way.
Requests and replies are the wire models the worker parses and answers with (protocol/messages.py);
a reply that does not validate drops the sample as `bad_reply`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Optional, TypeVar

import torch
from hivemind.p2p import PeerID

from protocol import version
from protocol.errors import (
    AgoraError,
    ErrorCode,
    NoWorkersError,
    PeerTimeout,
    PeerUnavailable,
    ProtocolError,
    RemoteError,
)
from protocol.messages import (
    AbandonReply,
    AbandonRequest,
    BackwardReply,
    BackwardRequest,
    EvaluateReply,
    EvaluateRequest,
    ForwardReply,
    ForwardRequest,
    RetractReply,
    RetractRequest,
    WireModel,
)
from protocol.evidence import Evidence
from protocol.run_config import RunConfig, VerificationConfig
from protocol.state_messages import WeightsReply, WeightsRequest
from protocol.transport import RpcClient
from roles.event_log import EventAggregator
from roles.model.memory_plan import stage_parameter_count
from roles.model.stage import build_stage_model
from roles.trainer.balancer import StageBalancer
from roles.trainer.reexecution import WeightsReferee
from roles.trainer.referee import Referee
from roles.trainer.retraction import KeptHop, KeptSample, Retractions
from roles.trainer.skipping import StageSkipping, skippable
from roles.trainer.spot_checks import SpotChecks

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=WireModel)

# Remote errors that say "this worker could not take it now", as opposed to "your request is bad".
_RETRYABLE_CODES = {ErrorCode.OVERLOADED, ErrorCode.NOT_READY, ErrorCode.INTERNAL, ErrorCode.WRONG_STAGE,
                    ErrorCode.RATE_LIMITED}


class SampleDropped(AgoraError):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.step: Optional[int] = None
        """The step the tail tagged the sample with, if it got that far."""
        self.unreached: list[tuple[int, str]] = []
        """(stage, worker) pairs whose backward the sample never reached: told to close its step without it."""
        self.unreachable = False
        """Every attempt found the stage's workers unreachable (gone), rather than busy, slow or wrong."""


@dataclass
class SampleResult:
    loss: float
    route: list[str]
    backward_fallbacks: int = 0
    elapsed_s: float = 0.0
    step: Optional[int] = None
    """The global step the tail tagged the sample with; every stage accumulated it into that step."""
    versions: list[Optional[int]] = field(default_factory=list)
    """Per stage, the weight version its gradient was taken at (step - version = its delay)."""
    skipped: list[int] = field(default_factory=list)
    """Body stages the sample was routed around (forward, or backward after its worker died)."""
    abandon_to: list[tuple[int, str]] = field(default_factory=list)
    """(stage, worker) of skipped stages that still list a worker: told the sample will not come."""


@dataclass(frozen=True)
class EvaluatedSample:
    """A held-out sample's loss at the tail, and the tail's weight version it was computed with."""

    loss: float
    version: int


RECONNECT_TIMEOUT_S = 5.0
"""How long a worker whose connection died may take to answer a dial before it counts as gone."""


@dataclass
class PipelineStats:
    forward_retries: int = 0
    backward_fallbacks: int = 0
    served: collections.Counter = field(default_factory=collections.Counter)  # (stage, peer) -> samples
    reconnected: int = 0
    """Calls that failed with their connection while the worker answered again at once (a relay it
    was reached through died): retried there, the worker not banned."""


class PipelineDriver:
    def __init__(self, client: RpcClient, balancers: list[StageBalancer], *,
                 connect: Callable[[str], Awaitable[None]], id_prefix: str = "",
                 max_attempts: int = 3, timeout_s: float = 30.0,
                 on_no_workers: Optional[Callable[[], None]] = None,
                 skipping: Optional[StageSkipping] = None,
                 reconnect: Optional[Callable[[str], Awaitable[None]]] = None,
                 verification: Optional[VerificationConfig] = None,
                 exclude: Optional[Callable[[int, str, str], None]] = None,
                 equal_replicas: Callable[[int], bool] = lambda stage: True, run_id: str = "",
                 report_evidence: Optional[Callable[[Evidence], Awaitable[str]]] = None,
                 run: Optional[RunConfig] = None):
        self.client = client
        self.balancers = balancers
        self.connect = connect
        self.reconnect = reconnect
        """Dials a worker at its announced addresses again (raises when none answers)."""
        self.id_prefix = id_prefix
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.on_no_workers = on_no_workers
        self.skipping = skipping if skipping is not None else StageSkipping(len(balancers))
        self.stats = PipelineStats()
        verification = verification or VerificationConfig(spot_check_rate=0.0)
        referee = Referee(self._call, balancers)
        weights_referee = None
        if run is not None and verification.referee_max_bytes > 0 and run.model.kind != "surrogate":
            weights_referee = WeightsReferee(  # roles/trainer/reexecution.py
                self._fetch_weights, lambda stage: build_stage_model(run, stage),
                size=lambda stage: stage_parameter_count(run, stage) * torch.empty((), dtype=getattr(
                    torch, run.dtype)).element_size(),
                max_bytes=verification.referee_max_bytes, tolerance=verification.tolerance)
        self.spot_checks = SpotChecks(
            verification.spot_check_rate, verification.tolerance,
            evaluate=lambda stage, peer, request: self._call(stage, peer, version.EVALUATE, request, EvaluateReply),
            replicas=lambda stage: self.balancers[stage].usable(), losses=referee.continuation_losses,
            slopes=referee.input_slopes, consistency=referee.loss_consistency,
            loss_margin=verification.loss_margin, strikes_to_exclude=verification.strikes_to_exclude,
            exact_strikes_to_exclude=verification.exact_strikes_to_exclude,
            exclude=self._excluder(exclude), equal_replicas=equal_replicas,
            suspect_rate=verification.suspect_check_rate, run_id=run_id, report_evidence=report_evidence,
            route_around=lambda stage, peer: self.balancers[stage].report_failure(peer),
            weights_referee=weights_referee)
        """A fraction of the hops re-executed on another replica of the stage (roles/trainer/spot_checks.py)."""
        self.retractions = Retractions(self._retract, lambda stage: self.balancers[stage].usable())
        """Recent samples kept, to take those an excluded worker served back out of their open steps
        (roles/trainer/retraction.py); only with spot checks on, the only way a worker is excluded."""
        self._keeps = verification.spot_check_rate > 0
        self.retries = EventAggregator(logger, "retried", "request", interval_s=10.0, level=logging.INFO)
        """Calls retried on another worker, by cause; the role flushes it with its progress line."""

    @property
    def num_stages(self) -> int:
        return len(self.balancers)

    async def _connection_lost(self, peer: str, exc: Exception) -> bool:
        """Whether `exc` took only the connection, not the worker: it is unreachable, yet a dial at
        its announced addresses answers at once (the relay it was reached through died, and the
        worker holds a slot on another). Such a worker is retried, not banned. The dial is needed:
        the daemon opens a stream only at addresses its peerstore holds, and libp2p's identify
        replaces the ones we dialled with the worker's own list, which lacks a relayed worker's
        circuits."""
        if self.reconnect is None or not isinstance(exc, PeerUnavailable):
            return False
        try:
            await asyncio.wait_for(self.reconnect(peer), RECONNECT_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - no answer anywhere: the worker is gone
            return False
        self.stats.reconnected += 1
        return True

    async def _call(self, stage: int, peer: str, handler: str, request: WireModel, reply: type[R]) -> R:
        await self.connect(peer)
        started = time.perf_counter()
        try:
            answer = await self.client.request(PeerID.from_base58(peer), handler, request, reply,
                                               timeout_s=self.timeout_s)
        except ProtocolError as exc:
            if isinstance(exc, RemoteError):
                raise
            raise SampleDropped("bad_reply", f"stage {stage} worker {peer[-8:]}: {exc}") from exc
        self.balancers[stage].report_success(peer, 1.0, time.perf_counter() - started)
        return answer

    async def _fetch_weights(self, stage: int, peer: str, request: WeightsRequest) -> WeightsReply:
        """One chunk of a worker's weights for the weights referee (roles/trainer/reexecution.py):
        not a hop, so its time says nothing of the worker's speed to the balancer."""
        await self.connect(peer)
        return await self.client.request(PeerID.from_base58(peer), version.WEIGHTS, request, WeightsReply,
                                         timeout_s=self.timeout_s)

    async def _balanced(self, stage: int, handler: str, request: WireModel, reply: type[R], *,
                        give_up_unreachable: bool = False) -> tuple[str, R]:
        """Call `handler` on the least-loaded worker of `stage`, retrying elsewhere on failure.

        `give_up_unreachable`: the stage is being skipped already, so a worker that cannot be
        reached ends the attempts at once instead of being waited for (its record has not lapsed)."""
        tried: list[str] = []
        reconnected: set[str] = set()  # at most once per worker, and it costs no attempt
        last_error = "no attempt made"
        unreachable = True
        attempts = 0
        while attempts < self.max_attempts:
            attempts += 1
            try:
                peer = self.balancers[stage].choose(1.0, exclude=tried)
            except NoWorkersError as exc:
                # While the stage is skipped, periodic discovery is enough to find its next worker;
                # a refresh per sample would read the DHT at the lanes' pace.
                if self.on_no_workers is not None and not self.skipping.active(stage):
                    self.on_no_workers()
                raise SampleDropped("no_workers", str(exc)) from exc  # names its stage
            tried.append(peer)
            try:
                return peer, await self._call(stage, peer, handler, request, reply)
            except (PeerUnavailable, PeerTimeout, RemoteError) as exc:
                if isinstance(exc, RemoteError) and exc.code not in _RETRYABLE_CODES:
                    raise SampleDropped("rejected", f"stage {stage} worker {peer[-8:]}: {exc}") from exc
                if peer not in reconnected and await self._connection_lost(peer, exc):
                    reconnected.add(peer)
                    tried.remove(peer)
                    attempts -= 1
                    self.retries.count("reconnected", f"stage {stage} worker {peer[-8:]}: {exc}")
                    continue
                unreachable = unreachable and isinstance(exc, PeerUnavailable)
                if give_up_unreachable and isinstance(exc, PeerUnavailable):
                    self.balancers[stage].report_failure(peer)
                    dropped = SampleDropped("worker_failures", f"stage {stage} worker {peer[-8:]}: {exc}")
                    dropped.unreachable = unreachable
                    raise dropped from exc
                backoff_s = self.balancers[stage].report_failure(peer)
                self.stats.forward_retries += 1
                self.retries.count(_failure_reason(exc), f"stage {stage} worker {peer[-8:]}: {exc}")
                last_error = str(exc)
                if backoff_s > 0:  # the stage's last usable worker: not banned, retried after a pause
                    tried.remove(peer)
                    logger.debug("stage %d worker %s failed (%s); it is the stage's last, retrying in %.1fs",
                                 stage, peer[-8:], exc, backoff_s)
                    await asyncio.sleep(backoff_s)
                else:
                    logger.debug("stage %d worker %s failed (%s); retrying elsewhere", stage, peer[-8:], exc)
        dropped = SampleDropped("worker_failures", f"stage {stage}: {self.max_attempts} attempts failed; "
                                f"last: {last_error}")
        dropped.unreachable = unreachable
        raise dropped

    async def train_sample(self, sample_id: str, tokens: torch.Tensor) -> SampleResult:
        started = time.perf_counter()
        sample_id = f"{self.id_prefix}{sample_id}"
        inputs: list[Optional[torch.Tensor]] = [None] * self.num_stages
        route: list[str] = [""] * self.num_stages
        """The worker that ran each stage's forward; "" for a stage the sample skipped."""
        skipped: list[int] = []
        coords: Optional[torch.Tensor] = None
        for stage in range(self.num_stages - 1):
            inputs[stage] = coords
            request = ForwardRequest(stage=stage, sample_id=sample_id, tokens=tokens, coords=coords)
            may_skip = self.skipping.may_skip(stage, _run_before(skipped, stage))
            try:
                route[stage], forward = await self._balanced(
                    stage, version.FORWARD, request, ForwardReply,
                    give_up_unreachable=may_skip and self.skipping.active(stage))
            except SampleDropped as exc:
                if not (may_skip and skippable(exc.reason, exc.unreachable)):
                    raise
                self.skipping.skipped(stage, "forward", exc.detail)
                skipped.append(stage)
                continue  # the same coordinates go on to the next stage
            self.skipping.served(stage)
            self.spot_checks.on_forward(stage, route[stage], tokens, coords, forward)
            coords = forward.coords
        tail = self.num_stages - 1
        request = BackwardRequest(stage=tail, sample_id=sample_id, tokens=tokens, coords=coords)
        route[tail], reply = await self._balanced(tail, version.BACKWARD, request, BackwardReply)
        loss, grad, step = reply.loss, reply.grad_input, reply.step
        hops = [KeptHop(tail, route[tail], route[tail], coords, None, reply.version)]
        """What each stage accumulated the sample's gradient from, and who did (retraction.py)."""
        versions: list[Optional[int]] = [None] * self.num_stages
        versions[tail] = reply.version
        if loss is None or grad is None:
            raise SampleDropped("bad_reply", f"tail worker {route[tail][-8:]} sent no loss or gradient")
        self.spot_checks.on_tail(tail, route[tail], tokens, coords, reply)
        fallbacks = 0
        reached = [s for s in range(self.num_stages) if s not in skipped]

        def unreached_from(stage: int) -> list[tuple[int, str]]:
            return [(s, route[s]) for s in range(stage, -1, -1) if s not in skipped]

        for stage in range(self.num_stages - 2, -1, -1):
            if stage in skipped:
                continue  # the gradient at the stage's output is the one at its input
            # The tail's tag makes every stage accumulate this sample into the same global step.
            request = BackwardRequest(stage=stage, sample_id=sample_id, tokens=tokens, coords=inputs[stage],
                                      grad_output=grad, step=step)
            may_skip = self.skipping.may_skip(stage, _run_around(skipped, stage))
            try:
                reply, used_fallback, backward_peer = await self._pinned_backward(stage, route[stage], request,
                                                                                  may_skip=may_skip)
            except SampleDropped as exc:
                if not (may_skip and skippable(exc.reason, exc.unreachable)):
                    exc.step, exc.unreached = step, unreached_from(stage)
                    raise
                # Its forward's worker died after the forward and no replica is left: the gradient
                # passes through as if the stage were the identity (roles/trainer/skipping.py).
                self.skipping.skipped(stage, "backward", exc.detail)
                skipped.append(stage)
                reached.remove(stage)
                continue
            fallbacks += used_fallback
            hops.append(KeptHop(stage, backward_peer, route[stage], inputs[stage], grad, reply.version))
            if stage > 0 and reply.grad_input is not None:
                self.spot_checks.on_backward(stage, route[stage], tokens, inputs[stage], grad, reply)
            grad = reply.grad_input
            versions[stage] = reply.version
            if stage > 0 and grad is None:
                dropped = SampleDropped("bad_reply", f"stage {stage} worker sent no input gradient")
                dropped.step, dropped.unreached = step, unreached_from(stage - 1)
                raise dropped
        for stage in reached:
            self.stats.served[(stage, route[stage])] += 1
        skipped.sort()
        self.skipping.sample_done(skipped)
        if self._keeps and step is not None:
            self.retractions.keep(KeptSample(sample_id, step, tokens, hops))
        return SampleResult(loss=loss, route=route, backward_fallbacks=fallbacks,
                            elapsed_s=time.perf_counter() - started, step=step, versions=versions,
                            skipped=skipped, abandon_to=self.abandon_targets(skipped))

    def abandon_targets(self, skipped: list[int]) -> list[tuple[int, str]]:
        """(stage, worker) for each skipped stage that still lists a worker (one this trainer could
        not reach, which may yet be alive): told that the sample will not come."""
        targets = []
        for stage in skipped:
            known = self.balancers[stage].known()
            if known:
                targets.append((stage, known[0]))
        return targets

    async def evaluate_sample(self, sample_id: str, tokens: torch.Tensor) -> EvaluatedSample:
        """A held-out sample forward through every stage with `agora/v1/evaluate`: no backward, no
        step tag, nothing any stage counts towards a step. Each hop goes to the least-loaded worker
        of its stage and a failed one to another worker (`_evaluation_hop`). A stage without a
        usable worker drops the sample (SampleDropped): evaluation never routes around a stage,
        since the loss would then be another model's."""
        sample_id = f"{self.id_prefix}{sample_id}"
        coords: Optional[torch.Tensor] = None
        tail = self.num_stages - 1
        for stage in range(self.num_stages):
            request = EvaluateRequest(stage=stage, sample_id=sample_id, tokens=tokens, coords=coords)
            peer, reply = await self._evaluation_hop(stage, request)
            if stage < tail:
                if reply.coords is None:
                    raise SampleDropped("bad_reply", f"stage {stage} worker {peer[-8:]} sent no coordinates")
                coords = reply.coords
        if reply.loss is None:
            raise SampleDropped("bad_reply", f"tail worker {peer[-8:]} sent no loss")
        return EvaluatedSample(loss=reply.loss, version=reply.version)

    def _excluder(self, exclude: Optional[Callable[[int, str, str], None]]) -> Callable[[int, str, str], None]:
        def excluded(stage: int, peer: str, why: str) -> None:
            self.spot_checks.stats.served_before_exclusion[peer] = self.stats.served[(stage, peer)]
            if exclude is not None:
                exclude(stage, peer, why)
            self.retractions.exclude(stage, peer)  # after `exclude`: the stage's usable replicas lack it
        return excluded

    async def _retract(self, stage: int, peer: str, request: RetractRequest) -> RetractReply:
        """One `agora/v1/retract` (retraction.py); its failures are the caller's to count."""
        await self.connect(peer)
        return await self.client.request(PeerID.from_base58(peer), version.RETRACT, request, RetractReply,
                                         timeout_s=self.timeout_s)

    async def _evaluation_hop(self, stage: int, request: EvaluateRequest) -> tuple[str, EvaluateReply]:
        """Up to `max_attempts` workers of the stage, each once. A failure is not reported to the
        balancer: evaluation must not ban a worker that training uses (an older worker has no
        evaluate handler at all)."""
        tried: list[str] = []
        last_error = "no attempt made"
        for _ in range(self.max_attempts):
            try:
                peer = self.balancers[stage].choose(1.0, exclude=tried)
            except NoWorkersError as exc:
                if tried:
                    break  # every usable worker of the stage failed once
                raise SampleDropped("no_workers", str(exc)) from exc
            tried.append(peer)
            try:
                return peer, await self._call(stage, peer, version.EVALUATE, request, EvaluateReply)
            except (PeerUnavailable, PeerTimeout, RemoteError) as exc:
                last_error = f"worker {peer[-8:]}: {exc}"
                logger.debug("stage %d evaluation hop failed on %s; trying another worker", stage, last_error)
        raise SampleDropped("worker_failures", f"stage {stage}: {len(tried)} worker(s) failed; last: {last_error}")

    async def abandon(self, sample_id: str, dropped: SampleDropped, timeout_s: float = 5.0) -> int:
        """Tell the stages a tagged sample never reached that it will not come, so they close its
        step now instead of after their timeout. Best effort: returns how many stages took it."""
        if dropped.step is None:
            return 0
        return await self._abandon(sample_id, dropped.step, dropped.unreached, timeout_s)

    async def abandon_skipped(self, sample_id: str, result: SampleResult, timeout_s: float = 2.0) -> int:
        """Tell a skipped stage that still lists a worker (one the trainer could not reach, which
        may yet be alive) that the sample will not come, so that its step does not wait for it."""
        if result.step is None or not result.abandon_to:
            return 0
        return await self._abandon(sample_id, result.step, result.abandon_to, timeout_s)

    async def _abandon(self, sample_id: str, step: int, to: list[tuple[int, str]], timeout_s: float) -> int:
        taken = 0
        for stage, peer in to:
            request = AbandonRequest(stage=stage, sample_id=f"{self.id_prefix}{sample_id}", step=step)
            try:
                await self.connect(peer)
                reply = await self.client.request(PeerID.from_base58(peer), version.ABANDON, request, AbandonReply,
                                                  timeout_s=timeout_s)
                taken += reply.taken
            except (PeerUnavailable, PeerTimeout, ProtocolError) as exc:
                logger.debug("stage %d worker %s did not take the abandon notice: %s", stage, peer[-8:], exc)
        return taken

    async def _pinned_backward(self, stage: int, peer: str, request: BackwardRequest, *,
                               may_skip: bool = False) -> tuple[BackwardReply, int, str]:
        """Backward must run on the forward's replica: replicas drift between averaging rounds,
        so another replica would recompute different activations [report 4.2.1]. When that
        replica is the stage's last usable worker it is retried after the balancer's backoff.

        `may_skip`: the stage could be passed through, so a pinned worker that is unreachable
        while the stage is already skipped (it died) is not waited for. Returns the reply, 1 if it
        came from another worker (else 0), and the worker that ran it."""
        unreachable = True
        reconnected = False
        for attempt in range(self.max_attempts):
            try:
                return await self._call(stage, peer, version.BACKWARD, request, BackwardReply), 0, peer
            except (PeerUnavailable, PeerTimeout, RemoteError) as exc:
                if isinstance(exc, RemoteError) and exc.code not in _RETRYABLE_CODES:
                    raise SampleDropped("rejected", f"stage {stage} backward: {exc}") from exc
                if not reconnected and await self._connection_lost(peer, exc):
                    reconnected = True
                    self.retries.count("backward_reconnected", f"pinned backward worker {peer[-8:]}: {exc}")
                    continue
                unreachable = unreachable and isinstance(exc, PeerUnavailable)
                if may_skip and unreachable and self.skipping.active(stage):
                    self.balancers[stage].report_failure(peer)
                    dropped = SampleDropped("backward_failed", f"stage {stage} backward: {exc}")
                    dropped.unreachable = True
                    raise dropped from exc
                backoff_s = self.balancers[stage].report_failure(peer)
                if backoff_s <= 0:
                    self.retries.count(f"backward_fallback_{_failure_reason(exc)}",
                                       f"pinned backward worker {peer[-8:]} of stage {stage} is gone: {exc}")
                    break
                self.retries.count(f"backward_{_failure_reason(exc)}",
                                   f"pinned backward worker {peer[-8:]}, the last of stage {stage}: {exc}")
                if attempt + 1 == self.max_attempts:
                    dropped = SampleDropped("backward_failed", f"stage {stage}: its last usable worker failed "
                                            f"{self.max_attempts} backward attempts; last: {exc}")
                    dropped.unreachable = unreachable
                    raise dropped from exc
                await asyncio.sleep(backoff_s)
        self.stats.backward_fallbacks += 1
        try:
            other, reply = await self._balanced(stage, version.BACKWARD, request, BackwardReply,
                                                give_up_unreachable=may_skip and self.skipping.active(stage))
        except SampleDropped as exc:
            dropped = SampleDropped("backward_failed", exc.detail)
            dropped.unreachable = skippable(exc.reason, exc.unreachable)
            raise dropped from exc
        return reply, 1, other


def _run_before(skipped: list[int], stage: int) -> int:
    """How many stages right before `stage` the sample skips (forward order: none after it yet)."""
    run = 0
    while stage - run - 1 in skipped:
        run += 1
    return run


def _run_around(skipped: list[int], stage: int) -> int:
    """How many stages right next to `stage`, on either side, the sample skips."""
    run, below = 0, stage - 1
    while below in skipped:
        run, below = run + 1, below - 1
    above = stage + 1
    while above in skipped:
        run, above = run + 1, above + 1
    return run


def _failure_reason(exc: Exception) -> str:
    """A short cause for counting failed calls: timeout, unavailable, or the remote error code."""
    if isinstance(exc, PeerTimeout):
        return "timeout"
    if isinstance(exc, RemoteError):
        return exc.code.name.lower()
    return "unavailable"
