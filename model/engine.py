"""Generation engine: KV-cache prefill/decode, sampling and continuous batching, on token ids only.

The engine knows nothing about text. A caller hands it prompt ids and `SamplingParams`, and receives
the generated ids one event at a time through a `sink` callback; tokenizing, chat templates and stop
*strings* are the serving layer's business.

Continuous batching. One `KVCache` holds `max_batch` rows. The active sequences always occupy rows
0..n-1. Between decode steps the scheduler admits the waiting requests that fit into rows n..n+k-1 and
prefills them in one forward over `cache.view(n, n+k)` (k=1: a request alone in row n), then every
active row decodes together in one forward over `cache.view(0, n+k)`.
A finished or cancelled row leaves at once: the last active row is moved into its slot (`copy_row`), so
the rows stay contiguous and the next step is again one forward over rows 0..n-1.
A prompt longer than `prefill_chunk` is prefilled a chunk per scheduler step, so the rows already
decoding keep producing tokens in between; until its prompt is in, its row sits out of each decode.

No host synchronisation inside a step. The scheduler keeps every row's length on the host (`lens`), so
the forward is told how many cache slots to attend over instead of reading the lengths back from the
GPU. On CUDA a decode step is therefore a fixed sequence of kernels for a given (rows, slots) pair, and
is replayed from a CUDA graph captured once per bucket: rows rounded up to a power of two, slots to a
power of two (at least 64); FlexAttention then reads each row's filled blocks of those slots.
The one device-to-host copy per step is the sampled ids, which the scheduler needs to stream them.
A request admitted alone (the common case at idle) has its first chunk prefilled from a graph too, one
per prompt-length bucket (`DecodeGraphs.prefill`): otherwise its first token waits on the host's launch
work, several times the prefill's kernels.

Sampling. Each request owns a `torch.Generator` (seeded => the same request gives the same ids) from
which it draws its uniform numbers on the host, ahead of time in blocks; the batched sampler
(temperature, top-k, top-p) runs on the model's device and turns each row's number into a token by
inverse CDF, so a row's randomness never depends on its neighbours.

Extras: OpenAI's presence and frequency penalties, logit_bias and log-probabilities. They live on the
device too: per row, a count of each id generated so far and a dense bias row (`Engine.counts`,
`Engine.bias`, moved with their row), updated and applied inside the step, and each step's logprobs
come back in the same device-to-host copy as the sampled ids. A step whose rows ask for none of them
runs the plain sampler (its own CUDA graphs), so they cost such rows nothing. Logprobs are the
model's own distribution (log-softmax of its logits, before temperature, penalties and bias, as vLLM
reports by default); a prompt's logprobs (`prompt_logprobs`) come from its prefill.

Tools. If the model emits `tool_start ... tool_end` (the calculator call), the engine passes the ids in
between to the `tool` callback and force-feeds the ids it returns (e.g. <|output_start|> 4
<|output_end|>) before sampling again; the engine never sees the expression as text.
"""
from __future__ import annotations

import collections
import itertools
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from .gpt import KVCache


class EngineError(RuntimeError):
    pass


class QueueFull(EngineError):
    """The waiting queue holds `max_queue` requests already."""


class PromptTooLong(EngineError):
    """The prompt does not leave room for even one generated token in the context."""


class EngineStopped(EngineError):
    pass


MAX_LOGPROBS = 20
"""Most alternatives a request may ask for at each position (OpenAI's limit on top_logprobs)."""
MAX_PENALTY = 2.0
"""presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)."""
MAX_BIAS = 100.0
"""logit_bias values lie in [-MAX_BIAS, MAX_BIAS]; -100 bans a token (OpenAI's range and meaning)."""


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


Sink = Callable[[object], None]  # receives Token and finally one Finished
Tool = Callable[[list[int]], Sequence[int]]


# the most logits `sample` ranks by counting (k_max**2 comparisons a row); a larger k_max sorts them all.
# Decode graphs for rows whose top_k are all within it sample from this many (`DecodeGraphs`)
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


# the columns of a step's settings block, one row per sequence (`Engine._settings`)
TEMPERATURE, TOP_K, TOP_P, UNIFORM, PRESENCE, FREQUENCY, TARGET = range(7)
N_SETTINGS = 7
IDLE = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, -1.0]  # a row that rides along (prefilling): greedy, counts nothing


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


def extras_step(logits: torch.Tensor, st: torch.Tensor, counts: torch.Tensor, bias: torch.Tensor,
                ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampling with penalties, bias and logprobs for rows with settings `st` (B, N_SETTINGS).

    `ids` (B,), in a decode step, are the ids this step feeds: they are counted first (in place, in
    `counts`, for rows with a penalty), so `counts` holds every id generated before the one sampled
    now. Returns the sampled ids and `logprob_info` of each row's emitted id: the sampled one, or the
    id a tool forces (column TARGET, -1 when none)."""
    if ids is not None:
        counting = ((st[:, PRESENCE] != 0) | (st[:, FREQUENCY] != 0)).float()
        counts.scatter_add_(1, ids.view(-1, 1), counting[:, None])
    adjusted = adjust(logits.float(), counts, bias, st[:, PRESENCE], st[:, FREQUENCY])
    sampled = sample(adjusted, st[:, TEMPERATURE], st[:, TOP_K].long(), st[:, TOP_P], st[:, UNIFORM])
    target = st[:, TARGET].long()
    return sampled, logprob_info(logits, torch.where(target >= 0, target, sampled))


class Request:
    """A submitted generation. `cancel()` may be called from any thread."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: SamplingParams, sink: Sink, max_new: int):
        self.rid = next(Request._ids)
        self.prompt = prompt
        self.params = params
        self.sink = sink
        self.max_new = max_new  # max_tokens clipped to the room left in the context
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(params.seed)
        self._uniforms: list[float] = []
        self.generated = 0
        self.prefilled = 0  # prompt ids already in the cache
        self.last = -1  # the id to feed at the next decode step
        self.forced: collections.deque[int] = collections.deque()
        self.tool_buf: list[int] | None = None  # ids of a tool call being written
        self.prompt_lp: PromptLogprobs | None = PromptLogprobs([], []) if params.prompt_logprobs is not None else None
        self.cancelled = False
        self.done = False
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    def uniform(self) -> float:
        """The next number of this request's own random stream (drawn in blocks: one call per row and
        step would cost more host time than the GPU's whole decode step)."""
        if not self._uniforms:
            self._uniforms = torch.rand(64, generator=self.generator, dtype=torch.float64).tolist()[::-1]
        return self._uniforms.pop()


@dataclass
class EngineConfig:
    max_batch: int = 16
    """Rows of the KV cache: requests decoded together."""
    max_queue: int = 64
    """Requests allowed to wait for a row; one more is refused with QueueFull."""
    max_len: int | None = None
    """Context per sequence (prompt + generated); default: the model's training context."""
    stop_ids: tuple[int, ...] = ()
    """Ids that end a reply (not emitted), e.g. <|assistant_end|> and <|bos|>."""
    tool_start: int | None = None
    tool_end: int | None = None
    max_tool_ids: int = 64
    """A tool call longer than this is abandoned (the ids stay plain output)."""
    dtype: torch.dtype | None = None
    """KV-cache dtype; default: the model's parameter dtype."""
    prefill_chunk: int = 512
    """Prompt ids prefilled per request and scheduler step; longer prompts take several steps."""
    run_ahead: bool | None = None
    """Launch the next decode step before reading this one's ids back, when its inputs allow; None: on
    CUDA only (on a CPU nothing runs behind the host's back, so it would only add wasted steps)."""
    cuda_graphs: bool = True
    """On CUDA, replay decode steps from CUDA graphs (one per bucket of rows and cache slots), over
    blocks compiled with torch.compile."""


class Engine:
    """Continuous-batching generator over one model. `start()` runs the scheduler in a thread. On CUDA,
    building one turns cuDNN's SDPA kernel off for the whole process (why: in `__init__`), and one with
    graphs raises dynamo's recompile limit for the process (why: in `DecodeGraphs.__init__`)."""

    def __init__(self, model, config: EngineConfig, tool: Tool | None = None):
        self.model = model
        self.config = config
        self.tool = tool if config.tool_start is not None and config.tool_end is not None else None
        p = next(model.parameters())
        self.device = p.device
        self.max_len = min(config.max_len or model.config.seq_len, getattr(model, "rope_len", 1 << 30))
        graphs = config.cuda_graphs and self.device.type == "cuda"
        # the graphs' path compiles the blocks, so its cache is read by FlexAttention (DecodeGraphs says why)
        self.cache = KVCache(model.config, config.max_batch, self.max_len, self.device, config.dtype or p.dtype,
                             flex=graphs)
        self.lens = [0] * config.max_batch  # tokens each cache row holds (the host's copy: no reads back)
        # per row: how often each id was generated (penalties) and the logit bias; rows move with their
        # request. Read only by steps whose rows ask for extras (SamplingParams.extras)
        self.vocab_size = V = model.config.vocab_size
        self.counts = torch.zeros((config.max_batch, V), dtype=torch.float32, device=self.device)
        self.bias = torch.zeros((config.max_batch, V), dtype=torch.float32, device=self.device)
        if self.device.type == "cuda":
            # no cuDNN attention kernel in this process (what SDPA's masked calls, the path without
            # graphs, would pick): on the H200 it gave other bits for the same inputs (so seeded
            # requests were not repeatable) and read past an odd-length mask; the memory-efficient
            # kernel SDPA picks instead did neither (bench/results/serving.md, "Repeatability on the GPU"). A
            # process-wide flag: a context manager inside the compiled blocks ran slower end to end (there)
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.graphs = DecodeGraphs(self) if graphs else None
        self.run_ahead = self.device.type == "cuda" if config.run_ahead is None else config.run_ahead
        self.active: list[Request] = []
        self._inflight: _Step | None = None  # a decode step launched ahead, not yet collected
        self.waiting: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self.steps = 0  # decode steps run (for tests and metrics)
        self.steps_ahead = 0  # of which launched before the previous one's ids were read back
        self.cpu_seconds = 0.0  # CPU time of the scheduler thread (metrics: is the host keeping up?)
        self.stop_ids = set(config.stop_ids)

    # ---- public API (any thread) ----
    @property
    def queue_depth(self) -> int:
        return len(self.waiting)

    @property
    def num_active(self) -> int:
        return len(self.active)

    def submit(self, prompt: Sequence[int], params: SamplingParams, sink: Sink) -> Request:
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        V = self.vocab_size
        bad = next((t for t in prompt if not 0 <= t < V), None)  # an id past the vocabulary would crash a kernel
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary (0..{V - 1})")
        bad = next((t for t in params.logit_bias or {} if t >= V), None)
        if bad is not None:
            raise ValueError(f"logit_bias: token id {bad} is outside the vocabulary (0..{V - 1})")
        room = self.max_len - len(prompt)
        if room < (1 if params.max_tokens else 0):
            raise PromptTooLong(f"the prompt has {len(prompt)} tokens but the model's context is "
                                f"{self.max_len} tokens (at least one must be left for the reply)")
        req = Request(prompt, params, sink, min(params.max_tokens, room))
        with self._cv:
            if not self._running:
                raise EngineStopped("the engine is not running")
            if len(self.waiting) >= self.config.max_queue:
                raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting)")
            self.waiting.append(req)
            self._cv.notify()
        return req

    def cancel(self, req: Request) -> None:
        """Stop a request: a waiting one leaves the queue now, an active one frees its row before the
        next decode step. No further events reach its sink except, possibly, Finished('cancelled')."""
        req.cancel()
        with self._cv:
            try:
                self.waiting.remove(req)
            except ValueError:
                return
        self._finish(req, "cancelled")

    def start(self) -> "Engine":
        with self._cv:
            if self._running:
                return self
        if self.graphs is not None:
            with torch.inference_mode():  # the mode the scheduler runs in (compiled code is guarded on it)
                self.graphs.warmup()
        with self._cv:
            self._running = True
        self._thread = threading.Thread(target=self._loop, name="sparkchat-engine", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._running = False
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
        for req in list(self.waiting) + self.active:
            self._finish(req, "cancelled")
        self.waiting.clear()
        self.active.clear()

    def generate(self, prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], Finished]:
        """Blocking convenience: submit and wait. Returns (ids, Finished)."""
        out: list[int] = []
        done = threading.Event()
        box: list[Finished] = []

        def sink(ev):
            if isinstance(ev, Token):
                out.append(ev.id)
            else:
                box.append(ev)
                done.set()

        self.submit(prompt, params, sink)
        done.wait()
        return out, box[0]

    # ---- scheduler (engine thread) ----
    def _loop(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while self._running and not self.waiting and not self.active:
                        self._cv.wait()
                    if not self._running:
                        return
                try:
                    self._admit()
                    self._prefill_chunks()
                    self._evict()
                    if self._inflight is not None or any(not r.prefilling for r in self.active):
                        self._decode()
                        self._evict()
                except Exception as e:  # never let one bad step kill the server
                    for req in list(self.active):
                        self._finish(req, "error", f"{type(e).__name__}: {e}")
                    self.active.clear()
                    self._inflight = None
                    self.lens = [0] * self.config.max_batch
                self.cpu_seconds = time.thread_time()

    def _admit(self) -> None:
        """Move waiting requests into free rows n.. and prefill them together in one forward (a long
        prompt: its first chunk).

        Prompts are right-padded to the longest: causal attention keeps the padding from touching real
        tokens, each row's length is then set to its own prompt, and the padding's keys (beyond the
        length) stay masked until decoding overwrites them.
        """
        new: list[Request] = []
        with self._cv:
            while self.waiting and len(self.active) + len(new) < self.config.max_batch:
                req = self.waiting.popleft()
                if req.cancelled:
                    self._finish(req, "cancelled")
                else:
                    new.append(req)
        if not new:
            return
        start = len(self.active)
        chunks = [r.prompt[:self.config.prefill_chunk] for r in new]
        self._set_lens(start, [0] * len(new))
        for b, r in enumerate(new):
            self._reset_extras(start + b, r)
        if self.graphs is not None and self.graphs.can_prefill(new, chunks):
            logits = self.graphs.prefill(chunks[0], start)  # (1, 1, V): the last position's logits only
            lasts = [0]
        else:
            longest = max(len(c) for c in chunks)
            ids = torch.zeros((len(new), longest), dtype=torch.long)
            for b, c in enumerate(chunks):
                ids[b, :len(c)] = torch.tensor(c)
            logits = self.model(ids.to(self.device), kv_cache=self.cache.view(start, start + len(new)), kv_len=longest)
            lasts = [len(c) - 1 for c in chunks]
        self._set_lens(start, [len(c) for c in chunks])
        for b, (r, c) in enumerate(zip(new, chunks)):
            r.prefilled = len(c)
            self._record_prompt_logprobs(r, logits[b, :len(c)], 0)
        self.active.extend(new)
        ready = [b for b, r in enumerate(new) if not r.prefilling and self._prompt_read(r)]
        if ready:
            last = torch.tensor([lasts[b] for b in ready], device=self.device)
            rows = torch.tensor(ready, device=self.device)
            self._advance([new[b] for b in ready], logits[rows, last], rows=rows + start)

    def _prefill_chunks(self) -> None:
        """The next chunk of every prompt still being prefilled, one request at a time."""
        for row, req in enumerate(self.active):
            if not req.prefilling or req.done:
                continue
            chunk = req.prompt[req.prefilled:req.prefilled + self.config.prefill_chunk]
            ids = torch.tensor([chunk], dtype=torch.long, device=self.device)
            logits = self.model(ids, kv_cache=self.cache.view(row, row + 1), kv_len=self.lens[row] + len(chunk))
            self.lens[row] += len(chunk)
            self._record_prompt_logprobs(req, logits[0], req.prefilled)
            req.prefilled += len(chunk)
            if not req.prefilling and self._prompt_read(req):
                self._advance([req], logits[:, -1], rows=slice(row, row + 1))

    def _reset_extras(self, row: int, req: Request) -> None:
        """A new request's row: nothing generated yet, and its own logit bias (zero when none)."""
        self.counts[row].zero_()
        self.bias[row].zero_()
        if req.params.logit_bias:
            ids, values = zip(*req.params.logit_bias.items())
            self.bias[row, list(ids)] = torch.tensor(values, dtype=torch.float32).to(self.device)

    def _record_prompt_logprobs(self, req: Request, logits: torch.Tensor, start: int) -> None:
        """Logprobs of the prompt ids that the logits of prompt positions start.. predict."""
        if req.prompt_lp is None:
            return
        end = min(start + logits.shape[0], len(req.prompt) - 1)  # the last position predicts the reply
        if end <= start:
            return
        targets = torch.tensor(req.prompt[start + 1:end + 1], device=logits.device)
        info = logprob_info(logits[:end - start], targets, req.params.prompt_logprobs).tolist()
        for row in info:
            req.prompt_lp.logprobs.append(row[0])
            req.prompt_lp.top.append(self._top(row, req.params.prompt_logprobs))

    @staticmethod
    def _top(info_row: list[float], n: int) -> list[tuple[int, float]]:
        """The n likeliest (id, logprob) of a `logprob_info` row."""
        width = (len(info_row) - 1) // 2
        return [(int(i), lp) for i, lp in zip(info_row[1:1 + n], info_row[1 + width:1 + width + n])]

    def _prompt_read(self, req: Request) -> bool:
        """The whole prompt is in: send its logprobs if asked; False when the request ends here
        (max_tokens 0: it only scores the prompt)."""
        if req.prompt_lp is not None:
            self._emit(req, req.prompt_lp)
            req.prompt_lp = None
        if req.max_new == 0 and not req.done:
            self._finish(req, "length")
        return not req.done

    def _set_lens(self, start: int, lens: list[int]) -> None:
        self.lens[start:start + len(lens)] = lens
        self.cache.lengths[start:start + len(lens)] = torch.tensor(lens)

    def _decode(self) -> None:
        """Collect one decode step: the one already running ahead, or a new one. Before reading its
        results back, launch the next step when its input can be this one's sampled ids as they lie
        on the device (`_can_run_ahead`): the host then handles step N's tokens while the device
        computes step N+1, instead of the device waiting for the host between steps."""
        step, self._inflight = self._inflight, None
        if step is None:
            step = self._launch([r.last if not r.prefilling else 0 for r in self.active])
        if self._can_run_ahead(step):
            self._inflight = self._launch(step.sampled)
            self.steps_ahead += 1
        self._collect(step)

    def _can_run_ahead(self, step: "_Step") -> bool:
        """The next step's inputs are `step`'s sampled ids: the rows are the same requests, none of
        them prefilling or fed by a tool, and no waiting request is about to take a free row. A row
        that `step` finishes computes one wasted token in the next step, which is dropped."""
        return (self.run_ahead and self.active == step.reqs
                and not any(r.prefilling or r.forced or r.cancelled for r in self.active)
                and not (self.waiting and len(self.active) < self.config.max_batch))

    def _launch(self, ids: "list[int] | torch.Tensor") -> "_Step":
        """Start one decode step over every active row (ids: each row's input, on the host or as the
        previous step's sampled ids on the device). Rows still prefilling ride along (the batch keeps
        its shape) and are put back to their length; their slot gets overwritten later."""
        n = len(self.active)
        reqs = list(self.active)
        kv_len = max(self.lens[:n]) + 1
        settings = [IDLE if r.prefilling else self._settings(r) for r in reqs]  # IDLE draws no random number
        extras = any(r.params.extras and not r.prefilling for r in reqs)
        if self.graphs is not None:  # the forward and the sampling in one graph replay
            sampled, info = self.graphs.step(ids, settings, kv_len, extras)
        else:
            x = (ids if torch.is_tensor(ids) else torch.tensor(ids, dtype=torch.long, device=self.device)).view(n, 1)
            logits = self.model(x, kv_cache=self.cache.view(0, n), kv_len=kv_len)[:, -1]
            sampled, info = self._sample(logits, settings, extras, slice(0, n), x[:, 0])
        self.steps += 1
        for row, req in enumerate(reqs):
            if req.prefilling:
                self.cache.lengths[row] = self.lens[row]
            else:
                self.lens[row] += 1
        return _Step(reqs, sampled, info)

    def _collect(self, step: "_Step") -> None:
        ids, info = step.result()
        rows = [row for row, r in enumerate(step.reqs) if not r.prefilling]
        self._advance([step.reqs[r] for r in rows], sampled=[ids[r] for r in rows],
                      info=None if info is None else [info[r] for r in rows])

    @staticmethod
    def _settings(req: Request) -> list[float]:
        """A row's settings (the columns TEMPERATURE.. TARGET) with its next random number."""
        p = req.params
        return [p.temperature, p.top_k, p.top_p, req.uniform(), p.presence_penalty, p.frequency_penalty,
                req.forced[0] if req.forced else -1]

    def _sample(self, logits: torch.Tensor, settings: list[list[float]], extras: bool, rows,
                ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled ids (on the logits' device) for cache rows `rows` with these settings, in one
        host-to-device copy; with `extras`, through `extras_step` (`ids`: the inputs a decode step
        counts), which also gives each row's `logprob_info`."""
        st = torch.tensor(settings, dtype=torch.float32).to(logits.device, non_blocking=True)
        if extras:
            return extras_step(logits, st, self.counts[rows], self.bias[rows], ids)
        return sample(logits, st[:, TEMPERATURE], st[:, TOP_K].long(), st[:, TOP_P], st[:, UNIFORM],
                      top_k_bound(settings)), None

    def _advance(self, reqs: list[Request], logits: torch.Tensor | None = None, rows=None,
                 sampled: list[int] | None = None, info: list[list[float]] | None = None) -> None:
        """Pick each row's next id (forced, or sampled from its logits, of cache rows `rows`, unless
        given with their `info`) and emit it."""
        if sampled is None:
            extras = any(r.params.extras for r in reqs)
            ids, info = self._sample(logits, [self._settings(r) for r in reqs], extras, rows)
            sampled, info = ids.tolist(), None if info is None else info.tolist()
        for i, (req, tok) in enumerate(zip(reqs, sampled)):
            if req.done:
                continue
            if req.cancelled:
                self._finish(req, "cancelled")
                continue
            forced = bool(req.forced)
            if forced:
                tok = req.forced.popleft()
            elif tok in self.stop_ids:
                self._finish(req, "stop")
                continue
            req.last = tok
            req.generated += 1
            event = Token(tok, forced)
            if req.params.logprobs is not None and info is not None:
                event.logprob, event.top = info[i][0], self._top(info[i], req.params.logprobs)
            if not self._emit(req, event):
                continue
            if not forced and self.tool is not None:
                self._track_tool(req, tok)
            if req.generated >= req.max_new:
                self._finish(req, "length")

    def _track_tool(self, req: Request, tok: int) -> None:
        c = self.config
        if tok == c.tool_start:
            req.tool_buf = []
        elif req.tool_buf is not None:
            if tok == c.tool_end:
                expr, req.tool_buf = req.tool_buf, None
                try:
                    req.forced.extend(int(t) for t in self.tool(expr))
                except Exception:
                    pass  # a failing tool feeds nothing; the model carries on
            else:
                req.tool_buf.append(tok)
                if len(req.tool_buf) > c.max_tool_ids:
                    req.tool_buf = None

    def _emit(self, req: Request, ev) -> bool:
        try:
            req.sink(ev)
            return True
        except Exception:  # the consumer is gone: drop the request
            req.cancelled = True
            self._finish(req, "cancelled")
            return False

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.done:
            return
        req.done = True
        try:
            req.sink(Finished(reason, len(req.prompt), req.generated, error))
        except Exception:
            pass

    def _evict(self) -> None:
        """Drop finished/cancelled rows, moving the last active row into each freed slot."""
        i = 0
        while i < len(self.active):
            req = self.active[i]
            if req.cancelled and not req.done:
                self._finish(req, "cancelled")
            if req.done:
                last = len(self.active) - 1
                if i != last:
                    self.cache.copy_row(last, i, self.lens[last])
                    self.counts[i] = self.counts[last]
                    self.bias[i] = self.bias[last]
                    self.lens[i] = self.lens[last]
                    self.active[i] = self.active[last]
                self.cache.reset_row(last)
                self.lens[last] = 0
                self.active.pop()
            else:
                i += 1


class _Step:
    """A launched decode step: the requests by row at launch, and their sampled ids (and, with extras,
    `logprob_info`) on the device, being copied to the host (pinned memory, so the copy runs behind
    the step; one wait for both)."""

    def __init__(self, reqs: list[Request], sampled: torch.Tensor, info: torch.Tensor | None = None):
        self.reqs, self.sampled = reqs, sampled
        if sampled.is_cuda:
            self.host, self.host_info = self._pinned(sampled), None if info is None else self._pinned(info)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host, self.host_info, self.ready = sampled, info, None

    @staticmethod
    def _pinned(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    def result(self) -> tuple[list[int], list[list[float]] | None]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist(), None if self.host_info is None else self.host_info.tolist()


class DecodeGraphs:
    """Decode steps, and the prefill of one request's first chunk, replayed from CUDA graphs.

    Decode: one graph per bucket (rows rounded up to a power of two, cache slots to a power of two of at
    least 64, and whether every row's top_k is within RANKED_K, so that only that many logits are
    sorted, or whether a row asks for extras: then `extras_step`, sorting all), all captured when the
    engine starts.

    A graph holds the whole step: the forward over cache rows 0..B-1 and slots 0..L-1 of the engine's
    one cache (whose storage never moves) and the sampling, reading ids and sampling settings from
    fixed buffers and writing the sampled ids to a fixed output. The blocks, the head and the sampler
    are compiled first (`torch.compile`, dynamic shapes: a compile serves many buckets), so a step is
    a few fused kernels per layer rather than dozens of small ones. The cache is read by FlexAttention
    (`KVCache.flex`), compiled with the blocks: it visits only the 128-slot blocks each row has
    filled and gave the same bits for the same inputs; SDPA's masked kernels read every slot of the
    bucket, cuDNN's was not repeatable and the memory-efficient one made the step slower at every batch
    size tried (bench/results/serving.md, "The cache read by FlexAttention"). Rows past the active ones are free:
    their length is set to 0 before a replay, so what the graph writes there is harmless (a row is
    reset when a request takes it).

    Prefill: a request admitted alone (the usual case at idle, where its first token's latency is the
    prefill's host time: several times its kernels' time for a short prompt on the H200,
    bench/results/serving.md, "Time to first token") and asking no prompt logprobs has its first chunk,
    right-padded to a power of two (16..PREFILL_MAX), prefilled by one replay into a scratch cache
    row, then copied into its own row; causal attention keeps the padding from touching the prompt.
    """

    PREFILL_MAX = 512  # longest first chunk prefilled from a graph (a bucket's logits: T x vocab fp32)

    def __init__(self, engine: "Engine", compile_blocks: bool = True):
        self.engine = engine
        n, dev = engine.config.max_batch, engine.device
        self.ids = torch.zeros((n, 1), dtype=torch.long, device=dev)
        self.settings = torch.zeros((n, N_SETTINGS), dtype=torch.float32, device=dev)
        # pinned, so each step's inputs go over asynchronously; two, taken in turn: a step launched
        # ahead fills one while the copy out of the other may still wait behind the running step
        self.hosts = [torch.zeros((n, 1 + N_SETTINGS), dtype=torch.float32, pin_memory=dev.type == "cuda")
                      for _ in range(2)]
        self.turn = 0
        # (rows, slots, k_max, extras) -> (graph, sampled ids, logprob_info or None)
        self.graphs: dict[tuple[int, int, int, bool], tuple] = {}
        self.pool = None
        self.sample = sample
        self.eager_k: set[int] = set()  # k_max values whose sampler compile failed: eager for them
        self.prefill_max = min(engine.config.prefill_chunk, self.PREFILL_MAX, engine.max_len)
        self.prefill_top = self._bucket(self.prefill_max, 16, self.PREFILL_MAX)  # the longest padded chunk
        self.scratch = KVCache(engine.model.config, 1, self.prefill_top, dev, engine.cache.k[0].dtype,
                               flex=engine.cache.flex)
        self.prefill_ids = torch.zeros((1, self.prefill_top), dtype=torch.long, device=dev)
        self.prefill_last = torch.zeros(1, dtype=torch.long, device=dev)
        self.prefills: dict[int, tuple] = {}  # padded length -> (graph, last position's logits)
        self.prefill_replays = 0
        if compile_blocks:
            # block by block (the twenty blocks share each compile): the whole forward as one compile
            # fuses a little more but took minutes to compile for every bucket
            # (bench/results/serving.md, "One decode step")
            model = engine.model
            # one compile per kind of call the buckets make (one row or more, one new token, under 128 or
            # more, the cache's whole length or less): more than dynamo's default limit of 8
            # (bench/results/serving.md, "The cache read by FlexAttention"), past which a block runs uncompiled (and
            # FlexAttention as its reference: `KVCache`)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            for block in model.blocks:
                block.compile(dynamic=True)
            model.head = torch.compile(model.head, dynamic=True)
            self.sample = torch.compile(sample, dynamic=True)

    @staticmethod
    def _bucket(n: int, floor: int, limit: int) -> int:
        """n rounded up to a power of two (at least `floor`), capped at `limit`."""
        return min(max(floor, 1 << (n - 1).bit_length()), limit)

    @classmethod
    def _buckets(cls, floor: int, limit: int) -> list[int]:
        """Every value `_bucket` can give for n in 1..limit."""
        return sorted({cls._bucket(n, floor, limit) for n in (1 << k for k in range(limit.bit_length() + 1))})

    def step(self, ids: "list[int] | torch.Tensor", settings: list[list[float]], kv_len: int,
             extras: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Replay the step's graph; returns the sampled ids and, with extras, their `logprob_info` (on
        the device, valid until the next replay of the same graph: `_Step` copies them out first)."""
        e = self.engine
        n = len(settings)
        rows = self._bucket(n, 1, e.config.max_batch)
        slots = self._bucket(kv_len, 64, e.max_len)
        k_max = RANKED_K if not extras and 0 < top_k_bound(settings) <= RANKED_K else 0
        host = self.hosts[self.turn]
        self.turn ^= 1
        if torch.is_tensor(ids):  # the previous step's sampled ids, still on the device
            self.ids[:n, 0].copy_(ids)
            host[:n, 0] = 0
        else:
            host[:n, 0] = torch.tensor(ids, dtype=torch.float32)  # ids < 2**24: exact in fp32
        host[:n, 1:] = torch.tensor(settings, dtype=torch.float32)
        staged = host[:n].to(e.device, non_blocking=True)
        if not torch.is_tensor(ids):
            self.ids[:n, 0] = staged[:, 0].long()
        self.settings[:n] = staged[:, 1:]
        if rows > n:
            e.cache.lengths[n:rows].zero_()
        key = (rows, slots, k_max, extras)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, out, info = self.graphs[key]
        graph.replay()
        return out[:n], None if info is None else info[:n]

    def can_prefill(self, new: list[Request], chunks: list[list[int]]) -> bool:
        """Whether this admission's prefill can be a graph replay: one request, a first chunk of at most
        prefill_max ids, and no prompt logprobs (they need every position's logits)."""
        return len(new) == 1 and new[0].prompt_lp is None and len(chunks[0]) <= self.prefill_max

    def prefill(self, ids: list[int], row: int) -> torch.Tensor:
        """Prefill `ids` (the first chunk of a prompt) into cache row `row` (its length is set by the
        caller); returns the last position's logits (1, 1, V), valid until the next prefill."""
        n = len(ids)
        T = self._bucket(n, 16, self.prefill_top)
        self.prefill_ids[0, :n] = torch.tensor(ids)
        self.prefill_last.fill_(n - 1)
        if T not in self.prefills:
            self.prefills[T] = self._capture_prefill(T)
        graph, logits = self.prefills[T]
        graph.replay()
        e, s = self.engine, self.scratch
        torch._foreach_copy_([t[row:row + 1, :, :n] for t in e.cache.k + e.cache.v], [t[:, :, :n] for t in s.k + s.v])
        self.prefill_replays += 1
        return logits

    def warmup(self) -> None:
        """Compile the blocks for prefill shapes and capture every prefill and decode bucket now, so
        that no request waits for a compile or a capture. Most of a GPU engine's start, so it shows a
        progress bar with an ETA on stderr (the compiles come first: the early ETA runs long)."""
        e = self.engine
        prefills = [T for T in self._buckets(16, self.prefill_top) if T not in self.prefills]
        decodes = [key for rows in self._buckets(1, e.config.max_batch) for slots in self._buckets(64, e.max_len)
                   for key in ((rows, slots, RANKED_K, False), (rows, slots, 0, False), (rows, slots, 0, True))
                   if key not in self.graphs]
        with tqdm(total=2 + len(prefills) + len(decodes), desc="engine warm-up: compile, capture graphs",
                  unit="graph", file=sys.stderr, mininterval=2.0) as bar:
            for b in (1, 2):
                e.cache.lengths.zero_()  # kv_len bounds every row's length after the call
                view = e.cache.view(0, b)
                e.model(torch.zeros((b, 8), dtype=torch.long, device=e.device), kv_cache=view, kv_len=8)
                bar.update()
            e.cache.lengths.zero_()
            for T in prefills:
                self.prefills[T] = self._capture_prefill(T)
                bar.update()
            for key in decodes:
                self.graphs[key] = self._capture(*key)
                bar.update()

    def _sample(self, logits, temperature, top_k, top_p, uniform, k_max: int):
        """The compiled sampler, or the eager one for a k_max whose compile failed (with a warning:
        slower steps rather than no server). On the H200, Inductor failed on the whole-vocabulary
        sort's cumulative sum (a SplitScan codegen error) at some row counts of max_batch 16."""
        args = (logits, temperature, top_k, top_p, uniform, k_max)
        if self.sample is not sample and k_max not in self.eager_k:
            try:
                return self.sample(*args)
            except Exception as e:
                # imported here: torch._inductor costs about a second at import, and is loaded by now
                from torch._inductor.exc import InductorError
                if not isinstance(e, InductorError):
                    raise
                warnings.warn(f"torch.compile failed on the sampler (k_max {k_max}), which runs uncompiled "
                              f"for it: {str(e)[:300]}")
                self.eager_k.add(k_max)
        return sample(*args)

    def _capture(self, rows: int, slots: int, k_max: int, extras: bool):
        e = self.engine
        view = e.cache.view(0, rows)
        saved = view.lengths.clone()
        saved_counts = e.counts[:rows].clone() if extras else None
        s = self.settings[:rows]

        def step():
            logits = e.model(self.ids[:rows], kv_cache=view, kv_len=slots)[:, -1]
            if extras:
                return extras_step(logits, s, e.counts[:rows], e.bias[:rows], self.ids[:rows, 0])
            return self._sample(logits, s[:, TEMPERATURE], s[:, TOP_K].long(), s[:, TOP_P], s[:, UNIFORM], k_max), None

        def put_back():  # what the warm-up advanced: the cache lengths, and the counts it added to
            view.lengths.copy_(saved)
            if extras:
                e.counts[:rows].copy_(saved_counts)

        graph, (out, info) = self._graph(step, put_back)
        return graph, out, info

    def _capture_prefill(self, T: int):
        s = self.scratch

        def step():
            s.lengths.zero_()
            logits = self.engine.model(self.prefill_ids[:, :T], kv_cache=s, kv_len=T)
            return logits[0].index_select(0, self.prefill_last)[None]

        return self._graph(step, s.lengths.zero_)

    def _graph(self, step, put_back):
        """A CUDA graph of `step()` (in the engine's one graph memory pool) and what it returns."""
        e = self.engine
        # warm up on a side stream (compiles; cuBLAS picks its kernels), then capture
        stream = torch.cuda.Stream(e.device)
        stream.wait_stream(torch.cuda.current_stream(e.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
                put_back()
        torch.cuda.current_stream(e.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        put_back()
        return graph, out
