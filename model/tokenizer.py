"""Byte-level BPE tokenizer (HuggingFace `tokenizers`) with the chat special tokens.

Pre-tokenisation splits text the GPT-4 way (letters, numbers in groups of 1-3, punctuation, spaces)
before byte-level BPE, so merges never cross word/number boundaries.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document and every conversation
    "<|system_start|>", "<|system_end|>",
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # assistant calls the calculator tool
    "<|output_start|>", "<|output_end|>",  # tool result, fed back by the engine
]

# GPT-4 style split, numbers grouped by at most 3 digits
SPLIT_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"
                 r"|\s*[\r\n]|\s+(?!\S)|\s+")


class SparkTokenizer:
    def __init__(self, tok: Tokenizer):
        self._tok = tok
        missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
        if missing:
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
        self.bos_id = self.special["<|bos|>"]

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> "SparkTokenizer":
        tok = Tokenizer(models.BPE(byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    @classmethod
    def load(cls, path: str | Path) -> "SparkTokenizer":
        return cls(Tokenizer.from_file(str(path)))

    def save(self, path: str | Path) -> None:
        self._tok.save(str(path))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets: the same ids, sooner
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        return [e.ids for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def iter_decode(self, ids: Iterator[int]) -> Iterator[str]:
        """Decode a stream of ids into text pieces that are always whole UTF-8 characters."""
        buf: list[int] = []
        emitted = ""
        for i in ids:
            buf.append(i)
            text = self.decode(buf)
            if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
                continue
            yield text[len(emitted):]
            emitted = text
