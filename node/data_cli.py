"""`agora-node data`: prepare a corpus into token shards, and look at a prepared one.

    agora-node data prepare INPUT... --output DIR [--train-tokenizer SIZE | --tokenizer FILE]
    agora-node data inspect DIR

`prepare` reads .txt, .jsonl (plain, .gz, .zst), Parquet, saved `datasets` directories and
hf:NAME (online), writes shards and a manifest (corpus/prepare.py), continues where a killed run
stopped, and does nothing when the same preparation is done. Bad input is one sentence and
exit code 2; Ctrl-C is exit code 130 and loses nothing written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from node.flags import OneLineErrorParser
from protocol.errors import ConfigError
from protocol.exit_codes import ExitCode

PROG = "agora-node data"

USAGE = """
  agora-node data prepare INPUT... --output DIR [--train-tokenizer SIZE | --tokenizer FILE]
                          [--heldout-fraction 0.01] [--shard-tokens N] [--text-column text] [--config RUN]
  agora-node data inspect DIR [--json]"""


def data_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog=PROG, usage=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="Turn a corpus into the token shards trainers read, and look at them.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=OneLineErrorParser)
    prep = commands.add_parser(
        "prepare", prog=f"{PROG} prepare", help="corpus in, token shards and a manifest out",
        description="Tokenize a corpus into fixed-size shards of token ids with a held-out split and a manifest.\n"
                    "Inputs: .txt (a document each), .jsonl / .jsonl.gz / .jsonl.zst, .parquet, a directory of\n"
                    "those, a `datasets` directory (save_to_disk), or hf:NAME[:SPLIT] (needs the network).\n"
                    "Run the same command again after an interruption: it continues where it stopped.",
        epilog="exit codes: 0 prepared (or already prepared); 2 bad input or flags; 130 interrupted.")
    prep.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories, datasets or hf:NAME")
    prep.add_argument("--output", "-o", required=True, type=Path, metavar="DIR", help="where shards and manifest go")
    tok = prep.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="FILE", help="an existing tokenizer.json (default: bytes, vocab 256)")
    tok.add_argument("--train-tokenizer", type=int, metavar="SIZE",
                     help="train a byte-level BPE of SIZE tokens on the training split")
    prep.add_argument("--tokenizer-train-mb", type=float, default=1024, metavar="MB",
                      help="text the tokenizer trains on at most (default 1024)")
    prep.add_argument("--heldout-fraction", type=float, default=0.01, metavar="F",
                      help="share of documents held out for evaluation, never trained on (default 0.01)")
    prep.add_argument("--shard-tokens", type=int, default=1 << 24, metavar="N",
                      help=f"token ids per shard (default {1 << 24:,})")
    prep.add_argument("--text-column", default="text", metavar="NAME",
                      help="the JSON field or column holding the text (default text)")
    prep.add_argument("--split", default="train", metavar="NAME",
                      help="the split of a saved DatasetDict or a hub dataset (default train)")
    prep.add_argument("--seed", type=int, default=0, metavar="N", help="seeds the held-out choice (default 0)")
    prep.add_argument("--config", metavar="PRESET|PATH",
                      help="the run's config: a tokenizer larger than its model.vocab_size is refused")
    prep.add_argument("--json", action="store_true", help="print the result as one JSON object")
    prep.add_argument("--quiet", action="store_true", help="no progress bar or log lines")
    inspect = commands.add_parser("inspect", prog=f"{PROG} inspect", help="what a prepared corpus holds",
                                  description="Print a prepared corpus's manifest in short, and its hash.")
    inspect.add_argument("path", metavar="DIR", help="the prepared corpus (its directory or manifest.json)")
    inspect.add_argument("--json", action="store_true", help="print the manifest as JSON, with its hash")
    return p


def _prepare(args: argparse.Namespace) -> int:
    from corpus.manifest import manifest_hash
    from corpus.prepare import PrepareOptions, prepare

    max_vocab = None
    if args.config is not None:
        from protocol.run_config import load_run_config

        max_vocab = load_run_config(args.config).model.vocab_size
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise ConfigError(f"tokenizer file {args.tokenizer} does not exist")
    options = PrepareOptions(
        inputs=args.inputs, output=args.output, tokenizer=args.tokenizer, train_tokenizer=args.train_tokenizer,
        tokenizer_train_bytes=int(args.tokenizer_train_mb * 1e6), heldout_fraction=args.heldout_fraction,
        shard_tokens=args.shard_tokens, text_column=args.text_column, split=args.split, seed=args.seed,
        max_vocab=max_vocab, progress=not (args.quiet or args.json))
    result = prepare(options)
    manifest = result.manifest
    digest = manifest_hash(result.path.read_bytes())
    cores = os.cpu_count() or 1
    if args.json:
        print(json.dumps({
            "manifest": str(result.path), "manifest_sha256": digest, "already_prepared": result.already_prepared,
            "resumed_shards": result.resumed_shards, "tokens_written": result.tokens_written,
            "seconds": round(result.seconds, 3), "tokens_per_second": round(result.tokens_per_second, 1),
            "tokens_per_second_per_core": round(result.tokens_per_second / cores, 1), "cores": cores,
            "vocab_size": manifest.tokenizer.vocab_size, "dtype": manifest.dtype,
            "splits": {name: {"documents": s.documents, "tokens": s.tokens, "shards": len(s.shards)}
                       for name, s in manifest.splits.items()},
            "skipped_rows": manifest.skipped_rows,
        }))
        return ExitCode.OK
    if result.already_prepared:
        print(f"{args.output} is already prepared from these inputs; nothing to do")
    else:
        resumed = f", continuing {result.resumed_shards} shard(s) written before" if result.resumed_shards else ""
        print(f"prepared {len(manifest.sources)} input(s) into {args.output} in {result.seconds:.1f} s: "
              f"{result.tokens_per_second:,.0f} tokens/s on {cores} core(s), "
              f"{result.tokens_per_second / cores:,.0f} per core{resumed}")
    print(_summary(manifest, result.path, digest))
    return ExitCode.OK


def _summary(manifest, path: Path, digest: str) -> str:
    tokenizer = manifest.tokenizer
    kind = ("bytes (vocab 256)" if tokenizer.kind == "byte" else
            f"{'byte-level BPE trained on the corpus' if tokenizer.trained else tokenizer.file}, "
            f"vocab {tokenizer.vocab_size:,}")
    lines = [f"  {name:<8} {s.documents:>10,} documents {s.tokens:>15,} tokens {len(s.shards):>5} shard(s)"
             for name, s in manifest.splits.items()]
    if manifest.skipped_rows:
        lines.append(f"  skipped  {manifest.skipped_rows:,} row(s) without text")
    lines += [f"  tokens   {manifest.dtype}, separator id {tokenizer.separator_id}; tokenizer: {kind}",
              f"  manifest {path} (sha256 {digest})"]
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    from corpus.manifest import MANIFEST_NAME, Manifest, manifest_hash

    path = Path(args.path)
    if path.is_dir():
        path = path / MANIFEST_NAME
    if not path.is_file():
        raise ConfigError(f"{args.path} holds no prepared corpus (no {MANIFEST_NAME}); prepare one with "
                          "`agora-node data prepare`")
    raw = path.read_bytes()
    manifest = Manifest.from_json(raw.decode("utf-8", errors="replace"), str(path))
    if args.json:
        print(json.dumps({"manifest_sha256": manifest_hash(raw), **manifest.model_dump(mode="json")}))
    else:
        print(_summary(manifest, path, manifest_hash(raw)))
    return ExitCode.OK


def data_main(argv: list[str]) -> int:
    args = data_parser().parse_args(argv)
    from node.logs import setup_logging

    setup_logging("warning" if getattr(args, "quiet", False) or getattr(args, "json", False) else "info", role="data")
    try:
        return _prepare(args) if args.command == "prepare" else _inspect(args)
    except KeyboardInterrupt:
        print("agora-node data: stopped; run the same command again to continue where it stopped",
              file=sys.stderr, flush=True)
        return ExitCode.INTERRUPTED
