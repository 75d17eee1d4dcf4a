"""The trainer's data: text sources, and their packing into fixed-length samples of one shard [report 3.3.2.1].

A source yields documents (strings). `SampleStream` tokenizes them, joins them with the tokenizer's
separator into one token stream, cuts it into back-to-back samples of `seq_len` tokens, and keeps
those whose position in the stream falls in its shard (`index % num_shards == shard_index`). Every
trainer of a run therefore sees the same stream (same source, tokenizer, `seq_len`, seed) and takes
a disjoint share of it, and the shares together cover it; nothing has to coordinate at run time.
The price is that every trainer reads the whole source: for a corpus far larger than one trainer's
share, hand each trainer its own files instead, as the report does with 3 shards per trainer.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from protocol.errors import ConfigError
from corpus.sample import Sample
from corpus.tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "Sample",
    "trainer_data",
    "SampleStream",
    "SyntheticCorpus",
    "TextFiles",
    "TextSource",
    "make_sample_stream",
    "validate_data",
]

log = logging.getLogger(__name__)


class TextSource(Protocol):
    """Anything that yields documents; `name` appears in error messages."""

    name: str

    def iter_text(self) -> Iterator[str]: ...


# Word lists of the synthetic grammar. Verbs restrict their objects, and time and place phrases are
# fixed collocations, so a small model finds structure beyond letter frequencies to learn.
_ANIMATE = {
    "cat": "cats", "dog": "dogs", "bird": "birds", "fox": "foxes",
    "farmer": "farmers", "child": "children", "teacher": "teachers", "king": "kings",
}  # fmt: skip
_ADJECTIVES = ("big", "small", "red", "old", "happy", "green")
_VERBS = {  # base form -> (third person, objects it takes)
    "eat": ("eats", ("apple", "cake", "fish", "bread")),
    "read": ("reads", ("book", "letter")),
    "sing": ("sings", ("song",)),
    "see": ("sees", ("apple", "ball", "book", "box", "fish", "house", "tree", "river")),
    "like": ("likes", ("apple", "ball", "book", "cake", "song", "river")),
    "find": ("finds", ("ball", "box", "letter", "book")),
    "hold": ("holds", ("ball", "box", "letter", "fish")),
    "want": ("wants", ("apple", "ball", "cake", "book")),
}
_UNCOUNTABLE = {"bread"}
_VOWEL_START = tuple("aeiou")
_PLACES = ("in the garden", "by the river", "at home", "near the old house", "under the big tree")
_TIMES = ("once upon a time", "every morning", "at night", "after a while", "on sunday")


class SyntheticCorpus:
    """An endless English-like corpus from a small probabilistic grammar, fixed by its seed.

    About 60 words in subject-verb-object sentences with agreement, verb-specific objects,
    questions, reported speech and fixed phrases: enough structure that a tiny byte-level model
    visibly learns within a few hundred steps, which is what the demo has to show.
    """

    def __init__(self, seed: int | str = 0) -> None:
        self.seed = seed
        self.name = f"synthetic(seed={seed})"

    def iter_text(self) -> Iterator[str]:
        rng = random.Random(self.seed)
        while True:
            yield self._document(rng)

    def _document(self, rng: random.Random) -> str:
        sentences = [self._sentence(rng) for _ in range(rng.randint(2, 6))]
        return " ".join(s[0].upper() + s[1:] for s in sentences)

    def _sentence(self, rng: random.Random) -> str:
        kind = rng.choices(("plain", "place", "time", "and", "question", "says"), (4, 2, 2, 1, 1, 1))[0]
        if kind == "question":
            subject, plural = self._subject(rng)
            base = rng.choice(tuple(_VERBS))
            return f"{'do' if plural else 'does'} {subject} {base} {self._object(rng, base)}?"
        clause = self._clause(rng)
        if kind == "place":
            return f"{clause} {rng.choice(_PLACES)}."
        if kind == "time":
            return f"{rng.choice(_TIMES)}, {clause}."
        if kind == "and":
            base = rng.choice(tuple(_VERBS))
            return f"{clause} and {_VERBS[base][0]} {self._object(rng, base)}."
        if kind == "says":
            subject, _ = self._subject(rng, allow_plural=False)
            return f"{subject} says that {clause}."
        return f"{clause}."

    def _clause(self, rng: random.Random) -> str:
        subject, _ = self._subject(rng, allow_plural=False)
        base = rng.choice(tuple(_VERBS))
        return f"{subject} {_VERBS[base][0]} {self._object(rng, base)}"

    def _subject(self, rng: random.Random, allow_plural: bool = True) -> tuple[str, bool]:
        noun = rng.choice(tuple(_ANIMATE))
        plural = allow_plural and rng.random() < 0.3
        if plural:
            return f"{rng.choice(('the', 'my', 'two'))} {_ANIMATE[noun]}", True
        return self._noun_phrase(rng, noun), False

    def _object(self, rng: random.Random, base: str) -> str:
        return self._noun_phrase(rng, rng.choice(_VERBS[base][1]))

    def _noun_phrase(self, rng: random.Random, noun: str) -> str:
        words = [rng.choice(_ADJECTIVES), noun] if rng.random() < 0.35 else [noun]
        if noun in _UNCOUNTABLE:
            return " ".join(["the", *words] if rng.random() < 0.5 else words)
        article = rng.choices(("the", "a", "my"), (5, 3, 1))[0]
        if article == "a" and words[0].startswith(_VOWEL_START):
            article = "an"
        return " ".join([article, *words])


class TextFiles:
    """Documents from `.txt` files (one document each) and `.jsonl` files (a "text" field per line).

    Directories are searched recursively, files sorted, so every trainer reads the same order. A
    malformed JSON line is skipped and counted in `bad_lines` rather than ending a long run.
    """

    SUFFIXES = (".txt", ".jsonl")

    def __init__(self, paths: str | Path | Iterable[str | Path]) -> None:
        roots = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
        if not roots:
            raise ConfigError("no data path given; pass a file or directory of .txt/.jsonl files, or 'synthetic'")
        self.name = ", ".join(str(r) for r in roots)
        self.files = self._resolve(roots)
        self.bad_lines = 0
        """Malformed lines of `.jsonl` files seen in the current (or last) pass."""

    @classmethod
    def _resolve(cls, roots: list[Path]) -> list[Path]:
        files: dict[Path, None] = {}
        for root in roots:
            if root.is_dir():
                found = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in cls.SUFFIXES)
                if not found:
                    raise ConfigError(f"no .txt or .jsonl files under data directory {root}")
                files.update(dict.fromkeys(p.resolve() for p in found))
            elif root.is_file():
                files[root.resolve()] = None
            else:
                raise ConfigError(
                    f"data path {root} does not exist; pass a .txt/.jsonl file, a directory, or 'synthetic'"
                )
        return list(files)

    def iter_text(self) -> Iterator[str]:
        self.bad_lines = 0
        for path in self.files:
            try:
                if path.suffix == ".jsonl":
                    yield from self._jsonl(path)
                else:
                    yield path.read_text(encoding="utf-8", errors="replace")
            except OSError as exc:
                raise ConfigError(f"cannot read data file {path}: {exc}") from exc

    def _jsonl(self, path: Path) -> Iterator[str]:
        bad = 0
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError, IndexError):
                    text = None
                if not isinstance(text, str):
                    bad += 1
                    continue
                yield text
        if bad:
            self.bad_lines += bad
            log.warning(
                "skipped %d malformed line(s) of %s (each needs a JSON object with a string 'text')", bad, path
            )


class SampleStream:
    """Fixed-length samples of one shard of a packed text source.

    All trainers of a run must pass the same source, tokenizer, `seq_len` and `seed`, and distinct
    `shard_index` values, for their shards to be disjoint. `seed` orders documents through a
    shuffle buffer, so files sorted by topic do not arrive topic by topic; `shuffle_buffer=0` keeps
    the source order. The stream runs `epochs` passes over a finite source (None: forever) and
    carries the unfinished sample of one pass into the next.
    """

    def __init__(
        self,
        source: TextSource,
        tokenizer: Tokenizer,
        seq_len: int,
        *,
        shard_index: int,
        num_shards: int,
        seed: int,
        shuffle_buffer: int = 256,
        epochs: int | None = 1,
    ) -> None:
        if seq_len < 2:
            raise ConfigError(f"seq_len must be at least 2 (inputs plus a shifted label), got {seq_len}")
        if num_shards < 1 or not 0 <= shard_index < num_shards:
            raise ConfigError(f"shard index must be in [0, num_shards), got {shard_index} of {num_shards}")
        if epochs is not None and epochs < 1:
            raise ConfigError(f"epochs must be at least 1 (or None for no limit), got {epochs}")
        self.source = source
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.shard_index = shard_index
        self.num_shards = num_shards
        self.seed = seed
        self.shuffle_buffer = max(0, shuffle_buffer)
        self.epochs = epochs

    def __iter__(self) -> Iterator[Sample]:
        seq_len, sep = self.seq_len, self.tokenizer.separator_id
        buffer: list[int] = []
        start = 0
        index = 0
        epoch = 0
        while self.epochs is None or epoch < self.epochs:
            for document in self._documents(epoch):
                ids = self.tokenizer.encode(document)
                if not ids:
                    continue
                buffer.extend(ids)
                buffer.append(sep)
                while len(buffer) - start >= seq_len:
                    if index % self.num_shards == self.shard_index:
                        tokens = torch.tensor(buffer[start : start + seq_len], dtype=torch.int64)
                        yield Sample(f"s{self.shard_index}-{index}", tokens)
                    start += seq_len
                    index += 1
                if start > 1 << 16:
                    del buffer[:start]
                    start = 0
            if epoch == 0 and index <= self.shard_index:
                raise ConfigError(
                    f"data {self.source.name} holds {len(buffer) - start} tokens, too few for shard "
                    f"{self.shard_index} of {self.num_shards} to get one sample of {seq_len}; "
                    "add data, lower --seq-len or run fewer trainers"
                )
            epoch += 1

    def _documents(self, epoch: int) -> Iterator[str]:
        documents = self.source.iter_text()
        if self.shuffle_buffer <= 1:
            yield from documents
            return
        rng = random.Random(f"{self.seed}:{epoch}")
        pool: list[str] = []
        for document in documents:
            if len(pool) < self.shuffle_buffer:
                pool.append(document)
                continue
            slot = rng.randrange(self.shuffle_buffer)
            yield pool[slot]
            pool[slot] = document
        rng.shuffle(pool)
        yield from pool


def make_sample_stream(
    data: str,
    tokenizer_path: str | None,
    seq_len: int,
    shard_index: int,
    num_shards: int,
    seed: int,
    *,
    epochs: int | None = 1,
    data_dir: str | None = None,
) -> Iterable[Sample]:
    """Build a trainer's stream from its flags: `data` is "synthetic", a file/directory path, or a
    prepared corpus (its directory or URL), read from the position `data_dir` keeps."""
    from corpus.shards import is_prepared_location

    if is_prepared_location(data):
        return _prepared_stream(data, seq_len, shard_index, num_shards, seed, data_dir)
    tokenizer = load_tokenizer(tokenizer_path)
    source: TextSource = SyntheticCorpus(seed) if data == "synthetic" else TextFiles(data)
    return SampleStream(
        source, tokenizer, seq_len, shard_index=shard_index, num_shards=num_shards, seed=seed, epochs=epochs
    )


def trainer_data(data: str, run) -> str:
    """The data a trainer reads: its `--data`, or the run's corpus when it passed none (the
    default, "synthetic") and the run config names where the corpus is."""
    location = getattr(getattr(run, "data", None), "location", None)
    if data == "synthetic" and location:
        return location
    return data


def _prepared_stream(data: str, seq_len: int, shard_index: int, num_shards: int, seed: int,
                     data_dir: str | None):
    from corpus.data_position import DataPosition
    from corpus.shards import PreparedCorpus, PreparedSampleStream

    corpus = PreparedCorpus(data)
    cache = Path(data_dir or "~/.cache/agora-node/data").expanduser() / corpus.sha256[:16]
    key = {"manifest_sha256": corpus.sha256, "shard_index": shard_index, "num_shards": num_shards,
           "seq_len": seq_len, "seed": seed}
    position = DataPosition.load(cache / f"position-{shard_index}-of-{num_shards}.json", key)
    stream = PreparedSampleStream(corpus, seq_len, shard_index=shard_index, num_shards=num_shards, seed=seed,
                                  cache_dir=cache, position=position)
    if stream.resumed_at:
        log.info("data: resuming %s at sample %d of this trainer's walk (epoch %d; %d samples per epoch)",
                 corpus.location, stream.resumed_at, stream.resumed_at // stream.samples_per_epoch,
                 stream.samples_per_epoch)
    else:
        numbers = ", ".join(str(shard_index + k * num_shards) for k in range(min(3, len(stream.shards))))
        log.info("data: reading %s from the start: %d of its %d training shards (%s%s), %d samples per epoch; "
                 "position kept in %s", corpus.location, len(stream.shards),
                 len(corpus.manifest.splits["train"].shards), numbers, ", ..." if len(stream.shards) > 3 else "",
                 stream.samples_per_epoch, position.path)
    return stream


def _check_prepared(data: str, seq_len: int | None, shard_index: int, num_shards: int,
                    vocab_size: int | None, manifest_sha256: str | None) -> None:
    from corpus.shards import PreparedCorpus

    corpus = PreparedCorpus(data)
    shards = corpus.trainer_shards(shard_index, num_shards)
    if manifest_sha256 is not None and corpus.sha256 != manifest_sha256:
        raise ConfigError(f"the run trains on the corpus whose manifest hashes to {manifest_sha256[:16]}..., and "
                          f"{data} is another ({corpus.sha256[:16]}...); pass the run's data")
    if vocab_size is not None and corpus.manifest.tokenizer.vocab_size > vocab_size:
        raise ConfigError(f"the corpus at {data} was tokenized with {corpus.manifest.tokenizer.vocab_size} tokens, "
                          f"more than the model's vocab_size {vocab_size}")
    if seq_len is not None and not any(entry.tokens >= seq_len for entry in shards):
        raise ConfigError(f"trainer {shard_index} of {num_shards}'s shards of {data} hold fewer than {seq_len} "
                          "tokens each; prepare with a larger --shard-tokens")


def validate_data(
    data: str, tokenizer_path: str | None, seq_len: int | None, shard_index: int, num_shards: int,
    *, vocab_size: int | None = None, manifest_sha256: str | None = None,
) -> None:
    """Check a trainer's `--data` before it joins anything; raise ConfigError with one sentence.

    Missing paths and empty data are found without the run config; with `seq_len`, the source is
    also read until this shard's first sample, so data too small for the shard fails here and not
    after admission (that reads the whole source only when it is too small). With the run config
    also: the tokenizer fits the model's vocabulary, and a prepared corpus is the one the run names.
    """
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise ConfigError(f"--shard-index must be in 0..{num_shards - 1} for --num-shards {num_shards}, "
                          f"got {shard_index}")
    from corpus.shards import is_prepared_location

    if is_prepared_location(data):
        _check_prepared(data, seq_len, shard_index, num_shards, vocab_size, manifest_sha256)
        return
    if manifest_sha256 is not None:
        raise ConfigError(f"the run trains on a prepared corpus (manifest {manifest_sha256[:16]}...); pass its "
                          f"directory or URL with --data instead of {data}")
    if vocab_size is not None and load_tokenizer(tokenizer_path).vocab_size > vocab_size:
        raise ConfigError(f"the tokenizer {tokenizer_path} has {load_tokenizer(tokenizer_path).vocab_size} tokens, "
                          f"more than the model's vocab_size {vocab_size}")
    if data == "synthetic":
        return
    source = TextFiles(data)
    empty = [path for path in source.files if path.stat().st_size == 0]
    if len(empty) == len(source.files):
        raise ConfigError(f"data {data} is empty ({len(empty)} empty file(s)); pass a .txt/.jsonl file with text, "
                          "or 'synthetic'")
    if seq_len is None:
        return
    stream = SampleStream(source, load_tokenizer(tokenizer_path), seq_len, shard_index=shard_index,
                          num_shards=num_shards, seed=0, shuffle_buffer=0, epochs=1)
    try:
        next(iter(stream), None)
    except ConfigError:
        tokens = sum(len(stream.tokenizer.encode(text)) + 1 for text in source.iter_text())
        needed = (shard_index + 1) * seq_len
        raise ConfigError(
            f"data {data} holds {tokens} tokens: too few for shard {shard_index} of {num_shards}, which needs at "
            f"least {needed} ({shard_index + 1} samples of {seq_len}); add data or use fewer --num-shards"
        ) from None
