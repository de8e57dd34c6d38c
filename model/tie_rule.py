"""When two decode paths give "the same" greedy ids: the tie rule (docs/serving.md, "FP8 weights").

Two paths that round differently (batched bf16 steps against one-at-a-time, FP8 weights against bf16)
pick different ids where the reference's top logits nearly tie; after that they continue different
texts, and comparing further says nothing. So a candidate's greedy ids agree with the reference's when
they are equal, or equal up to the first id where they part and there the reference itself rates the
candidate's id within `margin` of its own choice (logit of its choice - logit of the candidate's <=
margin). The reference is the plain eager forward (the whole sequence again each step, no cache), so
the rule needs nothing of the path under test but its ids.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@torch.inference_mode()
def reference_greedy(model, prompt: list[int], new: int) -> tuple[list[int], list[torch.Tensor]]:
    """`new` greedy ids after `prompt` from the eager forward without a cache, and each step's logits."""
    device = next(model.parameters()).device
    ids, logits = list(prompt), []
    for _ in range(new):
        last = model(torch.tensor([ids], device=device))[0, -1].float().cpu()
        logits.append(last)
        ids.append(int(last.argmax()))
    return ids[len(prompt):], logits


@dataclass
class Agreement:
    identical: bool
    parted_at: int | None  # the first position where the ids differ (None: they never do)
    gap: float | None  # there: the reference's logit of its id minus that of the candidate's
    within_ties: bool  # identical, or parted where gap <= margin


def agreement(want: list[int], logits: list[torch.Tensor], got: list[int], margin: float) -> Agreement:
    """The tie rule for one prompt: `want` and `logits` from reference_greedy, `got` the candidate's ids
    (as many; a shorter list parts where it ends, which no margin excuses)."""
    for p, w in enumerate(want):
        if p >= len(got):
            return Agreement(False, p, None, False)
        if got[p] != w:
            gap = float(logits[p][w] - logits[p][got[p]])
            return Agreement(False, p, round(gap, 4), gap <= margin)
    return Agreement(True, None, None, True)


# FP8 weights against the bf16/fp32 model: a logit moves by up to ~0.5 (0.54 on the CPU test's trained
# tiny model, tests/test_fp8_weights.py), so two ids can swap only where the reference's gap is below
# about twice that
FP8_WEIGHTS_MARGIN = 1.0
