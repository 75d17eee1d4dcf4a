"""`agora-node demo`: a whole swarm on 127.0.0.1 that trains the `tiny` model and shows loss falling.

It starts an authorizer, then workers and trainers that join through it, exactly as a public run
works: every node is admitted, placed on a stage and given a credential, and every message
between nodes is authenticated. The demo process itself joins as an observer (a trainer that
trains nothing) and runs the DHT node every other node bootstraps from, so all of them can start
at once; it reads their DHT records for the live progress line. Ctrl-C stops every node and
reaps every process the demo started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Optional

from node.flags import OneLineErrorParser
from node.launcher import LocalSwarm, NodeStartError
from node.lifecycle import reap_children
from protocol.errors import ConfigError


def demo_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="agora-node demo", description="Train the tiny model with a local swarm on 127.0.0.1.")
    p.add_argument("--stages", type=int, default=3, help="pipeline stages (default 3)")
    p.add_argument("--workers-per-stage", type=int, default=1, help="replicas of each stage (default 1)")
    p.add_argument("--trainers", type=int, default=2, help="trainer processes (default 2)")
    p.add_argument("--lanes", type=int, default=4, help="samples each trainer keeps in flight (default 4)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to train (default 60)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on the last line")
    p.add_argument("--keep-logs", action="store_true", help="keep the node logs and print where they are")
    return p


DEMO_EVALUATION_SAMPLES = 128


def demo_run_config(stages: int, steps: int) -> dict:
    """Overrides that cut the tiny preset into `stages` stages of one or more blocks each."""
    from protocol.run_config import load_run_config

    base = load_run_config("tiny")
    layers = max(base.model.n_layers, stages)
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return {
        "run_id": f"demo-{os.getpid()}",
        "model": {"n_layers": layers},
        "stages": [{"first_layer": bounds[i], "last_layer": bounds[i + 1]} for i in range(stages)],
        "optimizer": {"total_steps": max(steps * 2, base.optimizer.warmup_steps + 1)},
        # The synthetic grammar's samples differ little from each other: 128 keep the held-out
        # loss's standard error under 1% (real text needs the default 512), at a quarter of the cost.
        "evaluation": {"samples": DEMO_EVALUATION_SAMPLES},
    }


def _validate(args: argparse.Namespace) -> None:
    minimums = {"stages": 2, "workers_per_stage": 1, "trainers": 1, "lanes": 1, "steps": 1}
    for name, minimum in minimums.items():
        if getattr(args, name) < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least {minimum}")


def demo_main(argv: list[str]) -> int:
    args = demo_parser().parse_args(argv)
    _validate(args)
    from node.settings import NodeSettings
    from node.swarm import join_swarm
    from node.trust import establish_trust
    from protocol.identity import load_or_create_identity
    from protocol.run_config import dump_run_config, load_run_config

    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    workdir = tempfile.mkdtemp(prefix="agora-demo-")
    run = load_run_config("tiny", demo_run_config(args.stages, args.steps))
    config_path = os.path.join(workdir, "run.yaml")
    dump_run_config(run, config_path)

    swarm = LocalSwarm(os.path.join(workdir, "logs"), None, torch_threads=1, common_args=["--announce-period-s", "2"])
    authorizer = swarm.start_authorizer([
        "--run-config", config_path, "--data-dir", os.path.join(workdir, "authorizer"), "--port", "0", "--checks",
        "capability,integrity,reachability", "--join-rate", "50"])
    identity = load_or_create_identity(None)
    trust = asyncio.run(establish_trust(
        NodeSettings(role="trainer", authorizer=authorizer.url, account_token="demo-observer"), identity, "cpu"))
    # Forked before the demo starts threads of its own besides the launcher's pipe readers (docs/architecture.md, 'Processes and threads').
    membership = join_swarm(identity=identity, run_id=run.run_id, num_stages=run.num_stages, initial_peers=[],
                            host_maddrs=trust.host_maddrs, announce_maddrs=[], bootstrap_timeout_s=30,
                            auth_state=trust.auth_state, authorizer=trust.dht_authorizer)
    swarm.common_args += ["--authorizer", authorizer.url]
    # Exactly `steps` batches in all, so every step the stages take is a whole one.
    total_samples = args.steps * run.target_batch_size
    samples_per_trainer = [total_samples // args.trainers + (i < total_samples % args.trainers)
                           for i in range(args.trainers)]
    summary: Optional[dict] = None
    code = 0
    try:
        say(f"authorizer at {authorizer.url}; starting {args.stages} stage(s) x {args.workers_per_stage} worker(s) "
            f"and {args.trainers} trainer(s) "
            f"on 127.0.0.1; training {args.steps} steps of {run.target_batch_size} samples")
        # The authorizer places each worker on the stage furthest below its target.
        # Every demo worker is a stable local node, so each may reduce averaging slices.
        workers = [swarm.start("worker", args=["--max-batch", "16", "--account-token", f"demo-worker-{i}", "--reducer"],
                               wait_ready=False, name=f"worker-{i}")
                   for i in range(args.stages * args.workers_per_stage)]
        trainers = [
            swarm.start("trainer", args=["--lanes", str(args.lanes), "--max-samples", str(samples_per_trainer[i]),
                                         "--shard-index", str(i), "--num-shards", str(args.trainers),
                                         "--discovery-period-s", "2", "--account-token", f"demo-trainer-{i}"],
                        wait_ready=False, name=f"trainer-{i}")
            for i in range(args.trainers)
        ]
        for node in workers + trainers:
            swarm.wait_ready(node, timeout_s=120)
        asyncio.run(_watch(membership, identity.peer_id.to_base58(), run, trainers, args, say))
        summaries = [t.summary() for t in trainers]
        missing = [t for t, s in zip(trainers, summaries) if s is None]
        if missing:
            raise NodeStartError(f"{missing[0].name} ended without a summary:\n{missing[0].log_tail()}")
        summary = combine_summaries(summaries)
        # Workers print what they stepped on as they leave: stop them before reading it.
        swarm.stop_all()
        summary.update(combine_worker_summaries([_summary_of(w) for w in workers]))
    except KeyboardInterrupt:
        say("\ninterrupted; stopping every node")
        code = 130
    except NodeStartError as exc:
        print(f"agora-node demo: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        swarm.stop_all()
        membership.shutdown()
        asyncio.run(trust.close())
        if os.path.exists(identity.path):
            os.unlink(identity.path)
        reap_children()
        left = swarm.survivors()
        if left:
            print(f"agora-node demo: warning: processes {left} survived shutdown", file=sys.stderr)
        if code == 0 and not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"node logs: {swarm.workdir}", file=sys.stderr)
    if summary is None:
        return code or 1
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        first, last = summary["first_loss"], summary["last_loss"]
        print(f"done: loss {first:.3f} -> {last:.3f} ({(1 - last / first) * 100:.0f}% lower){_held_out(summary)}, "
              f"{summary['tokens_per_s']:.0f} tokens/s, {summary['samples_completed']} samples completed, "
              f"{summary['samples_dropped']} dropped", flush=True)
        steps = summary.get("steps_per_stage") or {}
        if steps:
            print(f"      steps per stage {list(steps.values())}, {summary['samples_per_step_mean']:g} samples per "
                  f"step (max {summary['samples_per_step_max']}, target {run.target_batch_size}), "
                  f"{summary['discarded_at_shutdown']} samples discarded at shutdown", flush=True)
    return 0


def _held_out(summary: dict) -> str:
    """", held-out loss 5.541 -> 2.210 +- 0.013 (steps 0 -> 59)", or nothing when no evaluation ran."""
    first, last = summary.get("first_eval_loss"), summary.get("last_eval_loss")
    if first is None or last is None:
        return ""
    stderr = summary.get("last_eval_stderr")
    return (f", held-out loss {first:.3f} -> {last:.3f}" + (f" +- {stderr:.3f}" if stderr is not None else "")
            + f" (steps {summary['first_eval_step']} -> {summary['last_eval_step']})")


def _summary_of(node, wait_s: float = 3.0) -> Optional[dict]:
    """A stopped node's summary line; its stdout reader may still be catching up."""
    deadline = time.monotonic() + wait_s
    while (summary := node.summary()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return summary


def combine_worker_summaries(summaries: list[Optional[dict]]) -> dict:
    """Steps per stage and the samples each step consumed, from the workers' summaries."""
    steps: dict[str, int] = {}
    sizes: list[tuple[float, int]] = []
    for summary in summaries:
        if not summary or "steps" not in summary:
            continue
        info = summary["steps"]
        stage = str(summary["stage"])
        steps[stage] = max(steps.get(stage, 0), summary["local_step"])
        if info.get("samples_per_step_mean") is not None:
            sizes.append((info["samples_per_step_mean"], info["samples_per_step_max"]))
    return {
        "steps_per_stage": dict(sorted(steps.items(), key=lambda kv: int(kv[0]))),
        "samples_per_step_mean": round(sum(m for m, _ in sizes) / len(sizes), 2) if sizes else None,
        "samples_per_step_max": max((m for _, m in sizes), default=None),
        "discarded_at_shutdown": sum(s["steps"].get("discarded_at_shutdown", 0) for s in summaries
                                     if s and "steps" in s),
    }


def combine_summaries(summaries: list[dict]) -> dict:
    def mean(key: str) -> Optional[float]:
        values = [s[key] for s in summaries if s.get(key) is not None]
        return sum(values) / len(values) if values else None

    wall = max(s["wall_s"] for s in summaries)
    tokens = sum(s["tokens"] for s in summaries)
    # one trainer evaluates (roles/trainer/evaluation.py); its evaluations in step order
    evaluations = sorted((e for s in summaries for e in s.get("eval") or []), key=lambda e: e["step"])
    return {
        "first_loss": mean("first_loss"),
        "last_loss": mean("last_loss"),
        "first_eval_loss": evaluations[0]["loss"] if evaluations else None,
        "last_eval_loss": evaluations[-1]["loss"] if evaluations else None,
        "first_eval_step": evaluations[0]["step"] if evaluations else None,
        "last_eval_step": evaluations[-1]["step"] if evaluations else None,
        "last_eval_stderr": evaluations[-1].get("stderr") if evaluations else None,
        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else 0.0,
        "samples_completed": sum(s["samples_completed"] for s in summaries),
        "samples_dropped": sum(s["samples_dropped"] for s in summaries),
        "wall_s": wall,
    }


async def _watch(membership, peer_id: str, run, trainers, args, say) -> None:
    """Show live progress, read from the swarm's DHT records, until the trainers finish: a rich view
    when stdout is a terminal, else a line (redrawn on a terminal stderr, every 5 s otherwise)."""
    from protocol.dht import SwarmDHT

    dht = SwarmDHT(membership.dht, peer_id)
    started = time.monotonic()
    # A terminal on stdout gets a live view; otherwise the plain lines scripts and tests read.
    live = None
    if sys.stdout.isatty() and not args.json:
        from node.live_display import DemoLiveDisplay

        live = DemoLiveDisplay(args.steps)
        live.start()
    interactive = live is None and sys.stderr.isatty() and not args.json
    try:
        await _watch_until_done(dht, run, trainers, args, say, started, live, interactive)
    finally:
        if live is not None:
            live.stop()
    if interactive:
        print(file=sys.stderr)


async def _watch_until_done(dht, run, trainers, args, say, started, live, interactive) -> None:
    from protocol.dht_schema import ProgressRecord, TrainerRecord, WorkerRecord, progress_key, trainers_key, workers_key

    last_print = 0.0
    while any(t.proc.poll() is None for t in trainers):
        workers = [len(await dht.get(workers_key(run.run_id, s), WorkerRecord)) for s in range(run.num_stages)]
        progress = [await dht.get(progress_key(run.run_id, s), ProgressRecord) for s in range(run.num_stages)]
        step = min(max((r.local_step for r in p.values()), default=0) for p in progress)
        records = await dht.get(trainers_key(run.run_id), TrainerRecord)
        tokens = sum(r.tokens for r in records.values())
        losses = [r.recent_loss for r in records.values() if r.recent_loss is not None and not r.final]
        loss = f"{sum(losses) / len(losses):.3f}" if losses else "-"
        elapsed = time.monotonic() - started
        line = (f"step {step}/{args.steps}  loss {loss}  {tokens / max(elapsed, 1e-9):.0f} tokens/s  "
                f"workers per stage {workers}  {elapsed:.0f}s")
        if live is not None:
            # the trainers withdraw their records as they finish: keep their last numbers on screen
            live.update(step=step, loss=sum(losses) / len(losses) if losses else None,
                        tokens_per_s=tokens / max(elapsed, 1e-9) if records else None, workers=workers)
        elif interactive:
            print("\r" + line.ljust(100), end="", file=sys.stderr, flush=True)
        elif time.monotonic() - last_print >= 5:
            say(line)
            last_print = time.monotonic()
        await asyncio.sleep(1.0)
