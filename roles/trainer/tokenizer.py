"""The tokenizers, where the trainer has always imported them from; they live in
corpus/tokenizers.py, below the roles, since data preparation uses them too."""

from corpus.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]
