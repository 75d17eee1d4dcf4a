#!/usr/bin/env python3
"""Data path benchmark: `agora-node data prepare` throughput, and a trainer's memory against the
size of the corpus it reads.

1. Writes a corpus of `--mb` MB of the synthetic grammar, half Parquet and half `.jsonl.zst`, and
   prepares it twice: with the byte tokenizer and with a trained byte-level BPE
   (`--vocab`). Reports tokens per second and per core, as prepare measures them.
2. Prepares a corpus `--memory-factor` times larger (byte tokenizer) and reads the same number of
   samples from each of the two with a trainer's reader (`corpus.shards`) in a fresh process,
   walking through every shard of its share; reports the peak resident memory of each and
   their ratio.

Prints one JSON object. Runs on CPU in a temporary directory it removes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

_READER = """
import json, sys
from pathlib import Path
from corpus.shards import PreparedCorpus, PreparedSampleStream
corpus = PreparedCorpus(sys.argv[1])
stream = PreparedSampleStream(corpus, int(sys.argv[2]), shard_index=0, num_shards=1, seed=0,
                              cache_dir=Path(sys.argv[3]))
count, total = int(sys.argv[4]), 0
for _, sample in zip(range(count), stream):
    total += int(sample.tokens[0])
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would report the parent's peak
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"samples": count, "shards": len(stream.shards), "max_rss_mb": round(hwm / 1024, 1)}))
"""


def write_corpus(root: Path, megabytes: float, seed: int) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    from roles.trainer.data import SyntheticCorpus

    docs, size = [], 0
    for i, text in enumerate(SyntheticCorpus(seed).iter_text()):
        docs.append(f"{i}: {text}")
        size += len(docs[-1]) + 1
        if size >= megabytes * 1e6:
            break
    half = len(docs) // 2
    pq.write_table(pa.table({"text": docs[:half]}), root / "part-0.parquet")
    lines = "".join(json.dumps({"text": d}) + "\n" for d in docs[half:]).encode()
    (root / "part-1.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(lines))
    return [str(root / "part-0.parquet"), str(root / "part-1.jsonl.zst")]


def _prepare(inputs: list[str], out: Path, *extra: str) -> dict:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "node.cli", "data", "prepare", *inputs, "--output", str(out),
                             "--json", *extra], capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"prepare failed: {result.stderr}")
    report = json.loads(result.stdout)
    wall = time.monotonic() - started
    report["wall_s"] = round(wall, 2)  # the whole command: start-up, reading, tokenizer training, shards
    report["wall_tokens_per_second_per_core"] = round(report["tokens_written"] / wall / report["cores"], 1)
    return report


def _read(corpus: Path, seq_len: int, samples: int, cache: Path) -> dict:
    result = subprocess.run([sys.executable, "-c", _READER, str(corpus), str(seq_len), str(cache), str(samples)],
                            capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise SystemExit(f"reading failed: {result.stderr}")
    return json.loads(result.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=float, default=50.0, help="corpus size in MB (default 50)")
    p.add_argument("--vocab", type=int, default=8192, help="BPE vocabulary trained (default 8192)")
    p.add_argument("--memory-factor", type=int, default=10, help="the larger corpus, times --mb (default 10)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--samples", type=int, default=20000, help="samples each reader takes (default 20000)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="agora-bench-data-") as tmp:
        root = Path(tmp)
        (root / "small").mkdir()
        (root / "large").mkdir()
        started = time.monotonic()
        small = write_corpus(root / "small", args.mb, seed=0)
        large = write_corpus(root / "large", args.mb * args.memory_factor, seed=1)
        written_s = time.monotonic() - started
        shard_tokens = str(1 << 20)
        byte = _prepare(small, root / "byte", "--shard-tokens", shard_tokens)
        bpe = _prepare(small, root / "bpe", "--shard-tokens", shard_tokens, "--train-tokenizer", str(args.vocab))
        big = _prepare(large, root / "byte-large", "--shard-tokens", shard_tokens)
        read_small = _read(root / "byte", args.seq_len, args.samples, root / "cache")
        read_large = _read(root / "byte-large", args.seq_len, args.samples, root / "cache")
        keys = ("tokens_written", "seconds", "tokens_per_second", "tokens_per_second_per_core", "wall_s",
                "wall_tokens_per_second_per_core", "cores", "splits")
        print(json.dumps({
            "corpus_mb": args.mb, "corpus_write_s": round(written_s, 1),
            "prepare_byte": {k: byte[k] for k in keys},
            "prepare_bpe": {**{k: bpe[k] for k in keys}, "vocab_size": bpe["vocab_size"],
                            "compression_vs_bytes": round(byte["tokens_written"] / max(1, bpe["tokens_written"]), 3)},
            "prepare_byte_large": {k: big[k] for k in keys if k != "splits"},
            "trainer_reader": {"small": read_small, "large": read_large,
                               "rss_ratio_large_over_small": round(read_large["max_rss_mb"] / read_small["max_rss_mb"], 3),
                               "corpus_ratio": round(big["tokens_written"] / byte["tokens_written"], 2)},
            "machine_cores": os.cpu_count(),
        }, indent=1))


if __name__ == "__main__":
    main()
