"""Run checkpoints in a real S3-compatible server: a swarm's writers upload every stage with its
optimizer state at agreed steps; the whole swarm is killed; a checkpoint whose upload never
finished is never loaded; a new swarm resumes from the newest complete one with the loss where it
was; and `agora-node export` turns the store's checkpoint into a model `transformers` loads."""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.polling import poll_until

pytestmark = pytest.mark.integration

EVERY = 5


def _losses(path: Path) -> list[float]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line)["loss"])
        except (ValueError, KeyError):  # a line cut by the kill
            pass
    return rows


def _plant_unfinished_upload(store, fs, latest: int) -> int:
    """Objects of a later step as a killed upload leaves them: every stage but the last uploaded
    with its sidecar, the last stage's object cut off mid-way and without a sidecar."""
    step = latest + 100 * EVERY
    source, target = store._step_dir(latest), store._step_dir(step)
    manifest = store.manifest(latest)
    for entry in manifest.stages[:-1]:
        fs.copy(f"{source}/{entry.file}", f"{target}/{entry.file}")
        sidecar = {"format": "agora-run-checkpoint/1", "step": step, **entry.to_json()}
        fs.pipe_file(f"{target}/stage-{entry.stage}.{entry.writer}.json", json.dumps(sidecar).encode())
    last = manifest.stages[-1]
    fs.pipe_file(f"{target}/{last.file}", fs.cat_file(f"{source}/{last.file}")[: last.bytes // 2])
    return step


@pytest.mark.timeout(480)
def test_a_killed_swarm_resumes_from_the_newest_complete_checkpoint_in_s3_and_exports_it(
        make_swarm, run_config_path, tmp_path, s3):
    from protocol.run_config import load_run_config
    from roles.checkpoint_store import CheckpointStore

    bucket = s3.bucket()
    url = f"s3://{bucket}/checkpoints"
    config = run_config_path(checkpoints={"store": url, "every_steps": EVERY, "keep": 2},
                             evaluation={"every_steps": 0})
    run = load_run_config(config)
    s3.apply_env()
    store = CheckpointStore(url, run.run_id, run.num_stages)
    fs = s3.filesystem()

    def start_swarm(tag: str):
        swarm = make_swarm(config, extra_env=s3.env)
        args = ["--max-batch", "16", "--checkpoint-write"]
        workers = [swarm.start("worker", stage=0, args=args, name=f"{tag}-w0")]
        workers += [swarm.start("worker", stage=s, args=args, wait_ready=False, name=f"{tag}-w{s}")
                    for s in range(1, run.num_stages)]
        for worker in workers:
            swarm.wait_ready(worker)
        return swarm, workers

    # ---- the first swarm trains until two checkpoints are complete, then everything is killed
    swarm, workers = start_swarm("a")
    trainer = swarm.start("trainer", name="a-t", env={"AGORA_SAMPLE_LOG": str(tmp_path / "a.jsonl")},
                          args=["--max-samples", "5000", "--lanes", "4", "--data-dir", str(tmp_path / "data")])
    # two complete and nothing older: a newer manifest is written just before the older one is pruned
    def two_recent_complete() -> bool:
        complete = store.complete_steps()  # listed once: a prune between two listings empties it
        return len(complete) == 2 and complete[-1] >= 3 * EVERY

    poll_until(two_recent_complete, 240,
               f"two complete checkpoints, the newest at step >= {3 * EVERY}, the older ones pruned")
    for node in [trainer, *workers]:
        swarm.stop(node, signal.SIGKILL, timeout_s=10)
    complete = store.complete_steps()
    assert len(complete) == 2, f"retention keeps the newest 2 complete checkpoints: {complete}"
    latest = complete[-1]
    before = _losses(tmp_path / "a.jsonl")
    first_losses = statistics.mean(before[:16])
    planted = _plant_unfinished_upload(store, fs, latest)
    assert store.latest().step == latest

    # ---- a new swarm (fresh DHT, no live worker) resumes from the newest complete checkpoint
    swarm, workers = start_swarm("b")
    for worker in workers:
        assert "resumed from the checkpoint at step" in Path(worker.log_path).read_text(), worker.log_tail()
    trainer = swarm.start("trainer", name="b-t", env={"AGORA_SAMPLE_LOG": str(tmp_path / "b.jsonl")},
                          args=["--max-samples", "48", "--lanes", "4", "--data-dir", str(tmp_path / "data")])
    assert swarm.wait(trainer, 180) == 0, trainer.log_tail()
    for worker in workers:
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
    summaries = [w.summary() for w in workers]
    for summary in summaries:
        joined = summary["joined"]
        assert joined["resumed"] and joined["loaded_step"] == latest, joined
        assert summary["local_step"] > latest, (summary["local_step"], latest)
    after = _losses(tmp_path / "b.jsonl")
    # the loss continues where the checkpoint left it, far below a fresh start's
    resumed, at_kill = statistics.mean(after[:16]), statistics.mean(before[-32:])
    assert resumed < first_losses - 0.6 * (first_losses - at_kill), (first_losses, at_kill, resumed)
    assert planted not in store.complete_steps(), "the unfinished upload became a checkpoint"

    # ---- the store's checkpoint exports to a Llama that transformers loads, logits equal to ours
    out = tmp_path / "export"
    result = subprocess.run([sys.executable, "-m", "node.cli", "export", "--config", config, "--output", str(out)],
                            capture_output=True, text=True, timeout=240, env={**swarm.env, **s3.env})
    assert result.returncode == 0, result.stderr
    newest = store.latest()
    assert f"stage steps {[newest.step] * run.num_stages}" in result.stdout, result.stdout

    from transformers import AutoModelForCausalLM

    from roles.model.hf_export import full_logits, load_stages, needs_remote_code

    files = [store.fetch_stage(newest, s, tmp_path / "fetched") for s in range(run.num_stages)]
    tokens = torch.randint(0, run.model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ours = full_logits(load_stages(run, files), tokens)
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=needs_remote_code(run)).eval()(tokens).logits
    assert float((theirs - ours).abs().max()) < 1e-4
