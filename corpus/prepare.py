"""`agora-node data prepare`: a corpus in, token shards and their manifest out.

Documents are read in a fixed order (sources.py), each goes to the held-out split or the
training split by a hash of its text and the seed (so a document repeated in the corpus never
lands in both), is tokenized, and gets the separator appended. Each split's tokens are cut into
shards of `shard_tokens` ids (`.npy`, uint16 when the vocabulary fits, else uint32; the last
shard of a split may be shorter), each written atomically.

Resumable: after every shard, `prepare-state.json` records for each split the shards written and
where its next shard starts (a document and how many of its tokens are already written). A
killed prepare run again with the same command reads past what is written (hashing, not
tokenizing) and continues; the result is the same bytes as an uninterrupted run. Idempotent: with
the manifest there and the same inputs and options, it does nothing. `manifest.json` is written
last; until then the directory holds no prepared corpus.

Tokenizing uses every core through `tokenizers`' batch encoding; the byte tokenizer needs none.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from corpus.manifest import MANIFEST_NAME, Manifest, ShardEntry, SplitEntry, TokenizerEntry, sha256_file
from corpus.sources import Input, open_inputs
from protocol.errors import ConfigError
from corpus.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["PrepareOptions", "PrepareResult", "prepare"]

log = logging.getLogger(__name__)

STATE_NAME = "prepare-state.json"
TOKENIZER_NAME = "tokenizer.json"
SPLITS = ("train", "heldout")
_BATCH_BYTES = 4 << 20
_BATCH_DOCUMENTS = 2048


@dataclass
class PrepareOptions:
    inputs: list[str]
    output: Path
    tokenizer: Optional[str] = None
    """A `tokenizers` JSON file; None: the byte tokenizer, unless `train_tokenizer`."""
    train_tokenizer: Optional[int] = None
    """Train a byte-level BPE of this vocabulary size on the training split."""
    tokenizer_train_bytes: int = 1 << 30
    heldout_fraction: float = 0.01
    shard_tokens: int = 1 << 24
    text_column: str = "text"
    split: str = "train"
    seed: int = 0
    max_vocab: Optional[int] = None
    """The run config's `model.vocab_size`: a larger tokenizer is refused."""
    progress: bool = True

    def check(self) -> None:
        if self.tokenizer is not None and self.train_tokenizer is not None:
            raise ConfigError("pass --tokenizer FILE or --train-tokenizer SIZE, not both")
        if not 0 <= self.heldout_fraction < 1:
            raise ConfigError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.shard_tokens < 1024:
            raise ConfigError(f"--shard-tokens must be at least 1024, got {self.shard_tokens}")
        if self.train_tokenizer is not None and self.max_vocab is not None and self.train_tokenizer > self.max_vocab:
            raise ConfigError(f"--train-tokenizer {self.train_tokenizer} is larger than the run config's "
                              f"model.vocab_size {self.max_vocab}; the model could not embed its tokens")


@dataclass
class PrepareResult:
    manifest: Manifest
    path: Path
    already_prepared: bool
    tokens_written: int = 0
    seconds: float = 0.0
    resumed_shards: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_written / self.seconds if self.seconds > 0 else 0.0


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def _fingerprint(options: PrepareOptions, inputs: list[Input]) -> str:
    tokenizer = ({"file": sha256_file(Path(options.tokenizer))} if options.tokenizer is not None
                 else {"train": options.train_tokenizer, "train_bytes": options.tokenizer_train_bytes}
                 if options.train_tokenizer is not None else "byte")
    request = {"inputs": [source.fingerprint() for source in inputs], "tokenizer": tokenizer,
               "heldout_fraction": options.heldout_fraction, "shard_tokens": options.shard_tokens,
               "text_column": options.text_column, "seed": options.seed}
    return hashlib.sha256(json.dumps(request, sort_keys=True, default=str).encode()).hexdigest()


def _is_heldout(text: str, seed: int, fraction: float) -> bool:
    if fraction <= 0:
        return False
    digest = hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8, key=str(seed).encode()).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


@dataclass
class _Cursor:
    """Where a split's next shard starts: document `next_doc`, after its first `skip_tokens` ids."""

    next_doc: int = 0
    skip_tokens: int = 0
    documents: int = 0
    shards: list[ShardEntry] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"next_doc": self.next_doc, "skip_tokens": self.skip_tokens, "documents": self.documents,
                "shards": [s.model_dump() for s in self.shards]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "_Cursor":
        return cls(data["next_doc"], data["skip_tokens"], data["documents"],
                   [ShardEntry.model_validate(s) for s in data["shards"]])


class _ShardWriter:
    """One split's tokens into fixed-size shards; `flushed` is what is on disk."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, shard_tokens: int, flushed: _Cursor,
                 on_flush):
        self.directory, self.split, self.dtype, self.shard_tokens = directory, split, dtype, shard_tokens
        self.flushed = flushed
        self.on_flush = on_flush
        self.buffer = np.empty(shard_tokens, dtype=dtype)
        self.fill = 0
        self.completed_docs = 0
        """Documents whose last token is in the buffer (or flushed since the last cursor)."""
        self.tokens_added = 0

    def wants(self, doc: int) -> bool:
        return doc >= self.flushed.next_doc

    def add(self, doc: int, ids: np.ndarray) -> None:
        offset = self.flushed.skip_tokens if doc == self.flushed.next_doc else 0
        ids = ids[offset:]
        while len(ids):
            n = min(self.shard_tokens - self.fill, len(ids))
            self.buffer[self.fill:self.fill + n] = ids[:n]
            self.fill += n
            self.tokens_added += n
            ids = ids[n:]
            offset += n
            if self.fill == self.shard_tokens:
                if len(ids):
                    self._flush(_Cursor(doc, offset))
                else:
                    self.completed_docs += 1
                    self._flush(_Cursor(doc + 1, 0))
                    return
        self.completed_docs += 1

    def finish(self, next_doc: int) -> None:
        if self.fill:
            self._flush(_Cursor(next_doc, 0))

    def _flush(self, cursor: _Cursor) -> None:
        name = f"{self.split}-{len(self.flushed.shards):05d}.npy"
        path = self.directory / name
        tmp = self.directory / f".{name}.tmp"
        with open(tmp, "wb") as f:
            np.save(f, self.buffer[:self.fill])
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
        cursor.documents = self.flushed.documents + self.completed_docs
        cursor.shards = [*self.flushed.shards, ShardEntry(file=name, tokens=self.fill, sha256=sha256_file(path))]
        self.flushed = cursor
        self.fill = 0
        self.completed_docs = 0
        self.on_flush()


class _Progress:
    """A progress bar on a terminal; a log line every 10 s otherwise."""

    def __init__(self, enabled: bool, total_bytes: int):
        self.total = total_bytes
        self.started = time.monotonic()
        self._last_line = self.started
        self._bar = None
        if enabled and sys.stderr.isatty():
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("preparing"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[note]}"),
                                 TimeRemainingColumn(), transient=True)
            self._task = self._bar.add_task("prepare", total=total_bytes or None, note="")
            self._bar.start()

    def update(self, done_bytes: int, tokens: int) -> None:
        elapsed = max(time.monotonic() - self.started, 1e-6)
        note = f"{tokens / 1e6:.1f}M tokens, {tokens / elapsed / 1e6:.2f}M tokens/s"
        if self._bar is not None:
            self._bar.update(self._task, completed=done_bytes, note=note)
        elif time.monotonic() - self._last_line >= 10:
            self._last_line = time.monotonic()
            share = f"{100 * done_bytes / self.total:.0f}% of {self.total / 1e6:.0f} MB read" if self.total else \
                f"{done_bytes / 1e6:.0f} MB read"
            log.info("prepare: %s, %s", share, note)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


class _Preparation:
    def __init__(self, options: PrepareOptions):
        self.options = options
        self.out = options.output

    def run(self) -> PrepareResult:
        options = self.options
        options.check()
        inputs = open_inputs(options.inputs, options.text_column, options.split)
        fingerprint = _fingerprint(options, inputs)
        self.out.mkdir(parents=True, exist_ok=True)
        done = self._already_prepared(fingerprint)
        if done is not None:
            return PrepareResult(done, self.out / MANIFEST_NAME, already_prepared=True)
        self.state = self._load_state(fingerprint)
        self._save_state()  # the directory is a preparation from now on: a rerun continues it
        tokenizer, tokenizer_entry = self._tokenizer(inputs, self.state)
        self.state["tokenizer"] = tokenizer_entry.model_dump()
        self._save_state()
        return self._tokenize(inputs, tokenizer, tokenizer_entry, fingerprint)

    # ---- what is there already ----

    def _already_prepared(self, fingerprint: str) -> Optional[Manifest]:
        path = self.out / MANIFEST_NAME
        if not path.exists():
            return None
        manifest = Manifest.from_json(path.read_text(), str(path))
        if manifest.preparation != fingerprint:
            raise ConfigError(f"{self.out} already holds a corpus prepared from other inputs or options; pass "
                              "another --output, or remove it to prepare again")
        return manifest

    def _load_state(self, fingerprint: str) -> dict[str, Any]:
        path = self.out / STATE_NAME
        if path.exists():
            try:
                state = json.loads(path.read_text())
            except ValueError:
                state = None
            if state is not None and state.get("fingerprint") != fingerprint:
                raise ConfigError(f"{self.out} holds an unfinished preparation of other inputs or options; pass "
                                  "another --output, or remove it to start over")
            if state is not None:
                return state
        elif any(not p.name.startswith(".") for p in self.out.iterdir()):
            raise ConfigError(f"--output {self.out} is not empty and holds no preparation; pass an empty or new "
                              "directory")
        return {"fingerprint": fingerprint, "splits": {}}

    def _save_state(self) -> None:
        _atomic_write(self.out / STATE_NAME, json.dumps(self.state, sort_keys=True).encode())

    # ---- tokenizer ----

    def _tokenizer(self, inputs: list[Input], state: dict[str, Any]) -> tuple[Tokenizer, TokenizerEntry]:
        options = self.options
        path = self.out / TOKENIZER_NAME
        if options.train_tokenizer is None and options.tokenizer is None:
            tokenizer: Tokenizer = ByteTokenizer()
            return tokenizer, TokenizerEntry(kind="byte", vocab_size=tokenizer.vocab_size,
                                             separator_id=tokenizer.separator_id)
        previous = state.get("tokenizer")
        if previous is not None and path.exists() and previous.get("sha256") == sha256_file(path):
            log.info("prepare: using the tokenizer %s from the interrupted run", path)
        elif options.tokenizer is not None:
            tmp = path.with_name(f".{path.name}.tmp")
            shutil.copyfile(options.tokenizer, tmp)
            tmp.replace(path)
        else:
            from corpus.tokenizer_training import train_bpe

            log.info("prepare: training a byte-level BPE tokenizer of %d tokens on up to %.0f MB of the training "
                     "split", options.train_tokenizer, options.tokenizer_train_bytes / 1e6)
            started = time.monotonic()
            train_bpe(self._training_texts(inputs), options.train_tokenizer, path,
                      max_bytes=options.tokenizer_train_bytes)
            log.info("prepare: tokenizer trained in %.1f s", time.monotonic() - started)
        tokenizer = HFTokenizer(path)
        if options.train_tokenizer is not None and tokenizer.vocab_size < options.train_tokenizer:
            log.warning("prepare: the trained tokenizer has %d tokens, not %d: the corpus offers no more merges",
                        tokenizer.vocab_size, options.train_tokenizer)
        if options.max_vocab is not None and tokenizer.vocab_size > options.max_vocab:
            raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens, more than the run config's "
                              f"model.vocab_size {options.max_vocab}; the model could not embed its tokens")
        return tokenizer, TokenizerEntry(kind="tokenizers", file=TOKENIZER_NAME, sha256=sha256_file(path),
                                         vocab_size=tokenizer.vocab_size, separator_id=tokenizer.separator_id,
                                         trained=options.train_tokenizer is not None)

    def _training_texts(self, inputs: list[Input]) -> Iterator[str]:
        for source in inputs:
            for text in source.documents():
                if not _is_heldout(text, self.options.seed, self.options.heldout_fraction):
                    yield text

    # ---- tokenizing ----

    def _tokenize(self, inputs: list[Input], tokenizer: Tokenizer, tokenizer_entry: TokenizerEntry,
                  fingerprint: str) -> PrepareResult:
        options = self.options
        dtype = np.dtype(np.uint16 if tokenizer_entry.vocab_size <= 1 << 16 else np.uint32)
        cursors = {s: _Cursor.from_dict(self.state["splits"][s]) if s in self.state["splits"] else _Cursor()
                   for s in SPLITS}
        resumed_shards = sum(len(c.shards) for c in cursors.values())
        if resumed_shards:
            log.info("prepare: continuing an interrupted run: %d shard(s) written already", resumed_shards)
        writers = {s: _ShardWriter(self.out, s, dtype, options.shard_tokens, cursors[s], self._on_flush)
                   for s in SPLITS}
        self.writers = writers
        separator = np.asarray([tokenizer.separator_id], dtype=dtype)
        progress = _Progress(options.progress, sum(source.bytes_total for source in inputs))
        started = time.monotonic()
        doc = 0
        batch: list[tuple[int, str, str]] = []
        batch_bytes = 0

        def encode() -> None:
            encoded = tokenizer.encode_batch([text for _, _, text in batch])
            for (index, split, _), ids in zip(batch, encoded):
                writers[split].add(index, np.concatenate([ids.astype(dtype, copy=False), separator]))
            batch.clear()

        try:
            for done_before, source in self._enumerate(inputs):
                for text in source.documents():
                    split = "heldout" if _is_heldout(text, options.seed, options.heldout_fraction) else "train"
                    if writers[split].wants(doc):
                        batch.append((doc, split, text))
                        batch_bytes += len(text)
                    doc += 1
                    if len(batch) >= _BATCH_DOCUMENTS or batch_bytes >= _BATCH_BYTES:
                        encode()
                        batch_bytes = 0
                        progress.update(done_before + source.bytes_read, sum(w.tokens_added for w in writers.values()))
            if batch:
                encode()
            for writer in writers.values():
                writer.finish(doc)
        finally:
            progress.close()
        seconds = time.monotonic() - started
        skipped = sum(source.skipped_rows for source in inputs)
        splits = {s: SplitEntry(documents=w.flushed.documents, tokens=sum(e.tokens for e in w.flushed.shards),
                                shards=w.flushed.shards) for s, w in writers.items()}
        if not splits["train"].tokens:
            raise ConfigError(f"the inputs hold no text for training ({doc} document(s), "
                              f"{splits['heldout'].documents} held out); check --text-column and the inputs")
        if options.heldout_fraction > 0 and not splits["heldout"].documents:
            log.warning("prepare: no document was held out (%d in all); raise --heldout-fraction for an "
                        "evaluation split", doc)
        from protocol.version import client_version

        manifest = Manifest(created_by=f"agora-node {client_version()} data prepare", tokenizer=tokenizer_entry,
                            dtype=dtype.name, shard_tokens=options.shard_tokens,
                            heldout_fraction=options.heldout_fraction, seed=options.seed,
                            text_column=options.text_column, sources=[s.fingerprint() for s in inputs],
                            skipped_rows=skipped, splits=splits, preparation=fingerprint)
        _atomic_write(self.out / MANIFEST_NAME, manifest.to_json().encode())
        (self.out / STATE_NAME).unlink(missing_ok=True)
        return PrepareResult(manifest, self.out / MANIFEST_NAME, already_prepared=False,
                             tokens_written=sum(w.tokens_added for w in writers.values()), seconds=seconds,
                             resumed_shards=resumed_shards)

    @staticmethod
    def _enumerate(inputs: list[Input]) -> Iterator[tuple[int, Input]]:
        done = 0
        for source in inputs:
            yield done, source
            done += source.bytes_total

    def _on_flush(self) -> None:
        self.state["splits"] = {s: w.flushed.to_dict() for s, w in self.writers.items()}
        self._save_state()


def prepare(options: PrepareOptions) -> PrepareResult:
    """Prepare the corpus, or continue an interrupted preparation, or see that it is done."""
    return _Preparation(options).run()
