"""The manifest of a prepared corpus: what a trainer needs to read it and a run config to name it.

`manifest.json` sits beside the shards and is written last, atomically: a directory without one
holds no prepared corpus (perhaps one being prepared). Its SHA-256 (`manifest_hash`) identifies
the data a run trains on: same shards, same tokenizer, same held-out split.
"""

from __future__ import annotations

import hashlib
import json
from typing import Literal, Optional

from pydantic import BaseModel, Field, ValidationError

from protocol.errors import ConfigError

__all__ = ["FORMAT", "MANIFEST_NAME", "Manifest", "ShardEntry", "SplitEntry", "TokenizerEntry", "manifest_hash", "sha256_file"]

FORMAT = "agora-token-shards/1"
MANIFEST_NAME = "manifest.json"


class TokenizerEntry(BaseModel):
    kind: Literal["byte", "tokenizers"] = Field(description="byte: UTF-8 bytes; tokenizers: the file beside the shards.")
    file: Optional[str] = Field(default=None, description="The tokenizer's JSON file, relative to the manifest.")
    sha256: Optional[str] = None
    vocab_size: int = Field(gt=0, description="Every token id in the shards is below this.")
    separator_id: int = Field(ge=0, description="The id placed after every document.")
    trained: bool = Field(default=False, description="Trained on this corpus's training split by prepare.")


class ShardEntry(BaseModel):
    file: str = Field(description="A .npy array of token ids, relative to the manifest.")
    tokens: int = Field(ge=0)
    sha256: str


class SplitEntry(BaseModel):
    documents: int = 0
    tokens: int = 0
    shards: list[ShardEntry] = Field(default_factory=list)


class Manifest(BaseModel):
    format: str = FORMAT
    created_by: str
    tokenizer: TokenizerEntry
    dtype: Literal["uint16", "uint32"]
    shard_tokens: int = Field(gt=0, description="Tokens per shard; the last shard of a split may hold fewer.")
    heldout_fraction: float = Field(ge=0, lt=1)
    seed: int
    text_column: str
    sources: list[dict] = Field(description="The inputs, as prepare identified them.")
    skipped_rows: int = Field(default=0, description="Input rows without text, skipped.")
    splits: dict[str, SplitEntry] = Field(description="'train' and 'heldout'.")
    preparation: str = Field(description="Hash of the inputs and options prepare ran with: the same again is a no-op.")

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str) -> "Manifest":
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{where} is not a prepared corpus's manifest: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else None
            raise ConfigError(f"{where} is not a manifest of format {FORMAT} (format: {found!r}); "
                              "prepare the corpus with `agora-node data prepare`")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            raise ConfigError(f"{where} is damaged: {'.'.join(map(str, first['loc']))}: {first['msg']}") from exc


def sha256_file(path) -> str:
    """SHA-256 of a file's bytes, read 1 MiB at a time (shards and tokenizer files)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_hash(text: str | bytes) -> str:
    """The hash a run config names its data by: SHA-256 of the manifest file's bytes."""
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()
