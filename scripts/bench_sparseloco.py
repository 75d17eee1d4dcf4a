"""SparseLoCo against the one-process model and against local training with plain averaging, at
equal tokens, in one process. Prints ONE JSON object on stdout (progress on stderr);
`--out PATH` also writes it; `--quick` runs a short smoke version.

R replicas of the whole model (`--preset` tiny or small; the stages chained by FullModel, as bench_fidelity's
reference) each take every step on their 1/R share of the step's samples, with the workers'
optimizer (StageOptimizer per stage: AdamW, stage-wise clipping, the schedule by the stage's
samples), and every H steps each stage runs a SparseLoCo round with the workers' own code
(roles/worker/sparseloco: chunks, compressor, error feedback, outer step), every replica's
fragment arriving. The figures are the held-out loss after the last round (all replicas hold the
consensus then) and its gap to:

- `one_process`: one model on every step's whole batch (what bench_fidelity calls the reference,
  and what the swarm with `averaging.gradients: every_step` trains exactly);
- `asyncsparta N20`: the replicas average one of 20 seeded 5% segments every 20 steps (AsyncSPARTA
  with `averaging.gradients: off`, the workers' index sets), the mean of the replicas evaluated;
- `average_every_H`: the same replicas and H, exchanging their pseudo-gradients dense and exact
  (SparseLoCo with top-k = chunk, 8 bits, no error decay): what compression costs on top of
  infrequent exchange.

Candidates vary H, the density (top-k per 4,096-chunk), the error decay beta and the outer
learning rate alpha. Everything is seeded: a figure is the same on every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import torch  # noqa: E402

from _bench_common import log, machine_info  # noqa: E402
from _fidelity_reference import SampleBank, build_stages, evaluate, held_out_tokens  # noqa: E402
from protocol.run_config import load_run_config  # noqa: E402
from roles.model.stage import FullModel  # noqa: E402
from roles.worker.layout import FlatLayout  # noqa: E402
from roles.worker.steps.optimizer import StageOptimizer  # noqa: E402
from roles.worker.sparseloco.chunks import fragment_due, plan_fragments  # noqa: E402
from roles.worker.averaging.index_sets import SegmentIndexSets  # noqa: E402
from roles.worker.averaging.schedule import segment_of  # noqa: E402
from roles.worker.sparseloco.outer import SparseLoCoState  # noqa: E402

HELD_OUT = 256
SEGMENTS = 20


@dataclass(frozen=True)
class Candidate:
    name: str
    inner_steps: int
    method: str = "sparseloco"
    """sparseloco, or asyncsparta: every `inner_steps` steps the replicas replace one of 20 seeded
    segments (5% of each stage) with their mean, as AsyncSPARTA's rounds do with the workers'
    index sets, and the model evaluated is the mean of the replicas (as bench_fidelity's swarm)."""
    topk: int = 64
    chunk: int = 4096
    bits: int = 2
    beta: float = 0.95
    alpha: float = 1.0


def _run(run, steps: int, replicas: int, cand: Optional[Candidate], held_out) -> dict:
    """Train; `cand` None: one process on the whole batch."""
    bank = SampleBank(run)
    batch = run.target_batch_size
    copies = 1 if cand is None else replicas
    models, optimizers, layouts = [], [], []
    for _ in range(copies):
        stages = build_stages(run)
        models.append((FullModel.from_stages(stages), stages))
        optimizers.append([StageOptimizer.for_stage(run, i, s.trainable_parameters(), "cpu", keep_previous=False)
                           for i, s in enumerate(stages)])
        layouts.append([FlatLayout.of_stage(s) for s in stages])
    states, plans = [], []
    sparta_sets = []
    if cand is not None and cand.method == "asyncsparta":
        sparta_sets = [SegmentIndexSets(lay, SEGMENTS, seed=run.seed, stage=i) for i, lay in enumerate(layouts[0])]
    elif cand is not None:
        for r in range(copies):
            states.append([SparseLoCoState.starting_at(lay.read(opt.master_params, 0, lay.numel))
                           for lay, opt in zip(layouts[r], optimizers[r])])
        plans = [plan_fragments(lay, chunk_size=cand.chunk, topk=cand.topk, fragments=1)[0] for lay in layouts[0]]
    losses = []
    for step in range(steps):
        indices = list(range(step * batch, (step + 1) * batch))
        share = [indices[r::copies] for r in range(copies)]
        step_loss = 0.0
        for r, ((model, _), opts) in enumerate(zip(models, optimizers)):
            model.train()
            out = model(bank.tokens(share[r]))
            out.sum().backward()
            for opt in opts:
                opt.add_samples(len(share[r]))
                opt.step(stage_samples=batch)
            step_loss += float(out.detach().sum())
        losses.append(step_loss / batch)
        if sparta_sets and (step + 1) % cand.inner_steps == 0:
            segment = segment_of((step + 1) // cand.inner_steps, SEGMENTS)
            for s, sets in enumerate(sparta_sets):
                index = sets.get(segment)
                values = []
                for r in range(copies):
                    out_r = torch.empty(len(index))
                    FlatLayout.gather(optimizers[r][s].master_params, index.pieces, out_r)
                    values.append(out_r)
                mean = torch.stack(values).mean(0)
                for r in range(copies):
                    FlatLayout.add_(optimizers[r][s].master_params, index.pieces, mean - values[r])
        elif cand is not None and cand.method == "sparseloco" and fragment_due(step + 1, 1, cand.inner_steps):
            for s, frag in enumerate(plans):
                caps = {}
                for r in range(copies):
                    lay, opt = layouts[r][s], optimizers[r][s]
                    weights = lay.read(opt.master_params, 0, lay.numel)
                    caps[f"r{r}"] = states[r][s].capture(step + 1, frag, weights, beta=cand.beta, bits=cand.bits).own
                for r in range(copies):
                    lay, opt = layouts[r][s], optimizers[r][s]
                    now = lay.read(opt.master_params, 0, lay.numel)
                    new, _ = states[r][s].apply(0, caps, now, alpha=cand.alpha)
                    lay.write(opt.master_params, 0, new)
    tail = losses[-max(1, steps // 10):]
    if copies > 1:  # the mean of the replicas (equal after a SparseLoCo round that closed the run)
        with torch.no_grad():
            for params in zip(*(m.parameters() for m, _ in models)):
                params[0].copy_(torch.stack([p.detach() for p in params]).mean(0))
    return {"held_out_loss": round(evaluate(models[0][0], held_out), 4),
            "final_train_loss": round(statistics.fmean(tail), 4)}


def candidates(quick: bool) -> list[Candidate]:
    if quick:
        return [Candidate("H15 k64", 15), Candidate("dense exact H15", 15, topk=4096, bits=8, beta=0.0),
                Candidate("asyncsparta N20", 20, method="asyncsparta")]
    out = []
    for h in (15, 5, 2):
        out.append(Candidate(f"dense exact H{h}", h, topk=4096, bits=8, beta=0.0))
        for k in (64, 256, 1024):
            out.append(Candidate(f"H{h} k{k}", h, topk=k))
    out.append(Candidate("asyncsparta N20", 20, method="asyncsparta"))
    out += [Candidate("H5 k256 beta0.9", 5, topk=256, beta=0.9), Candidate("H5 k256 beta0.99", 5, topk=256, beta=0.99),
            Candidate("H5 k256 alpha0.7", 5, topk=256, alpha=0.7), Candidate("H5 k256 4 bits", 5, topk=256, bits=4)]
    return out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=("tiny", "small"), default="tiny")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--steps", type=int, default=150, help="steps of target_batch_size (default: the demo's 150)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="comma-separated candidate names to run (default: all)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    steps = 30 if args.quick else args.steps
    run = load_run_config(args.preset, {"target_batch_size": args.batch, "seed": args.seed,
                                   "optimizer": {"total_steps": steps}})
    held_out = held_out_tokens(run, HELD_OUT)
    started = time.monotonic()
    ref = _run(run, steps, 1, None, held_out)
    log(f"one process: held-out {ref['held_out_loss']}")
    results: list[dict[str, Any]] = []
    chosen = candidates(args.quick)
    if args.only:
        wanted = [w.strip() for w in args.only.split(",")]
        chosen = [c for c in chosen if c.name in wanted]
    for cand in chosen:
        t = time.monotonic()
        found = _run(run, steps, args.replicas, cand, held_out)
        found.update(name=cand.name, method=cand.method, inner_steps=cand.inner_steps, topk_per_chunk=cand.topk,
                     bits=cand.bits,
                     error_decay=cand.beta, outer_lr=cand.alpha, density=round(cand.topk / cand.chunk, 5),
                     gap_vs_one_process=round(found["held_out_loss"] / ref["held_out_loss"] - 1, 4),
                     wall_s=round(time.monotonic() - t, 1))
        results.append(found)
        log(f"{cand.name}: held-out {found['held_out_loss']} ({100 * found['gap_vs_one_process']:+.1f}%)")
    dense = {r["inner_steps"]: r["held_out_loss"] for r in results if r["name"].startswith("dense")}
    sparta = next((r["held_out_loss"] for r in results if r["method"] == "asyncsparta"), None)
    for r in results:
        if r["inner_steps"] in dense and r["method"] == "sparseloco":
            r["gap_vs_average_every_H"] = round(r["held_out_loss"] / dense[r["inner_steps"]] - 1, 4)
        if sparta is not None:
            r["gap_vs_asyncsparta"] = round(r["held_out_loss"] / sparta - 1, 4)
    out = {"benchmark": "sparseloco", "quick": args.quick, "machine": machine_info(),
           "config": {"preset": args.preset, "replicas": args.replicas, "steps": steps, "target_batch_size": args.batch,
                      "seed": args.seed, "samples": steps * args.batch},
           "one_process": ref, "candidates": results, "elapsed_s": round(time.monotonic() - started, 1)}
    text = json.dumps(out)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
