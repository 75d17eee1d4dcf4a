#!/usr/bin/env python
"""What stage skipping costs the model: held-out loss after N steps when a body
stage is skipped for a fraction of the steps, against the same run without skipping, on the same
seed and the same samples; and against dropping those steps' samples instead.

One process, the swarm's own parts (scripts/_fidelity_reference.py): the run's seeded
`StageModel`s, one `StageOptimizer` per stage, every step on `target_batch_size` samples of the
run's synthetic stream in order. A model of 4 stages (head, two bodies, tail), the tiny preset's
widths with one block per stage. Stage failures follow the Crucible notes' experiment: outages of
`--outage-steps` global steps (6) on a body stage drawn at random, placed at random (seeded) until
the requested fraction of steps has a stage down. While a stage is down, a step

- skip: runs the model without it: its forward is the identity on the boundary coordinates (what
  the trainer's routing does, roles/trainer/skipping.py), it gets no gradient and takes no step;
  when it is back it jumps to the stage's step, as a rejoining worker does (runtime `_jump_to`),
  keeping its weights and optimizer state (a worker restarted from its checkpoint);
- drop: trains nothing: the step's samples are lost and every stage's schedule moves on (the
  run's tokens are fewer, its schedule the same).

Prints one JSON object (and writes it with --out): per variant the final held-out loss and its
increase relative to the no-failure run, which is Crucible's Figure 3 measure (they report about
0.6-0.9% at p = 0.10 with skipping, 3.4-3.6% dropping tokens, on a 178M model over 8 replicas).
--quick runs fewer steps for a smoke test.

    .venv/bin/python scripts/bench_skipping.py [--steps 240] [--fractions 0.1 0.2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from _fidelity_reference import SampleBank, build_stages, evaluate, held_out_tokens  # noqa: E402
from protocol.run_config import RunConfig, load_run_config  # noqa: E402
from roles.model.stage import FullModel, StageModel  # noqa: E402
from roles.worker.steps.optimizer import StageOptimizer  # noqa: E402

STAGES = 4
OUTAGE_STEPS = 6


def run_config(steps: int, seed: int) -> RunConfig:
    """The tiny preset's widths, one block per stage over 4 stages, the schedule spanning the run."""
    tiny = load_run_config("tiny")
    warmup = min(tiny.optimizer.warmup_steps, max(1, steps // 10))
    return load_run_config("tiny", {
        "run_id": "bench-skipping", "seed": seed,
        "model": {"n_layers": STAGES},
        "stages": [{"first_layer": i, "last_layer": i + 1} for i in range(STAGES)],
        "optimizer": {"total_steps": steps, "warmup_steps": warmup},
    })


def outage_schedule(steps: int, fraction: float, num_stages: int, seed: int,
                    outage_steps: int = OUTAGE_STEPS) -> dict[int, int]:
    """step -> the body stage that is down in it: non-overlapping outages of `outage_steps` steps
    at seeded random places, until `fraction` of the steps (rounded) have one."""
    target = round(fraction * steps)
    rng = random.Random(seed)
    down: dict[int, int] = {}
    attempts = 0
    while len(down) < target and attempts < 100_000:
        attempts += 1
        length = min(outage_steps, target - len(down))
        start = rng.randrange(0, steps - length + 1)
        span = range(start, start + length)
        if any(s in down or s - 1 in down or s + 1 in down for s in span):
            continue  # outages do not touch: each one ends before the next begins
        stage = rng.randrange(1, num_stages - 1)
        down.update({s: stage for s in span})
    return down


class SkippingModel(nn.Module):
    """The stages chained as FullModel does, leaving out `self.skip` (a body stage or None): its
    forward is the identity on the boundary coordinates."""

    def __init__(self, stages: list[StageModel]):
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self.skip: Optional[int] = None

    def forward(self, tokens: Tensor) -> Tensor:
        coords = None
        for index, stage in enumerate(self.stages):
            if index == self.skip:
                continue
            coords = stage(coords, tokens)
        return coords


def train(run: RunConfig, bank: SampleBank, steps: int, down: dict[int, int], mode: str,
          held_out: Tensor) -> dict:
    stages = build_stages(run)
    model = SkippingModel(stages)
    optimizers = [StageOptimizer.for_stage(run, i, s.trainable_parameters(), "cpu", keep_previous=False)
                  for i, s in enumerate(stages)]
    batch = run.target_batch_size
    losses: list[float] = []
    stage_steps = [0] * len(stages)
    for step in range(steps):
        down_stage = down.get(step)
        if down_stage is not None and mode == "drop":
            for optimizer in optimizers:  # the tokens are lost; the schedule goes on
                optimizer.set_step(optimizer.local_step + 1, optimizer.samples_consumed + batch)
            continue
        tokens = bank.tokens(range(step * batch, (step + 1) * batch))
        model.skip = down_stage
        model.train()
        sample_losses = model(tokens)
        sample_losses.sum().backward()
        for index, optimizer in enumerate(optimizers):
            if index == down_stage:
                continue
            if optimizer.local_step < step:  # back from an outage: join the stage's step
                optimizer.set_step(step, step * batch)
            optimizer.add_samples(len(tokens))
            optimizer.step()
            stage_steps[index] += 1
        losses.append(float(sample_losses.detach().mean()))
    model.skip = None
    tail = losses[-max(1, len(losses) // 10):]
    return {
        "held_out_loss": round(evaluate(FullModel.from_stages(stages), held_out), 4),
        "final_train_loss": round(sum(tail) / len(tail), 4),
        "steps_trained": len(losses),
        "steps_per_stage": stage_steps,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=240, help="global steps of every run")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.1],
                        help="fractions of steps with a body stage down")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run seeds (init, data, outages)")
    parser.add_argument("--no-drop", action="store_true", help="leave out the drop-tokens baseline")
    parser.add_argument("--quick", action="store_true", help="60 steps, fraction 0.1, one seed: a smoke test")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.fractions, args.seeds = 60, [0.1], args.seeds[:1]
    torch.set_num_threads(args.threads)
    started = time.monotonic()
    results: dict = {"config": {"stages": STAGES, "preset": "tiny (widths), one block per stage",
                                "steps": args.steps, "outage_steps": OUTAGE_STEPS, "seeds": args.seeds}}
    per_seed = []
    for seed in args.seeds:
        run = run_config(args.steps, seed)
        results["config"].update(target_batch_size=run.target_batch_size, seq_len=run.seq_len,
                                 d_model=run.model.d_model, subspace_rank=run.model.subspace_rank)
        bank = SampleBank(run)
        held_out = held_out_tokens(run)
        baseline = train(run, bank, args.steps, {}, "skip", held_out)
        entry = {"seed": seed, "baseline": baseline, "variants": {}}
        for fraction in args.fractions:
            down = outage_schedule(args.steps, fraction, STAGES, seed)
            for mode in ("skip",) + (() if args.no_drop else ("drop",)):
                result = train(run, bank, args.steps, down, mode, held_out)
                result["relative_increase_pct"] = round(
                    100 * (result["held_out_loss"] / baseline["held_out_loss"] - 1), 3)
                result["steps_down"] = len(down)
                entry["variants"][f"{mode}@{fraction:g}"] = result
                print(f"seed {seed} {mode}@{fraction:g}: held-out {result['held_out_loss']:.4f} vs "
                      f"{baseline['held_out_loss']:.4f} ({result['relative_increase_pct']:+.2f}%)", file=sys.stderr)
        per_seed.append(entry)
    results["runs"] = per_seed
    names = per_seed[0]["variants"].keys()
    results["mean_relative_increase_pct"] = {
        name: round(sum(e["variants"][name]["relative_increase_pct"] for e in per_seed) / len(per_seed), 3)
        for name in names}
    results["wall_s"] = round(time.monotonic() - started, 1)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
