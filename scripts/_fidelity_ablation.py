"""`bench_fidelity.py --ablation`: where the subspace model family loses against a plain Llama of
the same shape, one difference at a time, each trained in one process at equal tokens.

The subspace model differs from a plain Llama in three ways [report 4.1]: its blocks (all but the
tail's) write into span(U_k) only (rank), its token embedding is a fixed random table T_fixed of
row norm ~1 plus a learned part confined to span(U_k) (fixed embedding), and both start at other
scales (init: T_fixed is ~6x the plain embedding's 0.02, and Z U_k^T has std out_std*sqrt(k/d)).
Each variant below moves one of them; every variant sees the same samples in the same order, the
same stage-wise optimizers (parameters grouped by stage) and the same schedule, over a few run
seeds (a run seed moves the init and the data together, so gaps are taken seed by seed).
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _fidelity_reference import OneProcessTrainer, SampleBank, build_stages, evaluate, held_out_tokens, loss_figures
from protocol.run_config import RunConfig
from roles.model.plain import INIT_STD, PlainModel, plain_init_seed
from roles.model.stage import StageModel
from roles.model.subspace import fixed_token_embedding

Built = tuple[nn.Module, list[list[nn.Parameter]]]


class LearnedEmbeddingStages(nn.Module):
    """The subspace stages with the head's T_fixed + E U_k^T replaced by a learned full-rank
    embedding: rank-k writes, no fixed embedding. One process only (no boundary could carry it)."""

    def __init__(self, run: RunConfig, stages: list[StageModel]):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        generator = torch.Generator().manual_seed(plain_init_seed(run.seed))
        self.embedding = nn.Parameter(torch.empty(run.model.vocab_size, run.model.d_model).normal_(
            0.0, INIT_STD, generator=generator))

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = F.embedding(tokens, self.embedding)
        for stage in self.stages:
            hidden = stage.run_blocks(hidden)
        return self.stages[-1].loss_from_hidden(hidden, tokens)

    def groups(self) -> list[list[nn.Parameter]]:
        head, *rest = self.stages
        return [[self.embedding, *(p for p in head.trainable_parameters() if p is not head.embedding)],
                *(s.trainable_parameters() for s in rest)]


class FixedOffsetPlain(nn.Module):
    """A plain Llama whose learned embedding sits on top of the subspace model's frozen T_fixed:
    full-rank everything, plus the fixed embedding."""

    def __init__(self, run: RunConfig):
        super().__init__()
        self.plain = PlainModel(run)
        model = run.model
        self.register_buffer("fixed_embedding",
                             fixed_token_embedding(model.vocab_size, model.d_model, model.subspace_seed))

    def forward(self, tokens: Tensor) -> Tensor:
        hidden = self.fixed_embedding[tokens] + self.plain.embed(tokens)
        return self.plain.loss_from_hidden(self.plain.run_blocks(hidden), tokens)


def _subspace(run: RunConfig) -> Built:
    stages = build_stages(run)
    trainer = OneProcessTrainer.for_stages(run, stages)
    return trainer.model, [list(g) for g in trainer.groups]


def _subspace_rank_d(run: RunConfig) -> Built:
    return _subspace(run.model_copy(update={"model": run.model.model_copy(update={"subspace_rank": run.model.d_model})}))


def _subspace_small_fixed_embedding(run: RunConfig, rank: int | None = None) -> Built:
    """T_fixed scaled to the learned embeddings' std (0.02 instead of d^-1/2). Still lossless at
    a boundary: both sides would regenerate the same scaled table."""
    model, groups = _subspace(run) if rank is None else _subspace_rank_d(run)
    for stage in model.stages:
        stage.fixed_embedding = stage.fixed_embedding * (INIT_STD * run.model.d_model ** 0.5)
    return model, groups


def _subspace_learned_embedding(run: RunConfig) -> Built:
    model = LearnedEmbeddingStages(run, build_stages(run))
    return model, model.groups()


def _plain(run: RunConfig, **kwargs) -> Built:
    model = PlainModel(run, **kwargs)
    return model, model.stage_parameters(run)


def _plain_fixed_embedding(run: RunConfig) -> Built:
    model = FixedOffsetPlain(run)
    return model, model.plain.stage_parameters(run)


def _plain_out_std_subspace(run: RunConfig) -> Built:
    m = run.model
    return _plain(run, out_std=INIT_STD / math.sqrt(2 * m.n_layers) * math.sqrt(m.subspace_rank / m.d_model))


VARIANTS: dict[str, tuple[str, Callable[[RunConfig], Built]]] = {
    "subspace": ("the stage model as is: rank-k writes (tail full rank), T_fixed + learned E U_k^T", _subspace),
    "plain": ("plain Llama: learned full-rank embedding (std 0.02), full-rank writes", _plain),
    "subspace_rank_d": ("the stage model with subspace_rank = d_model: full-rank writes, T_fixed kept",
                        _subspace_rank_d),
    "subspace_learned_embedding": ("the stage model with rank-k writes but a learned full-rank embedding "
                                   "(std 0.02) instead of T_fixed + E U_k^T", _subspace_learned_embedding),
    "subspace_small_fixed_embedding": ("the stage model with T_fixed scaled down to std 0.02 (row norm "
                                       "~0.16, the plain embedding's scale); still lossless at a boundary",
                                       _subspace_small_fixed_embedding),
    "subspace_rank_d_small_fixed_embedding": ("subspace_rank = d_model and T_fixed at std 0.02: the whole "
                                              "embedding learnable, the fixed part small",
                                              lambda run: _subspace_small_fixed_embedding(run, run.model.d_model)),
    "plain_fixed_embedding": ("plain Llama plus the frozen T_fixed under its learned embedding",
                              _plain_fixed_embedding),
    "plain_embedding_std_fixed": ("plain Llama whose learned embedding starts at T_fixed's scale (std d^-1/2)",
                                  lambda run: _plain(run, embedding_std=run.model.d_model ** -0.5)),
    "plain_out_std_subspace": ("plain Llama with output projections at the subspace model's effective std "
                               "(out_std * sqrt(k/d))", _plain_out_std_subspace),
}


def _relative(a: float, b: float) -> float:
    return round((a - b) / b, 4)


def run_ablation(base: RunConfig, *, steps: int, seeds: list[int], variants: list[str], log) -> dict:
    """Train every variant on `steps` sequential steps of `base.target_batch_size` samples for
    each run seed; held-out loss on 256 held-out samples of that seed."""
    results: dict[str, dict] = {}
    for name in variants:
        description, build = VARIANTS[name]
        per_seed = []
        for seed in seeds:
            run = base.model_copy(update={"seed": seed})
            bank, held_out = SampleBank(run), held_out_tokens(run)
            started = time.monotonic()
            model, groups = build(run)
            trainer = OneProcessTrainer(model, groups, run)
            trainer.train(bank.sequential_steps(steps * run.target_batch_size, run.target_batch_size), bank)
            figures = loss_figures(trainer.history)
            per_seed.append({"seed": seed, "held_out_loss": round(evaluate(model, held_out), 4),
                             "final_train_loss": figures["final_train_loss"],
                             "train_loss_at_fraction": figures["train_loss_at_fraction"],
                             "wall_s": round(time.monotonic() - started, 1)})
            log(f"ablation {name} seed {seed}: held-out {per_seed[-1]['held_out_loss']:.4f} "
                f"({per_seed[-1]['wall_s']:.0f}s)")
        held = [r["held_out_loss"] for r in per_seed]
        results[name] = {"description": description, "runs": per_seed,
                         "held_out_loss_mean": round(statistics.fmean(held), 4),
                         "held_out_loss_spread": round(max(held) - min(held), 4),
                         "final_train_loss_mean": round(statistics.fmean(r["final_train_loss"] for r in per_seed), 4)}
    return {"variants": results, "attribution": _attribution(results, seeds),
            "config": {"steps": steps, "samples": steps * base.target_batch_size, "seeds": seeds,
                       "target_batch_size": base.target_batch_size, "order": "sequential"}}


def _attribution(results: dict, seeds: list[int]) -> dict:
    """Seed-by-seed mean relative held-out differences: what each constraint costs."""

    def gap(a: str, b: str):
        if a not in results or b not in results:
            return None
        pairs = zip(results[a]["runs"], results[b]["runs"])
        return round(statistics.fmean(_relative(x["held_out_loss"], y["held_out_loss"]) for x, y in pairs), 4)

    return {
        "subspace_vs_plain": gap("subspace", "plain"),
        "rank_k_vs_rank_d_with_fixed_embedding": gap("subspace", "subspace_rank_d"),
        "fixed_embedding_at_full_rank": gap("subspace_rank_d", "plain"),
        "fixed_embedding_at_full_rank_plain_side": gap("plain_fixed_embedding", "plain"),
        "fixed_embedding_at_rank_k": gap("subspace", "subspace_learned_embedding"),
        "rank_k_with_learned_embedding": gap("subspace_learned_embedding", "plain"),
        "embedding_init_scale": gap("plain_embedding_std_fixed", "plain"),
        "small_fixed_embedding_vs_plain": gap("subspace_small_fixed_embedding", "plain"),
        "small_fixed_embedding_vs_subspace": gap("subspace_small_fixed_embedding", "subspace"),
        "small_fixed_embedding_at_full_rank_vs_plain": gap("subspace_rank_d_small_fixed_embedding", "plain"),
        "output_init_scale": gap("plain_out_std_subspace", "plain"),
        "how_to_read": "(a - b) / b of held-out loss, mean over seeds; positive: a is worse",
    }
