"""The held-out samples a run's evaluation sends through the stages (roles/trainer/evaluation.py).

The set is fixed: the same samples at every evaluation, so successive held-out losses compare the
same text under weights that moved, and no sample of it is ever trained on.

- A prepared corpus: samples of `seq_len` tokens spread evenly over its held-out split (the
  shards in manifest order; training reads only the `train` split, shards.py). The first samples
  cut back to back would hold a few documents of whatever text the split starts with: on a corpus
  that mixes kinds of text, a curve of one kind. Sample i starts at token i x (split tokens //
  count), so every part of the split is in the estimate in proportion to its size. A split of
  more than `HELDOUT_SHARDS_MAX` shards is sampled on that many shards evenly spaced among them,
  which bounds what a remote corpus fetches.
- Generated text (the synthetic corpus under a seed of its own): the first samples of the
  documents packed the way a training stream packs them (each document followed by the
  tokenizer's separator).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from corpus.sample import Sample
from corpus.manifest import ShardEntry
from corpus.shards import PreparedCorpus, ShardFiles
from corpus.tokenizers import Tokenizer
from protocol.errors import ConfigError

__all__ = ["HELDOUT_SPLIT", "HeldOutUnavailable", "packed_heldout", "prepared_heldout", "prepared_heldout_missing"]

HELDOUT_SPLIT = "heldout"
HELDOUT_SHARDS_MAX = 16
"""Shards of the held-out split the samples are spread over, at most: what a remote corpus fetches."""


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
    """`count` held-out samples spread evenly over the split (fewer if it holds fewer; see the
    module's docstring). Reads only the windows it needs; a remote shard is fetched into
    `cache_dir` and checked like a training one."""
    missing = prepared_heldout_missing(corpus, seq_len)
    if missing is not None:
        raise HeldOutUnavailable(missing)
    shards = spread_shards(corpus.manifest.splits[HELDOUT_SPLIT].shards)
    ends = np.cumsum([entry.tokens for entry in shards])
    total = int(ends[-1]) if len(ends) else 0
    n = min(count, total // seq_len)
    stride = total // n if n else 0
    files = ShardFiles(corpus, cache_dir)
    samples: list[Sample] = []
    try:
        for i in range(n):
            tokens = _window(files, shards, ends, i * stride, seq_len)
            samples.append(Sample(f"heldout-{i}", torch.from_numpy(tokens)))
    finally:
        files.close()
    return samples


def spread_shards(shards: list[ShardEntry], most: Optional[int] = None) -> list[ShardEntry]:
    """At most `most` (default `HELDOUT_SHARDS_MAX`) of the split's shards, evenly spaced, in order."""
    most = HELDOUT_SHARDS_MAX if most is None else most
    if len(shards) <= most:
        return list(shards)
    return [shards[(k * len(shards)) // most] for k in range(most)]


def _window(files: ShardFiles, shards: list[ShardEntry], ends: np.ndarray, start: int, length: int) -> np.ndarray:
    """Tokens [start, start + length) of the shards taken back to back, as int64."""
    parts = []
    k = int(np.searchsorted(ends, start, side="right"))
    while length > 0:
        offset = start - (int(ends[k - 1]) if k else 0)
        part = np.asarray(files.array(shards[k])[offset:offset + length], dtype=np.int64)
        parts.append(part)
        start, length, k = start + len(part), length - len(part), k + 1
    return np.concatenate(parts)


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
