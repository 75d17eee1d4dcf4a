"""Exercise the worker's CUDA path on a real GPU and compare the memory plan with what torch
actually allocates. Prints one JSON object. Needs a CUDA device; exits 0 with a note without one.

For each case it builds the stage on the GPU (optimizer master weights and moments in pinned CPU
memory), runs coalesced forward and backward batches through the same StageRuntime code the
worker serves requests with (bf16 autocast where the run says so), takes optimizer steps, and
records peak device memory against `plan_memory(...).device_bytes`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from protocol.messages import BackwardRequest, ForwardRequest
from protocol.run_config import load_run_config
from roles.model.memory_plan import plan_memory
from roles.model.stage import StageModel
from roles.worker.steps.optimizer import StageOptimizer
from roles.worker.serving.queues import TaskQueues
from roles.worker.serving.runtime import StageRuntime
from roles.worker.steps.step_ledger import StepLedger


def build_runtime(run, stage: int, max_batch: int, device: torch.device) -> StageRuntime:
    model = StageModel(run, stage, device=device)
    optimizer = StageOptimizer.for_stage(run, stage, model.trainable_parameters(), device)
    autocast = getattr(torch, run.dtype) if run.dtype != "float32" else None
    ledger = StepLedger(run.target_batch_size, assigns=model.kind == "tail")
    return StageRuntime(model, optimizer, TaskQueues(max_batch), stage=stage, vocab_size=run.model.vocab_size,
                        max_seq_len=run.model.max_seq_len, device=device, ledger=ledger, autocast_dtype=autocast,
                        wire_dtype=getattr(torch, run.boundary_dtype))


def memory_case(preset: str, stage: int, max_batch: int, device: torch.device) -> dict:
    """The worst case the plan budgets for: on head and body stages, the open step's gradients, the
    next step's, and the previous weights for a pinned recompute, all on the device at once."""
    run = load_run_config(preset)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    runtime = build_runtime(run, stage, max_batch, device)
    built_s = time.perf_counter() - started
    seq, rank = run.seq_len, run.model.subspace_rank
    tokens = torch.randint(0, run.model.vocab_size, (seq,))
    coords = None if runtime.kind == "head" else torch.randn(seq, rank) * 0.01
    grad = None if runtime.kind == "tail" else torch.randn(seq, rank) * 1e-3

    def backward(prefix: str, step):
        return [BackwardRequest(stage=stage, sample_id=f"{prefix}{i}", tokens=tokens, coords=coords,
                                grad_output=grad, step=step) for i in range(max_batch)]

    def forward(prefix: str):
        return [ForwardRequest(stage=stage, sample_id=f"{prefix}{i}", tokens=tokens, coords=coords)
                for i in range(max_batch)]

    pinned = 0
    if runtime.kind == "tail":
        runtime._backward_batch(backward("t", None))
        runtime.optimizer.step()
    else:
        runtime._forward_batch(forward("f"))
        runtime._forward_batch(forward("g"))
        runtime._backward_batch(backward("x", 0))
        runtime.optimizer.step()
        runtime._backward_batch(backward("f", 1))  # open step, recomputed on the previous weights
        runtime._backward_batch(backward("g", 2))  # next step's gradients beside the open step's
        pinned = runtime.staleness.pinned_samples
    torch.cuda.synchronize(device)
    timings = []
    for _ in range(3):
        t = time.perf_counter()
        runtime._backward_batch(backward("t", None if runtime.kind == "tail" else 1))
        torch.cuda.synchronize(device)
        timings.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated(device)
    plan = plan_memory(run, stage, "cuda", max_batch)
    result = {
        "preset": preset, "stage": stage, "kind": runtime.kind, "max_batch": max_batch, "dtype": run.dtype,
        "build_s": round(built_s, 1), "backward_batch_s": round(min(timings), 4),
        "peak_allocated_gib": round(peak / 2**30, 3), "plan_device_gib": round(plan.device_bytes / 2**30, 3),
        "plan_over_actual": round(plan.device_bytes / max(peak, 1), 3),
        "master_on_host": not runtime.optimizer.shares_master, "pinned_samples": pinned,
        "next_step_samples": runtime.optimizer.next_accumulated,
    }
    del runtime
    torch.cuda.empty_cache()
    return result


def training_case(device: torch.device, steps: int = 30) -> dict:
    """Chain the tiny stages on the GPU exactly as the trainer chains workers; loss must fall."""
    run = load_run_config("tiny", {"target_batch_size": 8})
    runtimes = [build_runtime(run, s, 8, device) for s in range(run.num_stages)]
    generator = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, 256, (17,), generator=generator)
    losses = []
    for step in range(steps):
        batch = [torch.roll(pattern.repeat(run.seq_len // 17 + 1)[: run.seq_len], i) for i in range(8)]
        coords = [None] * 8
        inputs = []
        for s, runtime in enumerate(runtimes[:-1]):
            inputs.append(coords)
            coords = runtime._forward_batch([ForwardRequest(stage=s, sample_id=f"{step}-{i}", tokens=batch[i],
                                                            coords=coords[i]) for i in range(8)])
        tail = runtimes[-1]
        results = tail._backward_batch([BackwardRequest(stage=tail.stage, sample_id=f"{step}-{i}", tokens=batch[i],
                                                        coords=coords[i]) for i in range(8)])
        losses.append(sum(r.loss for r in results) / 8)
        grads = [r.grad_input for r in results]
        for s in range(len(runtimes) - 2, -1, -1):
            results = runtimes[s]._backward_batch([BackwardRequest(
                stage=s, sample_id=f"{step}-{i}", tokens=batch[i], coords=inputs[s][i], grad_output=grads[i])
                for i in range(8)])
            grads = [r.grad_input for r in results]
        for runtime in runtimes:
            runtime.optimizer.step()
    return {"first_loss": round(losses[0], 4), "last_loss": round(losses[-1], 4), "steps": steps,
            "loss_fell": losses[-1] < 0.7 * losses[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--skip-8b", action="store_true", help="leave out the 8b stage (slow to initialise)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"cuda": False, "note": "no CUDA device; nothing checked"}))
        return 0
    device = torch.device("cuda")
    report = {"cuda": True, "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "training": training_case(device), "memory": []}
    cases = [("tiny", 0, 16), ("tiny", 2, 16), ("1b", 1, 4), ("1b", 3, 2)]
    if not args.skip_8b:
        cases.append(("8b", 3, 1))
    for preset, stage, batch in cases:
        try:
            report["memory"].append(memory_case(preset, stage, batch, device))
        except Exception as exc:  # report and go on: one failing case must not hide the others
            report["memory"].append({"preset": preset, "stage": stage, "error": f"{type(exc).__name__}: {exc}"})
        print(json.dumps(report["memory"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
