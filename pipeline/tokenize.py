"""Stage `tokenize`: text shards and conversations -> flat token files, once, for every training stage.

    artifacts/tokens/pretrain/   train.ids.bin, val.ids.bin: every document as <|bos|> + its ids
    artifacts/tokens/chat/       mid_train, sft_train, chat_val: .ids.bin, .mask.bin, .offsets.bin,
                                 each conversation rendered by model/chat.py (ids and loss mask)
    index.json in each folder    dtype, tokenizer vocabulary and <|bos|>, per split its documents,
                                 tokens and each file's size and sha256; written last

(file formats: pipeline/data.py; paths: sparkchat.paths). The pretraining text is encoded ~2 MB at a
time with the `tokenizers` library's batch encoder, which runs on every core in Rust; conversations are
rendered in worker processes, one per core, when there are many. Each folder's
index is deleted first and written last (atomically), so a killed or failed stage (a full disk
included) never leaves token files that a training stage would take for complete. The same inputs give
the same bytes.
"""
from __future__ import annotations

import errno
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

from model.chat import render
from model.tokenizer import SparkTokenizer
from sparkchat import paths

from .data import INDEX, DataError, iter_shard_batches, open_parquet, read_shard_index, token_dtype
from .metrics import write_json, write_reports


class TokenizeError(RuntimeError):
    pass


class TokenFile:
    """One flat binary file written in appended arrays, hashed as it goes."""

    def __init__(self, path: Path, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self.sha, self.bytes = hashlib.sha256(), 0
        self._f = open(path, "wb")

    def _fail(self, e: OSError):
        full = e.errno in (errno.ENOSPC, errno.EDQUOT)
        raise TokenizeError(f"could not write {self.path}: {'disk full: ' if full else ''}{e.strerror or e}. "
                            f"No index was written, so nothing will read these files; "
                            f"{'free space and ' if full else ''}run the stage again") from None

    def write(self, arr: np.ndarray) -> None:
        data = np.ascontiguousarray(arr, dtype=self.dtype).data
        try:
            self._f.write(data)
        except OSError as e:
            self._fail(e)
        self.sha.update(data)
        self.bytes += data.nbytes

    def close(self) -> dict:
        try:
            self._f.flush()
            os.fsync(self._f.fileno())  # on disk before the index says so (a power cut, not just a kill)
            self._f.close()
        except OSError as e:
            self._fail(e)
        return {"file": self.path.name, "bytes": self.bytes, "sha256": self.sha.hexdigest()}


def _start(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / INDEX).unlink(missing_ok=True)  # first: from here on the folder reads as incomplete


def _finish(folder: Path, tok: SparkTokenizer, splits: dict) -> None:
    write_json(folder / INDEX, {"format": 1, "dtype": token_dtype(tok.vocab_size).name, "vocab_size": tok.vocab_size,
                                "bos_id": tok.bos_id, "splits": splits})  # last, atomic


def with_bos(encoded: list[list[int]], bos: int, dtype) -> np.ndarray:
    """Documents' ids -> one flat array, each document led by <|bos|>."""
    lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
    flat = np.fromiter(itertools.chain.from_iterable(encoded), dtype=dtype, count=int(lengths.sum()))
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    return np.insert(flat, starts, np.asarray(bos, dtype=dtype))


def _encoded(tok: SparkTokenizer, batches: Iterator[list[str]]) -> Iterator[tuple[list[str], list[list[int]]]]:
    """(texts, ids) per batch, in order; the next batch encodes (in Rust, without the GIL) while the
    caller packs and writes this one, so no core waits on the Python between batches."""
    with ThreadPoolExecutor(1) as pool:
        pending = None
        for texts in batches:
            job = (texts, pool.submit(tok.encode_batch, texts))
            if pending:
                yield pending[0], pending[1].result()
            pending = job
        if pending:
            yield pending[0], pending[1].result()


def tokenize_pretrain(tok: SparkTokenizer, shards: Path, out: Path) -> dict:
    """prepare's train/val shards -> <out>/train.ids.bin, val.ids.bin + index.json."""
    shard_index = read_shard_index(shards)
    _start(out)
    dtype = token_dtype(tok.vocab_size)
    total = sum(shard_index[s]["bytes"] for s in ("train", "val"))
    splits = {}
    with tqdm(total=total, desc="tokenize text", unit="B", unit_scale=True, file=sys.stderr, mininterval=2.0,
              smoothing=0.1) as bar:
        for split in ("train", "val"):
            f = TokenFile(out / f"{split}.ids.bin", dtype)
            docs = tokens = 0
            for texts, encoded in _encoded(tok, iter_shard_batches(shards, split)):
                arr = with_bos(encoded, tok.bos_id, dtype)
                f.write(arr)
                docs, tokens = docs + len(texts), tokens + len(arr)
                bar.update(sum(len(t.encode("utf-8")) for t in texts))
            splits[split] = {"docs": docs, "tokens": tokens, "bytes_of_text": shard_index[split]["bytes"],
                             "files": {"ids": f.close()}}
    _finish(out, tok, splits)
    return splits


POOL_MIN_CONVERSATIONS = 20_000  # fewer: rendering in-process beats starting worker processes
CONVERSATIONS_PER_TASK = 1024
_worker_tok: SparkTokenizer | None = None


def _init_worker(tok: SparkTokenizer) -> None:
    global _worker_tok
    _worker_tok = tok


def render_conversation(tok: SparkTokenizer, conversation) -> tuple[list[int], list[int]]:
    """(ids, mask) of a conversation as stored: a list of messages, or {"messages", "tools"}
    (pipeline/tool_tasks.py)."""
    if isinstance(conversation, dict):
        return render(tok, conversation["messages"], tools=conversation.get("tools"))
    return render(tok, conversation)


def _render_batch(messages: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """JSON conversations -> (ids, loss mask, lengths), rendered by model/chat.py."""
    rendered = [render_conversation(_worker_tok, json.loads(m)) for m in messages]
    return (np.fromiter(itertools.chain.from_iterable(r[0] for r in rendered), token_dtype(_worker_tok.vocab_size)),
            np.fromiter(itertools.chain.from_iterable(r[1] for r in rendered), np.uint8),
            np.fromiter((len(r[0]) for r in rendered), np.int64, count=len(rendered)))


def _rendered(tok: SparkTokenizer, batches: Iterator[list[str]], total: int) -> Iterator[tuple]:
    """_render_batch over the batches, in order: in worker processes (one per core) when there are many
    conversations (rendering is Python, one core each), at most two tasks per worker in flight."""
    workers = os.cpu_count() or 1
    if total < POOL_MIN_CONVERSATIONS or workers < 2:
        _init_worker(tok)
        yield from map(_render_batch, batches)
        return
    with multiprocessing.get_context("spawn").Pool(workers, _init_worker, (tok,)) as pool:
        window: deque = deque()
        for batch in batches:
            window.append(pool.apply_async(_render_batch, (batch,)))
            if len(window) >= 2 * workers:
                yield window.popleft().get()
        while window:
            yield window.popleft().get()


def tokenize_conversations(tok: SparkTokenizer, sources: dict[str, Path], out: Path) -> dict:
    """Conversation parquet files (column `messages`) -> per split <name>.ids/.mask/.offsets.bin + index.json."""
    _start(out)
    dtype = token_dtype(tok.vocab_size)
    splits = {}
    for name, path in sources.items():
        files = {"ids": TokenFile(out / f"{name}.ids.bin", dtype), "mask": TokenFile(out / f"{name}.mask.bin", np.uint8),
                 "offsets": TokenFile(out / f"{name}.offsets.bin", np.int64)}
        files["offsets"].write(np.zeros(1, np.int64))
        pf = open_parquet(path)
        batches = (b.column("messages").to_pylist()
                   for b in pf.iter_batches(batch_size=CONVERSATIONS_PER_TASK, columns=["messages"]))
        docs = tokens = 0
        with tqdm(total=pf.metadata.num_rows, desc=f"tokenize {name}", unit="conv", file=sys.stderr, mininterval=2.0) as bar:
            for ids, mask, lengths in _rendered(tok, batches, pf.metadata.num_rows):
                files["ids"].write(ids)
                files["mask"].write(mask)
                files["offsets"].write(tokens + np.cumsum(lengths))
                docs, tokens = docs + len(lengths), tokens + len(ids)
                bar.update(len(lengths))
        splits[name] = {"docs": docs, "tokens": tokens, "files": {k: f.close() for k, f in files.items()}}
    _finish(out, tok, splits)
    return splits


def tokenize_all(tok: SparkTokenizer, root: Path = Path(".")) -> dict:
    """Everything, from and to the `sparkchat.paths` locations under `root` (the project root)."""
    t0 = time.perf_counter()
    text = tokenize_pretrain(tok, root / paths.PRETRAIN_SHARDS, root / paths.PRETRAIN_TOKENS)
    text_s = time.perf_counter() - t0
    chat = tokenize_conversations(tok, {"mid_train": root / paths.MID_TRAIN, "sft_train": root / paths.SFT_TRAIN,
                                        "chat_val": root / paths.CHAT_VAL}, root / paths.CHAT_TOKENS)
    text_bytes = sum(s["bytes_of_text"] for s in text.values())
    text_tokens = sum(s["tokens"] for s in text.values())
    return {"pretrain_train_tokens": text["train"]["tokens"], "pretrain_val_tokens": text["val"]["tokens"],
            "pretrain_docs": sum(s["docs"] for s in text.values()),
            "bytes_per_token": round(text_bytes / max(1, text_tokens), 4),
            "text_mb_per_s": round(text_bytes / 1e6 / max(text_s, 1e-9), 2),
            "text_tokens_per_s": round(text_tokens / max(text_s, 1e-9)),
            **{f"{k}_tokens": v["tokens"] for k, v in chat.items()}, **{f"{k}_conversations": v["docs"] for k, v in chat.items()}}


def main(argv=None) -> None:
    if not paths.TOKENIZER.is_file():
        raise SystemExit(f"tokenize: {paths.TOKENIZER} is missing; run the tokenizer stage (dvc repro tokenizer)")
    tok = SparkTokenizer.load(paths.TOKENIZER)
    try:
        stats = tokenize_all(tok)
    except (TokenizeError, DataError) as e:
        raise SystemExit(f"tokenize: {e}") from None
    timings = {k: stats.pop(k) for k in ("text_mb_per_s", "text_tokens_per_s")}
    write_reports("tokenize", details=stats, timings=timings)  # token counts (no headline metric), MB/s
    print(f"tokenize: {stats['pretrain_train_tokens']:,} train / {stats['pretrain_val_tokens']:,} val tokens of text "
          f"({stats['bytes_per_token']} bytes a token, {timings['text_mb_per_s']} MB/s); {stats['mid_train_tokens']:,} "
          f"midtrain, {stats['sft_train_tokens']:,} sft, {stats['chat_val_tokens']:,} chat val tokens", file=sys.stderr)


if __name__ == "__main__":
    main()
