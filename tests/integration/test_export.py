"""`agora-node export` round trip: the checkpoints a real swarm wrote become a Hugging Face Llama
that `transformers` loads, whose logits equal our model's on the same tokens, and that
`agora-node generate` samples from; a trained BPE tokenizer goes along and encodes as ours."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.corpus import documents, write_jsonl

pytestmark = pytest.mark.integration

# float32 on both sides; the folded weights (U_k Z^T, T_fixed + E U_k^T) are computed in float64
# and rounded once, so the two forward passes differ only by summation order
LOGIT_ATOL = 1e-4


def _cli(*args: str, timeout_s: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.cli", *args], capture_output=True, text=True, timeout=timeout_s)


def _compare(run_config: str, checkpoints: Path, export: Path, tokens: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    from protocol.run_config import load_run_config
    from roles.model.hf_export import full_logits, load_stages

    run = load_run_config(run_config)
    ours = full_logits(load_stages(run, sorted(checkpoints.glob("*.safetensors"))), tokens)
    from roles.model.hf_export import needs_remote_code

    model = AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=needs_remote_code(run)).eval()
    with torch.no_grad():
        theirs = model(tokens).logits
    assert theirs.shape == ours.shape
    return float((theirs - ours).abs().max())


@pytest.mark.timeout(300)
def test_a_swarms_checkpoints_export_to_a_llama_that_transformers_loads_with_equal_logits(
        make_swarm, run_config_path, tmp_path):
    config = run_config_path()
    swarm = make_swarm(config)
    ckpt = tmp_path / "checkpoints"
    args = ["--max-batch", "16", "--checkpoint-dir", str(ckpt), "--checkpoint-period-s", "600"]
    workers = [swarm.start("worker", stage=0, args=args)]
    workers += [swarm.start("worker", stage=s, args=args, wait_ready=False) for s in (1, 2)]
    for worker in workers:
        swarm.wait_ready(worker)
    trainer = swarm.start("trainer", args=["--max-samples", "96", "--lanes", "4"])
    assert swarm.wait(trainer, 180) == 0, trainer.log_tail()
    for worker in workers:  # a stopping worker writes its last checkpoint
        assert swarm.stop(worker, signal.SIGTERM) == 0, worker.log_tail()
    out = tmp_path / "export"

    result = _cli("export", "--config", config, "--checkpoint", str(ckpt), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "modeling_agora.py"} <= {p.name for p in out.iterdir()}
    assert "trust_remote_code=True" in result.stdout, result.stdout

    tokens = torch.randint(0, 256, (3, 48), generator=torch.Generator().manual_seed(0))
    diff = _compare(config, ckpt, out, tokens)
    print(f"\nexport: max |logit difference| against our model {diff:.2e}")
    assert diff < LOGIT_ATOL

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    text = "the cat sees a red ball. ünïcödé"
    assert tokenizer(text).input_ids == list(text.encode("utf-8")), "the byte tokenizer round trip"
    assert tokenizer.decode(list(text.encode("utf-8"))) == text

    generated = _cli("generate", "--model", str(out), "--prompt", "the cat", "--max-new-tokens", "24")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("the cat") and len(generated.stdout.strip()) > len("the cat"), generated.stdout

    again = _cli("export", "--config", config, "--checkpoint", str(ckpt), "--output", str(out))
    assert again.returncode == 2 and "not empty" in again.stderr


@pytest.mark.parametrize("model", [{"anchor_rank": 8}, {"construction": "fixed-embedding"}],
                         ids=["factored-anchors", "fixed-embedding"])
def test_a_trained_tokenizer_travels_with_the_export_and_bad_checkpoints_are_refused(run_config_path, tmp_path, model):
    from corpus.prepare import PrepareOptions, prepare
    from protocol.run_config import load_run_config
    from roles.model.stage import build_stage_model
    from roles.trainer.tokenizer import HFTokenizer
    from roles.worker.state.stage_checkpoint import FORMAT, write_checkpoint
    from roles.worker.layout import FlatLayout

    write_jsonl(tmp_path / "docs.jsonl", documents(800))
    corpus = tmp_path / "corpus"
    prepare(PrepareOptions(inputs=[str(tmp_path / "docs.jsonl")], output=corpus, train_tokenizer=400,
                           shard_tokens=4096, progress=False))
    config = run_config_path(model={"vocab_size": 512, **model})
    run = load_run_config(config)
    ckpt = tmp_path / "ckpt"
    generator = torch.Generator().manual_seed(1)
    for index in range(run.num_stages):
        stage = build_stage_model(run, index)
        layout = FlatLayout.of_stage(stage)
        params = dict(stage.named_parameters())
        tensors = {name: (params[name].detach() + 0.05 * torch.randn(params[name].shape, generator=generator))
                   for name in layout.names}  # off the seeded init, so every folded term matters
        write_checkpoint(ckpt / f"{run.run_id}-stage{index}.safetensors", tensors,
                         {"format": FORMAT, "run_id": run.run_id, "stage": str(index), "step": "7",
                          "layout": layout.digest})

    out = tmp_path / "export"
    result = _cli("export", "--config", config, "--checkpoint", str(ckpt), "--output", str(out), "--data", str(corpus))
    assert result.returncode == 0, result.stderr
    from transformers import AutoTokenizer

    ours = HFTokenizer(corpus / "tokenizer.json")
    theirs = AutoTokenizer.from_pretrained(str(out))
    text = documents(3, seed=9)[2]
    assert theirs(text).input_ids == ours.encode(text)
    assert theirs.eos_token_id == ours.separator_id
    tokens = torch.tensor([ours.encode(text)[:64]])
    assert _compare(config, ckpt, out, tokens) < LOGIT_ATOL
    assert (out / "modeling_agora.py").exists() == (run.model.construction == "stage-anchors")

    # refused in one sentence: a stage missing, a checkpoint of another run
    (ckpt / f"{run.run_id}-stage1.safetensors").unlink()
    missing = _cli("export", "--config", config, "--checkpoint", str(ckpt), "--output", str(tmp_path / "e2"))
    assert missing.returncode == 2 and "no checkpoint of stage(s) [1]" in missing.stderr, missing.stderr
    other = _cli("export", "--config", run_config_path(), "--checkpoint", str(ckpt), "--output", str(tmp_path / "e3"))
    assert other.returncode == 2 and "is not a checkpoint of run" in other.stderr, other.stderr
    assert "Traceback" not in missing.stderr + other.stderr
