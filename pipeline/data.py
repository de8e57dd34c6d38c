"""Token batches for the three training stages, each resumable from a saved position.

- `TokenStream` (pretrain, midtrain): documents or rendered conversations joined into one stream of
  ids, each starting with <|bos|>, read as consecutive (B, T+1) windows. Midtraining learns on every
  token (the template, the prompts, the tool format); pretraining likewise.
- `ChatBatches` (sft): one conversation per row, padded; targets are masked (-1) everywhere except
  the assistant's own tokens, so SFT learns only what the assistant says.

Both hand out batches for one rank of `world` ranks, and `state()`/`load_state()` carry the position
so a resumed run reads exactly the batches an uninterrupted run would.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow.parquet as pq
import torch

from model.chat import render
from model.tokenizer import SparkTokenizer

IGNORE = -1


def read_texts(path: Path) -> list[str]:
    return pq.read_table(path, columns=["text"]).column("text").to_pylist()


def read_conversations(path: Path) -> list[list[dict]]:
    return [json.loads(m) for m in pq.read_table(path, columns=["messages"]).column("messages").to_pylist()]


def tokenize_texts(tok: SparkTokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for doc in tok.encode_batch(texts):
        ids.append(tok.bos_id)
        ids.extend(doc)
    return torch.tensor(ids, dtype=torch.long)


def tokenize_conversations(tok: SparkTokenizer, convs: list[list[dict]]) -> torch.Tensor:
    ids: list[int] = []
    for msgs in convs:
        ids.extend(render(tok, msgs)[0])
    return torch.tensor(ids, dtype=torch.long)


class TokenStream:
    def __init__(self, tokens: torch.Tensor, batch: int, seq_len: int, rank: int = 0, world: int = 1):
        self.tokens, self.batch, self.seq_len, self.rank, self.world = tokens, batch, seq_len, rank, world
        self.window = batch * seq_len  # tokens one rank consumes per micro-step (targets shift by one)
        if len(tokens) < self.window * world + 1:
            raise ValueError(f"only {len(tokens)} tokens: too few for one batch of {batch}x{seq_len} on {world} rank(s)")
        self.pos = 0  # micro-steps taken (same on every rank)
        self.epoch = 0

    @property
    def micro_steps_per_epoch(self) -> int:
        return (len(self.tokens) - 1) // (self.window * self.world)

    def next(self):
        if self.pos >= self.micro_steps_per_epoch:
            self.pos, self.epoch = 0, self.epoch + 1
        start = (self.pos * self.world + self.rank) * self.window
        chunk = self.tokens[start:start + self.window + 1]
        self.pos += 1
        x = chunk[:-1].view(self.batch, self.seq_len)
        y = chunk[1:].view(self.batch, self.seq_len)
        return x, y

    def state(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state(self, s: dict) -> None:
        self.pos, self.epoch = s["pos"], s["epoch"]


class ChatBatches:
    def __init__(self, tok: SparkTokenizer, convs: list[list[dict]], batch: int, seq_len: int,
                 pad_to_seq_len: bool, seed: int, rank: int = 0, world: int = 1):
        self.rows = []
        for msgs in convs:
            ids, mask = render(tok, msgs)
            ids, mask = ids[:seq_len + 1], mask[:seq_len + 1]
            if sum(mask[1:]) > 0:
                self.rows.append((ids, mask))
        self.batch, self.seq_len, self.pad_to_seq_len = batch, seq_len, pad_to_seq_len
        self.rank, self.world, self.seed = rank, world, seed
        self.pad_id = tok.special["<|assistant_end|>"]
        if len(self.rows) < batch * world:
            raise ValueError(f"only {len(self.rows)} conversations: too few for a batch of {batch} on {world} rank(s)")
        self.pos, self.epoch = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    @property
    def micro_steps_per_epoch(self) -> int:
        return len(self.rows) // (self.batch * self.world)

    def next(self):
        if self.pos >= self.micro_steps_per_epoch:
            self.pos, self.epoch = 0, self.epoch + 1
            self._order = self._shuffled(self.epoch)
        start = (self.pos * self.world + self.rank) * self.batch
        picked = [self.rows[i] for i in self._order[start:start + self.batch]]
        self.pos += 1
        width = self.seq_len if self.pad_to_seq_len else max(len(ids) for ids, _ in picked) - 1
        x = torch.full((self.batch, width), self.pad_id, dtype=torch.long)
        y = torch.full((self.batch, width), IGNORE, dtype=torch.long)
        for r, (ids, mask) in enumerate(picked):
            n = len(ids) - 1
            x[r, :n] = torch.tensor(ids[:-1])
            tgt = torch.tensor(ids[1:])
            keep = torch.tensor(mask[1:], dtype=torch.bool)
            y[r, :n] = torch.where(keep, tgt, torch.full_like(tgt, IGNORE))
        return x, y

    def state(self) -> dict:
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state(self, s: dict) -> None:
        self.pos, self.epoch = s["pos"], s["epoch"]
        self._order = self._shuffled(self.epoch)
