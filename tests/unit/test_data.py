"""Trainer data: synthetic corpus, text files, tokenizers and the sharded sample stream."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.errors import ConfigError
from roles.trainer.data import Sample, SampleStream, SyntheticCorpus, TextFiles, make_sample_stream
from roles.trainer.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer


def take(iterable, n):
    return list(itertools.islice(iterable, n))


def all_samples(stream: SampleStream) -> list[Sample]:
    return list(stream)


@pytest.fixture
def corpus_dir(tmp_path: Path) -> Path:
    """Thirty documents of varied length across nested .txt and .jsonl files."""
    (tmp_path / "sub").mkdir()
    for i in range(10):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"text file {i}: " + "lorem ipsum " * (i * 7 + 3))
    rows = [json.dumps({"text": f"json row {i} " + "dolor sit amet " * (i % 5 + 1)}) for i in range(20)]
    (tmp_path / "sub" / "rows.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "notes.md").write_text("not data")
    return tmp_path


def test_byte_tokenizer_basics():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode([104, 195, 169]) == "hé"
    assert tok.decode([0xFF]) == "\ufffd"
    assert isinstance(tok, Tokenizer)
    assert isinstance(load_tokenizer(None), ByteTokenizer)


@given(st.text())
@settings(max_examples=300, deadline=None)
def test_byte_tokenizer_round_trips(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_hf_tokenizer_missing_file_or_package(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.json"))
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        path = tmp_path / "tokenizer.json"
        path.write_text("{}")
        with pytest.raises(ConfigError, match=r"pip install 'agora-node\[tokenizers\]'"):
            HFTokenizer(path)


def test_synthetic_corpus_deterministic_and_varied():
    first = take(SyntheticCorpus(7).iter_text(), 200)
    assert first == take(SyntheticCorpus(7).iter_text(), 200)
    assert first != take(SyntheticCorpus(8).iter_text(), 200)
    assert len(set(first)) == 200
    text = " ".join(first)
    words = {w.strip(".,?").lower() for w in text.split()}
    assert 40 <= len(words) <= 120
    assert text.isascii() and "?" in text and "," in text


def test_synthetic_samples_deterministic_and_distinct_across_shards():
    def stream(shard):
        return make_sample_stream("synthetic", None, 64, shard, 3, seed=5)

    a = take(stream(0), 50)
    assert [s.tokens.tolist() for s in a] == [s.tokens.tolist() for s in take(stream(0), 50)]
    shards = [take(stream(i), 50) for i in range(3)]
    seqs = [tuple(s.tokens.tolist()) for shard in shards for s in shard]
    ids = [s.sample_id for shard in shards for s in shard]
    assert len(set(seqs)) == len(seqs)
    assert len(set(ids)) == len(ids)


def test_samples_shape_dtype_and_range():
    for sample in take(make_sample_stream("synthetic", None, 33, 0, 1, seed=0), 40):
        assert sample.tokens.shape == (33,)
        assert sample.tokens.dtype == torch.int64
        assert int(sample.tokens.min()) >= 0 and int(sample.tokens.max()) < 256


def test_file_shards_are_disjoint_and_cover(corpus_dir: Path):
    seq_len, num_shards = 16, 3

    def stream(shard, shards):
        return SampleStream(
            TextFiles(corpus_dir), ByteTokenizer(), seq_len, shard_index=shard, num_shards=shards, seed=3
        )

    whole = all_samples(stream(0, 1))
    assert len(whole) > 50
    parts = [all_samples(stream(i, num_shards)) for i in range(num_shards)]
    by_id = {s.sample_id.split("-", 1)[1]: s.tokens.tolist() for part in parts for s in part}
    assert sum(len(p) for p in parts) == len(whole) == len(by_id)
    assert sorted(map(tuple, by_id.values())) == sorted(tuple(s.tokens.tolist()) for s in whole)
    assert all(len(p) >= len(whole) // num_shards for p in parts)
    for sample in whole:
        assert sample.tokens.shape == (seq_len,) and sample.tokens.dtype == torch.int64


def test_packing_separates_documents_and_shuffle_depends_on_seed(corpus_dir: Path):
    def text(seed, shuffle_buffer=256):
        stream = SampleStream(
            TextFiles(corpus_dir), ByteTokenizer(), 8, shard_index=0, num_shards=1, seed=seed,
            shuffle_buffer=shuffle_buffer,
        )  # fmt: skip
        return b"".join(bytes(s.tokens.tolist()) for s in stream)

    plain = text(0, shuffle_buffer=0)
    docs = plain.split(b"\0")
    assert docs[0].startswith(b"text file 0: lorem ipsum")
    assert sum(1 for d in docs if d) in (29, 30)
    assert text(1) == text(1)
    assert text(1) != text(2)
    originals = {d.encode() for d in TextFiles(corpus_dir).iter_text()}
    shuffled = text(1).split(b"\0")[:-1]
    assert set(shuffled) <= originals
    assert shuffled != docs[: len(shuffled)]


def test_files_sorted_recursive_and_suffix_filtered(corpus_dir: Path):
    files = TextFiles(corpus_dir).files
    assert [f.name for f in files] == [f"doc{i:02d}.txt" for i in range(10)] + ["rows.jsonl"]
    assert len(list(TextFiles([corpus_dir / "doc01.txt", corpus_dir]).iter_text())) == 30


def test_jsonl_bad_lines_skipped_and_counted(tmp_path: Path):
    lines = [
        json.dumps({"text": "good one"}),
        "{not json",
        json.dumps({"body": "no text field"}),
        json.dumps({"text": 42}),
        json.dumps(["text"]),
        "",
        json.dumps({"text": "good two", "extra": 1}),
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines))
    source = TextFiles(path)
    assert list(source.iter_text()) == ["good one", "good two"]
    assert source.bad_lines == 4
    assert list(source.iter_text()) == ["good one", "good two"]
    assert source.bad_lines == 4


def test_missing_path_is_a_config_error(tmp_path: Path):
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError, match=str(missing)):
        TextFiles(missing)
    with pytest.raises(ConfigError, match=str(missing)):
        make_sample_stream(str(missing), None, 16, 0, 1, 0)


def test_directory_without_data_files_is_a_config_error(tmp_path: Path):
    (tmp_path / "readme.md").write_text("hello")
    with pytest.raises(ConfigError, match=str(tmp_path)):
        TextFiles(tmp_path)


def test_too_little_data_for_a_shard_is_a_config_error(tmp_path: Path):
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"text": "x" * 40}) + "\nbroken\n")
    assert len(list(make_sample_stream(str(path), None, 16, 1, 2, 0))) == 1
    with pytest.raises(ConfigError, match="too few"):
        list(make_sample_stream(str(path), None, 16, 2, 3, 0))


def test_epochs_repeat_a_finite_source(tmp_path: Path):
    path = tmp_path / "a.txt"
    path.write_text("abcdefghij" * 10)
    once = list(make_sample_stream(str(path), None, 10, 0, 1, 0))
    thrice = list(make_sample_stream(str(path), None, 10, 0, 1, 0, epochs=3))
    assert len(once) == 10
    assert len(thrice) == 30
    assert len({s.sample_id for s in thrice}) == 30
    forever = make_sample_stream(str(path), None, 10, 0, 1, 0, epochs=None)
    assert len(take(forever, 100)) == 100


@pytest.mark.parametrize(
    ("seq_len", "shard", "shards"), [(1, 0, 1), (16, 1, 1), (16, -1, 2), (16, 0, 0)]
)
def test_invalid_stream_config(seq_len, shard, shards):
    with pytest.raises(ConfigError):
        make_sample_stream("synthetic", None, seq_len, shard, shards, 0)
