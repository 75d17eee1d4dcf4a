"""`agora-node export` and `agora-node generate`: the run's model out, as a Hugging Face Llama
checkpoint that `transformers` (and the tools that read its format) load, and a quick look at it.

    agora-node export --config RUN --checkpoint STAGE_FILE... --output DIR [--data PREPARED | --tokenizer FILE]
    agora-node export --config RUN --checkpoint-store URL [--step N] --output DIR [...]
    agora-node generate --model DIR --prompt TEXT [--max-new-tokens 64]

The export reads one complete run checkpoint from the checkpoint store (the newest, or the one at
`--step`; default store: the run config's `checkpoints.store`), or one checkpoint file per stage
(the workers' `--checkpoint-dir` files); it folds the
subspace reparameterisation into dense weights (roles/model/hf_export.py) and writes
`config.json`, `generation_config.json`, `model.safetensors` (sharded past `--max-shard-gb`) and
the tokenizer files, into a new directory that appears whole or not at all.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from node.flags import OneLineErrorParser
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode

USAGE = """
  agora-node export --config RUN --checkpoint FILE... --output DIR [--data PREPARED | --tokenizer FILE]
  agora-node export --config RUN --checkpoint-store URL [--step N] --output DIR [...]
  agora-node generate --model DIR --prompt TEXT [--max-new-tokens 64] [--temperature 0.8]"""


def export_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="agora-node export", usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Write the run's model as a Hugging Face LlamaForCausalLM checkpoint.",
                           epilog="exit codes: 0 written; 2 bad input or flags.")
    p.add_argument("--config", required=True, metavar="PRESET|PATH", help="the run's config")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--checkpoint-store", metavar="URL",
                        help="the run's checkpoint store (a directory, file:///dir, s3://bucket/prefix); default: the "
                             "run config's checkpoints.store, else ~/.cache/agora-node/checkpoints")
    source.add_argument("--checkpoint", nargs="+", metavar="FILE",
                        help="one stage checkpoint per stage (the workers' --checkpoint-dir files), or that directory")
    p.add_argument("--step", type=int, metavar="N",
                   help="with a checkpoint store: the complete checkpoint at step N (default: the newest)")
    p.add_argument("--output", "-o", required=True, type=Path, metavar="DIR", help="a new directory for the export")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--data", metavar="DIR|URL", help="the prepared corpus the run trained on: its tokenizer goes along")
    tok.add_argument("--tokenizer", metavar="FILE", help="the tokenizers file the run trained with (default: bytes)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="weights' dtype in the export (default float32)")
    p.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                   help="largest safetensors file before the weights are split into shards (default 5)")
    return p


def generate_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="agora-node generate", usage=USAGE,
                           description="Sample text from an export with transformers, for a quick look.")
    p.add_argument("--model", required=True, metavar="DIR", help="an export (agora-node export --output)")
    p.add_argument("--prompt", required=True, metavar="TEXT")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T", help="0: greedy (default 0.8)")
    p.add_argument("--seed", type=int, default=0, metavar="N")
    return p


def _checkpoint_files(args: list[str]) -> list[Path]:
    files: list[Path] = []
    for arg in args:
        path = Path(arg)
        if path.is_dir():
            found = sorted(path.glob("*.safetensors"))
            if not found:
                raise ConfigError(f"no .safetensors stage checkpoints in {path}")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise ConfigError(f"checkpoint {path} does not exist")
    return files


def _stage_files(args: argparse.Namespace, run, fetch_dir: Path) -> list[Path]:
    """The stage files to export: named on the command line, or one complete run checkpoint's
    objects, verified and (from an object store) downloaded into `fetch_dir`."""
    if args.checkpoint is not None:
        if args.step is not None:
            raise ConfigError("--step picks a checkpoint in a store; with --checkpoint FILE... the files say their step")
        return _checkpoint_files(args.checkpoint)
    from roles.checkpoint_store import CheckpointStore, CheckpointStoreError, resolve_store_url

    store = CheckpointStore(resolve_store_url(args.checkpoint_store, run.checkpoints.store), run.run_id,
                            run.num_stages)
    try:
        if args.step is None:
            manifest = store.latest()
            if manifest is None:
                raise ConfigError(f"{store.describe()} holds no complete checkpoint of run {run.run_id} (steps with "
                                  f"a partial one: {store.steps() or 'none'}); name the store with --checkpoint-store "
                                  "URL, or the stage files with --checkpoint FILE...")
        else:
            manifest = store.manifest(args.step)
        return [store.fetch_stage(manifest, stage, fetch_dir) for stage in range(run.num_stages)]
    except CheckpointStoreError as exc:
        raise ConfigError(str(exc)) from exc


def _tokenizer_file(args: argparse.Namespace, run, fetch_dir: Path) -> str | None:
    if args.tokenizer is not None:
        if not Path(args.tokenizer).is_file():
            raise ConfigError(f"tokenizer file {args.tokenizer} does not exist")
        return args.tokenizer
    if args.data is not None:
        from corpus.shards import PreparedCorpus

        corpus = PreparedCorpus(args.data)
        if run.data.manifest_sha256 and corpus.sha256 != run.data.manifest_sha256:
            raise ConfigError(f"{args.data} is not the corpus the run trained on (its manifest hash differs)")
        return corpus.tokenizer_path(fetch_dir)
    return None


def _save_weights(state: dict, out: Path, dtype, max_shard_bytes: int) -> int:
    from safetensors.torch import save_file

    tensors = {name: tensor.to(dtype).contiguous() for name, tensor in state.items()}
    shards: list[dict] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        return 1
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {}}
    for i, shard in enumerate(shards, 1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / name, metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(shard, name))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


def export_main(argv: list[str]) -> int:
    args = export_parser().parse_args(argv)
    import torch

    from protocol.run_config import load_run_config
    from roles.model.hf_export import (MODELING_FILE, llama_config_dict, llama_state_dict, load_stages,
                                       modeling_source, needs_remote_code)
    from roles.model.hf_tokenizer import write_tokenizer_files

    run = load_run_config(args.config)
    out: Path = args.output
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--output {out} exists and is not empty; pass a new directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    fetch_dir = Path(tempfile.mkdtemp(prefix=f".{out.name}.checkpoint.", dir=out.parent))
    try:
        stages = load_stages(run, _stage_files(args, run, fetch_dir))
    finally:
        shutil.rmtree(fetch_dir, ignore_errors=True)
    steps = [stage.checkpoint_step for stage in stages]
    if len(set(steps)) > 1 or not any(steps):
        why = ("every stage's checkpoint is at step 0: the seeded, untrained weights (a worker writes its last "
               "checkpoint when it stops; wait for it)" if not any(steps) else
               "the stages' checkpoints are from different steps")
        print(f"agora-node export: warning: {why}; steps per stage: {steps}", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        fetched = work / ".tokenizer-fetch"  # a remote corpus's tokenizer file, removed below
        eos = write_tokenizer_files(work, _tokenizer_file(args, run, fetched), run.model.max_seq_len)
        shutil.rmtree(fetched, ignore_errors=True)
        config = llama_config_dict(run, eos_token_id=eos)
        config["torch_dtype"] = args.dtype
        (work / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if needs_remote_code(run):
            (work / MODELING_FILE).write_text(modeling_source())
        (work / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos, "do_sample": True, "temperature": 0.8},
            indent=2) + "\n")
        shards = _save_weights(llama_state_dict(run, stages), work, getattr(torch, args.dtype),
                               int(args.max_shard_gb * (1 << 30)))
        os.chmod(work, 0o755)
        if out.exists():
            out.rmdir()
        work.rename(out)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    params = sum(p.numel() for s in stages for p in s.parameters())
    print(f"exported run {run.run_id} ({run.model.n_layers} layers, {params:,} trained parameters; stage steps "
          f"{steps}) to {out}: "
          f"{config['architectures'][0]}, {args.dtype}, {shards} weight file(s); load it with "
          f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}"
          f"{', trust_remote_code=True' if needs_remote_code(run) else ''})"
          f"{' (the stock Llama plus its stage anchors, in ' + MODELING_FILE + ')' if needs_remote_code(run) else ''}")
    return ExitCode.OK


def generate_main(argv: list[str]) -> int:
    args = generate_parser().parse_args(argv)
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"{model_dir} holds no exported model (no config.json); write one with agora-node export")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)
    # An export of a stage-anchors run carries its own modeling file (roles/model/hf_anchored.py),
    # written by `agora-node export`; nothing else is trusted to run code.
    ours = json.loads((model_dir / "config.json").read_text()).get("model_type") == "agora_anchored_llama"
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=ours)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), trust_remote_code=ours).eval()
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    room = model.config.max_position_embeddings - ids.shape[1]
    if room <= 0:
        raise ConfigError(f"the prompt is {ids.shape[1]} tokens; the model takes {model.config.max_position_embeddings}")
    sample = args.temperature > 0
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=min(args.max_new_tokens, room), do_sample=sample,
                             temperature=args.temperature if sample else None, top_k=None, top_p=None,
                             pad_token_id=model.config.eos_token_id)
    sys.stdout.write(tokenizer.decode(out[0], skip_special_tokens=False) + "\n")
    return ExitCode.OK
