"""Spot checks on the workers path (`routing.path: workers`): the hops of a chained sample, checked
with what the checked worker's neighbours kept of it.

On its own path a trainer keeps the input it sent and the signed reply it got (spot_checks.py).
On the workers path it sees neither: the head passes coordinates to the next stage's worker and so
on, and the gradients come back the same way. Every worker signs what it passes on, as it signs a
ForwardReply or a BackwardReply, and keeps for a short while what it sent and got, with the
signer's signature (roles/worker/serving/hop_records.py). Once a chained sample completed, this
trainer draws its hops as SpotChecks draws its own (the same rates, probation, the suspect rate,
the tail's loss screened and the outlier budget), and for a hop of stage s run by worker W asks
W's neighbours, never W: what the worker before W sent it (the head's input is this trainer's own
tokens), what the worker after W got from W with W's signature (the tail's loss is in the chain's
reply, signed), and for a backward the gradient the worker after W sent back and the one the
worker before W got from W. W was asked nothing before its results were signed and passed on, and
is asked nothing now, so it cannot tell which of its samples are checked.

Before a hop is checked, its signature must bind what the neighbours returned: W's signature over
the result, given the input (and output gradient) its neighbours say W was given, must verify under
W's peer id. Then the hop goes to SpotChecks as if this trainer had routed it, and everything after
is the same: another replica re-executes it, a dispute goes to a third replica, to both sides asked
again, or to the referee's measurements; strikes, exclusion and evidence to the authorizer.

A check that cannot be made is counted, never a verdict: `not_kept` when a neighbour no longer
holds the record (evicted, gone, or unreachable); `unbound` when the signature does not bind what
the neighbours returned. Each worker checks its neighbours' signatures before it uses what they
sent (roles/worker/serving/chain_signatures.py), so W cannot have passed on a result signed over
an input it was not given; an `unbound` hop says a neighbour's record is false, or that W and a
neighbour lied together, and this cannot tell which. It is counted per worker checked: an honest
chain never produces one. A hop that came unsigned (a worker older than signed chains, or next to
one) is not checked, and counted per worker too.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import torch

from protocol.errors import ErrorCode, RemoteError
from protocol.evidence import hop_holds, loss_tensor, tensor_digest
from protocol.messages import ChainReply, HopRecordReply, HopRecordRequest, SignedHop
from roles.trainer.spot_checks import CHECKS_IN_FLIGHT_MAX, SpotChecks

logger = logging.getLogger(__name__)

Fetch = Callable[[int, str, HopRecordRequest], Awaitable[HopRecordReply]]
"""(the neighbour's stage, its peer id, the request) -> its record; raises when it cannot answer."""


@dataclass(frozen=True)
class _Drawn:
    """A drawn hop of a chained sample and the neighbours that hold what its check needs."""

    kind: str
    """`output`, `gradient` or `loss` (protocol/evidence.py)."""
    stage: int
    worker: str
    before: Optional[tuple[int, str]]
    """(stage, worker) that sent this stage its input; None at the head."""
    after: Optional[tuple[int, str]]
    """(stage, worker) this stage sent its output to; None at the tail."""


class _NotKept(Exception):
    """A neighbour could not hand a record: the check is not made."""


class ChainChecks:
    """Draws the hops of completed chained samples and hands each drawn one, with what its
    neighbours kept, to `spot_checks`."""

    def __init__(self, spot_checks: SpotChecks, fetch: Fetch, *, run_id: str, num_stages: int):
        self.spot_checks = spot_checks
        self._fetch = fetch
        self.run_id = run_id
        self.num_stages = num_stages
        self._tasks: set[asyncio.Task] = set()
        self.counters: collections.Counter[str] = collections.Counter()
        """drawn (hops), fetched and fetch_<reason> (records asked of neighbours), handed (hops
        handed to the spot checks), not_kept, unbound, unsigned, busy."""
        self.unbound: collections.Counter[str] = collections.Counter()
        """Worker -> its checked hops whose signature did not bind its neighbours' records."""
        self.unsigned: collections.Counter[str] = collections.Counter()
        """Worker -> its drawn hops that came with no signature (nor version): not checked."""

    def on_sample(self, sample_id: str, tokens: torch.Tensor, reply: ChainReply) -> None:
        """A chained sample completed (`reply` covers its route): draw its hops, and check the
        drawn ones in the background."""
        checks = self.spot_checks
        if checks.rate <= 0:
            return
        ran = sorted({(done.stage, done.worker) for done in reply.stages
                      if done.worker and not done.skipped and 0 <= done.stage < self.num_stages})
        if len({stage for stage, _ in ran}) != len(ran):
            return  # two workers named for one stage: a reply the route check let through; nothing to draw
        tail = self.num_stages - 1
        # the version the tail signed its loss at stands for the sample's (the stages step together)
        version = None if reply.signed_loss is None else reply.signed_loss.version
        drawn: list[_Drawn] = []
        for i, (stage, worker) in enumerate(ran):
            checks.drop_unlisted(stage)
            before = ran[i - 1] if i > 0 else None
            after = ran[i + 1] if i + 1 < len(ran) else None
            if stage != tail and after is not None:
                if checks.draw(stage, worker, version=version):
                    drawn.append(_Drawn("output", stage, worker, before, after))
            elif stage == tail and reply.loss is not None:
                # The loss is the one result of the chain this trainer sees: it is screened as on its own path.
                if checks.draw(stage, worker, checks.screen_loss(stage, worker, reply.loss, version), version):
                    drawn.append(_Drawn("loss", stage, worker, before, after))
            if before is not None and checks.draw(stage, worker, version=version):
                drawn.append(_Drawn("gradient", stage, worker, before, after))
        if not drawn:
            return
        self.counters["drawn"] += len(drawn)
        if len(self._tasks) >= CHECKS_IN_FLIGHT_MAX:
            self.counters["busy"] += len(drawn)
            checks.stats.outcomes["busy"] += len(drawn)
            return
        task = asyncio.ensure_future(self._check_sample(sample_id, tokens, reply, drawn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _check_sample(self, sample_id: str, tokens: torch.Tensor, reply: ChainReply,
                            drawn: list[_Drawn]) -> None:
        kept: dict[tuple[int, str], asyncio.Future] = {}

        def record(holder: tuple[int, str], which: str) -> Awaitable[HopRecordReply]:
            """Each record asked once per sample, whichever hops need it."""
            if (holder[0], which) not in kept:
                kept[(holder[0], which)] = asyncio.ensure_future(self._record(sample_id, holder, which))
            return kept[(holder[0], which)]

        try:
            for hop in drawn:
                try:
                    await self._check_hop(hop, tokens, reply, record)
                except _NotKept:
                    self.counters["not_kept"] += 1
                    self.spot_checks.stats.outcomes["not_kept"] += 1
                except Exception:  # noqa: BLE001 - a bug costs this check, counted, not the others
                    self.spot_checks.stats.outcomes["failed"] += 1
                    logger.exception("chain spot check of stage %d worker %s failed", hop.stage, hop.worker[-8:])
        finally:
            for future in kept.values():
                future.cancel()
                if future.done() and not future.cancelled():
                    future.exception()  # retrieved: a record nobody waited for does not log as lost

    async def _record(self, sample_id: str, holder: tuple[int, str], which: str) -> HopRecordReply:
        stage, peer = holder
        request = HopRecordRequest(run_id=self.run_id, stage=stage, sample_id=sample_id, which=which)
        try:
            answer = await self._fetch(stage, peer, request)
        except asyncio.CancelledError:
            raise
        except RemoteError as exc:
            self.counters["fetch_not_kept" if exc.code == ErrorCode.NOT_KEPT else "fetch_refused"] += 1
            raise _NotKept(f"stage {stage} worker {peer[-8:]}: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a neighbour gone or slow: no check, no verdict
            self.counters["fetch_failed"] += 1
            raise _NotKept(f"stage {stage} worker {peer[-8:]}: {exc}") from exc
        self.counters["fetched"] += 1
        return answer

    async def _check_hop(self, hop: _Drawn, tokens: torch.Tensor, reply: ChainReply,
                         record: Callable[[tuple[int, str], str], Awaitable[HopRecordReply]]) -> None:
        """Gather what the hop's check needs from its neighbours, bind it, hand it over."""
        coords = None if hop.before is None else (await record(hop.before, "coords_sent")).tensor
        if hop.kind == "output":
            got = await record(hop.after, "coords_received")
            result, signed, grad_output = got.tensor, got.signed, None
        elif hop.kind == "loss":
            result, signed, grad_output = reply.loss, reply.signed_loss, None
        else:
            got = await record(hop.before, "gradient_received")
            result, signed = got.tensor, got.signed
            grad_output = None if hop.after is None else (await record(hop.after, "gradient_sent")).tensor
        if signed is None:  # a worker older than signed chains: no version to compare at
            self.counters["unsigned"] += 1
            self.unsigned[hop.worker] += 1
            self.spot_checks.stats.outcomes["unchecked"] += 1
            return
        if not self._binds(hop, signed, tokens, coords, grad_output, result):
            self.counters["unbound"] += 1
            self.unbound[hop.worker] += 1
            self.spot_checks.stats.outcomes["unbound"] += 1
            logger.warning("chain spot check: stage %d worker %s's signed %s does not bind what its neighbours "
                           "kept (before: %s, after: %s); one of them lied, no verdict", hop.stage, hop.worker[-8:],
                           hop.kind, None if hop.before is None else hop.before[1][-8:],
                           None if hop.after is None else hop.after[1][-8:])
            return
        self.counters["handed"] += 1
        checks = self.spot_checks
        if hop.kind == "output":
            checks.check_forward(hop.stage, hop.worker, tokens, coords, result, signed.version, signed.attestation,
                                 signed.weights)
        elif hop.kind == "loss":
            checks.check_loss(hop.stage, hop.worker, tokens, coords, result, signed.version, signed.attestation,
                              signed.weights)
        else:
            checks.check_backward(hop.stage, hop.worker, tokens, coords, grad_output, result, signed.version,
                                  signed.attestation, signed.weights)

    def _binds(self, hop: _Drawn, signed: SignedHop, tokens: torch.Tensor, coords: Optional[torch.Tensor],
               grad_output: Optional[torch.Tensor], result) -> bool:
        """Whether W's signed result names the stage, W, and the input and output gradient its
        neighbours kept, and (when W signs) its signature over them verifies."""
        tensor = loss_tensor(result) if hop.kind == "loss" else result
        if (signed.peer_id != hop.worker or signed.stage != hop.stage or signed.coords_digest != tensor_digest(coords)
                or signed.grad_output_digest != tensor_digest(grad_output)
                or signed.result_digest != tensor_digest(tensor)):
            return False
        # A worker that does not sign is checked all the same; a dispute is then no evidence
        # (SpotChecks counts it `unsigned`).
        return signed.attestation is None or hop_holds(self.run_id, hop.kind, tensor_digest(tokens), signed)

    def summary(self) -> dict:
        """The trainer summary's `spot_checks.chain`."""
        return {**dict(self.counters), "unbound_by_worker": dict(self.unbound),
                "unsigned_by_worker": dict(self.unsigned)}

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
