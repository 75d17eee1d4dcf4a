"""Measurements that decide a spot-check dispute (roles/trainer/spot_checks.py), made with
`agora/v1/evaluate` through the stages' workers: nothing is computed on the trainer, and nothing
any worker does here counts towards a step.

- `continuation_losses`: the sample's loss from each of two outputs of a stage, carried through
  the later stages by the same workers, so that only the output differs.
- `input_slopes`: the loss's rate of change at a stage's input along given directions, by central
  differences; the true input gradient predicts them.
- `loss_consistency`: whether a tail's reported losses change along its own input gradient as
  that gradient says.
"""

from __future__ import annotations

import random
import uuid
from typing import Awaitable, Callable, Optional

import torch

from protocol import version
from protocol.errors import NoWorkersError, ProtocolError
from protocol.messages import EvaluateReply, EvaluateRequest
from roles.trainer.balancer import StageBalancer

STEP_OF_NORM = 1e-3
"""Finite differences move the input by this fraction of its norm: far above float32's rounding of
the loss, close enough that the loss is still linear there."""


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

    async def _loss_through(self, route: list[tuple[int, str]], tokens: torch.Tensor, coords: torch.Tensor) -> float:
        reply = None
        for stage, peer in route:
            reply = await self._evaluate(stage, peer, tokens, coords)
            coords = reply.coords
        if reply is None or reply.loss is None:
            raise ProtocolError(f"stage {self.num_stages - 1} worker sent no loss")
        return reply.loss

    async def continuation_losses(self, stage: int, tokens: torch.Tensor, outputs: list[torch.Tensor]) -> list[float]:
        """The loss each candidate output of `stage` for one sample leads to."""
        route = self._route(stage + 1)
        return [await self._loss_through(route, tokens, output) for output in outputs]

    async def input_slopes(self, stage: int, tokens: torch.Tensor, coords: torch.Tensor,
                           directions: list[torch.Tensor]) -> list[float]:
        """The rate of change of one sample's loss at `stage`'s input along each unit direction."""
        route = self._route(stage)
        x = coords.float()
        step = STEP_OF_NORM * float(torch.linalg.vector_norm(x).clamp_min(1e-6))
        slopes = []
        for direction in directions:
            d = direction.to(x.dtype).reshape(x.shape)
            up = await self._loss_through(route, tokens, x + step * d)
            down = await self._loss_through(route, tokens, x - step * d)
            slopes.append((up - down) / (2 * step))
        return slopes

    async def loss_consistency(self, stage: int, peer: str, tokens: torch.Tensor, coords: torch.Tensor) -> float:
        """How far a tail worker's losses are from what its own input gradient says: the slope of
        its loss along that gradient against the gradient's norm (relative; about 0 when honest)."""
        x = coords.float()
        reply = await self._evaluate(stage, peer, tokens, x, input_grad=True)
        if reply.grad_input is None or reply.loss is None:
            raise ProtocolError(f"tail worker {peer[-8:]} sent no gradient or loss")
        grad = reply.grad_input.float()
        size = float(torch.linalg.vector_norm(grad))
        if size == 0.0:
            return float("inf")  # a loss that nothing moves
        step = STEP_OF_NORM * float(torch.linalg.vector_norm(x).clamp_min(1e-6))
        up = await self._loss_through([(stage, peer)], tokens, x + step * grad / size)
        down = await self._loss_through([(stage, peer)], tokens, x - step * grad / size)
        return abs((up - down) / (2 * step) - size) / size
