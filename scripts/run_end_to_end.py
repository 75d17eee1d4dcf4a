#!/usr/bin/env python3
"""A run from corpus to model, end to end on this machine, as a run owner does it:

1. writes a corpus of `--mb` MB (half Parquet, half `.jsonl.zst`) of the synthetic grammar;
2. `agora-node data prepare` with a trained byte-level BPE (`--vocab`), and uploads the shards to
   an S3-compatible server (moto, started here on 127.0.0.1);
3. starts an authorizer (with its health monitor and dashboard), `--workers` workers that write
   run checkpoints to the same server, and two trainers reading their shards through `s3://`;
4. trains until the held-out loss has been evaluated at step >= `--kill-at-step`, read from the
   dashboard's progress API, then SIGKILLs every node, the authorizer included;
5. restarts all of them (fresh DHT, same authorizer database, same trainer data directories):
   the workers resume from the newest complete checkpoint and the trainers from their positions;
   trains until `--after-evals` more held-out evaluations;
6. `agora-node export` from the store, loads it with `transformers`, compares its logits with the
   swarm's model on the same tokens, and generates text.

Prints one JSON object: prepare throughput, held-out losses before and after the restart, the
steps involved, the export's logit difference and the generated text. Everything runs in a
temporary directory it removes; every process it starts is stopped.

    .venv/bin/python scripts/run_end_to_end.py            # ~10 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from scripts._bench_common import log, machine_info  # noqa: E402
from scripts.bench_data import write_corpus  # noqa: E402


def _cli(*args: str, env: dict | None = None, timeout_s: float = 900) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, cwd=ROOT,
                            env=env, timeout=timeout_s)
    if result.returncode != 0:
        raise SystemExit(f"agora-node {' '.join(args[:2])} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def _progress(url: str) -> list[dict]:
    import httpx

    try:
        return httpx.get(f"{url}/v1/monitor/progress", timeout=10).json()["points"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _evaluations(url: str, since: float = 0.0) -> list[tuple[int, float]]:
    """(step, held-out loss) of every evaluation the dashboard has seen since `since` (unix time;
    the dashboard keeps the run's whole history across restarts), by step."""
    seen: dict[int, float] = {}
    for point in _progress(url):
        if point.get("t", 0) < since:
            continue
        if point.get("eval_loss") is not None and point.get("eval_step") is not None:
            seen[int(point["eval_step"])] = float(point["eval_loss"])
    return sorted(seen.items())


def _wait(what: str, check, timeout_s: float, period_s: float = 2.0):
    deadline = time.monotonic() + timeout_s
    last_log = 0.0
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s:.0f}s waiting for {what}")
        if time.monotonic() - last_log > 30:
            log(f"waiting for {what} ...")
            last_log = time.monotonic()
        time.sleep(period_s)


class Run:
    """The authorizer, workers and trainers of one start of the run."""

    def __init__(self, root: Path, config: Path, env: dict, args, tag: str):
        from authorizer.testing import AuthorizerProcess
        from node.launcher import LocalSwarm

        self.authorizer = AuthorizerProcess(
            ["--run-config", str(config), "--data-dir", str(root / "authorizer"), "--port", "0",
             "--credential-ttl-s", "3600", "--admin-token", "end-to-end-admin-token-0123", "--monitor-interval-s", "2"],
            log_path=str(root / f"authorizer-{tag}.log"), env=env)
        self.swarm = LocalSwarm(str(root / f"swarm-{tag}"), None, extra_env=env, common_args=["--announce-period-s", "2"])
        self.root, self.args, self.tag = root, args, tag
        self.workers: list = []
        self.trainers: list = []

    def start(self) -> "Run":
        self.authorizer.start(timeout_s=120)
        node = ["--authorizer", self.authorizer.url]
        self.workers = [self.swarm.start("worker", args=[*node, "--account-token", f"worker-{i}", "--max-batch", "16",
                                                         "--checkpoint-write"], wait_ready=False, name=f"worker-{i}")
                        for i in range(self.args.workers)]
        for worker in self.workers:
            self.swarm.wait_ready(worker, timeout_s=300)
        self.trainers = [self.swarm.start("trainer", name=f"trainer-{i}", timeout_s=300, args=[
            *node, "--account-token", f"trainer-{i}", "--lanes", "4", "--max-samples", "100000000",
            "--num-shards", "2", "--shard-index", str(i), "--data-dir", str(self.root / f"trainer-data-{i}")])
            for i in range(2)]
        return self

    def kill(self) -> None:
        for node in [*self.trainers, *self.workers]:
            self.swarm.stop(node, signal.SIGKILL, timeout_s=10)
        self.authorizer.kill()

    def stop(self) -> None:
        self.swarm.stop_all(timeout_s=30)
        self.authorizer.stop()

    def logs(self, pattern: str) -> list[str]:
        lines = []
        for node in self.workers:
            lines += [line for line in Path(node.log_path).read_text(errors="replace").splitlines() if pattern in line]
        return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="corpus size in MB (default 50)")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary trained by prepare (default 4096)")
    p.add_argument("--workers", type=int, default=3, help="workers (the authorizer places them; default 3)")
    p.add_argument("--kill-at-step", type=int, default=60, help="kill once an evaluation at this step is in")
    p.add_argument("--after-evals", type=int, default=3, help="evaluations to wait for after the restart")
    p.add_argument("--keep", type=Path, help="keep the work directory here instead of a temporary one")
    args = p.parse_args()

    from tests.support.s3 import S3Server

    started = time.monotonic()
    report: dict = {"machine": machine_info()}
    tmp = tempfile.TemporaryDirectory(prefix="agora-e2e-")
    root = args.keep or Path(tmp.name)
    root.mkdir(parents=True, exist_ok=True)
    s3 = S3Server().start()
    s3.apply_env()
    env = {**os.environ, **s3.env, "OMP_NUM_THREADS": "1"}
    runs: list[Run] = []
    try:
        # ---- 1-2: corpus, prepare with a trained BPE, upload
        (root / "corpus").mkdir(exist_ok=True)
        inputs = write_corpus(root / "corpus", args.mb, seed=0)
        report["corpus"] = {"inputs": [Path(i).name for i in inputs],
                            "bytes": sum(Path(i).stat().st_size for i in inputs),
                            "text_mb": args.mb}
        config = root / "run.yaml"
        run_id = f"e2e-{uuid.uuid4().hex[:6]}"
        bucket = s3.bucket()
        base = {"preset": "tiny", "run_id": run_id, "model": {"vocab_size": args.vocab}}
        config.write_text(json.dumps(base))  # YAML is a superset of JSON
        log("preparing the corpus ...")
        prepared = json.loads(_cli("data", "prepare", *inputs, "--output", str(root / "prepared"), "--shard-tokens", "1048576", "--train-tokenizer",
                                   str(args.vocab), "--config", str(config), "--json", "--quiet").stdout)
        report["prepare"] = {k: prepared.get(k) for k in ("tokens_written", "seconds", "cores", "tokens_per_second",
                                                           "tokens_per_second_per_core", "vocab_size", "dtype",
                                                           "splits", "manifest_sha256")}
        s3.filesystem().put(str(root / "prepared") + "/", f"{bucket}/corpus/", recursive=True)
        store = f"s3://{bucket}/checkpoints"
        config.write_text(json.dumps({**base,
                                      "data": {"manifest_sha256": prepared["manifest_sha256"],
                                               "location": f"s3://{bucket}/corpus"},
                                      "checkpoints": {"store": store, "every_steps": 10, "keep": 3},
                                      "evaluation": {"every_steps": 10, "samples": 32}}))

        # ---- 3-4: train, watch the held-out loss on the dashboard, kill everything
        first = Run(root, config, env, args, "a")
        runs.append(first)
        first.start()
        log(f"dashboard: {first.authorizer.url}/  (training until an evaluation at step >= {args.kill_at_step})")
        before = _wait(f"a held-out evaluation at step >= {args.kill_at_step}",
                       lambda: (lambda e: e if e and e[-1][0] >= args.kill_at_step else None)(
                           _evaluations(first.authorizer.url)), 1800)
        from roles.checkpoint_store import CheckpointStore
        from protocol.run_config import load_run_config

        run = load_run_config(str(config))
        checkpoints = CheckpointStore(store, run.run_id, run.num_stages)
        first.kill()
        complete = checkpoints.complete_steps()
        report["before_kill"] = {"evaluations": [{"step": s, "heldout_loss": round(v, 4)} for s, v in before],
                                 "complete_checkpoints": complete, "all_checkpoint_steps": checkpoints.steps()}
        log(f"killed every node; held-out loss {before[-1][1]:.3f} at step {before[-1][0]}; checkpoints {complete}")

        # ---- 5: restart everything; the workers resume from the store
        restarted_at = time.time()
        second = Run(root, config, env, args, "b")
        runs.append(second)
        second.start()
        resumed_lines = second.logs("resumed from the checkpoint at step")
        after = _wait(f"{args.after_evals} held-out evaluations after the restart",
                      lambda: (lambda e: e if len(e) >= args.after_evals else None)(
                          _evaluations(second.authorizer.url, since=restarted_at)), 1800)
        second.stop()
        report["after_restart"] = {
            "workers_resumed": len(resumed_lines), "resumed_from_step": complete[-1] if complete else None,
            "evaluations": [{"step": s, "heldout_loss": round(v, 4)} for s, v in after]}
        report["heldout_loss"] = {"first": round(before[0][1], 4), "at_kill": round(before[-1][1], 4),
                                  "after_restart": round(after[0][1], 4), "last": round(after[-1][1], 4)}

        # ---- 6: export from the store, load with transformers, compare, generate
        out = root / "model"
        exported = _cli("export", "--config", str(config), "--output", str(out), "--data", str(root / "prepared"),
                        env=env)
        import torch
        from transformers import AutoModelForCausalLM

        from roles.model.hf_export import full_logits, load_stages, needs_remote_code

        newest = checkpoints.latest()
        files = [checkpoints.fetch_stage(newest, s, root / "fetched") for s in range(run.num_stages)]
        tokens = torch.randint(0, run.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
        ours = full_logits(load_stages(run, files), tokens)
        with torch.no_grad():
            theirs = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=needs_remote_code(run)).eval()(tokens).logits
        generated = _cli("generate", "--model", str(out), "--prompt", "The", "--max-new-tokens", "40").stdout.strip()
        report["export"] = {"step": newest.step, "stdout": exported.stdout.strip(),
                            "max_abs_logit_diff": float((theirs - ours).abs().max()), "generated": generated}
    finally:
        for r in runs:
            try:
                r.stop()
            except Exception:  # noqa: BLE001 - clean up the rest regardless
                pass
        s3.stop()
        if args.keep is None:
            tmp.cleanup()
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
