"""The batched sampler, and the extras it applies: penalties, logit bias and log-probabilities.

One call samples every row of a step on the model's device, each row with its own settings
(temperature, top-k, top-p) and a uniform number from its request's own stream (`Uniforms`), which it
turns into a token by inverse CDF: a row's randomness never depends on its neighbours.

The extras are OpenAI's presence and frequency penalties, logit_bias and logprobs (`extras_step`),
from per-row buffers on the device (`ExtrasBuffers`), so they need no host work inside a step.
Logprobs are the model's own distribution (log-softmax of its logits, before temperature, penalties
and bias, as vLLM reports by default).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .requests import MAX_LOGPROBS


# the most logits `sample` ranks by counting (k_max**2 comparisons a row); a larger k_max sorts them all.
# Decode graphs for rows whose top_k are all within it sample from this many (`model.decode_graphs`)
RANKED_K = 256


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           uniform: torch.Tensor, k_max: int = 0) -> torch.Tensor:
    """Batched sampling with per-row settings. logits (B, V); the rest (B,). Returns ids (B,).

    Rows with temperature 0 take the argmax. Others sort once, cut to top-k and top-p, and pick the
    token where the cumulative probability first exceeds `uniform` (inverse CDF). `k_max` > 0 promises
    that every row's top_k is in 1..k_max or its temperature is 0 (`top_k_bound`): then, up to
    RANKED_K, only the k_max largest logits are put in order.
    """
    logits = logits.float()
    scaled = logits / temperature.clamp(min=1e-5)[:, None]  # a greedy row's order is its logits' order
    if 0 < k_max <= RANKED_K and k_max < logits.shape[-1]:
        vals, idx = scaled.topk(k_max, dim=-1, sorted=False)
        # put them in order: larger first, equal ones (common in bf16) by id, lowest first, as argmax
        # does; torch.topk promises no order for ties, so equal logits could trade places between
        # runs. Each one's place is counted (k_max**2 comparisons, fused by torch.compile) instead of
        # sorted: CUDA's sort of 256 values cost more at one row than the rest of the sampler
        # (bench/results/serving.md, "The sampler")
        v, i = vals[:, None, :], idx[:, None, :]
        place = ((v > vals[:, :, None]) | ((v == vals[:, :, None]) & (i < idx[:, :, None]))).sum(-1)
        vals, idx = torch.empty_like(vals).scatter_(-1, place, vals), torch.empty_like(idx).scatter_(-1, place, idx)
    else:  # stable: equal logits by id here too
        vals, idx = scaled.sort(dim=-1, descending=True, stable=True)
    return sample_sorted(vals, idx, temperature, top_k, top_p, uniform)


def sample_sorted(vals: torch.Tensor, idx: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`sample` after its ordering: vals (B, K), scaled logits largest first, and their ids idx."""
    greedy = idx[:, 0]  # the argmax, from the sort already made (a separate argmax costs a pass over V)
    V = vals.shape[-1]
    rank = torch.arange(V, device=vals.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V))[:, None]
    vals = vals.masked_fill(rank >= k, float("-inf"))
    probs = torch.softmax(vals, dim=-1)
    cum = probs.cumsum(dim=-1)
    # keep a token if the mass before it is below top_p (the first token is always kept)
    keep = (cum - probs) < top_p[:, None]
    probs = probs * keep
    cum = probs.cumsum(dim=-1)
    target = uniform[:, None] * cum[:, -1:]
    choice = torch.searchsorted(cum, target).clamp(max=V - 1).squeeze(-1)
    sampled = idx.gather(-1, choice[:, None]).squeeze(-1)
    return torch.where(temperature > 0, sampled, greedy)


class Uniforms:
    """One request's own stream of uniform numbers, on the host (seeded => the same request gives the
    same ids), drawn in blocks: one call per row and step would cost more host time than the GPU's whole
    decode step."""

    def __init__(self, seed: int | None):
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self._block: list[float] = []

    def next(self) -> float:
        if not self._block:
            self._block = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._block.pop()


# the columns of a step's settings block, one row per sequence (`settings_row`)
TEMPERATURE, TOP_K, TOP_P, UNIFORM, PRESENCE, FREQUENCY, TARGET = range(7)
N_SETTINGS = 7
IDLE = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0]  # a row that rides along (prefilling): greedy, counts nothing


def settings_row(params, uniform: float, target: int) -> list[float]:
    """A request's row of the settings block: its `model.engine.SamplingParams`, its next uniform number
    and the id a tool forces now (-1: none)."""
    return [params.temperature, params.top_k, params.top_p, uniform, params.presence_penalty,
            params.frequency_penalty, target]


def top_k_bound(settings: list[list[float]]) -> int:
    """The most tokens any of these rows keeps (its top_k; a greedy row keeps 1), 0 when a row keeps all:
    a bound > 0 lets `sample` sort only that many logits."""
    ks = [1 if s[TEMPERATURE] == 0 else s[TOP_K] for s in settings]
    return int(max(ks)) if min(ks) > 0 else 0


def adjust(logits: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor, presence: torch.Tensor,
           frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI's penalties and logit bias: logit - frequency * count - presence * (count > 0) + bias.
    logits, counts, bias (B, V); presence, frequency (B,)."""
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0) + bias


def logprob_info(logits: torch.Tensor, chosen: torch.Tensor, n_top: int = MAX_LOGPROBS) -> torch.Tensor:
    """(B, 1 + 2 n_top) float32: the chosen id's log-probability, the n_top likeliest ids (as floats:
    exact below 2**24) and their log-probabilities, from the model's own logits (B, V)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    top = lp.topk(min(n_top, lp.shape[-1]), dim=-1)
    return torch.cat([lp.gather(-1, chosen[:, None]), top.indices.float(), top.values], dim=-1)


def top_alternatives(info: list[float], n: int) -> list[tuple[int, float]]:
    """The n likeliest (id, logprob) of a `logprob_info` row, read back as a list."""
    width = (len(info) - 1) // 2
    return [(int(i), lp) for i, lp in zip(info[1:1 + n], info[1 + width:1 + width + n])]


@dataclass
class ExtrasBuffers:
    """The extras' per-row state on the device, a row per cache row, moved with its request: how often
    each id was generated so far (the penalties), the dense logit bias, and a grammar's mask of the next
    id (0 or -inf, written before each step of a constrained row: model.grammar.write_masks)."""
    counts: torch.Tensor
    bias: torch.Tensor
    mask: torch.Tensor

    @classmethod
    def zeros(cls, rows: int, vocab_size: int, device) -> "ExtrasBuffers":
        return cls(*(torch.zeros((rows, vocab_size), dtype=torch.float32, device=device) for _ in range(3)))

    def reset_rows(self, start: int, logit_biases: list[dict[int, float] | None]) -> None:
        """New requests' rows start.. (one a bias): nothing generated yet, each its own logit bias (zero
        when none)."""
        rows = slice(start, start + len(logit_biases))
        self.counts[rows].zero_()
        self.bias[rows].zero_()
        self.mask[rows].zero_()
        for row, logit_bias in enumerate(logit_biases, start):
            if logit_bias:
                ids, values = zip(*logit_bias.items())
                self.bias[row, list(ids)] = torch.tensor(values, dtype=torch.float32).to(self.bias.device)

    def move_rows(self, src: "list[int] | torch.Tensor", dst: "list[int] | torch.Tensor") -> None:
        """Rows src's state into rows dst (none of them a source), in one copy each."""
        s, d = torch.as_tensor(src, device=self.counts.device), torch.as_tensor(dst, device=self.counts.device)
        self.counts[d] = self.counts[s]
        self.bias[d] = self.bias[s]
        self.mask[d] = self.mask[s]


def extras_step(logits: torch.Tensor, st: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor,
                ids: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling with penalties, bias and logprobs for rows with settings `st` (B, N_SETTINGS).

    `ids` (B,), in a decode step, are the ids this step feeds: they are counted first (in place, in
    `counts`, for rows with a penalty), so `counts` holds every id generated before the one sampled
    now. Returns the sampled ids and `logprob_info` of each row's emitted id: the sampled one, or the
    id a tool forces (column TARGET, -1 when none). `mask` (B, V), a grammar's (ExtrasBuffers.mask), is
    added to the logits first, as model.grammar.mask_rows sets them in place where no graph runs."""
    if mask is not None:
        logits = logits.float() + mask
    if ids is not None:
        counting = ((st[:, PRESENCE] != 0) | (st[:, FREQUENCY] != 0)).float()
        counts.scatter_add_(1, ids.view(-1, 1), counting[:, None])
    adjusted = adjust(logits.float(), counts, bias, st[:, PRESENCE], st[:, FREQUENCY])
    sampled = sample(adjusted, st[:, TEMPERATURE], st[:, TOP_K].long(), st[:, TOP_P], st[:, UNIFORM])
    target = st[:, TARGET].long()
    return sampled, logprob_info(logits, torch.where(target >= 0, target, sampled))


def sample_rows(logits: torch.Tensor, settings: list[list[float]], buffers: ExtrasBuffers | None = None,
                rows=None, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sampled ids (on the logits' device) for rows with these settings, sent over in one host-to-device
    copy; given the extras' `buffers`, through `extras_step` with their rows `rows` (`ids`: the inputs a
    decode step counts), which also gives each row's `logprob_info`."""
    st = torch.tensor(settings, dtype=torch.float32).to(logits.device, non_blocking=True)
    if buffers is not None:
        return extras_step(logits, st, buffers.counts[rows], buffers.bias[rows], ids)
    return sample(logits, st[:, TEMPERATURE], st[:, TOP_K].long(), st[:, TOP_P], st[:, UNIFORM],
                  top_k_bound(settings)), None
