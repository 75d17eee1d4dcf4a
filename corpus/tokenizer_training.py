"""Training a byte-level BPE tokenizer on a corpus with `tokenizers`, as GPT-2 and Llama 3 do.

Byte-level: every text encodes (no unknown token), and decoding gives the text back. The one
special token, `<|endoftext|>`, ends every document in the shards, and it is what a Hugging Face
export names as the end-of-sequence token. `tokenizers` trains on every core.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from protocol.errors import ConfigError

__all__ = ["END_OF_TEXT", "MIN_VOCAB", "train_bpe"]

END_OF_TEXT = "<|endoftext|>"
MIN_VOCAB = 257
"""The 256 byte symbols and the end-of-text token; merges come on top."""


def _capped(texts: Iterable[str], max_bytes: int) -> Iterator[str]:
    seen = 0
    for text in texts:
        yield text
        seen += len(text)
        if seen >= max_bytes:
            return


def train_bpe(texts: Iterable[str], vocab_size: int, path: Path, *, max_bytes: int) -> None:
    """Train on the texts (at most about `max_bytes` of them) and save the tokenizer JSON to `path`."""
    if vocab_size < MIN_VOCAB:
        raise ConfigError(f"--train-tokenizer {vocab_size} is too small: a byte-level BPE needs at least "
                          f"{MIN_VOCAB} tokens (256 bytes and {END_OF_TEXT})")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_capped(texts, max_bytes), trainer)
    tmp = path.with_name(path.name + ".tmp")
    tokenizer.save(str(tmp))
    tmp.replace(path)
