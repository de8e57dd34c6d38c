"""Log-likelihood of continuations: what lm-evaluation-harness's `loglikelihood` requests ask of a model.

A request is (context ids, continuation ids). The answer is the summed log-probability of the
continuation's tokens given everything before them, how many tokens that was, and whether each of
them was the model's most likely next token (greedy). Multiple-choice evaluation compares these across
the choices of a question; language-modelling tasks (LAMBADA) ask whether the continuation is greedy.

Works on token ids only (like the engine): the caller tokenizes, so the evaluate stage and a server
test can score the same ids. A request longer than `max_len` keeps its last `max_len` tokens (the
context is cut from the left, as nanochat's CORE evaluation and the harness do).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Continuation:
    logprob: float
    """Sum over the continuation's tokens of log p(token | the tokens before it), in nats."""
    tokens: int
    """Continuation tokens scored (all of them unless the request was longer than the context)."""
    greedy: bool
    """Every scored token was the argmax of the model's prediction."""

    @property
    def mean_logprob(self) -> float:
        """Per-token log-likelihood: CORE's multiple-choice score (length-normalised by tokens)."""
        return self.logprob / self.tokens


def _window(context: Sequence[int], continuation: Sequence[int], max_len: int) -> tuple[list[int], int]:
    """The ids one request puts through the model, cut to `max_len`, and how many continuation tokens
    are scored at its end."""
    if not context or not continuation:
        raise ValueError("a request needs a non-empty context (at least <|bos|>) and a non-empty continuation")
    ids = [int(t) for t in (*context, *continuation)][-max_len:]
    return ids, min(len(continuation), len(ids) - 1)


@torch.no_grad()
def score_continuations(model, requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int | None = None,
                        batch_tokens: int = 16384) -> list[Continuation]:
    """One Continuation per (context, continuation) request, in order.

    Requests go through the model in batches of about `batch_tokens` tokens, right-padded: attention
    is causal, so padding after a sequence never changes its logits. `max_len` defaults to the model's
    training context.
    """
    max_len = max_len or model.config.seq_len
    device = next(model.parameters()).device
    windows = [_window(c, x, max_len) for c, x in requests]
    out: list[Continuation] = []
    start = 0
    while start < len(windows):
        end, longest = start, 0
        while end < len(windows) and (end == start or max(longest, len(windows[end][0])) * (end - start + 1)
                                      <= batch_tokens):
            longest = max(longest, len(windows[end][0]))
            end += 1
        batch = windows[start:end]
        x = torch.zeros((len(batch), longest - 1), dtype=torch.long)
        for row, (ids, _) in enumerate(batch):
            x[row, :len(ids) - 1] = torch.tensor(ids[:-1])
        logits = model(x.to(device))
        for row, (ids, n) in enumerate(batch):
            # position i predicts ids[i + 1]: the last n targets are the continuation's tokens
            positions = torch.arange(len(ids) - 1 - n, len(ids) - 1, device=device)
            targets = torch.tensor(ids[-n:], device=device)
            lp = torch.log_softmax(logits[row, positions].float(), dim=-1)
            out.append(Continuation(logprob=float(lp.gather(1, targets[:, None]).sum()), tokens=n,
                                    greedy=bool((lp.argmax(-1) == targets).all())))
        start = end
    return out
