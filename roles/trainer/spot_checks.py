"""Spot checks: a trainer re-executes a fraction of the hops it routed (forward outputs, backward
input gradients, the tail's losses) on another replica of the same stage, and compares.

A credentialed worker can return any tensor of the right shape. Replicas of a stage that exchange
gradients every step hold the same weights at the same weight version, so another replica given
the same input at the same version must return the same result, up to float rounding. A trainer
draws `verification.spot_check_rate` of its hops (`suspect_check_rate` of those of a worker its
screen flagged, roles/trainer/screening.py), keeps what it sent and what it got, and asks
another replica of the stage for the same computation through `agora/v1/evaluate` (no queue,
nothing counted towards a step). The checked worker cannot tell which of its samples are
checked: the check goes elsewhere, after its reply.

Only stages whose replicas add up their gradients every step are checked (`equal_replicas`): with
SparseLoCo, or without the per-step exchange, replicas step on their own samples and differ between
averaging rounds, and a drawn hop there is `unchecked`. A check whose replica is at another version
is `stale` (no verdict), and one whose replica names other weights at that version (a weights
fingerprint: replicas part when one steps without some replica's gradients) is `diverged` (no
verdict either); one with no other replica of the stage is `unchecked`. A result further from the
replica's than `verification.tolerance` (relative L2 distance) is a dispute.

A dispute says that one of two replicas lied, not which: a liar answers the checks it is asked to
run falsely too. Where the stage has a third replica, it re-executes the hop at the same version
and the side it matches is right (honest replicas agree to the last bit); a third that matches
both or neither decides nothing. Its verdict, with the three results signed by their workers, is
evidence the run's authorizer can check by itself (protocol/evidence.py): the trainer reports it
once per accused (`report_evidence`), and the authorizer bans the liar's account. With two
replicas there is no majority: both sides are asked again (a side that contradicts itself lies);
for an output the trainer then re-executes the hop itself on the weights each side computed with
(roles/trainer/reexecution.py; a side its own weights contradict lies). Failing that,
measurements decide (roles/trainer/referee.py), each taken at
one set of weights along its route; their verdicts stay this trainer's. For an output, the loss:
both outputs are carried through the later stages by the same workers to the sample's loss, and
the output whose loss is worse by more than
`verification.loss_margin` (relative) earns its sender a strike; within the margin the dispute
stays unresolved, but which side's loss was worse is counted per pair: honest replicas never
dispute, so a pair that keeps disputing holds a liar, and a side worse far more often than a coin
would be (10 of 10) is struck. A lie that does not change what the model predicts is counted,
not attributed. A worker with `verification.strikes_to_exclude` strikes and fewer than a third as
many disputes resolved in its favour is excluded: this trainer routes nothing more to it. A
strike decided exactly (a third replica, a side contradicting itself, the trainer's own
re-execution: `EXACT_MECHANISMS`) excludes after `verification.exact_strikes_to_exclude` (one):
each of those verdicts is already evidence, and every sample a liar serves while strikes add up
is damage, much of it in steps that close before a retraction reaches them.

Backward hops of the body stages and the tail are checked the same way: the replica re-executes
the backward into the input only (`grad_output`, or `input_grad` at the tail; nothing accumulates)
at the version the worker's gradient was taken at. A gradient dispute is resolved by finite
differences: the sample's loss is carried from the stage's input, moved a little along each
candidate gradient's direction, and the candidate whose slopes predict the measured ones gets it
right; a flipped or zeroed gradient does not. (A liar that also falsifies the forwards of those
moved inputs can tilt this.) A dispute over the tail's loss is decided by each tail's own
consistency: its loss, measured a little way along its own input gradient, must change as that
gradient says; a tail that scales or fixes the loss it reports does not.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import random
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional

import torch

from protocol.evidence import Evidence, loss_tensor
from protocol.evidence import SignedResult as EvidenceResult
from protocol.messages import BackwardReply, EvaluateReply, EvaluateRequest, ForwardReply
from roles.trainer.screening import RECENT, Screening, coherence, loss_size, reply_size

logger = logging.getLogger(__name__)

GRADIENT_ERROR_MAX = 0.5
"""A gradient whose predicted slopes miss the measured ones by more than half their size (and by
four times the other candidate's miss) is in the wrong; finite differences of an honest one miss
by a few percent."""
CHECKS_IN_FLIGHT_MAX = 8
"""Checks waiting for their replica at once; a draw beyond that is not checked (counted `busy`)."""
OUTLIER_SHARE_MAX = 0.2
"""At most this share of a worker's hops (and `RECENT` more) is checked for standing out by itself:
a bound on what a stage whose replies spread widely costs; a liar that lies on one sample in ten
stays well inside it."""
EXACT_MECHANISMS = ("arbiter", "self_contradiction", "reexecuted")
"""What decides a dispute without a measurement of the loss (`Dispute.mechanism`): a re-execution
that honest compute matches within the measured tolerance and a lie does not."""
SIGN_TEST_P = 0.002
"""How unlikely (two-sided) a side's count of worse losses among a pair's close disputes must be
under a coin before it is struck: 10 of 10, 13 of 14, 16 of 17."""
LISTING_EVERY = 64
"""Replies between two looks at which workers discovery still lists; the screen drops the others."""
PROBATION_HOPS = 16
"""A worker's first hops on this trainer are drawn at the suspect rate: the screen holds nothing
of it yet, and a run's first steps, when a lie costs the model most (a step moves the weights most
then), are the ones a liar from the start takes part in. Measured: replays on weights four steps
old and flipped gradients, served for 22-35 samples from a run's start, cost up to 13% held-out."""
PROBATION_VERSIONS = 4
"""Hops computed at the run's first weight versions are drawn at the suspect rate too, whoever
computed them: a worker's first hops may all come before its first lie (a replay on older weights
answers honestly until the stage has stepped), and a lie in those steps changes the run's whole
trajectory. Measured at batch 64: a replay on weights 4 steps old, whose probation went to honest
answers in the first step, served 59 samples and moved the held-out loss by 1.6%."""


@dataclass
class Dispute:
    stage: int
    worker: str
    """The worker whose reply was checked."""
    checker: str
    """The replica that re-executed it."""
    version: int
    distance: float
    """Relative L2 distance of the outputs, or of the losses at the tail."""
    kind: str = "output"
    """What the two disagree on: a forward's `output`, a backward's input `gradient`, the tail's `loss`."""
    measures: Optional[tuple[float, float]] = None
    """What decided it, the worker's then the replica's: for an output, the sample's loss through
    the later stages from each; for a gradient or a loss, each side's slope error (relative)."""
    struck: Optional[str] = None
    """Whom the measures put in the wrong, if anyone."""
    arbiter: Optional[str] = None
    """A third replica whose re-execution matched one side only; `measures` are then the two
    sides' distances from it."""
    sign_test: Optional[tuple[int, int]] = None
    """Decided by the tally of disputes within the loss margin (`SpotChecks._tally`): the struck
    side's output carried the worse loss in the first of these many of the second."""
    self_contradiction: bool = False
    """Decided by asking both sides again: the struck one's second answer contradicted its first;
    `measures` are each side's distance between its two answers."""
    reexecuted: bool = False
    """Decided by the trainer's own re-execution on each side's weights (roles/trainer/reexecution.py):
    `measures` are each side's distance from what its own weights compute (inf: weights that do not
    carry their fingerprint; NaN: a side that could not be judged)."""
    signed: Optional[tuple["_Hop", "SignedResult"]] = field(default=None, repr=False, compare=False)
    """The hop and the checker's signed result: two-replica evidence, should the verdict exclude."""

    @property
    def mechanism(self) -> str:
        """What decided it: `arbiter`, `self_contradiction`, `reexecuted` (the trainer's own
        re-execution on each side's weights), `tally`, `loss` (an output's loss through the later
        stages) or `slope` (a gradient's or a tail loss's slope error)."""
        if self.arbiter:
            return "arbiter"
        if self.self_contradiction:
            return "self_contradiction"
        if self.reexecuted:
            return "reexecuted"
        if self.sign_test:
            return "tally"
        return "loss" if self.kind == "output" else "slope"


@dataclass
class SpotCheckStats:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    """agreed, disputed (of which some unresolved), stale, unchecked, busy, failed; targeted:
    checks drawn at the suspect rate; outlier: hops checked because the reply stood out by itself;
    tallied: strikes decided by the tally of disputes within the loss margin; probation: checks drawn
    at the suspect rate among a worker's first hops (`PROBATION_HOPS`) and the run's first versions
    (`PROBATION_VERSIONS`);
    diverged: the replica answered at the same version with other weights (replicas that parted
    after a step one of them took without some gradients); on the workers path
    (roles/trainer/chain_checks.py) also not_kept: a neighbour no longer held what the check
    needed, and unbound: the worker's signature did not bind what its neighbours kept."""
    largest_agreed: float = 0.0
    """The largest distance among the agreed checks: how close honest replicas are."""
    disputes: list[Dispute] = field(default_factory=list)
    strikes: collections.Counter = field(default_factory=collections.Counter)
    """Disputes resolved against each worker."""
    strikes_by_mechanism: dict[str, collections.Counter] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    """Worker -> strikes by what decided them (`Dispute.mechanism`): the disputes list keeps only the
    latest, this counts them all."""
    favoured: collections.Counter = field(default_factory=collections.Counter)
    """Disputes resolved in each worker's favour."""
    excluded: dict[str, str] = field(default_factory=dict)
    """Worker -> why it was excluded."""
    served_before_exclusion: dict[str, int] = field(default_factory=dict)
    """Worker -> samples this trainer had completed through it when it was excluded."""
    parted: collections.Counter = field(default_factory=collections.Counter)
    """Worker -> checks where a third replica showed it held other weights than its stage."""
    evidence: collections.Counter = field(default_factory=collections.Counter)
    """Evidence sent to the authorizer, by its verdict (`upheld`, `already_revoked`, `rejected`),
    or `failed` (not delivered), `unsigned` (a party that does not sign its results), `invalid`
    (a reply that does not fit the evidence's schema)."""

    def summary(self) -> dict:
        return {**{k: self.outcomes.get(k, 0) for k in ("agreed", "disputed", "unresolved", "stale", "unchecked", "busy",
                                                         "failed", "targeted", "diverged", "outlier",
                                                         "tallied", "probation", "not_kept", "unbound")},
                "resolved": sum(self.strikes.values()), "largest_agreed_distance": self.largest_agreed,
                "strikes": dict(self.strikes),
                "strikes_by_mechanism": {peer: dict(by) for peer, by in self.strikes_by_mechanism.items()},
                "excluded": dict(self.excluded),
                "served_before_exclusion": dict(self.served_before_exclusion),
                "evidence": dict(self.evidence), "parted": dict(self.parted),
                "disputes": [{"stage": d.stage, "worker": d.worker, "checker": d.checker, "version": d.version,
                              "kind": d.kind,
                              "distance": round(d.distance, 6),
                              "measures": None if d.measures is None else [_rounded(x) for x in d.measures],
                              "struck": d.struck, "arbiter": d.arbiter,
                              "self_contradiction": d.self_contradiction, "reexecuted": d.reexecuted,
                              "sign_test": None if d.sign_test is None else list(d.sign_test)}
                             for d in self.disputes[-16:]]}


@dataclass
class _Hop:
    """One drawn hop: what the worker was given and what it answered, signed."""

    stage: int
    worker: str
    tokens: torch.Tensor
    coords: Optional[torch.Tensor]
    version: Optional[int]
    kind: str
    """`output`, `gradient` or `loss` (protocol/evidence.py)."""
    claimed: Any
    """The worker's result: a tensor, or the tail's loss (a float)."""
    attestation: Optional[bytes]
    weights: Optional[bytes] = None
    """The fingerprint of the weights the worker said it used (None: a worker that does not say)."""
    grad_output: Optional[torch.Tensor] = None

    def request_fields(self) -> dict:
        """What else an evaluation of this hop asks for: the backward into the input, for a gradient."""
        if self.kind != "gradient":
            return {}
        return dict(grad_output=self.grad_output, input_grad=self.grad_output is None, version=self.version)

    def pick(self, reply: EvaluateReply) -> Any:
        """The part of an evaluation's reply that compares with `claimed`."""
        return {"output": reply.coords, "gradient": reply.grad_input, "loss": reply.loss}[self.kind]


@dataclass
class SignedResult:
    peer: str
    result: Any
    attestation: Optional[bytes]
    weights: Optional[bytes] = None

    def signed(self) -> EvidenceResult:
        result = self.result if isinstance(self.result, torch.Tensor) else loss_tensor(self.result)
        return EvidenceResult(peer_id=self.peer, result=result, attestation=self.attestation)


class SpotChecks:
    """Draws hops to check and runs the checks in background tasks.

    `evaluate(stage, peer, request)` sends one `agora/v1/evaluate` to that worker; `replicas(stage)`
    lists the stage's usable workers."""

    def __init__(self, rate: float, tolerance: float,
                 evaluate: Callable[[int, str, EvaluateRequest], Awaitable[EvaluateReply]],
                 replicas: Callable[[int], list[str]], rng: Optional[random.Random] = None, *,
                 losses: Optional[Callable[[int, torch.Tensor, list[torch.Tensor]], Awaitable[list[float]]]] = None,
                 slopes: Optional[Callable[[int, torch.Tensor, torch.Tensor, list[torch.Tensor]],
                                           Awaitable[list[float]]]] = None,
                 consistency: Optional[Callable[[int, str, torch.Tensor, torch.Tensor], Awaitable[float]]] = None,
                 loss_margin: float = 0.01, strikes_to_exclude: int = 3, exact_strikes_to_exclude: int = 1,
                 exclude: Optional[Callable[[int, str, str], None]] = None,
                 equal_replicas: Callable[[int], bool] = lambda stage: True,
                 suspect_rate: Optional[float] = None, run_id: str = "",
                 report_evidence: Optional[Callable[[Evidence], Awaitable[str]]] = None,
                 route_around: Optional[Callable[[int, str], None]] = None,
                 weights_referee: Optional[Any] = None):
        self.rate = rate
        self._weights_referee = weights_referee
        """roles/trainer/reexecution.py WeightsReferee: re-executes a two-replica output dispute on
        each side's own weights (`judge`), before the loss is asked; None: off."""
        self._route_around = route_around
        """(stage, worker): stop routing to a replica that parted from its stage, for a while."""
        self._run_id = run_id
        self._report_evidence = report_evidence
        """Sends evidence to the run's authorizer and returns its verdict; None in an open run."""
        self._reported: set[str] = set()
        """Workers evidence was sent against (or is being sent): one report each suffices."""
        self.suspect_rate = rate if suspect_rate is None else max(rate, suspect_rate)
        """The rate for a worker the screen flagged (roles/trainer/screening.py)."""
        self.screening = Screening()
        self.tolerance = tolerance
        self._evaluate = evaluate
        self._replicas = replicas
        self._losses = losses
        """(stage, tokens, candidate outputs of the stage) -> each one's loss through the later stages."""
        self._slopes = slopes
        """(stage, tokens, input coords, unit directions) -> the loss's slope at the input along each."""
        self._consistency = consistency
        """(stage, tail worker, tokens, input coords) -> how far its losses are from what its own
        input gradient predicts (relative)."""
        self.loss_margin = loss_margin
        self.strikes_to_exclude = strikes_to_exclude
        self.exact_strikes_to_exclude = exact_strikes_to_exclude
        self._exclude = exclude
        """(stage, worker, why): stop routing to a worker."""
        self._equal_replicas = equal_replicas
        """Whether a stage's replicas hold the same weights at the same version (per-step gradient exchange)."""
        self._rng = rng or random.Random()
        self._signs: dict[tuple[int, frozenset], collections.Counter] = collections.defaultdict(collections.Counter)
        """(stage, the disputing pair) -> each side's count of worse losses within the margin."""
        self._tasks: set[asyncio.Task] = set()
        self.stats = SpotCheckStats()
        self._hops: collections.Counter = collections.Counter()
        self._outlier_checks: collections.Counter = collections.Counter()
        self._since_listing: collections.Counter = collections.Counter()

    def draw(self, stage: Optional[int] = None, worker: Optional[str] = None, outlier: bool = False,
             version: Optional[int] = None) -> bool:
        """Whether to check a hop: always for a reply the screen found an outlier by itself (up to
        `OUTLIER_SHARE_MAX` of the worker's hops), else at the base rate, or the suspect rate for
        a flagged worker, for a worker's first `PROBATION_HOPS` and for a hop computed at one of
        the run's first `PROBATION_VERSIONS` weight versions."""
        if self.rate <= 0:
            return False
        if worker is not None:
            self._hops[worker] += 1
            if outlier and self._outlier_checks[worker] < OUTLIER_SHARE_MAX * self._hops[worker] + RECENT:
                self._outlier_checks[worker] += 1
                self.stats.outcomes["outlier"] += 1
                return True
        suspect = worker is not None and self.screening.suspect(stage, worker)
        on_probation = ((worker is not None and self._hops[worker] <= PROBATION_HOPS)
                        or (version is not None and version < PROBATION_VERSIONS))
        drawn = self._rng.random() < (self.suspect_rate if suspect or on_probation else self.rate)
        if drawn and suspect:
            self.stats.outcomes["targeted"] += 1  # drawn at the suspect rate
        elif drawn and on_probation:
            self.stats.outcomes["probation"] += 1
        return drawn

    # ---- what the pipeline calls for every hop: screen it, maybe check it ----

    def on_forward(self, stage: int, worker: str, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                   reply: ForwardReply) -> None:
        if self.rate > 0:
            self.drop_unlisted(stage)
            outlier = self.screening.stands_out(
                worker, self.screening.observe(stage, "output", worker, reply_size(reply.coords), reply.version),
                self._observe_coherence(stage, "output_coherence", worker, coords, reply.coords, reply.version))
            if self.draw(stage, worker, outlier, reply.version):
                self.check_forward(stage, worker, tokens, coords, reply.coords, reply.version, reply.attestation,
                                   reply.weights)

    def on_tail(self, stage: int, worker: str, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                reply: BackwardReply) -> None:
        if self.rate > 0:
            self.drop_unlisted(stage)
            if self.draw(stage, worker, self.screen_loss(stage, worker, reply.loss, reply.version), reply.version):
                self.check_loss(stage, worker, tokens, coords, reply.loss, reply.version, reply.loss_attestation,
                                reply.weights)
            if stage > 0:
                self.on_backward(stage, worker, tokens, coords, None, reply)

    def on_backward(self, stage: int, worker: str, tokens: torch.Tensor, coords: torch.Tensor,
                    grad_output: Optional[torch.Tensor], reply: BackwardReply) -> None:
        if self.rate > 0:
            outlier = self.screening.stands_out(
                worker,
                self.screening.observe(stage, "gradient", worker, reply_size(reply.grad_input), reply.version),
                self._observe_coherence(stage, "gradient_coherence", worker, grad_output, reply.grad_input,
                                        reply.version))
            if self.draw(stage, worker, outlier, reply.version):
                self.check_backward(stage, worker, tokens, coords, grad_output, reply.grad_input, reply.version,
                                    reply.attestation, reply.weights)

    def screen_loss(self, stage: int, worker: str, loss: float, version: Optional[int]) -> bool:
        """Note a tail's loss in the screen; whether it stands out by itself (an outlier to check)."""
        return self.screening.stands_out(
            worker, self.screening.observe(stage, "loss", worker, loss_size(loss), version))

    def _observe_coherence(self, stage: int, kind: str, worker: str, given: Optional[torch.Tensor],
                           answer: Optional[torch.Tensor], version: Optional[int]) -> float:
        """The reply's coherence score (`Screening.observe`), 0.0 where there is none to take."""
        value = coherence(given, answer)
        return 0.0 if value is None else self.screening.observe(stage, kind, worker, value, version)

    def drop_unlisted(self, stage: int) -> None:
        """Every `LISTING_EVERY` replies, drop from the screen the workers of this stage that
        discovery no longer lists (one revoked on another trainer's evidence, one that left): its
        replicas are no longer held against its old replies, and stay no suspects because of them."""
        self._since_listing[stage] += 1
        if self._since_listing[stage] < LISTING_EVERY:
            return
        self._since_listing[stage] = 0
        listed = set(self._replicas(stage))
        if not listed:
            return  # discovery knows nobody for now: no reason to forget anyone
        for worker in self.screening.workers(stage) - listed:
            self.screening.drop(stage, worker)
            self._hops.pop(worker, None)
            self._outlier_checks.pop(worker, None)
            for pair in [pair for pair in self._signs if pair[0] == stage and worker in pair[1]]:
                del self._signs[pair]

    def check_forward(self, stage: int, worker: str, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                      output: torch.Tensor, version: Optional[int], attestation: Optional[bytes] = None,
                      weights: Optional[bytes] = None) -> None:
        """Check a forward hop's output later, on another replica (call only for a drawn hop)."""
        self._start(_Hop(stage, worker, tokens, coords, version, "output", output, attestation, weights))

    def check_loss(self, stage: int, worker: str, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                   loss: float, version: Optional[int], attestation: Optional[bytes] = None,
                   weights: Optional[bytes] = None) -> None:
        """Check the tail's reported loss against another tail replica's evaluation of the same input."""
        self._start(_Hop(stage, worker, tokens, coords, version, "loss", loss, attestation, weights))

    def check_backward(self, stage: int, worker: str, tokens: torch.Tensor, coords: torch.Tensor,
                       grad_output: Optional[torch.Tensor], grad_input: torch.Tensor, version: Optional[int],
                       attestation: Optional[bytes] = None, weights: Optional[bytes] = None) -> None:
        """Check a backward hop's input gradient later, on another replica (a body stage, with the
        output gradient it was sent; or the tail, `grad_output` None)."""
        self._start(_Hop(stage, worker, tokens, coords, version, "gradient", grad_input, attestation, weights,
                         grad_output=grad_output))

    def _start(self, hop: _Hop) -> None:
        if hop.version is None or not self._equal_replicas(hop.stage):
            self.stats.outcomes["unchecked"] += 1  # a worker that does not say its version, or unequal replicas
            return
        if len(self._tasks) >= CHECKS_IN_FLIGHT_MAX:
            self.stats.outcomes["busy"] += 1
            return
        task = asyncio.ensure_future(self._check(hop))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _recompute(self, hop: _Hop, peer: str) -> tuple[Optional[SignedResult], Optional[str]]:
        """`peer`'s re-execution of the hop, or None and why not: it failed, answered at another
        version (`stale`) or with other weights (`diverged`), or sent nothing comparable."""
        request = EvaluateRequest(stage=hop.stage, sample_id=f"check-{uuid.uuid4().hex[:16]}", tokens=hop.tokens,
                                  coords=hop.coords, **hop.request_fields())
        try:
            reply = await self._evaluate(hop.stage, peer, request)
        except Exception as exc:  # noqa: BLE001 - a replica that cannot answer decides nothing
            logger.debug("spot check on stage %d replica %s failed: %s", hop.stage, peer[-8:], exc)
            return None, "failed"
        if reply.version != hop.version:
            return None, "stale"
        result = hop.pick(reply)
        if result is None:
            return None, "failed"
        signed = SignedResult(peer, result, reply.attestation, reply.weights)
        if hop.weights is not None and reply.weights is not None and reply.weights != hop.weights:
            return signed, "diverged"  # the same version, other weights: the replicas parted, nobody lied here
        return signed, None

    async def _check(self, hop: _Hop) -> None:
        others = [peer for peer in self._replicas(hop.stage) if peer != hop.worker]
        if not others:
            self.stats.outcomes["unchecked"] += 1
            return
        checker = self._rng.choice(others)
        recomputed, failure = await self._recompute(hop, checker)
        gap = None if failure else result_distance(hop.claimed, recomputed.result)
        if failure == "diverged":
            self.stats.outcomes["diverged"] += 1
            await self._find_parted(hop, recomputed, [peer for peer in others if peer != checker])
        elif gap is None:
            self.stats.outcomes[failure or "failed"] += 1
        elif gap <= self.tolerance:
            self.stats.outcomes["agreed"] += 1
            self.stats.largest_agreed = max(self.stats.largest_agreed, gap)
        else:
            self.stats.outcomes["disputed"] += 1
            dispute = Dispute(hop.stage, hop.worker, checker, hop.version, gap, kind=hop.kind)
            self.stats.disputes.append(dispute)
            del self.stats.disputes[:-64]
            logger.warning("spot check: stage %d worker %s and replica %s disagree at version %d (distance %.3g, "
                           "tolerance %.3g)", hop.stage, hop.worker[-8:], checker[-8:], hop.version, gap,
                           self.tolerance)
            thirds = [peer for peer in others if peer != checker]
            if thirds and await self._arbitrate(dispute, hop, recomputed, self._rng.choice(thirds)):
                return
            if await self._ask_again(dispute, hop, recomputed):
                return
            dispute.signed = (hop, recomputed)
            if hop.kind == "output" and await self._reexecute(dispute, hop, recomputed):
                return
            if hop.kind == "gradient" and self._slopes is not None:
                await self._resolve_gradient(dispute, hop.tokens, hop.coords, hop.claimed, recomputed.result)
            elif hop.kind == "output" and self._losses is not None:
                await self._resolve(dispute, hop.tokens, hop.claimed, recomputed.result)
            elif hop.kind == "loss" and self._consistency is not None:
                await self._resolve_loss(dispute, hop.tokens, hop.coords)
            else:
                self.stats.outcomes["unresolved"] += 1

    async def _arbitrate(self, dispute: Dispute, hop: _Hop, recomputed: SignedResult, arbiter: str) -> bool:
        """A third replica re-executes the hop at the same version: honest replicas agree to the
        last bit, so the side it matches is right, whatever a measurement of the loss would say.
        False (no verdict) when it matches both or neither, or cannot answer at that version.
        A verdict with all three results signed is evidence the authorizer can check itself."""
        third, failure = await self._recompute(hop, arbiter)
        if failure:
            return False
        gaps = (result_distance(hop.claimed, third.result), result_distance(recomputed.result, third.result))
        if None in gaps or (gaps[0] <= self.tolerance) == (gaps[1] <= self.tolerance):
            return False
        dispute.arbiter, dispute.measures = arbiter, gaps
        claim = SignedResult(hop.worker, hop.claimed, hop.attestation)
        accused, witness = (claim, recomputed) if gaps[0] > self.tolerance else (recomputed, claim)
        self._strike(dispute, accused.peer)
        self._report(hop, accused, [witness, third])
        return True

    async def _ask_again(self, dispute: Dispute, hop: _Hop, recomputed: SignedResult) -> bool:
        """Both sides re-execute the hop once more: honest compute is deterministic at one version
        (replicas agree to the last bit), so a side whose second answer contradicts its first lies,
        whichever way its lie goes (random noise, say) and without a third replica. Its two signed
        results are evidence by themselves. False (no verdict) when both or neither contradict
        themselves, or a side cannot answer at that version."""
        first = [SignedResult(hop.worker, hop.claimed, hop.attestation, hop.weights), recomputed]
        again = [await self._recompute(hop, side.peer) for side in first]
        if any(failure for _, failure in again):
            return False
        gaps = [result_distance(side.result, second.result) for side, (second, _) in zip(first, again)]
        if None in gaps or (gaps[0] > self.tolerance) == (gaps[1] > self.tolerance):
            return False
        liar = 0 if gaps[0] > self.tolerance else 1
        dispute.measures, dispute.self_contradiction = (gaps[0], gaps[1]), True
        self._strike(dispute, first[liar].peer)
        self._report(hop, first[liar], [again[liar][0]])
        return True

    async def _reexecute(self, dispute: Dispute, hop: _Hop, recomputed: SignedResult) -> bool:
        """The trainer re-executes the hop on the weights each side computed with at its version:
        a side further than `tolerance` from what its own weights compute (or whose weights do not
        carry the fingerprint it signed) lied. False (no verdict) when the referee is off, cannot
        get or judge the weights, or both sides compute what they claim."""
        referee = self._weights_referee
        if referee is None or not referee.enabled or not isinstance(hop.claimed, torch.Tensor):
            return False
        from roles.trainer.reexecution import Side

        gaps = await referee.judge(hop.stage, hop.version, hop.tokens, hop.coords,
                                   [Side(hop.worker, hop.claimed, hop.weights),
                                    Side(recomputed.peer, recomputed.result, recomputed.weights)])
        if gaps is None:
            return False
        liars = [side for side, gap in zip((hop.worker, recomputed.peer), gaps)
                 if gap is not None and not gap <= self.tolerance]
        if not liars:
            return False
        dispute.reexecuted = True
        dispute.measures = tuple(float("nan") if gap is None else gap for gap in gaps)
        for liar in liars:  # both, if both lied: neither is then in the right
            self._strike(dispute, liar, favour=len(liars) == 1)
        return True

    async def _find_parted(self, hop: _Hop, checker: SignedResult, thirds: list[str]) -> None:
        """The worker and its checker name other weights at one version: a third replica's says
        which of the two parted from the stage. The one that did is routed around for a while (a
        replica's next averaging round brings it back; a liar that names false weights to dodge its
        checks is routed around for good). No strike: parting is no lie."""
        if not thirds:
            return
        third, failure = await self._recompute(hop, self._rng.choice(thirds))
        if third is None or failure not in (None, "diverged") or third.weights is None:
            return
        if third.weights == checker.weights:
            parted = hop.worker
        elif third.weights == hop.weights:
            parted = checker.peer
        else:
            return
        self.stats.parted[parted] += 1
        logger.warning("spot check: stage %d worker %s holds other weights than its replicas at version %d; "
                       "routing around it", hop.stage, parted[-8:], hop.version)
        if self._route_around is not None:
            self._route_around(hop.stage, parted)

    def _report(self, hop: _Hop, accused: SignedResult, witnesses: list[SignedResult]) -> None:
        """Send the evidence to the run's authorizer (once per accused, in the background)."""
        if self._report_evidence is None or accused.peer in self._reported:
            return
        if any(party.attestation is None for party in (accused, *witnesses)):
            self.stats.evidence["unsigned"] += 1  # a worker that predates signed results
            return
        try:
            evidence = Evidence(
                run_id=self._run_id, stage=hop.stage, version=hop.version, weights=hop.weights, kind=hop.kind,
                tokens=hop.tokens, coords=hop.coords, grad_output=hop.grad_output,
                accused=accused.signed(), witnesses=[w.signed() for w in witnesses])
        except ValueError as exc:  # pydantic's ValidationError: a reply that cannot be put in evidence
            self.stats.evidence["invalid"] += 1
            logger.warning("the evidence against worker %s cannot be built: %s", accused.peer[-8:], exc)
            return
        self._reported.add(accused.peer)

        async def send() -> None:
            try:
                verdict = await self._report_evidence(evidence)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the authorizer unreachable: the next verdict tries again
                self._reported.discard(accused.peer)
                self.stats.evidence["failed"] += 1
                logger.warning("could not report evidence against worker %s to the authorizer: %s",
                               accused.peer[-8:], exc)
                return
            self.stats.evidence[verdict] += 1
            logger.warning("evidence against worker %s reported to the authorizer: %s", accused.peer[-8:], verdict)

        task = asyncio.ensure_future(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, dispute: Dispute, tokens: torch.Tensor, claimed: torch.Tensor,
                       recomputed: torch.Tensor) -> None:
        """Carry both outputs to the loss; strike the sender of the clearly worse one."""
        try:
            worker_loss, checker_loss = await self._losses(dispute.stage, tokens, [claimed, recomputed])
        except Exception as exc:  # noqa: BLE001 - a later stage that cannot answer decides nothing
            logger.debug("could not carry a disputed output of stage %d to the loss: %s", dispute.stage, exc)
            self.stats.outcomes["unresolved"] += 1
            return
        dispute.measures = (worker_loss, checker_loss)
        margin = self.loss_margin * max(min(worker_loss, checker_loss), 1e-6)
        if not (abs(worker_loss - checker_loss) > margin):  # NaN too: no verdict
            self.stats.outcomes["unresolved"] += 1
            self._tally(dispute, worker_loss, checker_loss)
            return
        self._strike(dispute, dispute.worker if worker_loss > checker_loss else dispute.checker)

    def _tally(self, dispute: Dispute, worker_loss: float, checker_loss: float) -> None:
        """Count which side's output carried the worse loss in a dispute within the margin. Honest
        replicas never dispute (they agree to the last bit), so a pair that keeps disputing holds a
        liar; a liar whose lie costs less than the margin per sample but costs it every time is
        worse far more often than a coin would be (`SIGN_TEST_P`, two-sided), and is struck once
        its side's count says so. The tally then starts again."""
        if not (worker_loss != checker_loss and max(worker_loss, checker_loss) < float("inf")):
            return  # NaN or a tie: no sign
        worse = dispute.worker if worker_loss > checker_loss else dispute.checker
        tally = self._signs[(dispute.stage, frozenset((dispute.worker, dispute.checker)))]
        tally[worse] += 1
        n, k = sum(tally.values()), tally[worse]
        if 2 * _binomial_tail(k, n) >= SIGN_TEST_P:
            return
        tally.clear()
        dispute.sign_test = (k, n)
        self.stats.outcomes["unresolved"] -= 1  # resolved after all, by the tally
        self.stats.outcomes["tallied"] += 1
        self._strike(dispute, worse)

    async def _resolve_gradient(self, dispute: Dispute, tokens: torch.Tensor, coords: torch.Tensor,
                                claimed: torch.Tensor, recomputed: torch.Tensor) -> None:
        """Measure the loss's slopes at the stage's input along both candidates' directions; the
        candidate whose predicted slopes are far off is struck."""
        candidates = [claimed.float(), recomputed.float()]
        directions = [g / torch.linalg.vector_norm(g) for g in candidates if torch.linalg.vector_norm(g) > 0]
        try:
            measured = await self._slopes(dispute.stage, tokens, coords, directions)
        except Exception as exc:  # noqa: BLE001 - a stage that cannot answer decides nothing
            logger.debug("could not measure the slopes of a disputed gradient of stage %d: %s", dispute.stage, exc)
            self.stats.outcomes["unresolved"] += 1
            return
        scale = sum(abs(m) for m in measured) + 1e-12
        errors = [sum(abs(float(torch.dot(g.flatten(), d.flatten())) - m) for d, m in zip(directions, measured)) / scale
                  for g in candidates]
        dispute.measures = (errors[0], errors[1])  # for a gradient: each candidate's slope error, relative
        self._judge(dispute, errors)

    async def _resolve_loss(self, dispute: Dispute, tokens: torch.Tensor, coords: torch.Tensor) -> None:
        """Each tail's losses against its own gradient; the inconsistent one is struck."""
        try:
            errors = [await self._consistency(dispute.stage, peer, tokens, coords)
                      for peer in (dispute.worker, dispute.checker)]
        except Exception as exc:  # noqa: BLE001 - a tail that cannot answer decides nothing
            logger.debug("could not test the tails' losses of stage %d: %s", dispute.stage, exc)
            self.stats.outcomes["unresolved"] += 1
            return
        dispute.measures = (errors[0], errors[1])
        self._judge(dispute, errors)

    def _judge(self, dispute: Dispute, errors: list[float]) -> None:
        """Strike the side whose error is large and four times the other's; else no verdict."""
        worse, better = max(errors), min(errors)
        if not (worse > GRADIENT_ERROR_MAX and better < worse / 4):  # NaN too: no verdict
            self.stats.outcomes["unresolved"] += 1
            return
        self._strike(dispute, dispute.worker if errors[0] > errors[1] else dispute.checker)

    def _strike(self, dispute: Dispute, struck: str, favour: bool = True) -> None:
        spared = dispute.checker if struck == dispute.worker else dispute.worker
        dispute.struck = struck
        self.stats.strikes[struck] += 1
        self.stats.strikes_by_mechanism[struck][dispute.mechanism] += 1
        if favour:
            self.stats.favoured[spared] += 1
        strikes, favoured = self.stats.strikes[struck], self.stats.favoured[struck]
        exact = sum(self.stats.strikes_by_mechanism[struck][m] for m in EXACT_MECHANISMS)
        if ((strikes >= self.strikes_to_exclude or exact >= self.exact_strikes_to_exclude)
                and 3 * favoured < strikes and struck not in self.stats.excluded):
            what = ("distance from a third replica" if dispute.arbiter
                    else "distance between its own two answers" if dispute.self_contradiction
                    else "distance from what its own weights compute" if dispute.reexecuted
                    else f"worse loss in {dispute.sign_test[0]} of {dispute.sign_test[1]} close disputes, last"
                    if dispute.sign_test else "loss" if dispute.kind == "output" else "slope error")
            mine, other = dispute.measures[::1 if struck == dispute.worker else -1]
            if not dispute.reexecuted:
                mine, other = max(dispute.measures), min(dispute.measures)
            why = (f"{strikes} spot-check dispute{'s' if strikes > 1 else ''} on stage {dispute.stage} "
                   f"resolved against it ({exact} decided exactly, {favoured} in its favour); "
                   f"last: {what} {mine:.4g} against {other:.4g} at version {dispute.version}")
            self.stats.excluded[struck] = why
            self.screening.forget(dispute.stage, struck)
            logger.warning("excluding worker %s: %s", struck[-8:], why)
            if dispute.signed is not None:  # two replicas: the pair's contradiction, and this trainer's verdict
                hop, recomputed = dispute.signed
                claim = SignedResult(hop.worker, hop.claimed, hop.attestation)
                self._report(hop, *((claim, [recomputed]) if struck == hop.worker else (recomputed, [claim])))
            if self._exclude is not None:
                self._exclude(dispute.stage, struck, why)

    def summary(self) -> dict:
        """The trainer summary's `spot_checks`: the checks' counts and verdicts, and the screen's
        (and the weights referee's, where there is one)."""
        referee = {} if self._weights_referee is None else {"referee": self._weights_referee.summary()}
        return {**self.stats.summary(), "screening": self.screening.summary(), **referee}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)


def _rounded(x: float):
    """A measure for the summary (JSON): rounded, or None for NaN and a string for infinity."""
    return None if math.isnan(x) else "inf" if math.isinf(x) else round(x, 6)


def _binomial_tail(k: int, n: int) -> float:
    """P(at least k heads in n fair coin tosses)."""
    return sum(math.comb(n, i) for i in range(k, n + 1)) / 2**n


def result_distance(claimed, recomputed) -> Optional[float]:
    """How far apart two results of a hop are: relative L2 distance of tensors, relative difference
    of losses; None when one is missing or of another shape."""
    if claimed is None or recomputed is None:
        return None
    if not isinstance(claimed, torch.Tensor):
        return abs(recomputed - claimed) / max(abs(recomputed), 1e-6)
    if not isinstance(recomputed, torch.Tensor) or recomputed.shape != claimed.shape:
        return None
    a, b = claimed.float(), recomputed.float()
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-12))
