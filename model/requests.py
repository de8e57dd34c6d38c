"""What a caller hands the engine (`model.engine`) and gets back, on token ids only: the sampling
settings of a request, the events its sink receives (each `Token`, a `PromptLogprobs` if asked, one
`Finished`), and the errors a submit can raise. The serving layer and the pipeline's evaluators speak
these types without the scheduler itself, and without torch (a server's front ends never load it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

# an engine's defaults (model.engine.EngineConfig), and so the server's (serve.settings)
MAX_BATCH = 16
"""Rows of the KV cache: requests decoded together."""
MAX_QUEUE = 64
"""Requests allowed to wait for a row; one more is refused with QueueFull."""
MAX_LOGPROBS = 20
"""Most alternatives a request may ask for at each position (OpenAI's limit on top_logprobs)."""
MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)."""
MAX_BIAS = 100.0
"""logit_bias values lie in [-MAX_BIAS, MAX_BIAS]; -100 bans a token (OpenAI's range and meaning)."""


class EngineError(RuntimeError):
    pass


class QueueFull(EngineError):
    """The waiting queue holds `max_queue` requests already."""


class PromptTooLong(EngineError):
    """The prompt does not leave room for even one generated token in the context."""


class EngineStopped(EngineError):
    pass


@dataclass
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose probability reaches top_p."""
    max_tokens: int = 256
    """Generated ids at most (forced tool ids included); the context limit may stop earlier. 0: none,
    the prompt is only read (for its `prompt_logprobs`)."""
    seed: int | None = None
    """Seeds the request's own generator; None draws fresh entropy."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every id generated so far (OpenAI's presence_penalty)."""
    frequency_penalty: float = 0.0
    """Subtracted from an id's logit once per time it was generated so far (OpenAI's frequency_penalty)."""
    logit_bias: dict[int, float] | None = None
    """Added to these ids' logits before sampling (greedy included)."""
    logprobs: int | None = None
    """Report each generated id's logprob and this many likeliest alternatives; None: none."""
    prompt_logprobs: int | None = None
    """The same for each prompt id after the first (scoring a text); None: none."""
    grammar: str | None = None
    """Constrain the reply to this grammar (model.grammar: a JSON schema's, a tool call's); None: none."""

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0 <= self.top_k < 2**31):
            raise ValueError(f"top_k must be in [0, 2**31), got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.seed is not None and not (-(2**63) <= self.seed < 2**64):
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not (-MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY):
                raise ValueError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {getattr(self, name)}")
        for i, b in (self.logit_bias or {}).items():
            if not (isinstance(i, int) and i >= 0):
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {i!r}")
            if not (-MAX_BIAS <= b <= MAX_BIAS):
                raise ValueError(f"logit_bias values must be in [-{MAX_BIAS}, {MAX_BIAS}], got {b} for {i}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a string, got {type(self.grammar).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not (0 <= n <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")

    @property
    def adjusts(self) -> bool:
        """Penalties or a bias change this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def extras(self) -> bool:
        """This request's decode steps need the extras sampler (`extras_step`)."""
        return self.adjusts or self.logprobs is not None


@dataclass
class Token:
    """One generated id. `forced` marks ids fed by a tool rather than sampled. With `logprobs` asked:
    its log-probability and the likeliest ids with theirs, best first."""
    id: int
    forced: bool = False
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class PromptLogprobs:
    """Sent before a request's first Token (or its Finished) when `prompt_logprobs` was asked: for each
    prompt id after the first, its log-probability given the ids before it, and the likeliest ids."""
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


@dataclass
class Finished:
    """Last event of a request. reason: 'stop' (a stop id), 'length', 'cancelled' or 'error'."""
    reason: str
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


def sampling_params(gen: dict, temperature=None, top_k=None, top_p=None, max_tokens=None,
                    seed=None, **extras) -> SamplingParams:
    """SamplingParams from the values given, generation.json's defaults (`gen`) for those left None.
    `extras`: the other SamplingParams fields (penalties, logit_bias, logprobs), which have no defaults
    in generation.json."""
    pick = lambda v, k: gen[k] if v is None else v  # noqa: E731
    return SamplingParams(temperature=float(pick(temperature, "temperature")),
                          top_k=int(pick(top_k, "top_k") or 0), top_p=float(pick(top_p, "top_p")),
                          max_tokens=int(pick(max_tokens, "max_tokens")), seed=seed, **extras)


Sink = Callable[[object], None]  # receives Token and finally one Finished
Tool = Callable[[list[int]], Sequence[int]]
