"""The data the stages share: prepare's parquet shards, the tokenize stage's token files, and the
batches the three training stages read from them, each resumable from a saved position.

Token files (written by pipeline/tokenize.py, read here by memory map) sit in a folder with an
`index.json` that the tokenize stage writes last. A split is named by a path prefix (`sparkchat.paths`):
    <prefix>.ids.bin       every token id, flat (uint16 when the vocabulary fits, else uint32)
    <prefix>.mask.bin      conversations: 1 where the model learns the token (uint8), as model/chat.py renders it
    <prefix>.offsets.bin   conversations: where each one starts (int64, one more than there are)
Files without a matching index (absent, or of another size) are refused: a killed tokenize stage never
passes for a finished one.

- `TokenStream` (pretrain, midtrain): the flat ids (documents and conversations each start with
  <|bos|>), read as consecutive (B, T+1) windows. Midtraining learns on every token (the template, the
  prompts, the tool format); pretraining likewise. A batch is one slice of the memory map, copied into
  a pinned buffer on CUDA.
- `ChatBatches` (sft): one conversation per row, padded; targets are masked (-1) everywhere except
  the assistant's own tokens, so SFT learns only what the assistant says.

Both hand out batches for one rank of `world` ranks (ranks read disjoint batches, numbered in the
single-process order, so a step reads the same rows on any number of ranks: `_GlobalOrder`), and
`state()`/`load_state()` carry the position so a resumed run, on this rank count or another, reads
exactly the batches an uninterrupted run would.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow.parquet as pq
import torch

IGNORE = -1
INDEX = "index.json"
# characters of text handed to the encoder at once: its encodings take ~150 bytes a token, so ~2 MB
# of text is a few hundred MB, and still hundreds of documents for every core to share
BATCH_CHARS = 2 << 20


class DataError(ValueError):
    pass


# -- prepare's pretraining shards ------------------------------------------------------------------

def read_shard_index(folder: Path) -> dict:
    path = folder / INDEX
    if not path.is_file():
        raise DataError(f"{folder}: no {INDEX}, so its shards are incomplete or absent; run the prepare stage "
                        f"(dvc repro prepare)")
    return json.loads(path.read_text())


def open_parquet(path: Path) -> pq.ParquetFile:
    """A parquet file to read in pieces. Without pre-buffering: with it (pyarrow's default here), a reader
    of the whole file held a growing share of it in memory (bench/results/training-and-data.md,
    "Peak memory per stage")."""
    return pq.ParquetFile(path, pre_buffer=False)


def pretrain_shard_files(folder: Path, split: str) -> list[str]:
    return [s["file"] for s in read_shard_index(folder)[split]["shards"]]


def iter_shard_batches(folder: Path, split: str, max_chars: int = BATCH_CHARS) -> Iterator[list[str]]:
    """The documents of one split in order, in lists of about `max_chars` characters: one row group is
    read at a time (pyarrow's iter_batches would join row groups up to its row count), then cut, so
    what the encoder holds at once stays small whatever the shard size."""
    for name in pretrain_shard_files(folder, split):
        pf = open_parquet(folder / name)
        for g in range(pf.num_row_groups):
            batch, n = [], 0
            for text in pf.read_row_group(g, columns=["text"]).column("text").to_pylist():
                batch.append(text)
                n += len(text)
                if n >= max_chars:
                    yield batch
                    batch, n = [], 0
            if batch:
                yield batch


def shard_texts(folder: Path, split: str) -> Iterator[str]:
    for texts in iter_shard_batches(folder, split):
        yield from texts


# -- the tokenize stage's token files --------------------------------------------------------------

def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass
class TokenSplit:
    """One split's token files, memory-mapped (nothing is read until a batch is sliced)."""
    ids: np.ndarray
    mask: np.ndarray | None       # conversations only
    offsets: np.ndarray | None    # conversations only
    meta: dict

    @property
    def docs(self) -> int:
        return self.meta["docs"]


def _map(path: Path, dtype, expect: dict) -> np.ndarray:
    if not path.is_file() or path.stat().st_size != expect["bytes"]:
        raise DataError(f"{path} does not match its index ({expect['bytes']} bytes expected): the tokenize stage "
                        f"did not finish; run dvc repro tokenize")
    if expect["bytes"] == 0:
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


def open_tokens(split: Path, tok=None) -> TokenSplit:
    """Memory-map the split named by `split` (a `sparkchat.paths` prefix). With `tok`, refuse token
    files made by a tokenizer with another vocabulary or <|bos|>."""
    index = split.parent / INDEX
    if not index.is_file():
        raise DataError(f"{index} is missing: the token files in {split.parent} are incomplete or absent; "
                        f"run the tokenize stage (dvc repro tokenize)")
    info = json.loads(index.read_text())
    if split.name not in info["splits"]:
        raise DataError(f"{index} has no split '{split.name}' (splits: {', '.join(info['splits'])})")
    if tok is not None and (tok.vocab_size, tok.bos_id) != (info["vocab_size"], info["bos_id"]):
        raise DataError(f"{split.parent} was tokenized with another tokenizer (vocab {info['vocab_size']}, bos "
                        f"{info['bos_id']}; this one: vocab {tok.vocab_size}, bos {tok.bos_id}); run dvc repro tokenize")
    meta = info["splits"][split.name]
    dtypes = {"ids": np.dtype(info["dtype"]), "mask": np.dtype(np.uint8), "offsets": np.dtype(np.int64)}
    arrays = {k: _map(split.parent / f["file"], dtypes[k], f) for k, f in meta["files"].items()}
    return TokenSplit(arrays["ids"], arrays.get("mask"), arrays.get("offsets"), meta)


# -- batches ---------------------------------------------------------------------------------------

class _GlobalOrder:
    """Batches numbered across ranks: global batch g is the g-th of the single-process order; rank r of
    `world` takes g = consumed + r, then every rank moves on by `world`. So a step's batches (grad_accum
    x world of them) are the same rows whatever the number of ranks, and a position (`state()`: batch
    `pos` of epoch `epoch`) means the same on any number of ranks: a checkpoint resumes on another rank
    count at the batch an uninterrupted run would read next."""
    batch: int
    seq_len: int
    rank: int
    world: int
    consumed: int  # global batches handed out before this round (the same on every rank)
    # batches from this global index on come with every target ignored (an evaluation of a set number
    # of batches on any rank count: every rank runs as many forwards, the surplus counts nothing)
    limit: int | None = None

    @property
    def batches_per_epoch(self) -> int:
        raise NotImplementedError

    @property
    def micro_steps_per_epoch(self) -> int:
        """Batches each rank reads in an epoch."""
        return self.batches_per_epoch // self.world

    @property
    def epoch(self) -> int:
        return self.consumed // self.batches_per_epoch

    def _take(self) -> tuple[int, int, bool]:
        """(epoch, index within it, whether it counts: below `limit`) of this rank's next batch."""
        g = self.consumed + self.rank
        self.consumed += self.world
        return *divmod(g, self.batches_per_epoch), self.limit is None or g < self.limit

    def state(self) -> dict:
        return {"pos": self.consumed % self.batches_per_epoch, "epoch": self.epoch}

    def load_state(self, s: dict) -> None:
        self.consumed = s["epoch"] * self.batches_per_epoch + s["pos"]


class TokenStream(_GlobalOrder):
    def __init__(self, tokens: np.ndarray, batch: int, seq_len: int, rank: int = 0, world: int = 1,
                 device: torch.device | str | None = None):
        self.tokens, self.batch, self.seq_len, self.rank, self.world = tokens, batch, seq_len, rank, world
        self.window = batch * seq_len  # tokens one batch holds (targets shift by one)
        if len(tokens) < self.window + 1:
            raise ValueError(f"only {len(tokens)} tokens: too few for one batch of {batch}x{seq_len}")
        self.consumed = 0
        self.device = torch.device(device) if device is not None else None
        if self.device is not None and self.device.type == "cuda":
            # two pinned buffers, each reused only once the copy that last read it has finished
            self._pinned = [torch.empty(self.window + 1, dtype=torch.long).pin_memory() for _ in range(2)]
            self._copied: list = [None, None]

    @property
    def batches_per_epoch(self) -> int:
        return (len(self.tokens) - 1) // self.window

    def next(self):
        _, index, counts = self._take()
        start = index * self.window
        chunk = self.tokens[start:start + self.window + 1]
        if self.device is None or self.device.type != "cuda":
            buf = torch.from_numpy(chunk.astype(np.int64))
        else:
            i = (self.consumed // self.world) % 2
            if self._copied[i] is not None:
                self._copied[i].synchronize()
            np.copyto(self._pinned[i].numpy(), chunk, casting="unsafe")
            buf = self._pinned[i].to(self.device, non_blocking=True)
            self._copied[i] = torch.cuda.Event()
            self._copied[i].record()
        x, y = buf[:-1].view(self.batch, self.seq_len), buf[1:].view(self.batch, self.seq_len)
        return x, y if counts else torch.full_like(y, IGNORE)


class ChatBatches(_GlobalOrder):
    def __init__(self, split: TokenSplit, pad_id: int, batch: int, seq_len: int, pad_to_seq_len: bool, seed: int,
                 rank: int = 0, world: int = 1):
        if split.offsets is None:
            raise DataError("ChatBatches needs conversation token files (ids, mask and offsets)")
        self.split = split
        off = split.offsets
        # conversations cut to seq_len + 1 tokens; those left with nothing to learn are dropped
        self.rows: list[tuple[int, int]] = []
        for i in range(len(off) - 1):
            start, n = int(off[i]), min(int(off[i + 1] - off[i]), seq_len + 1)
            if split.mask[start + 1:start + n].any():
                self.rows.append((start, n))
        self.batch, self.seq_len, self.pad_to_seq_len = batch, seq_len, pad_to_seq_len
        self.rank, self.world, self.seed = rank, world, seed
        self.pad_id = pad_id
        if len(self.rows) < batch:
            raise ValueError(f"only {len(self.rows)} conversations: too few for a batch of {batch}")
        self.consumed = 0
        self._order = (0, self._shuffled(0))  # (epoch, its order): a rank's batches go through epochs in turn

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    @property
    def batches_per_epoch(self) -> int:
        return len(self.rows) // self.batch

    def next(self):
        epoch, index, counts = self._take()
        if self._order[0] != epoch:
            self._order = (epoch, self._shuffled(epoch))
        start = index * self.batch
        picked = [self.rows[i] for i in self._order[1][start:start + self.batch]]
        width = self.seq_len if self.pad_to_seq_len else max(n for _, n in picked) - 1
        x = torch.full((self.batch, width), self.pad_id, dtype=torch.long)
        y = torch.full((self.batch, width), IGNORE, dtype=torch.long)
        for r, (s, n) in enumerate(picked):
            ids = torch.from_numpy(self.split.ids[s:s + n].astype(np.int64))
            keep = torch.from_numpy(self.split.mask[s + 1:s + n].astype(bool))
            x[r, :n - 1] = ids[:-1]
            y[r, :n - 1] = torch.where(keep, ids[1:], torch.full_like(ids[1:], IGNORE))
        return x, y if counts else torch.full_like(y, IGNORE)
