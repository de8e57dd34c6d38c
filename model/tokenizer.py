"""Byte-level BPE tokenizer (HuggingFace `tokenizers`) with the chat special tokens.

Pre-tokenisation splits text the GPT-4 way (letters, numbers in groups of 1-3, punctuation, spaces)
before byte-level BPE, so merges never cross word/number boundaries.
"""
from __future__ import annotations

import codecs
import functools
from pathlib import Path
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = [
    "<|bos|>",  # starts every document and every conversation
    "<|system_start|>", "<|system_end|>",
    "<|user_start|>", "<|user_end|>",
    "<|assistant_start|>", "<|assistant_end|>",
    "<|python_start|>", "<|python_end|>",  # assistant calls the calculator tool
    "<|output_start|>", "<|output_end|>",  # tool result, fed back by the engine
    # function calling (model/tools.py): the client's tool definitions, a call the model makes, its result
    "<|tools_start|>", "<|tools_end|>", "<|call_start|>", "<|call_end|>", "<|result_start|>", "<|result_end|>",
]
# nanochat's tokenizer, and so a published NanoChat checkpoint (model/hf.py), has every token above but
# these two: model/chat.py then puts a system prompt before the first user message, as nanochat does
SYSTEM_TOKENS = ("<|system_start|>", "<|system_end|>")
# a tokenizer trained before function calling (and nanochat's) lacks these: its model then takes no tools
TOOL_TOKENS = ("<|tools_start|>", "<|tools_end|>", "<|call_start|>", "<|call_end|>", "<|result_start|>",
               "<|result_end|>")


def _byte_of_char() -> dict[str, int]:
    """The byte-level alphabet's inverse: the byte each vocabulary character stands for. (GPT-2's
    bytes_to_unicode, which `tokenizers` uses but does not expose as a mapping.)"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + n)
    return {c: b for b, c in chars.items()}


BYTE_OF_CHAR = _byte_of_char()

# GPT-4 style split, numbers grouped by at most 3 digits
SPLIT_PATTERN = (r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]++[\r\n]*"
                 r"|\s*[\r\n]|\s+(?!\S)|\s+")


class SparkTokenizer:
    def __init__(self, tok: Tokenizer):
        self._tok = tok
        missing = [t for t in SPECIAL_TOKENS if tok.token_to_id(t) is None]
        optional = [group for group in (SYSTEM_TOKENS, TOOL_TOKENS) if set(group) & set(missing)]
        if [t for t in missing if not any(t in group for group in optional)] or \
                any(not set(group) <= set(missing) for group in optional):
            raise ValueError(f"tokenizer lacks special tokens {missing}")
        self.special = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS if t not in missing}
        self.bos_id = self.special["<|bos|>"]
        self.special_ids = frozenset(self.special.values())
        # text is text: "<|assistant_end|>" typed by a user (or found in a document) encodes as its
        # characters, never as the control id, so no message can forge a turn or a tool output.
        # Control ids come only from the renderer (model/chat.py), which adds them by id.
        tok.encode_special_tokens = True

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

    def to_str(self) -> str:
        """The tokenizer.json text (what `save` writes)."""
        return self._tok.to_str()

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

    def token_bytes(self, i: int) -> bytes:
        """The bytes id i stands for (a special token: its name; an id past the vocabulary: none). A
        token may end inside a UTF-8 character, so bytes, not text, are what a token is."""
        table = self.bytes_table
        return table[i] if 0 <= i < len(table) else b""

    @functools.cached_property
    def bytes_table(self) -> list[bytes]:
        """token_bytes(i) of every id, by index (built once: streams and logprobs read it a token at a time)."""
        def of(i: int) -> bytes:
            name = self._tok.id_to_token(i)
            if name is None:
                return b""
            return name.encode() if i in self.special_ids else bytes(BYTE_OF_CHAR[c] for c in name)
        return [of(i) for i in range(self.vocab_size)]


class StreamDecoder:
    """Token ids -> text deltas, for showing a reply as it is generated: a piece never splits a UTF-8
    character and special ids are dropped (what they delimit in a reply, model.chat.ReplyReader reads).

    The ids' bytes go through Python's incremental UTF-8 decoder: the bytes of a character cut between
    ids wait for the rest, and bytes that can never make a character show as U+FFFD at once, as decode()
    shows them. Each read is one join and one decode, whatever the ids.
    """

    def __init__(self, tok: SparkTokenizer):
        self.tok, self.special, self.table = tok, tok.special_ids, tok.bytes_table
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, i: int) -> str:
        """The text that id `i` completes ("" while a character is incomplete)."""
        return self.read([i])

    def read(self, ids: list[int]) -> str:
        """The text that `ids` complete (a front end reads a stream's new ids a few at a time)."""
        if self.special.isdisjoint(ids):
            return self.utf8.decode(self._bytes(ids))
        out = []
        for i in ids:  # a special id ends any character cut before it
            out.append(self.flush() if i in self.special else self.utf8.decode(self._bytes([i])))
        return "".join(out)

    def flush(self) -> str:
        """Whatever is held back (at the end of a reply), as U+FFFD."""
        return self.utf8.decode(b"", final=True)

    def _bytes(self, ids: list[int]) -> bytes:
        try:
            return b"".join([self.table[i] for i in ids])
        except IndexError:  # an id the model has but the tokenizer does not: no text
            return b"".join([self.tok.token_bytes(i) for i in ids])
