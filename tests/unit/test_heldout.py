"""The held-out samples an evaluation uses (corpus/heldout.py, roles/trainer/evaluation.py): the
same ones at every call, spread over the whole held-out split and cut from it only (or, for synthetic data, from text of a
seed of its own), and none at all for data without a held-out split."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from corpus.heldout import HeldOutUnavailable, prepared_heldout, spread_shards
from corpus.prepare import PrepareOptions, prepare
from corpus.shards import PreparedCorpus
from roles.trainer.data import make_sample_stream
from roles.trainer.evaluation import heldout_loader
from tests.support.corpus import documents, write_jsonl

SEQ = 100  # 2048-token shards are not a multiple of it: samples run on across shard boundaries


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("heldout")
    write_jsonl(root / "docs.jsonl", documents(600))
    prepare(PrepareOptions(inputs=[str(root / "docs.jsonl")], output=root / "out", shard_tokens=2048,
                           heldout_fraction=0.2, progress=False))
    return root / "out"


def _split(corpus_dir: Path, split: str) -> np.ndarray:
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    shards = manifest["splits"][split]["shards"]
    return np.concatenate([np.load(corpus_dir / e["file"]).astype(np.int64) for e in shards])


def test_prepared_heldout_samples_are_spread_evenly_over_the_heldout_split_and_fixed(corpus_dir, tmp_path):
    load, described = heldout_loader(str(corpus_dir), tokenizer_path=None, seq_len=SEQ, seed=3, count=25,
                                     data_dir=str(tmp_path))
    first, second = load(), load()
    assert "held-out split" in described
    assert len(first) == 25 and [s.sample_id for s in first] == [f"heldout-{i}" for i in range(25)]
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first, second)), "the same samples at every call"
    heldout = _split(corpus_dir, "heldout")
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    assert len(manifest["splits"]["heldout"]["shards"]) >= 3, "the test must cross shard boundaries"
    stride = len(heldout) // 25
    assert stride > 2 * SEQ, "the test must leave gaps between samples"
    expected = np.stack([heldout[i * stride:i * stride + SEQ] for i in range(25)])
    assert np.array_equal(np.stack([s.tokens.numpy() for s in first]), expected)  # from the split's start to its end
    assert all(s.tokens.dtype == torch.int64 and s.tokens.shape == (SEQ,) for s in first)

    train = _split(corpus_dir, "train")
    train_windows = {train[i:i + SEQ].tobytes() for i in range(0, len(train) - SEQ + 1)}
    assert not any(s.tokens.numpy().tobytes() in train_windows for s in first), "a held-out sample is training text"


def test_a_corpus_with_fewer_heldout_tokens_than_asked_gives_what_it_has(corpus_dir, tmp_path):
    tokens = len(_split(corpus_dir, "heldout"))
    samples = prepared_heldout(PreparedCorpus(str(corpus_dir)), SEQ, 10_000, tmp_path)
    assert len(samples) == tokens // SEQ


def test_a_split_of_many_shards_is_sampled_on_evenly_spaced_shards(corpus_dir, tmp_path):
    shards = list(range(100))
    assert spread_shards(shards, 4) == [0, 25, 50, 75] and spread_shards(shards[:3], 4) == [0, 1, 2]
    corpus = PreparedCorpus(str(corpus_dir))
    entries = corpus.manifest.splits["heldout"].shards
    import corpus.heldout as heldout_module

    few = heldout_module.HELDOUT_SHARDS_MAX
    heldout_module.HELDOUT_SHARDS_MAX = 2
    try:
        samples = prepared_heldout(corpus, SEQ, 6, tmp_path)
    finally:
        heldout_module.HELDOUT_SHARDS_MAX = few
    chosen = np.concatenate([np.load(corpus_dir / e.file).astype(np.int64) for e in spread_shards(entries, 2)])
    stride = len(chosen) // 6
    assert [s.tokens.numpy().tolist() for s in samples] == [chosen[i * stride:i * stride + SEQ].tolist()
                                                            for i in range(6)]


def test_no_heldout_split_means_no_evaluation(tmp_path):
    write_jsonl(tmp_path / "docs.jsonl", documents(100))
    prepare(PrepareOptions(inputs=[str(tmp_path / "docs.jsonl")], output=tmp_path / "none", shard_tokens=1024,
                           heldout_fraction=0.0, progress=False))
    with pytest.raises(HeldOutUnavailable, match="--heldout-fraction"):
        heldout_loader(str(tmp_path / "none"), tokenizer_path=None, seq_len=SEQ, seed=0, count=4,
                       data_dir=str(tmp_path))
    (tmp_path / "plain.txt").write_text("some text " * 100)
    with pytest.raises(HeldOutUnavailable, match="no held-out split"):
        heldout_loader(str(tmp_path / "plain.txt"), tokenizer_path=None, seq_len=SEQ, seed=0, count=4,
                       data_dir=str(tmp_path))


def test_synthetic_heldout_samples_are_fixed_and_not_the_training_stream(tmp_path):
    load, described = heldout_loader("synthetic", tokenizer_path=None, seq_len=64, seed=7, count=32,
                                     data_dir=str(tmp_path))
    first, second = load(), load()
    assert "heldout:7" in described
    assert len(first) == 32 and all(torch.equal(a.tokens, b.tokens) for a, b in zip(first, second))
    training = make_sample_stream("synthetic", None, 64, 0, 1, 7)
    trained = {s.tokens.numpy().tobytes() for _, s in zip(range(2000), training)}
    assert not any(s.tokens.numpy().tobytes() in trained for s in first), "a held-out sample is a training sample"
    other, _ = heldout_loader("synthetic", tokenizer_path=None, seq_len=64, seed=8, count=4, data_dir=str(tmp_path))
    assert not torch.equal(other()[0].tokens, first[0].tokens), "the run's seed picks the held-out text too"
