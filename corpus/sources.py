"""Documents from the corpus formats of the field, in a fixed order.

An input is a `.txt` file (one document), a JSON Lines file, plain or compressed with gzip or
zstd (a text field per line), a Parquet file (a text column), a Hugging Face `datasets`
dataset saved with `save_to_disk`, or `hf:NAME[:SPLIT]`, a dataset on the hub (needs the
network). A directory that is not a saved dataset stands for the files under it, recursively,
sorted by path. Each input is checked before anything is read in bulk, so a bad one fails in one
sentence, and every input reports how far it has been read, for the progress bar.

The readers are the libraries': `pyarrow.parquet`, `datasets`, `zstandard`, `gzip`.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from protocol.errors import ConfigError

__all__ = ["Input", "open_inputs"]

log = logging.getLogger(__name__)

_JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
_FILE_SUFFIXES = (".txt", ".parquet", *_JSONL_SUFFIXES)
_BATCH_ROWS = 1024


class Input:
    """One input of a corpus: what it is, how big, its documents and how far they have been read."""

    kind = "?"

    def __init__(self, name: str, text_column: str):
        self.name = name
        self.text_column = text_column
        self.bytes_total = 0
        """The input's size on disk; `bytes_read` moves from 0 to it while documents are read."""
        self.bytes_read = 0
        self.skipped_rows = 0
        """Rows without a string in the text column (malformed JSON, nulls), skipped and counted."""

    def check(self) -> None:
        """Raise ConfigError, in one sentence, if the input cannot be read as its kind."""

    def documents(self) -> Iterator[str]:
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this input's content cheaply: a changed input makes a new preparation."""
        return {"kind": self.kind, "name": self.name, "bytes": self.bytes_total}

    def _skip(self, count: int = 1) -> None:
        self.skipped_rows += count


class _LocalFile(Input):
    def __init__(self, path: Path, text_column: str):
        super().__init__(str(path), text_column)
        self.path = path
        try:
            stat = path.stat()
        except OSError as exc:
            raise ConfigError(f"cannot read input {path}: {exc.strerror or exc}") from exc
        self.bytes_total = stat.st_size
        self._mtime_ns = stat.st_mtime_ns
        if not os.access(path, os.R_OK):
            raise ConfigError(f"cannot read input {path}: permission denied")

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "mtime_ns": self._mtime_ns}


class TextFile(_LocalFile):
    """A `.txt` file: one document."""

    kind = "txt"

    def check(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.read(1)
        except OSError as exc:
            raise ConfigError(f"cannot read input {self.path}: {exc.strerror or exc}") from exc

    def documents(self) -> Iterator[str]:
        text = self.path.read_text(encoding="utf-8", errors="replace")
        self.bytes_read = self.bytes_total
        if text:
            yield text


class JsonLinesFile(_LocalFile):
    """JSON Lines, plain, `.gz` or `.zst`: one object per line with the text in `text_column`."""

    kind = "jsonl"

    def _open(self) -> tuple[io.BufferedReader, io.TextIOBase]:
        raw = self.path.open("rb")
        name = self.path.name
        if name.endswith(".gz"):
            stream = gzip.GzipFile(fileobj=raw)
        elif name.endswith(".zst"):
            import zstandard

            stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        else:
            stream = raw
        return raw, io.TextIOWrapper(stream, encoding="utf-8", errors="replace")

    def check(self) -> None:
        """The first non-empty line must be a JSON object with a string under `text_column`."""
        try:
            raw, text = self._open()
            with raw, text:
                for line in text:
                    if line.strip():
                        self._text_of(line, strict=True)
                        return
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - a broken archive or encoding, whatever the library raises
            raise ConfigError(f"cannot read input {self.path} as JSON Lines: {exc}") from exc
        raise ConfigError(f"input {self.path} holds no JSON lines")

    def _text_of(self, line: str, strict: bool = False) -> Optional[str]:
        try:
            row = json.loads(line)
        except ValueError as exc:
            if strict:
                raise ConfigError(f"input {self.path} is not JSON Lines: its first line does not parse ({exc})") from exc
            return None
        text = row.get(self.text_column) if isinstance(row, dict) else None
        if strict and not isinstance(text, str):
            keys = ", ".join(sorted(row)) if isinstance(row, dict) else type(row).__name__
            raise ConfigError(f"input {self.path} has no text field {self.text_column!r} (its first line has: "
                              f"{keys}); name the field with --text-column")
        return text if isinstance(text, str) else None

    def documents(self) -> Iterator[str]:
        raw, text_stream = self._open()
        with raw, text_stream:
            for number, line in enumerate(text_stream):
                if not line.strip():
                    continue
                text = self._text_of(line)
                if text is None:
                    self._skip()
                elif text:
                    yield text
                if number % 256 == 0:
                    self.bytes_read = raw.tell()
        self.bytes_read = self.bytes_total


class ParquetFile(_LocalFile):
    """A Parquet file: the strings of one column, read a batch of rows at a time."""

    kind = "parquet"

    def _file(self):
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except Exception as exc:  # noqa: BLE001 - pyarrow's errors for a file that is not Parquet
            raise ConfigError(f"cannot read input {self.path} as Parquet: {exc}") from exc

    def check(self) -> None:
        import pyarrow as pa

        schema = self._file().schema_arrow
        if self.text_column not in schema.names:
            raise ConfigError(f"input {self.path} has no column {self.text_column!r} (columns: "
                              f"{', '.join(schema.names)}); name the text column with --text-column")
        kind = schema.field(self.text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ConfigError(f"column {self.text_column!r} of input {self.path} holds {kind}, not text")

    def documents(self) -> Iterator[str]:
        parquet = self._file()
        rows = max(1, parquet.metadata.num_rows)
        done = 0
        for batch in parquet.iter_batches(batch_size=_BATCH_ROWS, columns=[self.text_column]):
            for text in batch.column(0).to_pylist():
                if isinstance(text, str):
                    if text:
                        yield text
                else:
                    self._skip()
            done += batch.num_rows
            self.bytes_read = self.bytes_total * done // rows


class SavedDataset(Input):
    """A `datasets` dataset saved with `save_to_disk` (a DatasetDict: its `split`)."""

    kind = "datasets"

    def __init__(self, path: Path, text_column: str, split: str):
        super().__init__(str(path), text_column)
        self.path = path
        self.split = split
        self.bytes_total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        self._dataset = None

    def _load(self):
        if self._dataset is None:
            import datasets

            try:
                loaded = datasets.load_from_disk(str(self.path))
            except Exception as exc:  # noqa: BLE001 - whatever `datasets` raises for a broken save
                raise ConfigError(f"cannot load the saved dataset {self.path}: {exc}") from exc
            if isinstance(loaded, datasets.DatasetDict):
                if self.split not in loaded:
                    raise ConfigError(f"the saved dataset {self.path} has no split {self.split!r} (splits: "
                                      f"{', '.join(loaded)}); choose one with --split")
                loaded = loaded[self.split]
            self._dataset = loaded
        return self._dataset

    def check(self) -> None:
        _check_dataset_column(self._load(), self.text_column, self.name)

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "split": self.split, "rows": len(self._load()),
                "dataset_fingerprint": getattr(self._load(), "_fingerprint", None)}

    def documents(self) -> Iterator[str]:
        yield from _dataset_documents(self, self._load())


class HubDataset(Input):
    """`hf:NAME[:SPLIT]`: a dataset on the Hugging Face hub, streamed (needs the network)."""

    kind = "hub"

    def __init__(self, spec: str, text_column: str, split: str):
        name, _, named_split = spec[len("hf:"):].partition(":")
        super().__init__(spec, text_column)
        self.dataset_name, self.split = name, named_split or split
        self._dataset = None

    def _load(self):
        if self._dataset is None:
            import datasets

            try:
                self._dataset = datasets.load_dataset(self.dataset_name, split=self.split, streaming=True)
            except Exception as exc:  # noqa: BLE001 - offline, unknown name, gated: all one sentence
                raise ConfigError(f"cannot open {self.name} on the Hugging Face hub: {exc}") from exc
        return self._dataset

    def check(self) -> None:
        features = getattr(self._load(), "features", None)
        if features is not None and self.text_column not in features:
            raise ConfigError(f"{self.name} has no column {self.text_column!r} (columns: {', '.join(features)}); "
                              "name the text column with --text-column")

    def documents(self) -> Iterator[str]:
        for row in self._load():
            text = row.get(self.text_column)
            if isinstance(text, str):
                if text:
                    yield text
            else:
                self._skip()


def _check_dataset_column(dataset, column: str, name: str) -> None:
    if column not in dataset.column_names:
        raise ConfigError(f"input {name} has no column {column!r} (columns: {', '.join(dataset.column_names)}); "
                          "name the text column with --text-column")


def _dataset_documents(source: Input, dataset) -> Iterator[str]:
    rows = max(1, len(dataset))
    for start in range(0, len(dataset), _BATCH_ROWS):
        for text in dataset[start:start + _BATCH_ROWS][source.text_column]:
            if isinstance(text, str):
                if text:
                    yield text
            else:
                source._skip()
        source.bytes_read = source.bytes_total * min(rows, start + _BATCH_ROWS) // rows


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file()
                                 for marker in ("dataset_info.json", "dataset_dict.json", "state.json"))


def _input_for_file(path: Path, text_column: str) -> Optional[Input]:
    name = path.name
    if name.endswith(".txt"):
        return TextFile(path, text_column)
    if name.endswith(".parquet"):
        return ParquetFile(path, text_column)
    if name.endswith(_JSONL_SUFFIXES):
        return JsonLinesFile(path, text_column)
    return None


def open_inputs(specs: list[str], text_column: str = "text", split: str = "train") -> list[Input]:
    """The inputs named on the command line, expanded and checked, in a fixed order."""
    if not specs:
        raise ConfigError("no input given; name .txt, .jsonl[.gz|.zst] or .parquet files, directories, a saved "
                          "`datasets` directory, or hf:NAME")
    inputs: list[Input] = []
    for spec in specs:
        if spec.startswith("hf:"):
            inputs.append(HubDataset(spec, text_column, split))
            continue
        path = Path(spec)
        if _is_saved_dataset(path):
            inputs.append(SavedDataset(path, text_column, split))
        elif path.is_dir():
            found = [p for p in sorted(path.rglob("*")) if p.is_file() and p.name.endswith(_FILE_SUFFIXES)]
            if not found:
                raise ConfigError(f"no {', '.join(_FILE_SUFFIXES)} files under input directory {path}")
            inputs.extend(_input_for_file(p, text_column) for p in found)
        elif path.is_file() or path.is_symlink():
            source = _input_for_file(path, text_column)
            if source is None:
                raise ConfigError(f"input {path} is of no kind prepare reads; name .txt, .jsonl, .jsonl.gz, "
                                  ".jsonl.zst or .parquet files, a saved `datasets` directory, or hf:NAME")
            inputs.append(source)
        else:
            raise ConfigError(f"input {path} does not exist")
    for source in inputs:
        source.check()
    return inputs
