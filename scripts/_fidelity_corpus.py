"""The prepared-corpus side of `bench_fidelity.py --data`: the samples a swarm's trainers read from
a corpus made by `agora-node data prepare`, by the ids they log, and its held-out samples.

A trainer `k` of `n` walks its share of the training shards in an order fixed by the run's seed
(corpus/shards.py `PreparedSampleStream`); its sample ids name a shard, a sample of it and the
epoch (`train-00003-17-e0`), its ordinals the place in that walk. `PreparedSampleBank` walks the
same streams, from the start, as trainers with a fresh data position do, and numbers a sample
`ordinal * n + k`: the same interleave as the synthetic stream's positions (a shard keeps the
positions `index % n == k`), so `sequential_steps` means "both trainers' walks round-robin" for
either bank, and the one-process references need not know which data they train on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from corpus.heldout import HELDOUT_SPLIT, prepared_heldout
from corpus.sample import Sample
from corpus.shards import PreparedCorpus, PreparedSampleStream
from protocol.errors import ConfigError
from protocol.run_config import RunConfig

__all__ = ["PreparedSampleBank", "describe_corpus", "prepared_heldout_tokens"]


class PreparedSampleBank:
    """Tokens of `num_shards` trainers' walks through a prepared corpus, by sample number
    (`ordinal * num_shards + shard`), read once up to the furthest sample asked for."""

    def __init__(self, run: RunConfig, corpus: PreparedCorpus, num_shards: int, cache_dir: Path):
        self.corpus = corpus
        self.num_shards = num_shards
        self._streams = [PreparedSampleStream(corpus, run.seq_len, shard_index=k, num_shards=num_shards, seed=run.seed,
                                              cache_dir=cache_dir, position=None) for k in range(num_shards)]
        self._walks: list[Iterator[Sample]] = [iter(s) for s in self._streams]
        self._tokens: list[list[Tensor]] = [[] for _ in range(num_shards)]
        self._ordinals: list[dict[str, int]] = [{} for _ in range(num_shards)]
        train = corpus.manifest.splits["train"].shards
        self._shard_of_stem = {entry.file.rsplit(".", 1)[0]: i for i, entry in enumerate(train)}

    def _advance(self, shard: int) -> None:
        sample = next(self._walks[shard])
        assert sample.ordinal == len(self._tokens[shard]), "a fresh walk yields every ordinal in turn"
        self._ordinals[shard][sample.sample_id] = sample.ordinal
        self._tokens[shard].append(sample.tokens)

    def index(self, sample_id: str) -> int:
        """The sample number of a trainer's logged sample id (ValueError if no walk holds it)."""
        stem, _, epoch = sample_id.rsplit("-", 2) if sample_id.count("-") >= 2 else (sample_id, "", "")
        if stem not in self._shard_of_stem or not epoch.startswith("e") or not epoch[1:].isdigit():
            raise ValueError(f"{sample_id!r} is not a sample id of the corpus at {self.corpus.location}")
        shard = self._shard_of_stem[stem] % self.num_shards
        # A walk visits every sample of an epoch once before the next epoch begins.
        limit = (int(epoch[1:]) + 1) * self._streams[shard].samples_per_epoch
        while sample_id not in self._ordinals[shard] and len(self._tokens[shard]) < limit:
            self._advance(shard)
        if sample_id not in self._ordinals[shard]:
            raise ValueError(f"{sample_id!r} is not in trainer {shard}'s walk of {self.corpus.location}")
        return self._ordinals[shard][sample_id] * self.num_shards + shard

    def tokens(self, indices: Iterable[int]) -> Tensor:
        """[n, seq_len] int64 tokens of the given sample numbers, in that order."""
        rows = []
        for index in indices:
            ordinal, shard = divmod(index, self.num_shards)
            while len(self._tokens[shard]) <= ordinal:
                self._advance(shard)
            rows.append(self._tokens[shard][ordinal])
        return torch.stack(rows)

    def sequential_steps(self, total_samples: int, batch: int) -> list[list[int]]:
        """Numbers 0..total-1 cut into steps of `batch`: the trainers' walks taken round-robin."""
        return [list(range(start, min(start + batch, total_samples))) for start in range(0, total_samples, batch)]

    def epochs(self, indices: Iterable[int]) -> float:
        """How many passes over the training split the given samples come to, at the furthest trainer."""
        furthest = [0] * self.num_shards
        for index in indices:
            ordinal, shard = divmod(index, self.num_shards)
            furthest[shard] = max(furthest[shard], ordinal + 1)
        return max(n / s.samples_per_epoch for n, s in zip(furthest, self._streams))

    def close(self) -> None:
        for stream in self._streams:
            stream.close()


def prepared_heldout_tokens(corpus: PreparedCorpus, seq_len: int, count: int, cache_dir: Path) -> Tensor:
    """`count` held-out samples spread evenly over the corpus's held-out split, [count, seq_len]:
    the selection the trainers' own evaluation uses (corpus/heldout.py)."""
    samples = prepared_heldout(corpus, seq_len, count, cache_dir)
    if len(samples) < count:
        raise ConfigError(f"the corpus at {corpus.location} holds {len(samples)} held-out samples of {seq_len} "
                          f"tokens, fewer than the {count} the benchmark evaluates on; prepare it with a larger "
                          "--heldout-fraction")
    return torch.stack([s.tokens for s in samples])


def describe_corpus(corpus: PreparedCorpus) -> dict[str, Any]:
    """What the JSON's `config.data` says of a prepared corpus."""
    manifest = corpus.manifest
    heldout = manifest.splits.get(HELDOUT_SPLIT)
    return {"kind": "prepared", "path": corpus.location, "manifest_sha256": corpus.sha256,
            "tokenizer": manifest.tokenizer.kind, "tokenizer_trained": manifest.tokenizer.trained,
            "vocab_size": manifest.tokenizer.vocab_size,
            "train_tokens": manifest.splits["train"].tokens, "train_shards": len(manifest.splits["train"].shards),
            "heldout_tokens": heldout.tokens if heldout is not None else 0}
