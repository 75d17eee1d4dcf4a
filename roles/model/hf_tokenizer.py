"""The tokenizer files of a Hugging Face export: `tokenizer.json` and `tokenizer_config.json`.

A run's `tokenizers` file (a prepared corpus's, or `--tokenizer`'s) is copied as it is. The
byte tokenizer (ids = UTF-8 bytes, separator NUL = 0) becomes the equivalent `tokenizers` file:
a byte-level BPE with the 256 byte symbols as ids 0..255 and no merges, so `transformers`
encodes and decodes text exactly as the trainers did.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from corpus.tokenizers import HFTokenizer

__all__ = ["write_tokenizer_files"]


def _byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, alphabet[0]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of bytes to printable characters, which byte-level BPE uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def write_tokenizer_files(out: Path, tokenizer_file: Optional[str], max_length: int) -> int:
    """Write the tokenizer files into `out`; returns the end-of-text token id (the separator the
    trainers put between documents)."""
    if tokenizer_file is None:
        tokenizer, eos = _byte_tokenizer()
        tokenizer.save(str(out / "tokenizer.json"))
        eos_id = 0
    else:
        ours = HFTokenizer(tokenizer_file)
        shutil.copyfile(tokenizer_file, out / "tokenizer.json")
        eos_id = ours.separator_id
        eos = ours._tok.id_to_token(eos_id)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "bos_token": eos,
              "model_max_length": max_length, "clean_up_tokenization_spaces": False, "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": eos, "bos_token": eos}, indent=2) + "\n")
    return eos_id
