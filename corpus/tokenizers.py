"""Tokenizers the trainer turns text into token ids with [report 3.3.2.1].

The byte tokenizer needs nothing and covers every text, so the demo and tests run without
downloads; a real run loads a `tokenizers` JSON file (an optional dependency). The trainer checks
`tokenizer.vocab_size <= model vocab_size` before it sends a single token, since a worker's
embedding would otherwise fail on the first out-of-range id.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from protocol.errors import ConfigError

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]

_EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "[SEP]")


@runtime_checkable
class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    vocab_size: int
    """Every id `encode` returns is below this."""
    separator_id: int
    """Id placed between packed documents."""

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of many texts at once (a `tokenizers` file uses every core for it)."""
        ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, no files, lossless for any text without lone surrogates."""

    vocab_size = 256
    separator_id = 0
    """NUL: it almost never occurs in text, so it marks document boundaries unambiguously."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8) for text in texts]

    def decode(self, ids: list[int]) -> str:
        """Decode ids, replacing invalid UTF-8 (as a model's samples may well be) with U+FFFD."""
        return bytes(ids).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face `tokenizers` JSON file (e.g. a model's `tokenizer.json`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ConfigError(f"tokenizer file {self.path} does not exist; pass a tokenizer.json path or omit it")
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as exc:
            raise ConfigError(
                f"tokenizer file {self.path} needs the 'tokenizers' package: pip install 'agora-node[tokenizers]'"
            ) from exc
        try:
            self._tok = _RustTokenizer.from_file(str(self.path))
        except Exception as exc:
            raise ConfigError(f"cannot load tokenizer {self.path}: {exc}; is it a tokenizers JSON file?") from exc
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.separator_id: int = self._find_separator()

    def _find_separator(self) -> int:
        for token in _EOS_CANDIDATES:
            token_id = self._tok.token_to_id(token)
            if token_id is not None:
                return token_id
        return 0

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.asarray(e.ids, dtype=np.uint32) for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r})"


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """None (or "byte") gives the byte tokenizer; anything else is a `tokenizers` JSON file."""
    if path is None or str(path) in ("", "byte", "bytes"):
        return ByteTokenizer()
    return HFTokenizer(path)
