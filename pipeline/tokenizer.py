"""Stage `tokenizer`: train the byte-level BPE on pretraining + chat text, add the chat special tokens,
save it (`sparkchat.paths.TOKENIZER`) and report compression (bytes per token) on validation text."""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Iterator


from model.chat import content_text
from model.tools import tools_text
from model.tokenizer import SparkTokenizer

from sparkchat import paths

from .config import Params, load_params
from .data import open_parquet, shard_texts
from .metrics import write_reports

REPORT_DOCS = 2000  # validation documents the compression report encodes (a fixed sample, not all of them)


def training_text(data: Path, max_chars: int) -> Iterator[str]:
    """Pretraining text first, then chat turns, until max_chars (chat is ~10% of the budget)."""
    budget_text, budget_chat = int(max_chars * 0.9), max_chars - int(max_chars * 0.9)
    for t in shard_texts(data / paths.PRETRAIN_SHARDS.relative_to(paths.DATA), "train"):
        if budget_text <= 0:
            break
        yield t[:budget_text]
        budget_text -= len(t)
    for batch in open_parquet(data / paths.MID_TRAIN.name).iter_batches(columns=["messages"]):
        for m in batch.column("messages").to_pylist():
            if budget_chat <= 0:
                return
            conv = json.loads(m)
            if isinstance(conv, dict):  # a tool-use conversation (pipeline/tool_tasks.py): its signatures and calls
                texts = [tools_text(conv["tools"])] + [p["text"] for turn in conv["messages"]
                                                       if isinstance(turn["content"], list)
                                                       for p in turn["content"] if p["type"] == "call"]
                conv = conv["messages"]
            else:
                texts = []
            texts += [content_text(turn["content"]) if turn["content"] else "" for turn in conv]
            for text in texts:
                budget_chat -= len(text)
                yield text


def bytes_per_token(tok: SparkTokenizer, texts: list[str]) -> float:
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    return n_bytes / max(1, n_tokens)


def train_tokenizer(p: Params, data: Path = paths.DATA, out: Path = paths.TOKENIZER.parent) -> dict:
    """Trains and saves the tokenizer; returns its size and its bytes a token on held-out text."""
    tok = SparkTokenizer.train(training_text(data, p.tokenizer.train_chars), p.tokenizer.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(out / "tokenizer.json")
    val = list(itertools.islice(shard_texts(data / paths.PRETRAIN_SHARDS.relative_to(paths.DATA), "val"), REPORT_DOCS))
    return {"vocab_size": tok.vocab_size, "val_bytes_per_token": round(bytes_per_token(tok, val), 4)}


def main(argv=None) -> None:
    report = train_tokenizer(load_params(stage="tokenizer"))
    write_reports("tokenizer", details=report)  # no headline: the tokenizer's figures are a file away
    print(f"tokenizer: vocab {report['vocab_size']}, {report['val_bytes_per_token']} bytes/token on val text",
          file=sys.stderr)


if __name__ == "__main__":
    main()
