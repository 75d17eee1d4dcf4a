"""Reading prepared shards: trainers split the training split between them, never see held-out
tokens, and a restart continues the walk without a sample twice or one skipped."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from corpus.data_position import DataPosition
from corpus.prepare import PrepareOptions, prepare
from corpus.shards import PreparedCorpus, PreparedSampleStream
from protocol.errors import ConfigError
from tests.support.corpus import documents, write_jsonl

SEQ = 32


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(root / "docs.jsonl", documents(3000))
    prepare(PrepareOptions(inputs=[str(root / "docs.jsonl")], output=root / "out", shard_tokens=8192,
                           heldout_fraction=0.05, progress=False))
    return root / "out"


def _stream(corpus_dir: Path, tmp_path: Path, index: int, of: int, position: bool = True) -> PreparedSampleStream:
    corpus = PreparedCorpus(str(corpus_dir))
    key = {"manifest_sha256": corpus.sha256, "shard_index": index, "num_shards": of, "seq_len": SEQ, "seed": 7}
    pos = DataPosition.load(tmp_path / f"position-{index}-of-{of}.json", key) if position else None
    return PreparedSampleStream(corpus, SEQ, shard_index=index, num_shards=of, seed=7, cache_dir=tmp_path / "cache",
                                position=pos)


def _windows(corpus_dir: Path, split: str) -> dict[str, np.ndarray]:
    """Every window of `SEQ` tokens of a split, by the id its sample carries (without the epoch)."""
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    out = {}
    for entry in manifest["splits"][split]["shards"]:
        tokens = np.load(corpus_dir / entry["file"]).astype(np.int64)
        stem = entry["file"].rsplit(".", 1)[0]
        out.update({f"{stem}-{i}": tokens[i * SEQ:(i + 1) * SEQ] for i in range(len(tokens) // SEQ)})
    return out


def test_two_trainers_read_every_training_sample_once_per_epoch_and_no_heldout_one(corpus_dir, tmp_path):
    streams = [_stream(corpus_dir, tmp_path, i, 2, position=False) for i in range(2)]
    seen = {}
    for stream in streams:
        it = iter(stream)
        for _ in range(stream.samples_per_epoch):
            sample = next(it)
            key = sample.sample_id.rsplit("-e", 1)[0]
            assert key not in seen, f"{key} read twice"
            seen[key] = sample.tokens.numpy()
    train = _windows(corpus_dir, "train")
    assert seen.keys() == train.keys(), "each training sample once, by two trainers together"
    assert all(np.array_equal(seen[k], train[k]) for k in train)
    assert not any(k.startswith("heldout") for k in seen) and _windows(corpus_dir, "heldout")


def test_the_walk_is_fixed_by_the_seed_and_reshuffled_each_epoch(corpus_dir, tmp_path):
    a, b = (_stream(corpus_dir, tmp_path, 0, 1, position=False) for _ in range(2))
    n = a.samples_per_epoch
    ids_a = [s.sample_id for _, s in zip(range(2 * n), a)]
    ids_b = [s.sample_id for _, s in zip(range(2 * n), b)]
    assert ids_a == ids_b
    first, second = [i.rsplit("-e", 1)[0] for i in ids_a[:n]], [i.rsplit("-e", 1)[0] for i in ids_a[n:]]
    assert sorted(first) == sorted(second) and first != second


def test_a_restart_continues_without_a_sample_twice_or_one_skipped(corpus_dir, tmp_path):
    stream = _stream(corpus_dir, tmp_path, 1, 2)
    it = iter(stream)
    taken = [next(it) for _ in range(40)]
    # samples end out of order; 35 and 37 were cut off by the crash and never ended
    ended = [s for s in taken if s.ordinal not in (35, 37, 38, 39)]
    for sample in reversed(ended):
        stream.ended(sample.ordinal)
    stream.close()

    again = _stream(corpus_dir, tmp_path, 1, 2)
    assert again.resumed_at == 35
    rest = [s for _, s in zip(range(6), iter(again))]
    assert [s.ordinal for s in rest] == [35, 37, 38, 39, 40, 41]
    reference = iter(_stream(corpus_dir, tmp_path / "other", 1, 2, position=False))
    expected = {s.ordinal: s.sample_id for _, s in zip(range(42), reference)}
    assert all(expected[s.ordinal] == s.sample_id for s in taken + rest)


def test_a_position_of_other_data_is_set_aside(corpus_dir, tmp_path):
    stream = _stream(corpus_dir, tmp_path, 0, 2)
    sample = next(iter(stream))
    stream.ended(sample.ordinal)
    other = _stream(corpus_dir, tmp_path, 0, 2)
    assert other.resumed_at == 1
    moved = PreparedSampleStream(PreparedCorpus(str(corpus_dir)), SEQ, shard_index=0, num_shards=2, seed=7,
                                 cache_dir=tmp_path / "cache", position=DataPosition.load(
                                     tmp_path / "position-0-of-2.json", {"manifest_sha256": "other"}))
    assert moved.resumed_at is None
    assert (tmp_path / "position-0-of-2.json.other").exists()


def test_too_many_trainers_for_the_shards_is_refused(corpus_dir, tmp_path):
    shards = len(json.loads((corpus_dir / "manifest.json").read_text())["splits"]["train"]["shards"])
    with pytest.raises(ConfigError, match=f"has {shards} training shard"):
        _stream(corpus_dir, tmp_path, shards, shards + 1)


def test_a_damaged_shard_is_refused_by_its_checksum(corpus_dir, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(corpus_dir, copy)
    first = json.loads((copy / "manifest.json").read_text())["splits"]["train"]["shards"][0]["file"]
    data = bytearray((copy / first).read_bytes())
    data[-1] ^= 0xFF
    (copy / first).write_bytes(bytes(data))
    stream = _stream(copy, tmp_path, 0, 1, position=False)
    samples = iter(stream)
    with pytest.raises(ConfigError, match="does not match its manifest checksum"):
        for _ in range(stream.samples_per_epoch):
            next(samples)
