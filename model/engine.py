"""The scheduler: continuous batching over one KV cache, on token ids only.

The engine knows nothing about text. A caller hands it prompt ids and `SamplingParams`, and receives
the generated ids one event at a time through a `sink` callback; tokenizing, chat templates and stop
*strings* are the serving layer's business.

Continuous batching. One `KVCache` holds `max_batch` rows. The active sequences always occupy rows
0..n-1. Between decode steps the scheduler admits the waiting requests that fit into rows n..n+k-1 and
prefills them in one forward over `cache.view(n, n+k)` (k=1: a request alone in row n; requests of one
prompt run one row of it, which the others copy), then every active row decodes together in one forward
over `cache.view(0, n+k)`.
Finished and cancelled rows leave at once: the active rows past the end of those that stay move into
their slots, all in one copy a layer (`copy_rows`), so the rows stay contiguous and the next step is
again one forward over rows 0..n-1.
A prompt longer than `prefill_chunk` is prefilled a chunk per scheduler step, so the rows already
decoding keep producing tokens in between; until its prompt is in, its row sits out of each decode.

No host synchronisation inside a step. The scheduler keeps every row's length on the host (`lens`), so
the forward is told how many cache slots to attend over instead of reading the lengths back from the
GPU, and on CUDA a decode step can be replayed from a graph (`model.decode_graphs`). The one
device-to-host copy per step is the sampled ids (and, with extras, their logprobs), which the
scheduler needs to stream them.

Sampling (`model.sampling`) runs inside the step, each row with its request's settings and random
stream. The extras' per-row buffers move with their row; a step whose rows ask for no extras runs the
plain sampler (its own CUDA graphs), so they cost such rows nothing. A prompt's logprobs
(`prompt_logprobs`) come from its prefill.

Grammars. A request whose params carry a `grammar` gets a `model.grammar.Constraint` from the engine's
`grammars` callback at submit; before each of its tokens the ids the grammar forbids are masked out of its
row's logits on the host's say (`mask_rows`; under CUDA graphs, written into the extras' mask rows, and
the step replays the extras' graph), and the token it takes advances it. A step with such a row is not
run ahead (its mask needs the previous token); steps without one are unchanged.

Tools. If the model emits `tool_start ... tool_end` (the calculator call), the engine passes the ids in
between to the `tool` callback and force-feeds the ids it returns (e.g. <|output_start|> 4
<|output_end|>) before sampling again; the engine never sees the expression as text.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .decode_graphs import DecodeGraphs, LaunchedStep
from .gpt import KVCache
from .grammar import Constraint, mask_rows, write_masks
from .requests import (MAX_BATCH, MAX_QUEUE, EngineStopped, Finished, PromptLogprobs, PromptTooLong, QueueFull, SamplingParams, Sink,
                       Token, Tool)
from .sampling import IDLE, ExtrasBuffers, Uniforms, logprob_info, sample_rows, settings_row, top_alternatives

PHASES = ("hooks", "admit", "decode", "wait")
"""Engine.phase_seconds' keys: the step's hooks (before_step, after_step: a server's channel), admitting
and prefilling requests (with evicting rows before the decode), the decode step (launch, read back,
events, evictions) and, within it, the wait for the device's sampled ids."""


class Request:
    """A submitted generation. `cancel()` may be called from any thread."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], params: SamplingParams, sink: Sink, max_new: int):
        self.rid = next(Request._ids)
        self.prompt = prompt
        self.params = params
        self.sink = sink
        self.max_new = max_new  # max_tokens clipped to the room left in the context
        self.uniforms = Uniforms(params.seed)
        self.generated = 0
        self.prefilled = 0  # prompt ids already in the cache
        self.last = -1  # the id to feed at the next decode step
        self.forced: collections.deque[int] = collections.deque()
        self.tool_buf: list[int] | None = None  # ids of a tool call being written
        self.constraint: Constraint | None = None  # the grammar its reply must follow (params.grammar)
        self.prompt_lp: PromptLogprobs | None = PromptLogprobs([], []) if params.prompt_logprobs is not None else None
        self.cancelled = False
        self.done = False
        self.submitted_at = time.perf_counter()

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def prefilling(self) -> bool:
        return self.prefilled < len(self.prompt)

    def settings(self) -> list[float]:
        """This request's row of a step's settings block, with its next random number."""
        return settings_row(self.params, self.uniforms.next(), self.forced[0] if self.forced else -1)


@dataclass
class EngineConfig:
    max_batch: int = MAX_BATCH
    max_queue: int = MAX_QUEUE
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

    def __init__(self, model, config: EngineConfig, tool: Tool | None = None,
                 grammars: Callable[[str], Constraint] | None = None):
        self.model = model
        self.config = config
        self.tool = tool if config.tool_start is not None and config.tool_end is not None else None
        self.grammars = grammars  # grammar -> Constraint (model.grammar.Grammars); None: grammars refused
        p = next(model.parameters())
        self.device = p.device
        self.max_len = min(config.max_len or model.config.seq_len, getattr(model, "rope_len", 1 << 30))
        graphs = config.cuda_graphs and self.device.type == "cuda"
        # the graphs' path compiles the blocks, so its cache is read by FlexAttention (DecodeGraphs says why)
        self.cache = KVCache(model.config, config.max_batch, self.max_len, self.device, config.dtype or p.dtype,
                             flex=graphs)
        self.lens = [0] * config.max_batch  # tokens each cache row holds (the host's copy: no reads back)
        self.vocab_size = model.config.vocab_size
        # read only by steps whose rows ask for extras (SamplingParams.extras)
        self.extras_buffers = ExtrasBuffers.zeros(config.max_batch, self.vocab_size, self.device)
        if self.device.type == "cuda":
            # no cuDNN attention kernel in this process (what SDPA's masked calls, the path without
            # graphs, would pick): on the H200 it gave other bits for the same inputs (so seeded
            # requests were not repeatable) and read past an odd-length mask; the memory-efficient
            # kernel SDPA picks instead did neither (bench/results/serving.md, "Repeatability on the GPU"). A
            # process-wide flag: a context manager inside the compiled blocks ran slower end to end (there)
            torch.backends.cuda.enable_cudnn_sdp(False)
        self.graphs = DecodeGraphs(model, self.cache, self.extras_buffers, config.prefill_chunk) if graphs else None
        self.run_ahead = self.device.type == "cuda" if config.run_ahead is None else config.run_ahead
        self.active: list[Request] = []
        self._inflight: LaunchedStep | None = None  # a decode step launched ahead, not yet collected
        self.waiting: collections.deque[Request] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._running = False
        self.steps = 0  # decode steps run (for tests and metrics)
        self.steps_ahead = 0  # of which launched before the previous one's ids were read back
        self.cpu_seconds = 0.0  # CPU time of the scheduler thread (metrics: is the host keeping up?)
        self.step_cpu_seconds = 0.0  # of which inside the steps themselves (not after_step, not idle waits)
        # wall time of the scheduler thread by phase of its steps (where a step's time goes; `decode`
        # includes `wait`, the host waiting for the device's sampled ids), and the admissions' prefills
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.admissions = 0  # prefills of waiting requests (one forward or graph replay each)
        self.admitted_rows = 0  # the requests they took in
        self.before_step: Callable[[], None] | None = None
        """Called on the scheduler thread before each step (the server reads its front ends' commands)."""
        self.after_step: Callable[[], None] | None = None
        """Called on the scheduler thread after each step (the server sends that step's events on)."""
        self.on_idle: Callable[[], None] | None = None
        """Called on the scheduler thread when it runs out of work, before it waits for more."""
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
        if params.grammar is not None:
            if self.grammars is None:
                raise ValueError("this engine takes no grammars")
            req.constraint = self.grammars(params.grammar)  # a GrammarError is a ValueError: refused
        with self._cv:
            if not self._running:
                raise EngineStopped("the engine is not running")
            if len(self.waiting) >= self.config.max_queue:
                raise QueueFull(f"the queue is full ({self.config.max_queue} requests waiting)")
            self.waiting.append(req)
            self._cv.notify()
        return req

    def submit_all(self, requests: Sequence[tuple[Sequence[int], SamplingParams, Sink]]) -> list[Request]:
        """Submit (prompt, params, sink) triples at once, all or none: the scheduler sees none of them before
        the last is queued, so on an idle engine the batches they run in follow from the requests alone, not
        from thread timing, and seeded requests give the same ids on every run (RL rollouts resume
        bit-exactly); one refused (QueueFull, PromptTooLong, ValueError) leaves none of them queued."""
        with self._cv:  # a Condition's lock is reentrant: each submit takes it again
            queued: list[Request] = []
            try:
                for r in requests:
                    queued.append(self.submit(*r))
            except BaseException:
                for req in queued:  # (the scheduler has not seen them: it waits for this lock)
                    self.waiting.remove(req)
                raise
            return queued

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
                if self.on_idle is not None and not self.waiting and not self.active:
                    self.on_idle()
                with self._cv:
                    while self._running and not self.waiting and not self.active:
                        self._cv.wait()
                    if not self._running:
                        return
                clock, t0 = self.phase_seconds, time.perf_counter()
                if self.before_step is not None:
                    self.before_step()
                t = time.thread_time()
                t1 = time.perf_counter()
                try:
                    self._admit()
                    self._prefill_chunks()
                    self._evict()
                    t2 = time.perf_counter()
                    clock["admit"] += t2 - t1
                    if self._inflight is not None or any(not r.prefilling for r in self.active):
                        self._decode()
                        self._evict()
                        clock["decode"] += time.perf_counter() - t2
                except Exception as e:  # never let one bad step kill the server
                    for req in list(self.active):
                        self._finish(req, "error", f"{type(e).__name__}: {e}")
                    self.active.clear()
                    self._inflight = None
                    self.lens = [0] * self.config.max_batch
                self.cpu_seconds = time.thread_time()
                self.step_cpu_seconds += self.cpu_seconds - t
                clock["hooks"] += t1 - t0
                if self.after_step is not None:
                    t3 = time.perf_counter()
                    self.after_step()
                    clock["hooks"] += time.perf_counter() - t3

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
        self.admissions += 1
        self.admitted_rows += len(new)
        # requests of one prompt (an RL group's samples, a request's `n` choices) are prefilled once: each
        # prompt's first request runs in the forward, the others then copy its cache row (`src`: the row
        # whose logits and cache each request takes). The firsts go first: the forward's rows are contiguous
        firsts, copies, src, row_of = [], [], [], {}
        for r in new:
            key = tuple(r.prompt[:self.config.prefill_chunk])
            if key in row_of:
                copies.append(r)
                src.append(row_of[key])
            else:
                row_of[key] = len(firsts)
                firsts.append(r)
        new, src = firsts + copies, list(range(len(firsts))) + src
        start = len(self.active)
        self.active.extend(new)  # before the forward: if it fails, `_loop` ends them with the rest
        chunks = [r.prompt[:self.config.prefill_chunk] for r in new]
        self._set_lens(start, [0] * len(new))
        self.extras_buffers.reset_rows(start, [r.params.logit_bias for r in new])
        if self.graphs is not None and self.graphs.can_prefill(chunks, any(r.prompt_lp is not None for r in new)):
            logits = self.graphs.prefill(chunks[0], start)  # (1, 1, V): the last position's logits only
            lasts = [0]
        else:
            n = len(firsts)  # the rows the forward runs
            longest = max(len(c) for c in chunks[:n])
            ids = torch.zeros((n, longest), dtype=torch.long)
            for b, c in enumerate(chunks[:n]):
                ids[b, :len(c)] = torch.tensor(c)
            logits = self.model(ids.to(self.device), kv_cache=self.cache.view(start, start + n), kv_len=longest)
            if n < len(new):  # a copy holds its source's prompt: slots past its length are never read
                self.cache.copy_rows([start + s for s in src[n:]], list(range(start + n, start + len(new))),
                                     max(len(c) for c in chunks[n:]))
            lasts = [len(c) - 1 for c in chunks]
        self._set_lens(start, [len(c) for c in chunks])
        for b, (r, c) in enumerate(zip(new, chunks)):
            r.prefilled = len(c)
            self._record_prompt_logprobs(r, logits[src[b], :len(c)], 0)
        ready = [b for b, r in enumerate(new) if not r.prefilling and self._prompt_read(r)]
        if ready:
            last = torch.tensor([lasts[b] for b in ready], device=self.device)
            rows = torch.tensor(ready, device=self.device)
            self._advance([new[b] for b in ready], logits[torch.tensor([src[b] for b in ready], device=self.device), last],
                          rows=rows + start)

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
            req.prompt_lp.top.append(top_alternatives(row, req.params.prompt_logprobs))

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

    def _can_run_ahead(self, step: "LaunchedStep") -> bool:
        """The next step's inputs are `step`'s sampled ids: the rows are the same requests, none of
        them prefilling or fed by a tool, and no waiting request is about to take a free row. A row
        that `step` finishes computes one wasted token in the next step, which is dropped."""
        return (self.run_ahead and self.active == step.reqs
                and not any(r.prefilling or r.forced or r.cancelled or r.constraint for r in self.active)
                and not (self.waiting and len(self.active) < self.config.max_batch))

    def _launch(self, ids: "list[int] | torch.Tensor") -> "LaunchedStep":
        """Start one decode step over every active row (ids: each row's input, on the host or as the
        previous step's sampled ids on the device). Rows still prefilling ride along (the batch keeps
        its shape) and are put back to their length; their slot gets overwritten later."""
        n = len(self.active)
        reqs = list(self.active)
        kv_len = max(self.lens[:n]) + 1
        settings = [IDLE if r.prefilling else r.settings() for r in reqs]  # IDLE draws no random number
        extras = any(r.params.extras and not r.prefilling for r in reqs)
        constrained = [(row, r.constraint) for row, r in enumerate(reqs) if r.constraint and not r.prefilling]
        if self.graphs is not None:  # the forward and the sampling in one graph replay
            # a grammar's masks go in through the extras' mask rows, which that graph adds to the logits
            write_masks(self.extras_buffers.mask, constrained)
            sampled, info = self.graphs.step(ids, settings, kv_len, extras or bool(constrained))
        else:
            x = (ids if torch.is_tensor(ids) else torch.tensor(ids, dtype=torch.long, device=self.device)).view(n, 1)
            logits = self.model(x, kv_cache=self.cache.view(0, n), kv_len=kv_len)[:, -1]
            mask_rows(logits, constrained)
            sampled, info = sample_rows(logits, settings, self.extras_buffers if extras else None, slice(0, n), x[:, 0])
        self.steps += 1
        for row, req in enumerate(reqs):
            if req.prefilling:
                self.cache.lengths[row] = self.lens[row]
            else:
                self.lens[row] += 1
        return LaunchedStep(reqs, sampled, info)

    def _collect(self, step: "LaunchedStep") -> None:
        t = time.perf_counter()
        ids, info = step.result()
        self.phase_seconds["wait"] += time.perf_counter() - t
        rows = [row for row, r in enumerate(step.reqs) if not r.prefilling]
        self._advance([step.reqs[r] for r in rows], sampled=[ids[r] for r in rows],
                      info=None if info is None else [info[r] for r in rows])

    def _advance(self, reqs: list[Request], logits: torch.Tensor | None = None, rows=None,
                 sampled: list[int] | None = None, info: list[list[float]] | None = None) -> None:
        """Pick each row's next id (forced, or sampled from its logits, of cache rows `rows`, unless
        given with their `info`) and emit it."""
        if sampled is None:
            mask_rows(logits, [(i, r.constraint) for i, r in enumerate(reqs) if r.constraint])
            extras = any(r.params.extras for r in reqs)
            ids, info = sample_rows(logits, [r.settings() for r in reqs], self.extras_buffers if extras else None, rows)
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
            if req.constraint is not None and not forced and not req.constraint.accept(tok):
                self._finish(req, "error", f"the grammar refused token {tok}: {req.constraint.error}")
                continue
            req.last = tok
            req.generated += 1
            event = Token(tok, forced)
            if req.params.logprobs is not None and info is not None:
                event.logprob, event.top = info[i][0], top_alternatives(info[i], req.params.logprobs)
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
        """Drop finished/cancelled rows. The n rows that stay keep rows 0..n-1: each freed row below n,
        lowest first, takes the last staying row above n, all copied in one go. (A copy a row was two
        kernels a layer: a wave of 128 streams ending cost thousands of launches, and its next requests
        waited for them.)"""
        for req in self.active:
            if req.cancelled and not req.done:
                self._finish(req, "cancelled")
        total = len(self.active)
        stay = [i for i, r in enumerate(self.active) if not r.done]
        if len(stay) == total:
            return
        n = len(stay)
        holes = [i for i in range(n) if self.active[i].done]
        movers = [i for i in reversed(stay) if i >= n]  # as many as holes
        if movers:  # the rows as index tensors once, for the cache and the extras alike
            moved, freed = torch.tensor(movers, device=self.device), torch.tensor(holes, device=self.device)
            self.cache.copy_rows(moved, freed, max(self.lens[i] for i in movers))
            self.extras_buffers.move_rows(moved, freed)
            for src, dst in zip(movers, holes):
                self.lens[dst], self.active[dst] = self.lens[src], self.active[src]
        self.cache.lengths[n:total] = 0
        self.lens[n:total] = [0] * (total - n)
        del self.active[n:]
