"""The held-out samples a run's evaluation sends through the stages (roles/trainer/evaluation.py).

The set is fixed: the same samples at every evaluation, so successive held-out losses compare the
same text under weights that moved, and no sample of it is ever trained on.

- A prepared corpus: the first samples of `seq_len` tokens cut back to back from its held-out
  split, the shards in manifest order (training reads only the `train` split, shards.py).
- Generated text (the synthetic corpus under a seed of its own): the first samples of the
  documents packed the way a training stream packs them (each document followed by the
  tokenizer's separator).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from corpus.sample import Sample
from corpus.shards import PreparedCorpus, ShardFiles
from corpus.tokenizers import Tokenizer
from protocol.errors import ConfigError

__all__ = ["HELDOUT_SPLIT", "HeldOutUnavailable", "packed_heldout", "prepared_heldout", "prepared_heldout_missing"]

HELDOUT_SPLIT = "heldout"


class HeldOutUnavailable(ConfigError):
    """The data has no held-out samples to evaluate on; the message says why and what would give some."""


def prepared_heldout_missing(corpus: PreparedCorpus, seq_len: int) -> str | None:
    """Why the corpus has no held-out sample of `seq_len` tokens, or None when it has one."""
    split = corpus.manifest.splits.get(HELDOUT_SPLIT)
    tokens = split.tokens if split is not None else 0
    if tokens >= seq_len:
        return None
    return (f"the corpus at {corpus.location} holds {tokens} held-out tokens, fewer than one sample of {seq_len}; "
            "prepare it with a larger --heldout-fraction to evaluate")


def prepared_heldout(corpus: PreparedCorpus, seq_len: int, count: int, cache_dir: Path) -> list[Sample]:
    """The first `count` held-out samples (fewer if the split holds fewer). Reads only the shard
    prefixes it needs; a remote shard is fetched into `cache_dir` and checked like a training one."""
    missing = prepared_heldout_missing(corpus, seq_len)
    if missing is not None:
        raise HeldOutUnavailable(missing)
    files = ShardFiles(corpus, cache_dir)
    samples: list[Sample] = []
    carry = np.empty(0, dtype=np.int64)  # the start of a sample that runs on into the next shard
    try:
        for entry in corpus.manifest.splits[HELDOUT_SPLIT].shards:
            needed = (count - len(samples)) * seq_len - len(carry)
            if needed <= 0:
                break
            tokens = np.concatenate([carry, np.asarray(files.array(entry)[:needed], dtype=np.int64)])
            whole = len(tokens) // seq_len
            samples += [Sample(f"heldout-{len(samples) + k}", torch.from_numpy(tokens[k * seq_len:(k + 1) * seq_len]))
                        for k in range(whole)]
            carry = tokens[whole * seq_len:]
    finally:
        files.close()
    return samples


def packed_heldout(documents: Iterable[str], tokenizer: Tokenizer, seq_len: int, count: int) -> list[Sample]:
    """The first `count` samples of `documents` packed back to back, each document followed by the
    tokenizer's separator (as roles/trainer/data.py SampleStream packs training text)."""
    if seq_len < 1 or count < 1:
        raise ConfigError(f"held-out samples need seq_len >= 1 and count >= 1, got {seq_len} and {count}")
    buffer: list[int] = []
    samples: list[Sample] = []
    for document in documents:
        ids = tokenizer.encode(document)
        if not ids:
            continue
        buffer += ids
        buffer.append(tokenizer.separator_id)
        while len(buffer) >= seq_len and len(samples) < count:
            samples.append(Sample(f"heldout-{len(samples)}", torch.tensor(buffer[:seq_len], dtype=torch.int64)))
            del buffer[:seq_len]
        if len(samples) == count:
            break
    return samples
