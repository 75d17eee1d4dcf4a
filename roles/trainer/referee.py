"""Measurements that decide a spot-check dispute (roles/trainer/spot_checks.py), made with
`agora/v1/evaluate` through the stages' workers: nothing is computed on the trainer, and nothing
any worker does here counts towards a step.

- `continuation_losses`: the sample's loss from each of two outputs of a stage, carried through
  the later stages by the same workers, so that only the output differs.
- `input_slopes`: the loss's rate of change at a stage's input along given directions, by central
  differences; the true input gradient predicts them.
- `loss_consistency`: whether a tail's reported losses change along its own input gradient as
  that gradient says.

Every measurement compares losses from several passes; a worker on the route that steps between
two passes would make the difference its update's, not the candidates'. So each pass notes the
weight version every worker answered at, and a measurement whose passes saw different versions is
taken again (`MEASURE_ATTEMPTS` in all) or given up (`WeightsMoved`): no verdict.
"""

from __future__ import annotations

import random
import uuid
from typing import Awaitable, Callable, Optional

import torch

from protocol import version
from protocol.errors import AgoraError, ErrorCode, NoWorkersError, ProtocolError
from protocol.messages import EvaluateReply, EvaluateRequest
from roles.trainer.balancer import StageBalancer

MEASURE_ATTEMPTS = 3
"""Tries of a measurement before a route whose workers keep stepping under it is given up."""
STEP_OF_NORM = 1e-3
"""Finite differences move the input by this fraction of its norm: far above float32's rounding of
the loss, close enough that the loss is still linear there."""


class WeightsMoved(AgoraError):
    """A worker of the route stepped during every try of a measurement: it cannot decide anything."""

    code = ErrorCode.NOT_READY


class Referee:
    """`call(stage, peer, handler, request, reply type)` sends one request (the pipeline's)."""

    def __init__(self, call: Callable[..., Awaitable], balancers: list[StageBalancer]):
        self._call = call
        self.balancers = balancers

    @property
    def num_stages(self) -> int:
        return len(self.balancers)

    def _route(self, first: int) -> list[tuple[int, str]]:
        """One usable worker, at random, for each stage from `first` to the tail."""
        route = []
        for stage in range(first, self.num_stages):
            usable = self.balancers[stage].usable()
            if not usable:
                raise NoWorkersError(f"stage {stage} has no usable worker")
            route.append((stage, random.choice(usable)))
        return route

    async def _evaluate(self, stage: int, peer: str, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                        input_grad: bool = False) -> EvaluateReply:
        request = EvaluateRequest(stage=stage, sample_id=f"referee-{uuid.uuid4().hex[:16]}", tokens=tokens,
                                  coords=coords, input_grad=input_grad)
        return await self._call(stage, peer, version.EVALUATE, request, EvaluateReply)

    async def _loss_through(self, route: list[tuple[int, str]], tokens: torch.Tensor,
                            coords: torch.Tensor) -> tuple[float, tuple]:
        """The loss from `coords` through `route`, and the weight version each worker answered at."""
        reply, versions = None, []
        for stage, peer in route:
            reply = await self._evaluate(stage, peer, tokens, coords)
            versions.append(reply.version)
            coords = reply.coords
        if reply is None or reply.loss is None:
            raise ProtocolError(f"stage {self.num_stages - 1} worker sent no loss")
        return reply.loss, tuple(versions)

    @staticmethod
    async def _at_one_version(passes: Callable[[], Awaitable[list[tuple[float, tuple]]]]) -> list[float]:
        """The losses of `passes()`, taken again until every pass saw the same weights."""
        for _ in range(MEASURE_ATTEMPTS):
            results = await passes()
            if len({versions for _, versions in results}) == 1:
                return [loss for loss, _ in results]
        raise WeightsMoved(f"the route's workers stepped during each of {MEASURE_ATTEMPTS} tries")

    async def continuation_losses(self, stage: int, tokens: torch.Tensor, outputs: list[torch.Tensor]) -> list[float]:
        """The loss each candidate output of `stage` for one sample leads to."""
        route = self._route(stage + 1)

        async def passes():
            return [await self._loss_through(route, tokens, output) for output in outputs]
        return await self._at_one_version(passes)

    async def input_slopes(self, stage: int, tokens: torch.Tensor, coords: torch.Tensor,
                           directions: list[torch.Tensor]) -> list[float]:
        """The rate of change of one sample's loss at `stage`'s input along each unit direction."""
        route = self._route(stage)
        x = coords.float()
        step = STEP_OF_NORM * float(torch.linalg.vector_norm(x).clamp_min(1e-6))

        async def passes():
            return [await self._loss_through(route, tokens, x + sign * step * d.to(x.dtype).reshape(x.shape))
                    for d in directions for sign in (1, -1)]
        losses = await self._at_one_version(passes)
        return [(up - down) / (2 * step) for up, down in zip(losses[0::2], losses[1::2])]

    async def loss_consistency(self, stage: int, peer: str, tokens: torch.Tensor, coords: torch.Tensor) -> float:
        """How far a tail worker's losses are from what its own input gradient says: the slope of
        its loss along that gradient against the gradient's norm (relative; about 0 when honest)."""
        x = coords.float()
        step = STEP_OF_NORM * float(torch.linalg.vector_norm(x).clamp_min(1e-6))
        size = 0.0

        async def passes():
            nonlocal size
            reply = await self._evaluate(stage, peer, tokens, x, input_grad=True)
            if reply.grad_input is None or reply.loss is None:
                raise ProtocolError(f"tail worker {peer[-8:]} sent no gradient or loss")
            grad = reply.grad_input.float()
            size = float(torch.linalg.vector_norm(grad))
            if size == 0.0:
                return [(0.0, (reply.version,))]  # a loss that nothing moves
            return [(0.0, (reply.version,)),
                    *[await self._loss_through([(stage, peer)], tokens, x + sign * step * grad / size)
                      for sign in (1, -1)]]
        losses = await self._at_one_version(passes)
        if size == 0.0:
            return float("inf")
        up, down = losses[1], losses[2]
        return abs((up - down) / (2 * step) - size) / size
