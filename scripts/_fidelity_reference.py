"""The one-process reference of `bench_fidelity.py`: train a model on given step compositions with
the optimizer a swarm's workers use, evaluate it, and load a swarm's final stage weights.

What makes the comparison with a swarm fair is that only the pipeline differs: the same seeded
`StageModel`s (so the same init), one `StageOptimizer.for_stage` per stage (AdamW, schedule by
samples, stage-wise clipping), gradients summed over a step's samples and divided by their
count, and the very samples the swarm put into each step, regenerated from their ids. Sample ids
`s{shard}-{index}` name a position in the run's one sample stream (a shard keeps the positions
`index % num_shards == shard`), so an unsharded stream regenerates any trainer's sample.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from protocol.run_config import RunConfig
from roles.model.stage import FullModel, StageModel
from roles.trainer.data import SampleStream, SyntheticCorpus
from roles.trainer.tokenizer import load_tokenizer
from roles.worker.layout import FlatLayout
from roles.worker.steps.optimizer import StageOptimizer

HELD_OUT_SEED_OFFSET = 1000
"""The held-out set is the synthetic corpus under seed `run.seed + 1000`: text no trainer reads."""

_SAMPLE_ID = re.compile(r"s(\d+)-(\d+)$")


def stream_index(sample_id: str) -> int:
    """Position in the run's sample stream of a trainer sample id (a routing prefix is allowed)."""
    match = _SAMPLE_ID.search(sample_id)
    if match is None:
        raise ValueError(f"{sample_id!r} is not a trainer sample id (s<shard>-<index>)")
    return int(match.group(2))


def synthetic_stream(run: RunConfig, seed: int) -> SampleStream:
    """The unsharded synthetic stream of `run` under `seed`: sample k is stream position k."""
    return SampleStream(SyntheticCorpus(seed), load_tokenizer(None), run.seq_len, shard_index=0, num_shards=1,
                        seed=seed, epochs=None)


class SampleBank:
    """Tokens of the run's synthetic training stream by position, generated once up to the
    highest position asked for."""

    def __init__(self, run: RunConfig):
        self._stream = iter(synthetic_stream(run, run.seed))
        self._tokens: list[Tensor] = []

    def tokens(self, indices: Iterable[int]) -> Tensor:
        """[n, seq_len] int64 tokens of the given stream positions, in that order."""
        indices = list(indices)
        while len(self._tokens) <= max(indices, default=-1):
            self._tokens.append(next(self._stream).tokens)
        return torch.stack([self._tokens[i] for i in indices])

    def index(self, sample_id: str) -> int:
        """The stream position of a trainer's sample id (scripts/_fidelity_corpus.py numbers a
        prepared corpus's samples to the same scheme)."""
        return stream_index(sample_id)

    def sequential_steps(self, total_samples: int, batch: int) -> list[list[int]]:
        """Positions 0..total-1 cut into steps of `batch`: what the trainers would read if one
        process consumed their shards round-robin."""
        return [list(range(start, min(start + batch, total_samples))) for start in range(0, total_samples, batch)]


def held_out_tokens(run: RunConfig, count: int = 256) -> Tensor:
    """`count` samples of the held-out stream, [count, seq_len]."""
    stream = iter(synthetic_stream(run, run.seed + HELD_OUT_SEED_OFFSET))
    return torch.stack([next(stream).tokens for _ in range(count)])


def build_stages(run: RunConfig) -> list[StageModel]:
    """The run's stages at their seeded init, exactly as each worker builds its own."""
    return [StageModel(run, index) for index in range(run.num_stages)]


@dataclass
class StepRecord:
    """One reference step: samples in it and their mean training loss."""

    samples: int
    loss: float


@dataclass
class OneProcessTrainer:
    """Trains `model` (tokens [n, T] -> per-sample losses [n]) with one StageOptimizer per group
    of `groups`, the i-th configured as stage i of `run`."""

    model: nn.Module
    groups: Sequence[Sequence[nn.Parameter]]
    run: RunConfig
    optimizers: list[StageOptimizer] = field(init=False)
    history: list[StepRecord] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if len(self.groups) != self.run.num_stages:
            raise ValueError(f"{len(self.groups)} parameter groups for a run of {self.run.num_stages} stages")
        # keep_previous only serves a worker's pinned recompute; the reference never recomputes.
        self.optimizers = [StageOptimizer.for_stage(self.run, index, group, "cpu", keep_previous=False)
                           for index, group in enumerate(self.groups)]

    @classmethod
    def for_stages(cls, run: RunConfig, stages: Optional[list[StageModel]] = None) -> OneProcessTrainer:
        """The reference for the subspace model: the stages chained by FullModel."""
        stages = build_stages(run) if stages is None else stages
        return cls(FullModel.from_stages(stages), [s.trainable_parameters() for s in stages], run)

    def step(self, tokens: Tensor, retracted: Optional[dict[int, set[int]]] = None) -> float:
        """One optimizer step on all of `tokens`: summed per-sample gradients, then each stage's
        optimizer divides by the count, clips and steps, as workers do with a stage's batch.
        `retracted`: {row: stages} whose gradient of that sample the swarm took back out of the
        step (roles/worker/serving/retractions.py): subtracted at those stages, which then divide by
        one sample fewer each, as the workers did; the schedule still advances by every sample, as
        a worker's step ledger counts a retracted one."""
        self.model.train()
        losses = self.model(tokens)
        losses.sum().backward()
        self.retract_and_step(len(tokens), retracted, lambda row, params: torch.autograd.grad(
            self.model(tokens[row:row + 1]).sum(), params, allow_unused=True))
        loss = float(losses.detach().mean())
        if not math.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {len(self.history)}")
        self.history.append(StepRecord(len(tokens), loss))
        return loss

    def retract_and_step(self, samples: int, retracted: Optional[dict[int, set[int]]],
                         gradients_of: Callable[[int, list[nn.Parameter]], Sequence[Optional[Tensor]]]) -> None:
        """Subtract each retracted row's gradient (`gradients_of(row, params)`) at its stages, then
        step every stage's optimizer on the samples left there; the schedule still counts all
        `samples`, as a worker's ledger counts a retracted one."""
        taken = [0] * len(self.optimizers)
        for row, stages in (retracted or {}).items():
            params = [p for stage in sorted(stages) for p in self.groups[stage]]
            for param, grad in zip(params, gradients_of(row, params)):
                if grad is not None and param.grad is not None:
                    param.grad.sub_(grad)
            for stage in stages:
                taken[stage] += 1
        for optimizer, fewer in zip(self.optimizers, taken):
            optimizer.add_samples(samples - fewer)
            optimizer.step(stage_samples=samples)

    def train(self, steps: Sequence[Sequence[int]], bank: SampleBank,
              progress: Optional[Callable[[int, float], None]] = None,
              retracted: Optional[dict[int, set[int]]] = None) -> list[StepRecord]:
        """Run one step per entry of `steps` (stream positions); empty steps are skipped, since
        the schedule follows samples and an empty step changes nothing. `retracted`: {stream
        position: stages} the swarm took the sample's gradient back out of (`step`)."""
        retracted = retracted or {}
        for indices in steps:
            if indices:
                rows = {row: retracted[index] for row, index in enumerate(indices) if retracted.get(index)}
                loss = self.step(bank.tokens(indices), rows)
                if progress is not None:
                    progress(len(self.history), loss)
        return self.history


class StaleReplay:
    """Replays a swarm's staleness in one process: each sample's loss and gradients are taken, at
    every stage, at the weight version that stage's forward used in the swarm, and join the step
    the sample was tagged with. With every version equal to the step this is the plain reference;
    the difference between the two prices staleness alone, and what the swarm loses beyond the
    replay is something else (a bug, compression, lost samples).

    Versions are a stage's optimizer steps taken (its `local_step`) at the forward, as logged; the
    weights of version v are those before step v, kept for `keep` versions.
    """

    def __init__(self, trainer: OneProcessTrainer, keep: int = 16):
        self.trainer = trainer
        self.keep = keep
        self._names = {id(p): name for name, p in trainer.model.named_parameters()}
        self._snapshots: dict[int, list[list[Tensor]]] = {}

    def _snapshot(self, version: int) -> None:
        self._snapshots[version] = [[p.detach().clone() for p in group] for group in self.trainer.groups]
        for old in [v for v in self._snapshots if v <= version - self.keep]:
            del self._snapshots[old]

    def _weights(self, stage: int, version: int) -> list[Tensor]:
        # A version without a snapshot followed an empty step: its weights equal the one before.
        known = [v for v in self._snapshots if v <= version]
        if not known:
            raise ValueError(f"stage {stage}: weight version {version} is older than the {self.keep} kept")
        return self._snapshots[max(known)][stage]

    def _stale(self, step: int, seen: tuple[int, ...]) -> dict:
        """{parameter: its weights at the version stage s saw}, for the stages that saw an older one."""
        stale = {}
        for stage, version in enumerate(seen):
            if version == step:
                continue
            for param, weights in zip(self.trainer.groups[stage], self._weights(stage, version)):
                stale[param] = weights.detach().requires_grad_(True)
        return stale

    def step(self, step: int, tokens: Tensor, versions: Sequence[Sequence[int]],
             retracted: Optional[dict[int, set[int]]] = None) -> float:
        """One step numbered `step` on `tokens`, sample i seen by stage s at version versions[i][s].
        `retracted`: {row: stages} whose gradient of that sample, taken at the same versions, the
        swarm took back out of the step, as `OneProcessTrainer.step` takes it out."""
        trainer = self.trainer
        trainer.model.train()
        self._snapshot(step)
        groups: dict[tuple[int, ...], list[int]] = {}
        for i, seen in enumerate(versions):
            seen = tuple(int(v) for v in seen)
            if len(seen) != len(trainer.groups) or max(seen) > step:
                raise ValueError(f"sample {i} of step {step} has versions {seen}; expected one per stage, "
                                 f"none after the step")
            groups.setdefault(seen, []).append(i)
        total = 0.0
        for seen, rows in groups.items():
            stale = self._stale(step, seen)
            losses = torch.func.functional_call(trainer.model, {self._names[id(p)]: w for p, w in stale.items()},
                                                (tokens[rows],))
            losses.sum().backward()
            for param, weights in stale.items():
                if weights.grad is not None:
                    param.grad = weights.grad if param.grad is None else param.grad.add_(weights.grad)
                weights.grad = None
            total += float(losses.detach().sum())
        def gradients_of(row: int, params: list[nn.Parameter]) -> Sequence[Optional[Tensor]]:
            stale = self._stale(step, tuple(int(v) for v in versions[row]))
            loss = torch.func.functional_call(trainer.model, {self._names[id(p)]: w for p, w in stale.items()},
                                              (tokens[row:row + 1],)).sum()
            return torch.autograd.grad(loss, [stale.get(p, p) for p in params], allow_unused=True)

        trainer.retract_and_step(len(tokens), retracted, gradients_of)
        loss = total / len(tokens)
        trainer.history.append(StepRecord(len(tokens), loss))
        return loss


@torch.no_grad()
def evaluate(model: nn.Module, tokens: Tensor, batch: int = 64) -> float:
    """Mean per-sample loss of `model` on `tokens`."""
    model.eval()
    total = sum(float(model(tokens[i:i + batch]).sum()) for i in range(0, len(tokens), batch))
    return total / len(tokens)


def load_stage_weights(stage: StageModel, tensors: dict[str, Tensor]) -> None:
    """Copy a checkpoint's tensors (named by the stage's FlatLayout) into `stage`."""
    names = FlatLayout.of_module(stage).names
    missing = [name for name in names if name not in tensors]
    if missing:
        raise KeyError(f"checkpoint of stage {stage.stage_index} misses {missing[:3]}")
    with torch.no_grad():
        for name, param in zip(names, stage.trainable_parameters()):
            if tensors[name].shape != param.shape:
                raise ValueError(f"stage {stage.stage_index}: {name} has shape {tuple(tensors[name].shape)}, "
                                 f"expected {tuple(param.shape)}")
            param.copy_(tensors[name])


def loss_figures(steps: Sequence[StepRecord]) -> dict:
    """Final training loss (mean step loss over the last 10% of steps) and the sample-weighted
    training loss over the 10% of tokens that end at 25, 50, 75 and 100% of them."""
    if not steps:
        return {"final_train_loss": None, "train_loss_at_fraction": {}, "steps": 0, "samples": 0}
    tail = steps[-max(1, math.ceil(0.1 * len(steps))):]
    total = sum(s.samples for s in steps)
    at: dict[str, Optional[float]] = {}
    for fraction in (0.25, 0.5, 0.75, 1.0):
        lo, hi = (fraction - 0.1) * total, fraction * total
        seen, weighted, count = 0, 0.0, 0
        for record in steps:
            end = seen + record.samples
            if lo < end <= hi or (count == 0 and end > hi):  # at least the step that crosses `hi`
                weighted += record.loss * record.samples
                count += record.samples
            seen = end
            if seen >= hi and count:
                break
        at[f"{round(fraction * 100)}%"] = round(weighted / count, 4) if count else None
    return {"final_train_loss": round(sum(s.loss for s in tail) / len(tail), 4), "train_loss_at_fraction": at,
            "steps": len(steps), "samples": total}
