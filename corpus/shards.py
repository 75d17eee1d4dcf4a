"""A trainer's share of a prepared corpus: its training shards, cut into samples, in an order fixed
by the run's seed, from a position that survives restarts.

Trainer `i` of `n` reads the training shards `i::n` and nothing else (the held-out split is the
evaluator's). A shard of `t` tokens gives `t // seq_len` back-to-back samples. Epoch `e` visits
this trainer's shards in a permutation drawn from (seed, i, n, e) and each shard's samples in a
permutation drawn from (seed, shard, e), so every trainer of the run, restarted or not, walks
the same sequence. A sample's ordinal is its place in that sequence.

The corpus lives in a local directory or behind a URL (`s3://`, `gs://`, `https://`, `file://`;
`fsspec`). Local shards are memory-mapped where they lie; remote ones are fetched in 8 MiB range
requests into a bounded local cache (the shard in use and the next, fetched ahead in a thread)
and checked against the manifest's SHA-256. Either way a trainer's memory does not grow with
the corpus.

The position (data_position.py) records which ordinals have ended; a restarted trainer starts at
the first one that has not and skips those that ended after it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from corpus.data_position import DataPosition
from corpus.manifest import MANIFEST_NAME, Manifest, ShardEntry, manifest_hash, sha256_file
from corpus.sample import Sample
from protocol.errors import ConfigError

__all__ = ["PreparedCorpus", "PreparedSampleStream", "is_prepared_location", "open_prepared"]

log = logging.getLogger(__name__)

_READ_BYTES = 8 << 20
_REMOTE_PREFIXES = ("s3://", "gs://", "gcs://", "http://", "https://", "file://", "memory://")


def is_prepared_location(data: str) -> bool:
    """Whether `--data` names a prepared corpus (a URL, a manifest, or a directory holding one)."""
    if data.startswith(_REMOTE_PREFIXES):
        return True
    path = Path(data)
    return path.name == MANIFEST_NAME or (path / MANIFEST_NAME).is_file()


class PreparedCorpus:
    """A manifest and where its shards are."""

    def __init__(self, location: str):
        import fsspec

        self.location = location
        url = location if location.endswith(MANIFEST_NAME) else location.rstrip("/") + "/" + MANIFEST_NAME
        try:
            self.fs, path = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise ConfigError(f"cannot read data at {location}: {exc}") from exc
        self.base = path.rsplit("/", 1)[0] if "/" in path else ""
        try:
            raw = self.fs.cat_file(path)
        except FileNotFoundError:
            raise ConfigError(f"no prepared corpus at {location} (no {MANIFEST_NAME}); prepare one with "
                              "`agora-node data prepare`, or wait until its preparation has finished") from None
        except Exception as exc:  # noqa: BLE001 - network, credentials, permissions: one sentence
            raise ConfigError(f"cannot read {url}: {exc}") from exc
        self.manifest = Manifest.from_json(raw.decode("utf-8", errors="replace"), url)
        self.sha256 = manifest_hash(raw)
        self.local = type(self.fs).__name__ == "LocalFileSystem"

    def shard_path(self, entry: ShardEntry) -> str:
        return f"{self.base}/{entry.file}" if self.base else entry.file

    def tokenizer_path(self, cache_dir: Path) -> Optional[str]:
        """A local path to the corpus's tokenizer file (fetched into the cache if remote), or None."""
        entry = self.manifest.tokenizer
        if entry.file is None:
            return None
        remote = f"{self.base}/{entry.file}" if self.base else entry.file
        if self.local:
            return remote
        local = cache_dir / f"tokenizer-{entry.sha256[:16]}.json"
        if not local.is_file():
            cache_dir.mkdir(parents=True, exist_ok=True)
            tmp = local.with_name(f".{local.name}.{os.getpid()}.tmp")
            tmp.write_bytes(self.fs.cat_file(remote))
            tmp.replace(local)
        return str(local)

    def trainer_shards(self, shard_index: int, num_shards: int) -> list[ShardEntry]:
        shards = self.manifest.splits["train"].shards
        mine = shards[shard_index::num_shards]
        if not mine:
            raise ConfigError(f"the corpus at {self.location} has {len(shards)} training shard(s), too few for "
                              f"trainer {shard_index} of {num_shards}; prepare it with a smaller --shard-tokens or "
                              "run fewer trainers")
        return mine


class ShardFiles:
    """Shard arrays by entry: memory maps of local files, or of files fetched into the cache."""

    def __init__(self, corpus: PreparedCorpus, cache_dir: Path, keep: int = 2):
        self.corpus = corpus
        self.cache_dir = cache_dir
        self.keep = max(2, keep)
        self._verified: set[str] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shard-fetch")
        self._pending: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.fetched_bytes = 0

    def array(self, entry: ShardEntry) -> np.ndarray:
        """The shard's tokens, memory-mapped; waits for its fetch if it is remote."""
        path = self._future(entry).result()
        return np.load(path, mmap_mode="r")

    def prefetch(self, entry: ShardEntry) -> None:
        self._future(entry)

    def _future(self, entry: ShardEntry) -> concurrent.futures.Future:
        with self._lock:
            future = self._pending.get(entry.file)
            if future is None:
                future = self._pool.submit(self._materialize, entry)
                self._pending[entry.file] = future
                while len(self._pending) > self.keep:
                    oldest = next(iter(self._pending))
                    self._pending.pop(oldest)
                    if not self.corpus.local:
                        (self.cache_dir / oldest).unlink(missing_ok=True)
            return future

    def _materialize(self, entry: ShardEntry) -> str:
        if self.corpus.local:
            path = self.corpus.shard_path(entry)
            if entry.file not in self._verified:
                self._check(path, entry)
            return path
        local = self.cache_dir / entry.file
        if local.is_file():  # fetched before, by this process or an earlier one
            try:
                if entry.file not in self._verified:
                    self._check(str(local), entry)
                return str(local)
            except ConfigError:
                local.unlink(missing_ok=True)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = local.with_name(f".{local.name}.{os.getpid()}.tmp")
        try:
            with self.corpus.fs.open(self.corpus.shard_path(entry), "rb", block_size=_READ_BYTES,
                                     cache_type="none") as src, open(tmp, "wb") as dst:
                for block in iter(lambda: src.read(_READ_BYTES), b""):
                    dst.write(block)
                    self.fetched_bytes += len(block)
            self._check(str(tmp), entry)
            tmp.replace(local)
        finally:
            tmp.unlink(missing_ok=True)
        return str(local)

    def _check(self, path: str, entry: ShardEntry) -> None:
        if sha256_file(path) != entry.sha256:
            raise ConfigError(f"shard {entry.file} of {self.corpus.location} does not match its manifest "
                              "checksum; the corpus is damaged or was changed after it was prepared")
        self._verified.add(entry.file)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class PreparedSampleStream:
    """Samples of `seq_len` tokens from this trainer's shards, forever (epoch after epoch), from
    the recorded position on. Call `ended(sample)` when a sample completed or was dropped."""

    def __init__(self, corpus: PreparedCorpus, seq_len: int, *, shard_index: int, num_shards: int, seed: int,
                 cache_dir: Path, position: Optional[DataPosition] = None):
        self.corpus = corpus
        self.seq_len = seq_len
        self.shard_index, self.num_shards, self.seed = shard_index, num_shards, seed
        self.shards = corpus.trainer_shards(shard_index, num_shards)
        self.counts = [entry.tokens // seq_len for entry in self.shards]
        self.samples_per_epoch = sum(self.counts)
        if not self.samples_per_epoch:
            raise ConfigError(f"trainer {shard_index} of {num_shards}'s shards of {corpus.location} hold fewer than "
                              f"{seq_len} tokens each; prepare with a larger --shard-tokens or lower seq_len")
        self.files = ShardFiles(corpus, cache_dir)
        self.position = position
        self.resumed_at = position.next if position is not None and position.next else None

    def _shard_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.shards)))
        random.Random(f"{self.seed}:{self.shard_index}:{self.num_shards}:{epoch}").shuffle(order)
        return order

    def _sample_order(self, shard: int, epoch: int) -> np.ndarray:
        rng = np.random.default_rng(int.from_bytes(hashlib.sha256(
            f"{self.seed}:{self.shards[shard].file}:{epoch}".encode()).digest()[:8], "big"))
        return rng.permutation(self.counts[shard])

    def __iter__(self) -> Iterator:
        start = self.position.next if self.position is not None else 0
        epoch, offset = divmod(start, self.samples_per_epoch)
        while True:
            order = self._shard_order(epoch)
            base = epoch * self.samples_per_epoch
            for place, shard in enumerate(order):
                count = self.counts[shard]
                if offset >= count:
                    offset -= count
                    base += count
                    continue
                entry = self.shards[shard]
                tokens = self.files.array(entry)
                if place + 1 < len(order):
                    self.files.prefetch(self.shards[order[place + 1]])
                samples = self._sample_order(shard, epoch)
                stem = entry.file.rsplit(".", 1)[0]
                for k in range(offset, count):
                    ordinal = base + k
                    if self.position is not None and self.position.has_ended(ordinal):
                        continue
                    index = int(samples[k])
                    window = np.asarray(tokens[index * self.seq_len:(index + 1) * self.seq_len], dtype=np.int64)
                    yield Sample(f"{stem}-{index}-e{epoch}", torch.from_numpy(window), ordinal)
                offset = 0
                base += count
            epoch += 1

    def ended(self, ordinal: Optional[int]) -> None:
        if self.position is not None and ordinal is not None:
            self.position.end(ordinal)

    def describe(self) -> dict:
        position = self.position.next if self.position is not None else 0
        return {"manifest_sha256": self.corpus.sha256, "location": self.corpus.location,
                "shards": len(self.shards), "samples_per_epoch": self.samples_per_epoch,
                "resumed_at": self.resumed_at, "position": position,
                "epoch": position // self.samples_per_epoch, "fetched_bytes": self.files.fetched_bytes}

    def close(self) -> None:
        self.files.close()
        if self.position is not None:
            self.position.save()


def open_prepared(location: str) -> PreparedCorpus:
    return PreparedCorpus(location)
