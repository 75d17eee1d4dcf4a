"""Fidelity benchmark: does a swarm train as well as the same model in one process, at
equal tokens? Prints ONE JSON object on stdout (progress goes to stderr); `--out PATH` also writes
it to a file, `--quick` runs a short smoke version, `--setting demo|batch64|all` picks the runs.

Settings (the tiny preset, 3 stages x R workers, 2 trainers x 4 lanes, lr schedule over the run):
  demo     target_batch_size 16, 150 steps = 2,400 samples; aim: held-out gap <= 3%
  batch64  target_batch_size 64,  60 steps = 3,840 samples; aim: held-out gap <= 1%

For each setting the benchmark starts real agora-node processes on 127.0.0.1 (open run, the
first worker is the bootstrap peer; averaging is off while each stage has one replica). Each
trainer appends one line per completed sample to the file `AGORA_SAMPLE_LOG` names:
`{"sample_id", "step", "loss"}`, `step` being the optimizer step the sample joined at every
stage. When the trainers are done the workers get SIGTERM and write their final weights to
`--checkpoint-dir`. Then, in this process, with the same seeded init, data, stage-wise
optimizers (`StageOptimizer.for_stage`) and schedule:

- `reference.swarm_order` trains the unsplit model on exactly the swarm's steps (the logged
  sample sets, tokens regenerated from the ids), so order noise cancels and only the pipeline
  (staleness, short or long steps) differs. This is the reference the gaps use.
- `reference.swarm_replay` replays the swarm's steps with each sample's loss and gradients taken,
  at every stage, at the weight version that stage's forward used in the swarm (the log line's
  optional `versions`, one per stage): what staleness alone costs. The swarm's gap to the replay
  is what it loses beyond staleness.
- `reference.sequential` trains on the first N samples in stream order (both shards
  round-robin) in steps of target_batch_size: how far order alone moves the loss.
- `reference.order_noise` retrains the reference with the samples of every 4 consecutive steps
  reshuffled among them (3 runs, `--noise-runs`): the held-out loss's run-to-run spread from order
  alone, which a single swarm run's gap must be read against (`aim.gap_in_noise_std`).
- `unconstrained` trains transformers' `LlamaForCausalLM` of the same shape (roles/model/plain.py:
  learned full-rank embedding, full-rank writes) on the swarm's steps: the price of the subspace
  model.

Figures, for each: final training loss (mean step loss over the last 10% of steps), held-out loss
(256 samples of the corpus under seed + 1000; the swarm's from its checkpoints, evaluated with
FullModel, i.e. without boundary compression, which is lossless to ~1e-7), and the training loss
over the 10% of tokens ending at 25/50/75/100%. Gaps are (swarm - reference) / reference. Per
stage: steps taken, samples per step and staleness from the workers' summaries (null while a
worker does not report them), and samples per step from the log.

Measured on this 2-core machine (`--setting all` takes about 6 minutes; `--quick` about 1.2):
- With the default staleness.max_delayed_per_step 0 (the head keeps only as many samples in
  flight as its open step still needs): demo and batch64 held-out gap 0.0% in each of three runs
  (e.g. swarm 1.1213 = reference 1.1213; 2.1578 = 2.1578); every stage 150 (60) steps of exactly
  16 (64) samples; no gradient delayed; order noise 1.7-5.9% (0.2%) for scale.
- Without the gate (`--no-forward-gate`), demo: held-out +12.3%, +5.7% in two runs (earlier
  builds: +3.2%, +9.7%, -1.6%, +10.2%), with 33% of the head's and 19% of the body's gradients one
  step old; `swarm_replay` reproduces the swarm to 0.0%, so staleness is the whole gap. Gate 2:
  15% delayed, -0.6%; gate 4: 25% delayed, +10.5%. The gate costs the demo 14% of its tokens/s
  (1,900 against 2,220, same run), the drain of a 3-stage pipeline once per 16-sample step.
- batch64 without the gate: +0.1%, -0.4%, +0.1% (about 7% of the head's gradients one step old).

`--workers-per-stage R` (default 1) starts R replicas of every stage (`worker-s{s}-r{r}`, each
writing its checkpoints to its own `checkpoints/r{r}`), with the preset's averaging on unless
`--averaging-off`. The swarm's held-out loss is then that of the elementwise mean of the replicas'
final weights, which the gaps and the setting's aim use; each replica's own model (stage s from
replica r for every s) gets its held-out loss and gap too, aimed at <= 5% (`aim.replicas_met`).
`swarm.replicas` gives, per stage, the pairwise L2 distance between the replicas' weights against
the distance each moved from the seeded init (`relative_distance`), and `swarm.per_stage` the
stage's steps over its replicas, its averaging rounds, and each replica's own figures.

`--churn` (with `--workers-per-stage` 2 or more) kills one replica mid-run and restarts it, to
check that the figures hold under churn. Every worker runs with its own `--identity`
file, so the restart keeps its peer id. Once the sample logs hold 40% of the run's samples, replica
1 of the middle stage (the last one with two stages) gets SIGKILL, then its process group (its DHT
process and p2pd) too, as a crashed machine would; 5 s later the same command (stage, identity,
checkpoint directory and every other argument) starts again as `worker-s1-r1-restart`, and its
final checkpoint lands in the same `checkpoints/r1`. `swarm.churn` says when each happened and how
long the restart took to announce itself ready; `swarm.per_stage` lists both processes (the killed
one reports no summary). For every run, churn or not, `swarm.accounting` adds up the trainers'
completed and dropped samples against the target (`unaccounted` should be 0), and each stage's
`steps.closed_by` counts why its replicas closed their steps, so short steps can be told apart
from samples really lost. No churn figures are quoted here until a run has measured them.

`--data PREPARED_DIR` trains on a corpus made by `agora-node data prepare` (e.g. with
`--train-tokenizer 4096 --shard-tokens 16384`: the two trainers need a training shard each, and
small shards mix the text each reads) instead of the synthetic grammar: the run config names it
(`data.location`, `manifest_sha256`), so the trainers read it as in a real run, each from a data
directory of the run's own, and `model.vocab_size` is its tokenizer's. The references get the
very samples the trainers logged (scripts/_fidelity_corpus.py walks each trainer's shards as it
does and numbers them as the synthetic stream's positions are numbered, so `sequential` is the
two walks round-robin), and every held-out loss is taken on HELD_OUT_SAMPLES samples spread
evenly over the corpus's held-out split (corpus/heldout.py, the selection the trainers' own
evaluation uses). `config.data` says
which corpus (path, manifest hash, vocabulary, training tokens) and `swarm.train_split_epochs` how
much of it the run read. `--data text` (or `text:MB`) needs no corpus at hand: the bench makes one
of real text from the documentation already on the machine (scripts/make_text_corpus.py, 10 MB by
default), prepares it once as a user would (a 4,096-token BPE, shards of 65,536 tokens, the
default 1% held out, more for a corpus under 10 MB so the held-out split holds the 256 samples the
references are evaluated on) and reuses it from `~/.cache/agora-node/bench-fidelity/`.

`swarm.evaluation` is the run's own held-out curve as trainer 0 measured it during the run
(roles/trainer/evaluation.py, `evaluation.samples` per point, `--evaluation-samples N` to change
it): each point with its standard error beside the swarm's training loss just before it, and what
the evaluations cost (their forward passes against the training's, their seconds).

At a large vocabulary the stage anchors (one [vocab, d_model] table per stage) outweigh the
rest of the tiny model; `--anchor-rank K` factors them (`model.anchor_rank`). `unconstrained`
reports `trained_parameters` of the plain Llama, `trained_parameters_ours` of the stage model,
and `anchor_rank_nearest_in_parameters`, the K at which the two counts are nearest, so the
subspace gap can be read at equal trained values.

`--ablation` instead trains the construction ablation of scripts/bench_construction.py
(one-process candidates against transformers' Llama at the demo's budget, three seeds; that script
is the place to run it with other sizes and budgets).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run as a file: find the helpers
from _bench_common import REPO_ROOT, emit_report, log, machine_info, rounded  # noqa: E402

SAMPLE_LOG_ENV = "AGORA_SAMPLE_LOG"
HELD_OUT_SAMPLES = 256
TEXT_DATA = re.compile(r"text(?::(\d+(?:\.\d+)?))?")
"""`--data text[:MB]`: real text the bench makes and prepares itself."""
TEXT_DATA_MB = 10.0
TEXT_DATA_VOCAB = 4096
TEXT_DATA_SHARD_TOKENS = 65536
"""Small shards: each of the two trainers reads every other one, so both read every kind of text."""
TRAIN_LOSS_WINDOW = 10
"""Steps of training loss averaged before each in-run held-out point (swarm.evaluation)."""
STAGES, TRAINERS, LANES = 3, 2, 4
CHURN_AT_SHARE = 0.4
"""--churn: kill the replica once the sample logs hold this share of the run's samples."""
CHURN_RESTART_AFTER_S = 5.0
REPLICA_GAP_MAX = 0.05
"""The aim for each replica's own model; their mean is held to the setting's aim. Averaging syncs
only a slice of the weights every few steps, so a replica may differ a little from the mean."""


@dataclass(frozen=True)
class Setting:
    target_batch_size: int
    steps: int
    quick_steps: int
    worker_max_batch: int
    held_out_gap_max: float


SETTINGS = {
    "demo": Setting(target_batch_size=16, steps=150, quick_steps=20, worker_max_batch=16, held_out_gap_max=0.03),
    "batch64": Setting(target_batch_size=64, steps=60, quick_steps=10, worker_max_batch=64, held_out_gap_max=0.01),
    # Not in `all`: a point of the frontier (scripts/bench_frontier.py); 20 steps of 512 are few for a
    # loss figure but show what the gate costs in tokens/s at a large batch.
    "batch512": Setting(target_batch_size=512, steps=20, quick_steps=4, worker_max_batch=64, held_out_gap_max=0.01),
}
DEFAULT_SETTINGS = ("demo", "batch64")


def fidelity_run_config(name: str, setting: Setting, steps: int, args: argparse.Namespace):
    """The tiny preset at the setting's batch, its schedule spanning the run (never shorter than
    the warmup). Averaging is off with one replica per stage (nothing to average) or with
    --averaging-off; otherwise the preset's averaging runs, since that is what replicas train with."""
    from protocol.run_config import load_run_config

    warmup = load_run_config("tiny").optimizer.warmup_steps
    overrides: dict[str, Any] = {
        "run_id": f"fidelity-{name}-{os.getpid()}",
        "target_batch_size": setting.target_batch_size,
        "optimizer": {"total_steps": max(steps, warmup)},
    }
    if args.workers_per_stage == 1 or args.averaging_off:
        overrides["averaging"] = {"enabled": False}
    else:
        averaging: dict[str, Any] = {}
        if getattr(args, "averaging_method", "asyncsparta") == "sparseloco":
            averaging["method"] = "sparseloco"
            averaging["sparseloco"] = {"inner_steps": args.inner_steps, "transport": args.sparseloco_transport}
            if args.sparseloco_transport == "store":
                averaging["sparseloco"]["store"] = os.path.join(os.path.dirname(os.path.abspath(
                    args.out or "fidelity.json")), f"sparseloco-store-{os.getpid()}")
        if getattr(args, "gradients", None):
            averaging["gradients"] = args.gradients
        if averaging:
            overrides["averaging"] = averaging
    staleness: dict[str, Any] = {}
    if args.max_in_flight_ratio is not None:
        staleness["max_in_flight_ratio"] = args.max_in_flight_ratio
    if args.no_pin_forward_weights:
        staleness["pin_forward_weights"] = False
    if args.max_delayed_per_step is not None:
        staleness["max_delayed_per_step"] = args.max_delayed_per_step
    if args.no_forward_gate:
        staleness["max_delayed_per_step"] = None
    if staleness:
        overrides["staleness"] = staleness
    if args.routing != "trainer":
        overrides["routing"] = {"path": args.routing}
    model: dict[str, Any] = {}
    if getattr(args, "data", None):
        # The trainers read the corpus the run config names (trainer_data), and its tokenizer's
        # vocabulary is the model's; the trainers refuse a corpus whose manifest hashes otherwise.
        corpus = open_corpus(args.data)
        model["vocab_size"] = corpus.manifest.tokenizer.vocab_size
        overrides["data"] = {"location": corpus.location, "manifest_sha256": corpus.sha256}
    if getattr(args, "anchor_rank", None):
        model["anchor_rank"] = args.anchor_rank
    if model:
        overrides["model"] = model
    if getattr(args, "evaluation_samples", None):
        overrides["evaluation"] = {"samples": args.evaluation_samples}
    return load_run_config("tiny", overrides)


def prepared_text_corpus(megabytes: float) -> str:
    """A real-text corpus prepared as a user would (`agora-node data prepare --train-tokenizer`), made
    from the documentation on this machine and kept in a cache directory: the same text and shards
    every time on one machine, and no download. Returns the prepared directory."""
    from make_text_corpus import make_text_corpus

    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "agora-node",
                         "bench-fidelity", f"text-{megabytes:g}mb-bpe{TEXT_DATA_VOCAB}")
    prepared = os.path.join(cache, "prepared")
    if os.path.isfile(os.path.join(prepared, "manifest.json")):
        return prepared
    made = make_text_corpus(Path(cache) / "raw", megabytes)
    log(f"preparing {made['bytes']:,} bytes of text ({made['documents']} documents) into {prepared}")
    # 1% held out, as `data prepare` does by default, once the corpus is large enough for that to
    # hold the HELD_OUT_SAMPLES windows the references are evaluated on; a small one holds out more.
    heldout_fraction = min(0.2, max(0.01, 0.1 / megabytes))
    command = [sys.executable, "-m", "node.cli", "data", "prepare", "--output", prepared, "--train-tokenizer",
               str(TEXT_DATA_VOCAB), "--shard-tokens", str(TEXT_DATA_SHARD_TOKENS),
               "--heldout-fraction", f"{heldout_fraction:g}", "--quiet", made["path"]]
    subprocess.run(command, check=True, cwd=REPO_ROOT, stdout=sys.stderr)  # stdout is the JSON report's
    return prepared


def open_corpus(location: str):
    """The prepared corpus at `location` (a directory), by its absolute path, so every node finds it."""
    from corpus.shards import PreparedCorpus

    return PreparedCorpus(os.path.abspath(location))


# ---------------------------------------------------------------------------------------------
# the swarm
# ---------------------------------------------------------------------------------------------

def run_swarm(run, config_path: str, workdir: str, setting: Setting, total_samples: int, replicas: int,
              churn: bool = False, lanes: int = LANES, prefixes: Optional[dict[str, list[str]]] = None,
              skip_stage: bool = False, depart_at_samples: Optional[int] = None,
              node_args: Optional[Callable[[str], list[str]]] = None,
              on_tick: Optional[Callable[[Any, float], None]] = None) -> dict:
    """Train `total_samples` with a local swarm of `replicas` workers per stage; return its sample
    logs, summaries and one checkpoint directory per replica index (checkpoint files are named by
    run and stage only, so replicas of a stage cannot share one), and its failure in "errors".
    With `churn`, one replica is killed mid-run and restarted (`Churn`); "churn" says how it went.
    With `skip_stage`, every replica of the churned stage is killed together and restarted: the
    trainers skip the stage meanwhile (run.skipping); "churn" is then a list, one entry a replica.
    With `depart_at_samples`, the replica `churn` would kill is killed once the logs hold that many
    samples and never restarted (a worker that leaves for good); "churn" says how it went.
    For other benchmarks (scripts/bench_trust.py): `prefixes` runs the named nodes through another
    command (an altered worker), `node_args(name)` adds arguments to a node's command line (its
    authorizer and account), and `on_tick(swarm, seconds since the trainers started)` is called
    twice a second while they run. Every process is stopped before this returns (or an interrupt
    propagates)."""
    from node.launcher import LocalSwarm

    checkpoint_dirs = [os.path.join(workdir, "checkpoints", f"r{r}") for r in range(replicas)]
    swarm = LocalSwarm(os.path.join(workdir, "logs"), config_path, torch_threads=1,
                       common_args=["--announce-period-s", "2"])
    logs = [os.path.join(workdir, f"samples-{k}.jsonl") for k in range(TRAINERS)]
    out: dict[str, Any] = {"sample_logs": logs, "checkpoint_dirs": checkpoint_dirs, "replica_of": {}, "errors": [],
                           "churned": {}}
    started = time.monotonic()
    churners: list[Churn] = []
    try:
        workers = []
        worker_args: dict[str, list[str]] = {}
        for r, directory in enumerate(checkpoint_dirs):
            for s in range(STAGES):
                name = f"worker-s{s}-r{r}"
                out["replica_of"][name] = r
                # Its own identity file (the node creates it): a restart with it keeps the peer id.
                worker_args[name] = ["--max-batch", str(setting.worker_max_batch), "--checkpoint-dir", directory,
                                     "--checkpoint-period-s", "100000",
                                     "--identity", os.path.join(workdir, f"identity-s{s}-r{r}.key"),
                                     *(node_args(name) if node_args else [])]
                # The first worker is the bootstrap peer: the others need its address to start.
                workers.append(swarm.start("worker", stage=s, name=name, wait_ready=not workers, timeout_s=120,
                                           args=worker_args[name], prefix=(prefixes or {}).get(name, ())))
        for node in workers:
            swarm.wait_ready(node, timeout_s=120)
        out["startup_s"] = round(time.monotonic() - started, 1)
        log(f"  workers ready after {out['startup_s']:.0f}s; starting {TRAINERS} trainers")
        per_trainer = math.ceil(total_samples / TRAINERS)
        trainers = []
        base_env = swarm.env
        for k in range(TRAINERS):
            # LocalSwarm has one environment for all its nodes; each trainer needs its own log.
            swarm.env = {**base_env, SAMPLE_LOG_ENV: logs[k]}
            try:
                trainers.append(swarm.start(
                    "trainer", wait_ready=False, name=f"trainer-{k}",
                    args=["--lanes", str(lanes), "--max-samples", str(per_trainer), "--shard-index", str(k),
                          "--num-shards", str(TRAINERS), "--discovery-period-s", "2",
                          *(node_args(f"trainer-{k}") if node_args else [])]))
            finally:
                swarm.env = base_env
        # 3 processes per worker share the machine's cores; with 4 replicas per stage on 2 cores a
        # trainer took over 100 s just to join, so the patience grows with the swarm.
        ready_timeout_s = 120 * max(1, replicas / 2)
        for node in trainers:
            swarm.wait_ready(node, timeout_s=ready_timeout_s)
        train_started = time.monotonic()
        victims = ([n for n in workers if n.stage == CHURN_STAGE] if skip_stage
                   else [n for n in workers if n.name == f"worker-s{CHURN_STAGE}-r1"] if churn else [])
        if depart_at_samples is not None:
            victims = [n for n in workers if n.name == f"worker-s{CHURN_STAGE}-r1"]
        at_samples = math.ceil(CHURN_AT_SHARE * total_samples) if depart_at_samples is None else depart_at_samples
        churners = [Churn(swarm, victim, worker_args[victim.name], at_samples, train_started,
                          restart=depart_at_samples is None) for victim in victims]
        deadline = train_started + 300 + total_samples / 4
        last_report = train_started
        while any(t.proc.poll() is None for t in trainers):
            if time.monotonic() > deadline:
                raise TimeoutError(f"trainers still running after {time.monotonic() - train_started:.0f}s")
            time.sleep(0.5)
            if on_tick is not None:
                on_tick(swarm, time.monotonic() - train_started)
            for churner in (c for c in churners if c.pending):
                restarted = churner.tick(logs)
                if restarted is not None:
                    out["replica_of"][restarted.name] = out["replica_of"][churner.victim.name]
                    out["churned"][restarted.name] = "restarted"
                    out["churned"][churner.victim.name] = "killed"
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                log(f"  {sum(_count_lines(p) for p in logs)}/{total_samples} samples logged, "
                    f"{last_report - train_started:.0f}s")
        out["train_wall_s"] = round(time.monotonic() - train_started, 1)
        out["trainer_exit_codes"] = [t.proc.returncode for t in trainers]
        if any(out["trainer_exit_codes"]):
            out["errors"].append(f"trainer exit codes {out['trainer_exit_codes']}")
    except Exception as exc:  # noqa: BLE001 - keep what the nodes logged and checkpointed so far
        out["errors"].append(f"swarm: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    finally:
        for churner in churners:
            if churner.victim.name not in out["churned"] and churner.killed_at is not None:
                out["churned"][churner.victim.name] = "killed"
            out["errors"] += churner.errors()
        if churners:
            out["churn"] = [c.report() for c in churners] if skip_stage else churners[0].report()
        swarm.stop_all(timeout_s=60)  # SIGTERM: workers write their final checkpoints
        out["wall_s"] = round(time.monotonic() - started, 1)
        out["survivors"] = swarm.survivors()
        if out["survivors"]:
            out["errors"].append(f"processes {out['survivors']} survived shutdown")
        out["summaries"] = {node.name: _summary(node) for node in swarm.nodes}
        out["stages"] = {node.name: node.stage for node in swarm.nodes}
        out["peer_ids"] = {node.name: node.peer_id for node in swarm.nodes}
        out["exit_codes"] = {node.name: node.proc.returncode for node in swarm.nodes}
        out["log_dir"] = swarm.workdir
    return out


CHURN_STAGE = STAGES // 2
"""The stage whose replica 1 --churn kills: the middle one (1 of 3), or the last of two."""


class Churn:
    """Kills `victim` (SIGKILL, then its process group: a crashed machine) once the sample logs
    hold `at_samples`, and CHURN_RESTART_AFTER_S later starts the same command again under the
    name `<victim>-restart` (without `restart`, never: a departure); `tick` advances it from the
    trainers' wait loop. Times are seconds since `t0`, the trainers' start."""

    def __init__(self, swarm, victim, args: list[str], at_samples: int, t0: float, restart: bool = True):
        self.swarm, self.victim, self.args, self.at_samples, self.t0 = swarm, victim, list(args), at_samples, t0
        self.restart = restart
        self.killed_at: Optional[float] = None
        self.killed_at_samples: Optional[int] = None
        self.kill_exit_code: Optional[int] = None
        self.restarted = None
        self.restarted_at: Optional[float] = None
        self.ready_after: Optional[float] = None
        self.restart_error: Optional[str] = None
        self._waiter: Optional[Any] = None

    @property
    def pending(self) -> bool:
        return self.killed_at is None or (self.restart and self.restarted is None)

    def tick(self, logs: list[str]):
        """Kill or restart when due; returns the restarted node on the tick that started it."""
        now = time.monotonic()
        if self.killed_at is None:
            logged = sum(_count_lines(p) for p in logs)
            if logged < self.at_samples:
                return None
            log(f"  churn: SIGKILL {self.victim.name} at {logged} samples logged, {now - self.t0:.0f}s")
            self.killed_at_samples = logged
            # Sends the signal, waits for the node to exit, then kills what is left of its group
            # (hivemind's DHT process and p2pd, which would otherwise keep its peer id alive).
            self.kill_exit_code = self.swarm.stop(self.victim, sig=signal.SIGKILL, timeout_s=30)
            self.killed_at = time.monotonic()
            return None
        if not self.restart:
            return None
        if now - self.killed_at < CHURN_RESTART_AFTER_S:
            return None
        import threading

        name = f"{self.victim.name}-restart"
        log(f"  churn: restarting {self.victim.name} as {name}, {now - self.t0:.0f}s")
        self.restarted = self.swarm.start("worker", stage=self.victim.stage, name=name, wait_ready=False,
                                          args=self.args)
        self.restarted_at = time.monotonic()
        self._waiter = threading.Thread(target=self._wait_ready, daemon=True)
        self._waiter.start()
        return self.restarted

    def _wait_ready(self) -> None:
        try:
            self.swarm.wait_ready(self.restarted, timeout_s=120)
            self.ready_after = time.monotonic() - self.restarted_at
            log(f"  churn: {self.restarted.name} ready after {self.ready_after:.1f}s")
        except Exception as exc:  # noqa: BLE001 - reported in the churn figures and errors
            self.restart_error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

    def report(self) -> dict:
        def since(t: Optional[float]) -> Optional[float]:
            return None if t is None else round(t - self.t0, 1)

        how = ("seconds since the trainers started; the killed worker got SIGKILL, then its process "
               "group; the restart ran the same command (stage, --identity, --checkpoint-dir, ...) "
               f"{CHURN_RESTART_AFTER_S:.0f}s later; restart_ready_s: from its start to its readiness "
               "line (null if it never printed one before the trainers finished)")
        if not self.restart:
            how = ("seconds since the trainers started; the killed worker got SIGKILL, then its process group, "
                   "and was never restarted (a departure)")
        return {
            "killed": self.victim.name if self.killed_at is not None else None,
            "killed_at_samples": self.killed_at_samples,
            "kill_at_samples_target": self.at_samples,
            "killed_at_s": since(self.killed_at),
            "kill_exit_code": self.kill_exit_code,
            "restarted_at_s": since(self.restarted_at),
            "restart_ready_s": rounded(self.ready_after, 1),
            "restarted_name": self.restarted.name if self.restarted is not None else None,
            "restart_error": self.restart_error,
            "how_to_read": how,
        }

    def errors(self) -> list[str]:
        if self.killed_at is None:
            return [f"churn: the trainers finished before {self.at_samples} samples were logged; nothing was killed"]
        if not self.restart:
            return []
        if self.restarted is None:
            return [f"churn: the trainers finished before {self.victim.name} was restarted"]
        if self.restart_error is not None:
            return [f"churn: {self.restarted.name} did not come back: {self.restart_error}"]
        return []


def _summary(node, wait_s: float = 3.0) -> Optional[dict]:
    """A node's final summary line; the stdout reader may still be catching up after exit."""
    deadline = time.monotonic() + wait_s
    while (found := node.summary()) is None and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def _count_lines(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return sum(1 for _ in f)
    except OSError:
        return 0


def read_sample_logs(paths: list[str], index_of: Optional[Callable[[str], int]] = None,
                     ) -> tuple[dict[int, list[tuple[int, float, Optional[tuple]]]], int]:
    """Logged samples grouped by step: {step: [(sample number, loss, versions)]}, and how many
    lines were unreadable. `index_of` numbers a logged sample id as the sample bank does (default:
    the synthetic stream's position). `versions` (None if not logged) are the weight versions each
    stage's forward used. A sample logged twice (a retry) counts once, at its last line."""
    from _fidelity_reference import stream_index

    index_of = index_of or stream_index
    latest: dict[int, dict] = {}
    bad = 0
    for record in _log_records(paths):
        try:
            if "retracted_at" in record:
                continue  # not a sample: its retraction at a stage (read_retractions)
            latest[index_of(record["sample_id"])] = record
        except (ValueError, KeyError, TypeError):
            bad += 1
    steps: dict[int, list[tuple[int, float, Optional[tuple]]]] = defaultdict(list)
    for index, record in latest.items():
        try:
            versions = record.get("versions")
            if versions is not None and any(v is None for v in versions):
                versions = None  # a stage did not say (an older worker): no replay for this sample
            steps[int(record["step"])].append((index, float(record["loss"]),
                                               None if versions is None else tuple(int(v) for v in versions)))
        except (ValueError, KeyError, TypeError):
            bad += 1
    return {step: sorted(samples) for step, samples in sorted(steps.items())}, bad


def read_retractions(paths: list[str], index_of: Optional[Callable[[str], int]] = None) -> dict[int, set[int]]:
    """The stages that took each sample's gradient back out of its step (a trainer logs
    `{"sample_id", "retracted_at": stage}` for each retraction a worker applied), by sample
    number as `read_sample_logs` numbers them."""
    from _fidelity_reference import stream_index

    index_of = index_of or stream_index
    out: dict[int, set[int]] = defaultdict(set)
    for record in _log_records(paths):
        try:
            if "retracted_at" in record:
                out[index_of(record["sample_id"])].add(int(record["retracted_at"]))
        except (ValueError, KeyError, TypeError):
            continue
    return dict(out)


def _log_records(paths: list[str]):
    """Every line of the trainers' sample logs, parsed (None for a line that is not JSON, which
    the callers count as unreadable); a file that cannot be read is skipped."""
    for path in paths:
        try:
            with open(path) as f:
                lines = f.readlines()
        except OSError:
            continue
        for line in lines:
            try:
                yield json.loads(line)
            except ValueError:
                yield None


def read_checkpoints(run, directory: str) -> tuple[dict, dict[int, Optional[int]]]:
    """One replica's final stages, {stage: StageModel} for those it wrote a checkpoint of, and the
    step each was written at (None where missing)."""
    from safetensors import safe_open

    from _fidelity_reference import build_stages, load_stage_weights
    from roles.worker.state.stage_checkpoint import checkpoint_path

    stages, written = {}, {}
    for stage in build_stages(run):
        path = checkpoint_path(directory, run.run_id, stage.stage_index)
        written[stage.stage_index] = None
        if path.is_file():
            with safe_open(str(path), framework="pt") as handle:
                load_stage_weights(stage, {name: handle.get_tensor(name) for name in handle.keys()})
                written[stage.stage_index] = int((handle.metadata() or {}).get("step", "0"))
            stages[stage.stage_index] = stage
    return stages, written


def mean_of_replicas(run, replicas: list[dict]) -> dict:
    """Per stage, the elementwise mean of the weights of the replicas that have it: what a stage
    whose replicas averaged fully would hold, and the model the swarm's held-out loss is taken of."""
    import torch

    from _fidelity_reference import build_stages

    mean = {}
    for stage in build_stages(run):
        held = [r[stage.stage_index] for r in replicas if stage.stage_index in r]
        if not held:
            continue
        with torch.no_grad():
            for k, param in enumerate(stage.trainable_parameters()):
                param.copy_(torch.stack([r.trainable_parameters()[k].detach() for r in held]).mean(0))
        mean[stage.stage_index] = stage
    return mean


def held_out_of(stages: dict, held_out) -> Optional[float]:
    """Held-out loss of the model chained from `stages` ({index: StageModel}); None if one is missing."""
    from _fidelity_reference import evaluate
    from roles.model.stage import FullModel

    if len(stages) < STAGES:
        return None
    return round(evaluate(FullModel.from_stages([stages[s] for s in range(STAGES)]), held_out), 4)


def replica_distances(run, replicas: list[dict]) -> dict:
    """Per stage, how far apart its replicas ended (pairwise L2 of the flattened weights) against
    how far each moved from the seeded init: a relative_distance near 0 means averaging kept the
    replicas one model, near 1 or above that they trained as separate ones."""
    import itertools

    import torch

    from _fidelity_reference import build_stages

    def flat(stage) -> torch.Tensor:
        return torch.cat([p.detach().flatten().double() for p in stage.trainable_parameters()])

    out = {}
    for init in build_stages(run):
        index = init.stage_index
        weights = {r: flat(stages[index]) for r, stages in enumerate(replicas) if index in stages}
        start = flat(init)
        moved = {r: float(torch.linalg.vector_norm(w - start)) for r, w in weights.items()}
        pairs = [float(torch.linalg.vector_norm(weights[a] - weights[b]))
                 for a, b in itertools.combinations(sorted(weights), 2)]
        mean_pair = statistics.fmean(pairs) if pairs else None
        mean_moved = statistics.fmean(moved.values()) if moved else None
        out[str(index)] = {
            "replicas_with_checkpoint": sorted(weights),
            "pairwise_distance_max": rounded(max(pairs), 6) if pairs else None,
            "pairwise_distance_mean": rounded(mean_pair, 6),
            "moved_from_init": [rounded(moved.get(r), 6) for r in range(len(replicas))],
            "moved_from_init_mean": rounded(mean_moved, 6),
            "relative_distance": (rounded(mean_pair / mean_moved, 4)
                                  if mean_pair is not None and mean_moved else None),
        }
    return out


def _stage_figures(summary: Optional[dict]) -> dict:
    """What a worker reported about its steps and staleness; null where it reported nothing."""
    summary = summary or {}
    steps = summary.get("steps") or {}
    stale = summary.get("staleness") or {}
    return {
        "local_step": summary.get("local_step"),
        "steps": {k: steps.get(k) for k in ("taken", "samples_per_step_mean", "samples_per_step_max",
                                           "samples_per_step_min", "short_steps", "late_samples",
                                           "discarded_at_shutdown", "long_steps", "abandoned_samples",
                                           "steps_skipped", "closed_by")},
        "summary_reported": bool(summary),
        "staleness": {k: stale.get(k) for k in ("samples", "mean_gap", "max_gap", "stale_share", "pinned",
                                                "mean_delay", "max_delay", "delayed_share")},
        # A pinned sample's forward ran before this stage's last step and its gradient joins a later
        # step: one step older than the reference's, however consistent its recompute.
        "pinned_share": (round(stale["pinned"] / stale["samples"], 4)
                         if stale.get("samples") and stale.get("pinned") is not None else None),
        "mean_batch_size": summary.get("mean_batch_size"),
        "compute_s": summary.get("compute_s"),
        "averaging_rounds": _round_counts(summary.get("averaging")),
        "gradient_exchange": summary.get("gradient_exchange"),
        "sparseloco": ({k: v for k, v in summary["sparseloco"].items() if k not in ("recent", "anchors")}
                       if summary.get("sparseloco") else None),
        # backwards run through a kept forward graph (backward_kept) against recomputed ones
        "backward_kept": (summary.get("counters") or {}).get("backward_kept", 0) if summary else None,
        "kept_activations": summary.get("kept_activations"),
    }


ROUND_STATUSES = ("complete", "partial", "failed", "skipped")


def _round_counts(averaging: Optional[dict]) -> Optional[dict]:
    """A worker's averaging rounds by outcome (its `rounds_*` counters); None if it reported none."""
    if averaging is None:
        return None
    counters = averaging.get("counters") or {}
    counts = {status: counters.get(f"rounds_{status}", 0) for status in ROUND_STATUSES}
    counts.update({k.removeprefix("rounds_"): v for k, v in sorted(counters.items()) if k.startswith("rounds_")})
    return counts


def _stage_over_replicas(replicas: list[dict]) -> dict:
    """A stage's step figures over its replicas, which each report their own: what the stage did
    and whether any replica's steps strayed from the target."""
    def combine(fn, key: str):
        found = [r["steps"][key] for r in replicas if r["steps"][key] is not None]
        return fn(found) if found else None

    counted = [r["averaging_rounds"] for r in replicas if r["averaging_rounds"] is not None]
    outcomes = dict.fromkeys(k for c in counted for k in c)
    reasons = [r["steps"].get("closed_by") for r in replicas if r["steps"].get("closed_by") is not None]
    closed_by: Optional[dict] = None
    if reasons:
        closed_by = defaultdict(int)
        for found in reasons:
            for reason, count in found.items():
                closed_by[reason] += count
        closed_by = dict(sorted(closed_by.items()))
    return {
        "steps": {"taken": combine(max, "taken"),
                  "samples_per_step_mean": combine(lambda v: rounded(statistics.fmean(v)), "samples_per_step_mean"),
                  "samples_per_step_max": combine(max, "samples_per_step_max"),
                  "samples_per_step_min": combine(min, "samples_per_step_min"),
                  "short_steps": combine(sum, "short_steps"), "late_samples": combine(sum, "late_samples"),
                  "discarded_at_shutdown": combine(sum, "discarded_at_shutdown"),
                  "long_steps": combine(sum, "long_steps"), "abandoned_samples": combine(sum, "abandoned_samples"),
                  "closed_by": closed_by},
        # Every member of a round counts it, so the stage ran as many as its busiest replica saw.
        "averaging_rounds": {k: max(c.get(k, 0) for c in counted) for k in outcomes} if counted else None,
        "replicas": replicas,
    }


# ---------------------------------------------------------------------------------------------
# one setting
# ---------------------------------------------------------------------------------------------

def _parameter_counts(run) -> dict[str, Optional[int]]:
    """Trained values of the stage model (all stages) and of the plain Llama of its shape, and the
    `model.anchor_rank` that brings the stage model's count nearest the Llama's (None without
    stage anchors): a factored anchor of rank r holds r x (vocab + d_model) values per stage."""
    from _fidelity_reference import build_stages
    from roles.model.plain import PlainModel

    stages = build_stages(run)
    ours = sum(p.numel() for s in stages for p in s.trainable_parameters())
    plain = sum(p.numel() for p in PlainModel(run).parameters() if p.requires_grad)
    nearest = None
    anchored = [s for s in stages if s.anchor is not None]
    if anchored:
        without = ours - sum(p.numel() for s in anchored for p in (s.anchor, s.anchor_basis) if p is not None)
        per_rank = len(anchored) * (run.model.vocab_size + run.model.d_model)
        nearest = max(1, round((plain - without) / per_rank))
    return {"ours": ours, "plain": plain, "anchor_rank_nearest": nearest}


def committed_steps(logged: dict, applied: Optional[int]) -> dict:
    """The logged steps (`read_sample_logs`) below `applied`, the step every final checkpoint
    reached (None: all of them): steps the workers did not apply before they stopped are not in
    the swarm's weights."""
    return {s: samples for s, samples in logged.items() if applied is None or s < applied}


def step_order(swarm_steps: dict) -> list[list[int]]:
    """Each step's stream positions, in step order: what the swarm-order reference trains on."""
    return [[index for index, _, _ in samples] for samples in swarm_steps.values()]


def _gap(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else round((a - b) / b, 4)


def train_reference(trainer, steps, bank, held_out, label: str, retracted: Optional[dict] = None) -> dict:
    """Train `trainer` on `steps` (lists of stream positions, tokens from `bank`) and evaluate it
    on `held_out`: its loss figures, held-out loss and wall seconds (scripts/bench_trust.py's
    own-order reference too, with the swarm's retractions: `read_retractions`)."""
    from _fidelity_reference import evaluate, loss_figures

    started = time.monotonic()
    trainer.train(steps, bank, retracted=retracted)
    figures = loss_figures(trainer.history)
    figures["held_out_loss"] = round(evaluate(trainer.model, held_out), 4)
    figures["wall_s"] = round(time.monotonic() - started, 1)
    log(f"  {label}: held-out {figures['held_out_loss']:.4f}, final train {figures['final_train_loss']:.4f} "
        f"({figures['wall_s']:.0f}s)")
    return figures


def _replayed(run, swarm_steps: dict, bank, held_out) -> dict:
    """The swarm's steps replayed at the weight versions each stage's forward used."""
    from _fidelity_reference import OneProcessTrainer, StaleReplay, evaluate, loss_figures

    started = time.monotonic()
    trainer = OneProcessTrainer.for_stages(run)
    replay = StaleReplay(trainer)
    for step, samples in swarm_steps.items():
        replay.step(step, bank.tokens([index for index, _, _ in samples]), [v for _, _, v in samples])
    figures = loss_figures(trainer.history)
    figures["held_out_loss"] = round(evaluate(trainer.model, held_out), 4)
    figures["wall_s"] = round(time.monotonic() - started, 1)
    log(f"  reference, swarm replay (stale versions): held-out {figures['held_out_loss']:.4f}")
    return figures


def _order_noise(run, steps: list[list[int]], bank, held_out, runs: int, base: dict) -> dict:
    """How far the reference's held-out loss moves when the samples of every 4 consecutive steps
    are reshuffled among them (step sizes kept): the run-to-run noise a swarm's gap has to be
    read against, since a pipeline reorders samples on about that scale."""
    import random

    from _fidelity_reference import OneProcessTrainer

    values = [base["held_out_loss"]]
    for seed in range(runs):
        rng = random.Random(seed)
        shuffled: list[list[int]] = []
        for start in range(0, len(steps), 4):
            window = steps[start:start + 4]
            pool = [index for step in window for index in step]
            rng.shuffle(pool)
            for step in window:
                shuffled.append(pool[:len(step)])
                pool = pool[len(step):]
        values.append(train_reference(OneProcessTrainer.for_stages(run), shuffled, bank, held_out,
                               f"reference, order noise {seed}")["held_out_loss"])
    mean = statistics.fmean(values)
    return {"held_out_losses": values, "relative_std": round(statistics.stdev(values) / mean, 4),
            "how": "the reference as trained, then retrained with the samples of every 4 consecutive steps "
                   "reshuffled among them (seeds 0..n-1); relative_std = stdev / mean of the held-out losses"}


def _log_staleness(swarm_steps: dict, stages: int) -> dict:
    """Per stage, how many steps older than its step the weights a sample's forward used were."""
    out = {}
    for stage in range(stages):
        lags = [step - versions[stage] for step, samples in swarm_steps.items() for _, _, versions in samples]
        out[str(stage)] = {"mean_lag": rounded(statistics.fmean(lags), 4), "max_lag": max(lags),
                           "stale_share": rounded(sum(1 for g in lags if g > 0) / len(lags), 4)}
    return out


def evaluation_curve(summaries: dict[str, Optional[dict]], swarm_steps: dict, train_wall_s: Optional[float]
                     ) -> Optional[dict]:
    """The run's own held-out curve, as trainer 0 measured it during the run (roles/trainer/evaluation.py):
    each point with its standard error, beside the swarm's training loss over the steps just
    before it (so one can see the curve fall where training falls), and what the evaluations cost."""
    points = next((s["eval"] for n, s in sorted(summaries.items()) if n.startswith("trainer") and s and s.get("eval")),
                  None)
    if not points:
        return None
    curve = []
    for point in points:
        recent = [loss for step, samples in swarm_steps.items() if point["step"] - TRAIN_LOSS_WINDOW <= step
                  < point["step"] for _, loss, _ in samples]
        stderr = point.get("stderr")
        curve.append({"step": point["step"], "held_out_loss": point["loss"], "stderr": stderr,
                      "relative_stderr": rounded(stderr / point["loss"], 4) if stderr is not None and point["loss"]
                      else None,
                      "train_loss_before": rounded(statistics.fmean(recent)) if recent else None,
                      "samples": point["samples"], "seconds": point["seconds"]})
    trained = sum(len(v) for v in swarm_steps.values())
    evaluated = sum(p["samples"] + p.get("dropped", 0) for p in points)
    seconds = sum(p["seconds"] for p in points)
    later = [c for c in curve if c["step"] > 0]
    return {
        "curve": curve,
        "samples_per_evaluation": max(p["samples"] + p.get("dropped", 0) for p in points),
        "relative_stderr_max_after_step_0": max((c["relative_stderr"] for c in later
                                                 if c["relative_stderr"] is not None), default=None),
        "evaluations": len(points), "forward_samples": evaluated,
        "compute_share": rounded(evaluated / (evaluated + 3 * trained), 4) if trained else None,
        "seconds": rounded(seconds, 1),
        "seconds_share_of_training": rounded(seconds / train_wall_s, 4) if train_wall_s else None,
        "how_to_read": "curve: trainer 0's held-out evaluations during the run (relative_stderr = stderr / loss; "
                       f"train_loss_before: the swarm's mean training loss over the {TRAIN_LOSS_WINDOW} steps before "
                       "the point); compute_share: the evaluations' forward passes against the training samples' "
                       "counted as three forwards each (forward and backward); seconds_share_of_training: the "
                       "evaluations' wall time (they overlap training) against the trainers' wall time",
    }


def _accounting(trainers: dict[str, Optional[dict]], target: int, step_sizes: list[int], batch: int) -> dict:
    """Every sample the trainers were asked for, completed or dropped (from their summaries), and
    what the log's short steps lack, to set against the drops."""
    reported = [s for s in trainers.values() if s]

    def total(key: str) -> Optional[int]:
        found = [s.get(key) for s in reported if s.get(key) is not None]
        return sum(found) if found else None

    completed, dropped = total("samples_completed"), total("samples_dropped")
    by_reason: dict[str, int] = defaultdict(int)
    for s in reported:
        for reason, count in (s.get("dropped_by_reason") or {}).items():
            by_reason[reason] += count
    return {
        "samples_target": target,
        "completed": completed,
        "dropped": dropped,
        # a trainer without a summary (it crashed) leaves its samples unknown, not unaccounted
        "unaccounted": (None if completed is None or dropped is None or len(reported) < len(trainers)
                        else target - completed - dropped),
        "in_flight_at_end": total("samples_in_flight"),
        "dropped_by_reason": dict(sorted(by_reason.items())),
        "trainers_without_summary": sorted(n for n, s in trainers.items() if not s),
        "short_step_deficit_from_log": sum(batch - n for n in step_sizes if n < batch),
        "how_to_read": "samples_target: what the trainers were asked for (--max-samples each); completed, dropped: "
                       "sums of the trainers' summaries (null if none reported); unaccounted = target - completed - "
                       "dropped, 0 when every sample is accounted for (null while a trainer reported no summary); "
                       "short_step_deficit_from_log: samples the log's applied short steps lack against "
                       "target_batch_size, to set against dropped",
    }


def bench_setting(name: str, args: argparse.Namespace) -> dict:
    """One setting: the swarm, then the references. Its logs are removed unless something failed
    (or --keep-logs), in which case their directory is printed, interrupts included."""
    workdir = tempfile.mkdtemp(prefix=f"agora-fidelity-{name}-")
    keep = True
    try:
        out = _bench_setting(name, args, workdir)
        keep = bool(out["errors"]) or args.keep_logs
        return out
    finally:
        if keep:
            log(f"[{name}] node logs and sample logs: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


def _bench_setting(name: str, args: argparse.Namespace, workdir: str) -> dict:
    from _fidelity_reference import OneProcessTrainer, SampleBank, StepRecord, held_out_tokens, loss_figures
    from _fidelity_corpus import PreparedSampleBank, describe_corpus, prepared_heldout_tokens
    from protocol.run_config import dump_run_config
    from roles.model.plain import PlainModel

    setting = SETTINGS[name]
    steps = args.steps or (setting.quick_steps if args.quick else setting.steps)
    total = steps * setting.target_batch_size
    run = fidelity_run_config(name, setting, steps, args)
    config_path = os.path.join(workdir, "run.yaml")
    dump_run_config(run, config_path)
    replicas = args.workers_per_stage
    if run.averaging.enabled:
        averaging: Any = run.averaging.model_dump(mode="json")
    else:
        averaging = "off (one replica per stage)" if replicas == 1 else "off (--averaging-off)"
    # The samples and held-out set come first: a corpus too small for them fails before the swarm.
    data = getattr(args, "data", None)
    trainer_args: dict[str, Any] = {}
    if data:
        corpus = open_corpus(data)
        cache = Path(workdir) / "data-cache"
        held_out = prepared_heldout_tokens(corpus, run.seq_len, HELD_OUT_SAMPLES, cache)
        bank: Any = PreparedSampleBank(run, corpus, TRAINERS, cache)
        data_figures = describe_corpus(corpus)
        # A data directory of this run's own, so no trainer resumes a position an earlier run left.
        trainer_args["node_args"] = lambda node: (["--data-dir", str(cache)] if node.startswith("trainer") else [])
    else:
        held_out = held_out_tokens(run, HELD_OUT_SAMPLES)
        bank = SampleBank(run)
        data_figures = {"kind": "synthetic", "tokenizer": "byte", "vocab_size": run.model.vocab_size}
    parameters = _parameter_counts(run)
    out: dict[str, Any] = {
        "config": {"preset": "tiny", "stages": STAGES, "workers_per_stage": replicas, "trainers": TRAINERS,
                   "lanes": args.lanes, "target_batch_size": run.target_batch_size, "steps": steps, "samples": total,
                   "seq_len": run.seq_len, "worker_max_batch": setting.worker_max_batch,
                   "optimizer": run.optimizer.model_dump(mode="json"), "averaging": averaging,
                   "staleness": run.staleness.model_dump(mode="json"), "churn": bool(args.churn),
                   "routing": run.routing.path, "data": data_figures, "vocab_size": run.model.vocab_size,
                   "anchor_rank": run.model.anchor_rank, "trained_parameters": parameters["ours"]},
    }
    errors: list[str] = []
    started = time.monotonic()
    log(f"[{name}] swarm: {STAGES} stages x {replicas} worker(s) (--workers-per-stage {replicas}, averaging "
        f"{'on' if run.averaging.enabled else 'off'}), {TRAINERS} trainers x {args.lanes} lanes, {steps} steps of "
        f"{run.target_batch_size} = {total} samples")
    # churn and lanes are passed only when set, so a run_swarm stand-in without them (the tests') still fits
    swarm = run_swarm(run, config_path, workdir, setting, total, replicas, **trainer_args,
                      **({"churn": True} if args.churn else {}), **({"lanes": args.lanes} if args.lanes != LANES else {}))
    errors += swarm.pop("errors", [])

    logged, bad_lines = read_sample_logs(swarm.get("sample_logs", []), bank.index)
    replica_stages: list[dict] = []
    replica_written: list[dict[int, Optional[int]]] = []
    for r, directory in enumerate(swarm["checkpoint_dirs"]):
        try:
            found, written = read_checkpoints(run, directory)
        except Exception as exc:  # noqa: BLE001 - a garbled file: report it, keep the other replicas
            found, written = {}, {s: None for s in range(STAGES)}
            errors.append(f"reading replica {r}'s checkpoints: {type(exc).__name__}: {exc}")
        if len(found) < STAGES:
            errors.append(f"replica {r}: missing final checkpoints (step written per stage: {written})")
        replica_stages.append(found)
        replica_written.append(written)
    # A step counts as applied only once every replica of every stage that wrote a checkpoint has it.
    applied = min((v for w in replica_written for v in w.values() if v is not None), default=None)
    if not logged:
        errors.append(f"the trainers logged no samples to ${SAMPLE_LOG_ENV}; the swarm-order reference and the "
                      "swarm's training loss are missing")
    if logged and applied is not None and any(s >= applied for s in logged):
        errors.append(f"samples of steps >= {applied} were logged but not applied by every stage before shutdown")
    mean_stages = mean_of_replicas(run, replica_stages)
    if len(mean_stages) < STAGES:
        errors.append(f"no replica has a final checkpoint of stage(s) "
                      f"{sorted(set(range(STAGES)) - set(mean_stages))}; no swarm held-out loss")
    swarm_steps = committed_steps(logged, applied)
    unapplied = sum(len(v) for s, v in logged.items() if s not in swarm_steps)
    step_sizes = [len(v) for v in swarm_steps.values()]
    history = [StepRecord(len(v), statistics.fmean(loss for _, loss, _ in v)) for v in swarm_steps.values()]
    versioned = bool(swarm_steps) and all(
        versions is not None and len(versions) == run.num_stages for v in swarm_steps.values() for _, _, versions in v)
    swarm_figures = loss_figures(history)
    swarm_figures["held_out_loss"] = held_out_of(mean_stages, held_out)
    per_replica_held_out = [held_out_of(stages, held_out) for stages in replica_stages]
    distances = replica_distances(run, replica_stages)
    for stage, figures in distances.items():
        figures["checkpoint_steps"] = [w.get(int(stage)) for w in replica_written]
    stage_replicas: dict[int, list[dict]] = defaultdict(list)
    for node_name, summary in swarm.get("summaries", {}).items():
        if node_name in swarm["replica_of"]:
            stage_replicas[swarm["stages"][node_name]].append(
                {"name": node_name, "replica": swarm["replica_of"][node_name],
                 "churn": swarm.get("churned", {}).get(node_name), **_stage_figures(summary)})
    by_stage = {str(stage): _stage_over_replicas(sorted(found, key=lambda f: f["replica"]))
                for stage, found in sorted(stage_replicas.items())}
    out["swarm"] = {
        **swarm_figures,
        "held_out_loss_per_replica": per_replica_held_out,
        "held_out_how_to_read": "held_out_loss: the model whose every stage is the elementwise mean of its "
                                "replicas' final weights (with one replica, that replica); held_out_loss_per_replica: "
                                "replica r's own model, stage s taken from replica r for every s",
        "replicas": distances,
        "samples_logged": sum(len(v) for v in logged.values()), "samples_in_unapplied_steps": unapplied,
        "unreadable_log_lines": bad_lines,
        "checkpoint_step_per_stage": {s: min((w[s] for w in replica_written if w.get(s) is not None), default=None)
                                      for s in range(STAGES)},
        "samples_per_step_from_log": {"mean": rounded(statistics.fmean(step_sizes)) if step_sizes else None,
                                      "max": max(step_sizes, default=None), "min": min(step_sizes, default=None),
                                      "steps_not_at_target": sum(1 for n in step_sizes if n != run.target_batch_size)},
        "per_stage": by_stage,
        "staleness_from_log": _log_staleness(swarm_steps, run.num_stages) if versioned else None,
        "per_stage_how_to_read": "steps: over the stage's replicas (taken, samples_per_step_max: the most any "
                                 "replica reported; samples_per_step_mean: the mean of their means; short_steps, "
                                 "late_samples, discarded_at_shutdown: sums); averaging_rounds: per outcome, the "
                                 "most any replica counted; closed_by: per reason (complete, peer_ahead, peer_due, "
                                 "overtaken, timeout), summed over the replicas, so a short step says why it "
                                 "closed; long_steps, abandoned_samples: sums. replicas: steps, staleness, "
                                 "averaging rounds and "
                                 "gradient_exchange (null if not reported) as each worker reports them. "
                                 "staleness.mean_gap, max_gap and "
                                 "stale_share: version gaps between the weights a sample's forward saw and the ones "
                                 "its backward recomputed on (0 once pinned); mean_delay, max_delay, delayed_share: "
                                 "versions between the weights a gradient was taken at and the step it was applied "
                                 "in, where the reference has 0 for every sample; pinned: backwards recomputed on "
                                 "the previous weights; churn: 'killed' or 'restarted' for the processes --churn "
                                 "stopped and started (a killed one reports no summary: its figures are null)",
        "trainers": {n: s for n, s in swarm.get("summaries", {}).items() if n.startswith("trainer")},
        "evaluation": evaluation_curve(swarm.get("summaries", {}), swarm_steps, swarm.get("train_wall_s")),
        "accounting": _accounting({n: s for n, s in swarm.get("summaries", {}).items() if n.startswith("trainer")},
                                  math.ceil(total / TRAINERS) * TRAINERS, step_sizes, run.target_batch_size),
        "churn": swarm.get("churn"),
        "startup_s": swarm.get("startup_s"), "train_wall_s": swarm.get("train_wall_s"), "wall_s": swarm.get("wall_s"),
        # From the trainers' start to the last one's exit (their start-up and drain included): the
        # frontier's rate axis, comparable between runs of one setting, not an absolute rate.
        "train_tokens_per_s": (round(total * run.seq_len / swarm["train_wall_s"]) if swarm.get("train_wall_s")
                               else None),
        "exit_codes": swarm.get("exit_codes"), "survivors": swarm.get("survivors"),
    }
    if data and swarm_steps:
        # Over 1, the trainers read some samples again: a corpus too small for the run.
        out["swarm"]["train_split_epochs"] = rounded(
            bank.epochs(index for v in swarm_steps.values() for index, _, _ in v), 4)

    log(f"[{name}] one-process references")
    samples = sum(step_sizes) if step_sizes else total
    reference: dict[str, Any] = {"swarm_order": None}
    try:
        if swarm_steps:
            order = step_order(swarm_steps)
            reference["swarm_order"] = train_reference(OneProcessTrainer.for_stages(run), order, bank, held_out,
                                                "reference, swarm order")
        reference["swarm_replay"] = None
        if not versioned:
            reference["swarm_replay_missing"] = ("the sample log has no per-stage 'versions' (the weight version "
                                                 "each stage's forward used), so staleness cannot be replayed")
        else:
            try:
                reference["swarm_replay"] = _replayed(run, swarm_steps, bank, held_out)
            except ValueError as exc:  # versions the log cannot have come from (one after its step): the
                # swarm's fault, to report; the references after this one do not depend on it
                reference["swarm_replay_missing"] = f"the replay failed: {exc}"
                errors.append(f"swarm replay: {exc}")
        sequential = bank.sequential_steps(samples, run.target_batch_size)
        reference["sequential"] = train_reference(OneProcessTrainer.for_stages(run), sequential, bank, held_out,
                                           "reference, sequential order")
        plain = PlainModel(run)
        out["unconstrained"] = train_reference(OneProcessTrainer(plain, plain.stage_parameters(run), run),
                                        order if swarm_steps else sequential, bank, held_out,
                                        "unconstrained plain Llama")
        out["unconstrained"]["order"] = "swarm" if swarm_steps else "sequential"
        out["unconstrained"].update(trained_parameters=parameters["plain"], trained_parameters_ours=parameters["ours"],
                                    parameters_ratio=rounded(parameters["ours"] / parameters["plain"], 4),
                                    anchor_rank_nearest_in_parameters=parameters["anchor_rank_nearest"])
        if args.noise_runs:
            reference["order_noise"] = _order_noise(run, order if swarm_steps else sequential, bank, held_out,
                                                    args.noise_runs, (reference["swarm_order"] or reference["sequential"]))
    except Exception as exc:  # noqa: BLE001
        errors.append(f"reference: {type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    out["reference"] = reference

    primary = reference["swarm_order"] or reference.get("sequential") or {}
    sequential_ref = reference.get("sequential") or {}
    held_gap = _gap(swarm_figures["held_out_loss"], primary.get("held_out_loss"))
    replica_gaps = [_gap(loss, primary.get("held_out_loss")) for loss in per_replica_held_out]
    worst_replica_gap = max((g for g in replica_gaps if g is not None), default=None)
    out["gaps"] = {
        "reference_used": "swarm_order" if reference["swarm_order"] else "sequential",
        "held_out": held_gap,
        "held_out_per_replica": replica_gaps,
        "held_out_worst_replica": worst_replica_gap,
        "final_train": _gap(swarm_figures["final_train_loss"], primary.get("final_train_loss")),
        "held_out_vs_sequential_reference": _gap(swarm_figures["held_out_loss"], sequential_ref.get("held_out_loss")),
        "order_alone_held_out": _gap((reference["swarm_order"] or {}).get("held_out_loss"),
                                     sequential_ref.get("held_out_loss")),
        "held_out_vs_replay": _gap(swarm_figures["held_out_loss"],
                                   (reference.get("swarm_replay") or {}).get("held_out_loss")),
        "staleness_alone_held_out": _gap((reference.get("swarm_replay") or {}).get("held_out_loss"),
                                         (reference["swarm_order"] or {}).get("held_out_loss")),
        "subspace_constraint_held_out": _gap(primary.get("held_out_loss"),
                                             (out.get("unconstrained") or {}).get("held_out_loss")),
        "how_to_read": "(a - b) / b; held_out and final_train: swarm against the reference (held_out: the mean of "
                       "the replicas' weights; held_out_per_replica: each replica's own model); order_alone: the "
                       "reference on the swarm's steps against sequential order; staleness_alone: the replay (the swarm's "
                       "steps at the swarm's weight versions) against the reference; held_out_vs_replay: what the "
                       "swarm loses beyond staleness; subspace_constraint: the "
                       "subspace reference against the plain Llama",
    }
    noise = (reference.get("order_noise") or {}).get("relative_std")
    out["aim"] = {"held_out_gap_max": setting.held_out_gap_max,
                  "met": None if held_gap is None else held_gap <= setting.held_out_gap_max,
                  "gap_in_noise_std": None if held_gap is None or not noise else round(held_gap / noise, 2)}
    if replicas > 1:
        out["aim"]["replica_gap_max"] = REPLICA_GAP_MAX
        out["aim"]["replicas_met"] = None if worst_replica_gap is None else worst_replica_gap <= REPLICA_GAP_MAX
    if data:
        bank.close()
    out["errors"] = errors
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    return out


# ---------------------------------------------------------------------------------------------
# ablation
# ---------------------------------------------------------------------------------------------

def bench_ablation(args: argparse.Namespace) -> dict:
    """scripts/bench_construction.py --ablation at the demo's budget (10 steps, one seed with --quick)."""
    import bench_construction

    return bench_construction.bench("tiny", "10" if args.quick else "demo", [0] if args.quick else [0, 1, 2],
                                    ["hf_llama", *bench_construction.ABLATION],
                                    {**bench_construction.MODELS, **bench_construction.ABLATION})


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short smoke run (demo ~1 min, batch64 ~1 min)")
    p.add_argument("--setting", choices=[*SETTINGS, "all"], default="all",
                   help=f"which setting to run; all: {', '.join(DEFAULT_SETTINGS)}")
    p.add_argument("--steps", type=int, metavar="N", help="optimizer steps (default: the setting's)")
    p.add_argument("--lanes", type=int, default=LANES, metavar="N", help=f"lanes per trainer (default {LANES})")
    p.add_argument("--ablation", action="store_true",
                   help="instead of the swarm, train the one-process candidates of the construction ablation "
                        "(scripts/bench_construction.py --ablation)")
    p.add_argument("--max-in-flight-ratio", type=float, help="run config staleness.max_in_flight_ratio")
    p.add_argument("--max-delayed-per-step", type=int, help="run config staleness.max_delayed_per_step")
    p.add_argument("--no-forward-gate", action="store_true",
                   help="run config staleness.max_delayed_per_step = null (the head forwards freely)")
    p.add_argument("--no-pin-forward-weights", action="store_true",
                   help="run config staleness.pin_forward_weights = false")
    p.add_argument("--workers-per-stage", type=int, default=1, metavar="R",
                   help="replicas of every stage (default 1); with more than one, averaging runs as the preset says")
    p.add_argument("--churn", action="store_true",
                   help="kill replica 1 of the middle stage at 40%% of the samples and restart it 5 s later "
                        "with the same identity and checkpoint directory (needs --workers-per-stage 2 or more)")
    p.add_argument("--averaging-method", choices=("asyncsparta", "sparseloco"), default="asyncsparta",
                   help="run config averaging.method with replicas (default asyncsparta)")
    p.add_argument("--gradients", choices=("auto", "every_step", "off"),
                   help="run config averaging.gradients (default: the preset's, auto)")
    p.add_argument("--inner-steps", type=int, default=15, metavar="H",
                   help="averaging.sparseloco.inner_steps with --averaging-method sparseloco (default 15)")
    p.add_argument("--sparseloco-transport", choices=("swarm", "store"), default="swarm",
                   help="averaging.sparseloco.transport (store: a directory beside --out)")
    p.add_argument("--averaging-off", action="store_true",
                   help="run config averaging.enabled = false even with replicas")
    p.add_argument("--noise-runs", type=int, default=None,
                   help="reshuffled reference runs that measure order noise (default 3, 0 with --quick)")
    p.add_argument("--routing", choices=("trainer", "workers"), default="trainer",
                   help="run config routing.path: the trainer calls each stage (default), or worker to worker")
    p.add_argument("--data", metavar="PREPARED_DIR|text[:MB]",
                   help="train on a corpus made by `agora-node data prepare` (with at least 2 training shards) "
                        "instead of the synthetic grammar; model.vocab_size becomes its tokenizer's. `text` or "
                        f"`text:MB`: real text from the documentation on this machine (scripts/make_text_corpus.py, "
                        f"default {TEXT_DATA_MB:g} MB), prepared once with a {TEXT_DATA_VOCAB}-token BPE into a cache "
                        "directory and reused")
    p.add_argument("--evaluation-samples", type=int, metavar="N",
                   help="run config evaluation.samples: held-out samples of trainer 0's in-run evaluations "
                        "(default: the run config's); swarm.evaluation reports their curve and cost")
    p.add_argument("--anchor-rank", type=int, metavar="K",
                   help="run config model.anchor_rank: factor the stage anchors at rank K (default: full tables), "
                        "e.g. to bring the trained parameters near the plain Llama's at a large vocabulary")
    p.add_argument("--out", metavar="PATH", help="also write the JSON result to PATH")
    p.add_argument("--keep-logs", action="store_true", help="keep node and sample logs and print where they are")
    args = p.parse_args(argv)
    if args.lanes < 1 or (args.steps is not None and args.steps < 1):
        p.error("--lanes and --steps must be at least 1")
    if args.workers_per_stage < 1:
        p.error("--workers-per-stage must be at least 1")
    if args.churn and args.workers_per_stage < 2:
        p.error("--churn needs --workers-per-stage 2 or more, so the killed replica's stage keeps a live one")
    if args.anchor_rank is not None and args.anchor_rank < 1:
        p.error("--anchor-rank must be at least 1")
    if args.data is not None and TEXT_DATA.fullmatch(args.data):
        megabytes = TEXT_DATA.fullmatch(args.data).group(1)
        args.data = prepared_text_corpus(float(megabytes) if megabytes else TEXT_DATA_MB)
    elif args.data is not None and not os.path.isfile(os.path.join(args.data, "manifest.json")):
        p.error(f"--data {args.data} holds no prepared corpus (no manifest.json); make one with "
                "`agora-node data prepare ... --train-tokenizer 4096 --shard-tokens 16384`")
    if args.noise_runs is None:
        args.noise_runs = 0 if args.quick else 3
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)

    def on_sigterm(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    import torch

    torch.set_num_threads(1)  # tiny matrices: threads buy nothing and stall when a core is busy
    started = time.monotonic()
    out: dict[str, Any] = {"benchmark": "fidelity", "quick": args.quick, "machine": machine_info()}
    errors: list[str] = []
    try:
        if args.ablation:
            out["ablation"] = bench_ablation(args)
        else:
            names = list(DEFAULT_SETTINGS) if args.setting == "all" else [args.setting]
            out["settings"] = {}
            for name in names:
                out["settings"][name] = result = bench_setting(name, args)
                errors += [f"{name}: {e}" for e in result["errors"]]
    except KeyboardInterrupt:
        errors.append("interrupted")
    except Exception as exc:  # noqa: BLE001 - report what was measured, and the failure
        errors.append(f"{type(exc).__name__}: {exc}")
        log(traceback.format_exc())
    out["errors"] = errors
    out["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    out["elapsed_s"] = round(time.monotonic() - started, 1)
    emit_report(out, args.out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
