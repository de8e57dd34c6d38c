"""Bits per byte: the tokenizer-independent loss every stage and evaluation reports."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .tokenizer import SparkTokenizer


def token_bytes(tok: SparkTokenizer, device) -> torch.Tensor:
    """UTF-8 bytes each token stands for (0 for special tokens): the denominator of bits per byte."""
    special = tok.special_ids
    lengths = [0 if i in special else len(b) for i, b in enumerate(tok.bytes_table)]
    return torch.tensor(lengths, dtype=torch.float32, device=device)


@torch.no_grad()
def evaluate_bpb(model, batches, n_batches: int, tbytes: torch.Tensor, device, autocast) -> float:
    """Bits per byte: tokenizer-independent, so runs with different vocabularies compare."""
    nats, nbytes = torch.zeros((), device=device), torch.zeros((), device=device)
    for _ in range(n_batches):
        x, y = batches.next()
        x, y = x.to(device), y.to(device)
        with autocast:
            loss = model(x, y, reduction="none")
        valid = y.view(-1) >= 0
        b = torch.where(valid, tbytes[y.view(-1).clamp(min=0)], torch.zeros_like(loss))
        nats += (loss * (b > 0)).sum()
        nbytes += b.sum()
    if dist.is_initialized():
        dist.all_reduce(nats)
        dist.all_reduce(nbytes)
    return float(nats / (math.log(2) * nbytes.clamp(min=1)))
