"""A referee of last resort for a two-replica output dispute (roles/trainer/spot_checks.py): the
trainer fetches the weights each side computed with at the hop's version (`agora/v1/weights`,
roles/worker/serving/weights_server.py) and re-executes the hop itself, on its own CPU.

Honest compute at one set of weights is deterministic up to the rounding of the precision it runs
in, so a side whose claimed output is further than the spot checks' `tolerance` from what its OWN
weights compute lied, whatever the loss says (a lie that costs little loss, an output scaled by 3,
a replay on older weights, a small bias, is caught at once, where the loss through the later
stages attributes it slowly or not at all). A side whose handed-over weights do not carry the
fingerprint it names them with lied too (forged weights). The re-execution runs on the weights
in the dtype they are handed over in, as a CPU worker with the default compute dtype runs its
stage (no autocast): a worker computing under bfloat16 autocast beside it stays within the
tolerance, as beside a float32 replica (measured: 0.0114 against 0.02).

A side whose weights cannot be had as they were when it computed (it no longer keeps the version,
it stepped past it; its weights changed at that version since, in an averaging round, so the
fingerprint it names now is not the one it signed, or between two chunks; a fetch fails; it
refuses) is held against what the other side's weights compute, when those carry the fingerprint
both sides signed and compute the other side's claim: such replicas hold the same weights, and a
liar must not dodge the referee by not answering it. No verdict (the dispute goes on to the loss)
when the stage is larger than `verification.referee_max_bytes`, neither side can be judged, or
both sides compute what they claim (two sets of weights that differ: parted replicas). What it costs: the stage's
weights, twice, per dispute (the last two sets are kept, so disputes at one version fetch once).
What it cannot see: a liar whose weights match the sampled fingerprint (64 elements a tensor) yet
compute its lie.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, Optional

import torch
from torch import nn

from protocol.errors import ErrorCode, RemoteError
from protocol.state_messages import MAX_WEIGHTS_CHUNK_ELEMENTS, WeightsReply, WeightsRequest
from roles.trainer.spot_checks import result_distance
from roles.worker.serving.compute_stats import weights_fingerprint

logger = logging.getLogger(__name__)

KEPT_SETS = 2
"""Sets of weights kept after a judgement (the two sides of the last dispute)."""

Fetch = Callable[[int, str, WeightsRequest], Awaitable[WeightsReply]]


@dataclass(frozen=True)
class Side:
    """One side of a dispute: who, what it claimed, and the fingerprint it signed that with."""

    peer: str
    claimed: torch.Tensor
    weights: Optional[bytes]


class _NoJudgement(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Stage:
    module: nn.Module
    names: list[str]
    shapes: list[torch.Size]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return sum(shape.numel() for shape in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


class WeightsReferee:
    """`fetch(stage, peer, request)` sends one `agora/v1/weights`; `build(stage)` builds the stage's
    module as a worker does (roles/model/stage.py build_stage_model); `size(stage)`, the bytes of its
    parameters, says before anything is built whether it is within `max_bytes`."""

    def __init__(self, fetch: Fetch, build: Callable[[int], nn.Module], *, max_bytes: int, tolerance: float,
                 size: Optional[Callable[[int], int]] = None, chunk_elements: int = MAX_WEIGHTS_CHUNK_ELEMENTS):
        self._fetch = fetch
        self._build = build
        self._size = size
        self.max_bytes = max_bytes
        self.tolerance = tolerance
        self.chunk_elements = max(1, min(chunk_elements, MAX_WEIGHTS_CHUNK_ELEMENTS))
        self._stages: dict[int, Optional[_Stage]] = {}
        self._kept: collections.OrderedDict[tuple, dict[str, torch.Tensor]] = collections.OrderedDict()
        self._lock = asyncio.Lock()
        """One judgement at a time: the trainer's CPU and memory hold one stage's re-execution."""
        self.counts: collections.Counter[str] = collections.Counter()
        """fetched (sides whose weights came), kept (sides whose weights were still held), bytes,
        verdicts (judgements that put a side in the wrong), forged (sides whose weights did not
        carry their fingerprint), crossed (sides judged on the other side's weights)."""
        self.no_verdict: collections.Counter[str] = collections.Counter()
        """Judgements that put nobody in the wrong, by why: over_budget, unsupported, not_kept,
        moved, refused, failed, invalid, not_finite, self_consistent."""

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def summary(self) -> dict:
        """The trainer summary's `spot_checks.referee`."""
        return {**{k: self.counts.get(k, 0) for k in ("fetched", "kept", "bytes", "verdicts", "forged", "crossed")},
                "no_verdict": dict(self.no_verdict)}

    async def judge(self, stage: int, version: int, tokens: torch.Tensor, coords: Optional[torch.Tensor],
                    sides: list[Side]) -> Optional[list[Optional[float]]]:
        """Each side's distance between what it claimed and what its own weights compute (inf for
        forged weights, None for a side that could not be judged); None when nobody could be."""
        if not self.enabled:
            return None
        async with self._lock:
            try:
                if self._size is not None and self._size(stage) > self.max_bytes:
                    raise _NoJudgement("over_budget")  # not even built
                spec = await self._stage(stage)
                if spec.nbytes > self.max_bytes:
                    raise _NoJudgement("over_budget")
                gaps: list[Optional[float]] = []
                outputs: list[Optional[torch.Tensor]] = []
                reasons = []
                for side in sides:
                    try:
                        gap, output = await self._judge_side(spec, stage, version, tokens, coords, side)
                    except _NoJudgement as exc:
                        gap, output = None, None
                        reasons.append(exc.reason)
                    gaps.append(gap)
                    outputs.append(output)
            except _NoJudgement as exc:
                self.no_verdict[exc.reason] += 1
                return None
        self._cross_judge(sides, gaps, outputs)
        if any(gap is not None and not gap <= self.tolerance for gap in gaps):
            self.counts["verdicts"] += 1
        else:
            self.no_verdict[reasons[0] if reasons else "self_consistent"] += 1
        return None if all(gap is None for gap in gaps) else gaps

    async def _stage(self, stage: int) -> _Stage:
        if stage not in self._stages:
            module = await asyncio.to_thread(self._build, stage)
            if list(getattr(module, "averaged_payload", lambda: [])()):
                self._stages[stage] = None  # a surrogate's payload: weights the replies do not name
            else:
                named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
                module.eval()
                self._stages[stage] = _Stage(module, [n for n, _ in named], [p.shape for _, p in named],
                                             named[0][1].dtype)
        spec = self._stages[stage]
        if spec is None:
            raise _NoJudgement("unsupported")
        return spec

    async def _judge_side(self, spec: _Stage, stage: int, version: int, tokens: torch.Tensor,
                          coords: Optional[torch.Tensor], side: Side) -> tuple[float, Optional[torch.Tensor]]:
        key = (stage, side.peer, version, side.weights)
        weights = self._kept.get(key)
        if weights is not None:
            self.counts["kept"] += 1
        else:
            weights = await self._fetch_side(spec, stage, version, side)
            if weights is None:
                self.counts["forged"] += 1
                logger.warning("spot check: stage %d worker %s handed over weights of version %d that do not carry "
                               "the fingerprint it named them with", stage, side.peer[-8:], version)
                return float("inf"), None
            if side.weights is not None:  # a set whose fingerprint is the one it signed: kept for the next dispute
                self._kept[key] = weights
                while len(self._kept) > KEPT_SETS:
                    self._kept.popitem(last=False)
        out = await asyncio.to_thread(_run, spec.module, weights, tokens, coords)
        if not bool(torch.isfinite(out).all()):
            raise _NoJudgement("not_finite")
        gap = result_distance(side.claimed, out.to(side.claimed.dtype))
        if gap is None:
            raise _NoJudgement("invalid")
        return gap, out

    def _cross_judge(self, sides: list[Side], gaps: list[Optional[float]],
                     outputs: list[Optional[torch.Tensor]]) -> None:
        """A side that could not be judged on weights of its own (it refused them, named others,
        or no longer keeps the version) is held against what the other side's weights compute,
        when those carry the very fingerprint both signed their results with and compute the
        other side's claim: replicas that exchange gradients every step hold the same weights, so
        its claim must match that output too. Otherwise a liar would dodge the referee by not
        answering it."""
        for i, side in enumerate(sides):
            if gaps[i] is not None or side.weights is None:
                continue
            for j, other in enumerate(sides):
                out = outputs[j]
                if (j != i and out is not None and other.weights == side.weights and gaps[j] is not None
                        and gaps[j] <= self.tolerance):
                    gaps[i] = result_distance(side.claimed, out.to(side.claimed.dtype))
                    self.counts["crossed"] += gaps[i] is not None
                    break

    async def _fetch_side(self, spec: _Stage, stage: int, version: int,
                          side: Side) -> Optional[dict[str, torch.Tensor]]:
        """The side's weights at `version` (by name), or None when they do not carry the
        fingerprint they come with (forged); raises _NoJudgement when they cannot be had as they
        were when it computed."""
        flat = torch.empty(spec.numel, dtype=spec.dtype)
        offset, named = 0, None
        while offset < spec.numel:
            count = min(self.chunk_elements, spec.numel - offset)
            try:
                reply = await self._fetch(stage, side.peer, WeightsRequest(stage=stage, version=version,
                                                                           offset=offset, count=count))
            except RemoteError as exc:
                raise _NoJudgement("not_kept" if exc.code == ErrorCode.NOT_KEPT else "refused") from exc
            except Exception as exc:  # noqa: BLE001 - a side that cannot hand its weights over decides nothing
                logger.debug("could not fetch the weights of stage %d worker %s: %s", stage, side.peer[-8:], exc)
                raise _NoJudgement("failed") from exc
            data = reply.data
            if (reply.stage != stage or reply.version != version or reply.offset != offset
                    or reply.numel != spec.numel or data is None or data.dtype != spec.dtype or data.dim() != 1
                    or not 0 < data.numel() <= count):
                raise _NoJudgement("invalid")
            if named is None:
                named = reply.weights
            elif reply.weights != named:
                raise _NoJudgement("moved")  # the weights changed between two chunks
            flat[offset:offset + data.numel()] = data
            offset += data.numel()
            self.counts["bytes"] += data.numel() * data.element_size()
        if side.weights is not None and named != side.weights:
            raise _NoJudgement("moved")  # what it holds at that version now is not what it computed with
        self.counts["fetched"] += 1
        tensors = [t.view(shape) for t, shape in zip(flat.split([s.numel() for s in spec.shapes]), spec.shapes)]
        if weights_fingerprint(tensors) != named:
            return None
        return dict(zip(spec.names, tensors))


@torch.no_grad()
def _run(module: nn.Module, weights: dict[str, torch.Tensor], tokens: torch.Tensor,
         coords: Optional[torch.Tensor]) -> torch.Tensor:
    """The stage's output for one sample on `weights`, computed as a CPU worker does (its
    evaluation: runtime.py `evaluate`, without autocast)."""
    inputs = (None if coords is None else coords.unsqueeze(0).to(torch.float32), tokens.unsqueeze(0))
    return torch.func.functional_call(module, weights, inputs).detach()[0].float()
