"""GPU pipeline benchmark: the `1b` model's four stages as real worker processes on ONE
GPU, trainers on the host, against the same model trained in one process on the same GPU.
Prints ONE JSON object on stdout (logs go to stderr); `--out PATH` also writes it.

What it measures, in one run of under 8 minutes:

`swarm_vs_centralized`
    Swarm tokens/s (from the trainers' own signed DHT records over a steady window, start-up and
    warm-up discarded, as in scripts/bench_pipeline.py) over the tokens/s of one process that
    trains the same stages chained (FullModel: no boundary compression, no recompute) with
    AdamW, the run's dtype under autocast, at the same global batch and sequence length.
`mfu`
    Model FLOPs utilisation of both: tokens/s x the model's FLOPs per token (forward and backward
    of the one-process model, counted by torch's FlopCounterMode on the reference's first step:
    the swarm's recomputed forwards are not model FLOPs) over the GPU's peak (`--peak-tflops`,
    or a table of known parts for bf16 dense; null when unknown).
`per_stage`
    Each worker's compute time over wall time in the window and its mean coalesced forward and
    backward batch sizes, from its own `agora/v1/info` counters.

The bench's run config is the preset with a shorter sequence and batch (`--seq-len`,
`--batch`), so one process can hold the reference's activations and a step takes seconds, not
minutes; both sides use the same. `--dry-run` runs the same code on the CPU with the `tiny`
preset and short windows (the suite runs it so the script cannot rot between GPU sessions).
Without CUDA and without `--dry-run` it prints a note and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_pipeline as pipeline  # noqa: E402
from _bench_common import emit_report, log, machine_info, rounded  # noqa: E402

PEAK_BF16_DENSE_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
                          "RTX 4090": 165.0, "RTX 3090": 71.0}
"""Dense bf16 tensor-core peaks by device name fragment (vendor data sheets)."""


def bench_run_config(args):
    from protocol.run_config import load_run_config

    overrides: dict[str, Any] = {"run_id": f"bench-gpu-{os.getpid()}", "evaluation": {"every_steps": 0}}
    if args.seq_len:
        overrides["seq_len"] = args.seq_len
    if args.batch:
        overrides["target_batch_size"] = args.batch
    return load_run_config(args.preset, overrides)


def peak_tflops(args, device) -> Optional[float]:
    if args.peak_tflops:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    for fragment, tflops in PEAK_BF16_DENSE_TFLOPS.items():
        if fragment in name:
            return tflops
    return None


def measure_centralized(run, device, steps: int, warmup_steps: int, micro_batch: int, budget_s: float) -> dict:
    """The same stages chained in this process on `device`: AdamW, per-stage clipping, the run's
    dtype under autocast, the global batch in micro-batches of `micro_batch` (gradients added)."""
    import torch

    from roles.model.stage import FullModel, StageModel
    from roles.trainer.data import make_sample_stream

    stages = [StageModel(run, s, device=device) for s in range(run.num_stages)]
    model = FullModel.from_stages(stages)
    opt = run.optimizer
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opt.lr, betas=opt.betas,
                                  eps=opt.eps, weight_decay=opt.weight_decay)
    samples = iter(make_sample_stream("synthetic", None, run.seq_len, 0, 1, run.seed, epochs=None))
    autocast = getattr(torch, run.dtype) if run.dtype != "float32" else None
    batch = run.target_batch_size
    micro = max(1, min(micro_batch, batch))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for start in range(0, batch, micro):
            n = min(micro, batch - start)
            tokens = torch.stack([next(samples).tokens for _ in range(n)]).to(device, non_blocking=True)
            with torch.autocast(device_type=device.type, dtype=autocast, enabled=autocast is not None):
                loss = model(tokens).float().sum() / batch
            loss.backward()
            total += float(loss.detach())
        for index, stage in enumerate(stages):
            torch.nn.utils.clip_grad_norm_(stage.trainable_parameters(), run.clip_threshold(index))
        optimizer.step()
        return total

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:  # the model's own FLOPs, counted once
        losses = [step()]
    flops_per_token = counter.get_total_flops() / (batch * run.seq_len)
    losses += [step() for _ in range(warmup_steps)]
    sync()
    started = time.perf_counter()
    done = 0
    while done < steps and (done < 2 or time.perf_counter() - started < budget_s):
        losses.append(step())
        done += 1
    sync()
    wall = time.perf_counter() - started
    result = {"tokens_per_s": round(done * batch * run.seq_len / wall, 1), "steps": done, "wall_s": round(wall, 2),
              "batch_samples": batch, "micro_batch": micro, "seq_len": run.seq_len,
              "flops_per_token": flops_per_token,
              "loss_first_last": [round(losses[0], 3), round(losses[-1], 3)]}
    if device.type == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    del model, stages, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


async def measure_swarm(args, windows, run, swarm, membership, peer_id: str, out: dict) -> None:
    """One worker per stage on the device (`--max-batch`), `--trainers` x `--lanes` on the host;
    one steady window (bench_pipeline.measure_trainers)."""
    t0 = time.monotonic()
    probe = pipeline.SwarmProbe(membership, peer_id, run)
    try:
        await probe.open()
        device_args = ["--device", args.device, "--max-batch", str(args.max_batch)]
        log(f"[{time.monotonic() - t0:5.1f}s] starting {run.num_stages} workers ({' '.join(device_args)})")
        workers = [swarm.start("worker", stage=s, wait_ready=False, args=device_args) for s in range(run.num_stages)]
        for node in workers:
            await asyncio.to_thread(swarm.wait_ready, node, args.worker_start_s)
        log(f"[{time.monotonic() - t0:5.1f}s] {args.trainers} trainers x {args.lanes} lanes, "
            f"{windows.swarm_window_s:.0f}s window")
        result = await pipeline.measure_trainers(swarm, probe, run, workers, trainers=args.trainers,
                                                 lanes=args.lanes, windows=windows,
                                                 window_s=windows.swarm_window_s)
        out["swarm"] = result
    finally:
        await probe.close()
        log(f"[{time.monotonic() - t0:5.1f}s] stopping every node")
        await asyncio.to_thread(swarm.stop_all)


def summarise(out: dict, run, device_peak: Optional[float]) -> None:
    swarm, central = out.get("swarm", {}), out.get("centralized", {})
    per_token = central.get("flops_per_token")
    swarm_rate, central_rate = swarm.get("tokens_per_s"), central.get("tokens_per_s")
    if swarm_rate and central_rate:
        out["swarm_vs_centralized"] = rounded(swarm_rate / central_rate)
    out["mfu"] = {
        "peak_tflops": device_peak,
        "flops_per_token": per_token,
        "swarm": None if not (device_peak and swarm_rate and per_token) else rounded(swarm_rate * per_token / (device_peak * 1e12), 4),
        "centralized": None if not (device_peak and central_rate and per_token) else rounded(
            central_rate * per_token / (device_peak * 1e12), 4),
    }
    stages = swarm.get("per_stage", {})
    out["per_stage"] = {stage: {k: s.get(k) for k in ("utilization", "mean_forward_batch", "mean_backward_batch")}
                        for stage, s in stages.items()}
    batches = [s.get("mean_forward_batch") or s.get("mean_backward_batch") for s in stages.values()]
    batches = [b for b in batches if b]
    out["workers_mean_coalesced_batch"] = rounded(sum(batches) / len(batches), 2) if batches else None
    out["aims"] = {"swarm_vs_centralized_min": 0.85, "workers_mean_coalesced_batch_min": 16,
                   "met": None if out.get("dry_run") else bool(
                       (out.get("swarm_vs_centralized") or 0) >= 0.85
                       and (out.get("workers_mean_coalesced_batch") or 0) >= 16)}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="the same code on the CPU: tiny preset, short windows (the suite's check, about a minute)")
    p.add_argument("--preset", default=None, help="run config preset (default 1b; tiny with --dry-run)")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default 1024; the preset's with --dry-run)")
    p.add_argument("--batch", type=int, default=None, help="global batch in samples (default 64)")
    p.add_argument("--max-batch", type=int, default=None, help="workers' --max-batch (default 32; 8 with --dry-run)")
    p.add_argument("--trainers", type=int, default=2)
    p.add_argument("--lanes", type=int, default=None, help="lanes per trainer (default 48; 4 with --dry-run)")
    p.add_argument("--window-s", type=float, default=None, help="steady window (default 60 s; 5 s with --dry-run)")
    p.add_argument("--central-steps", type=int, default=None, help="reference steps (default 20; 3 with --dry-run)")
    p.add_argument("--central-micro-batch", type=int, default=16, help="the reference's micro-batch (default 16)")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU (default: by its name)")
    p.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")
    p.add_argument("--keep-logs", action="store_true", help="keep the node logs and print where they are")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.preset = args.preset or ("tiny" if dry else "1b")
    args.seq_len = args.seq_len or (None if dry else 1024)
    args.batch = args.batch or (None if dry else 64)
    args.max_batch = args.max_batch or (8 if dry else 32)
    args.lanes = args.lanes or (4 if dry else 48)
    args.window_s = args.window_s or (5.0 if dry else 60.0)
    args.central_steps = args.central_steps or (3 if dry else 20)
    args.device = "cpu" if dry else "cuda"
    args.worker_start_s = 120.0 if dry else 300.0
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    out: dict[str, Any] = {"benchmark": "gpu", "dry_run": args.dry_run, "machine": machine_info()}
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        out["skipped"] = "no CUDA device here; --dry-run runs the same code on the CPU"
        emit_report(out, args.out)
        return 0

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    device = torch.device(args.device)
    run = bench_run_config(args)
    out["config"] = {"preset": args.preset, "stages": run.num_stages, "seq_len": run.seq_len,
                     "target_batch_size": run.target_batch_size, "dtype": run.dtype, "worker_max_batch": args.max_batch,
                     "trainers": args.trainers, "lanes_per_trainer": args.lanes, "device": args.device}
    if device.type == "cuda":
        out["machine"]["gpu"] = torch.cuda.get_device_name(device)
    windows = pipeline.Windows(swarm_window_s=args.window_s, lanes_window_s=args.window_s,
                               warmup_samples=max(16, 2 * args.trainers * args.lanes),
                               warmup_s=2.0 if args.dry_run else 10.0, rpc_round_trips=0, rpc_block=1,
                               central_steps=0, central_warmup_steps=0, central_budget_s=0.0, idle_window_s=0.0,
                               deadline_s=args.window_s * 4)
    # The swarm first: the seed DHT forks, which must happen before this process starts threads
    # (the reference's CUDA context and torch's pools).
    errors = pipeline.on_local_swarm(run, lambda *a: measure_swarm(args, windows, *a), out,
                                     keep_logs=args.keep_logs)
    if not errors:
        log(f"centralized reference: {args.central_steps} steps on {args.device}")
        try:
            out["centralized"] = measure_centralized(run, device, args.central_steps, 1, args.central_micro_batch,
                                                     budget_s=30.0 if args.dry_run else 120.0)
        except Exception as exc:  # noqa: BLE001 - report the swarm's figures and the failure
            errors.append(f"centralized reference: {type(exc).__name__}: {exc}")
    summarise(out, run, peak_tflops(args, device))
    out["errors"] = errors
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    emit_report(out, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    code = main()
    pipeline._exit_cleanly(code)
