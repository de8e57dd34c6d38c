"""The CUDA-graph decode runner: decode steps, and a lone request's first prefill chunk, replayed from
CUDA graphs captured when the engine starts.

A decode step reads nothing back from the GPU (`model.engine` says how), so for a given number of rows
and cache slots it is a fixed sequence of kernels: captured once per bucket of those, it is replayed
in one launch instead of the host launching each kernel. The runner is given what its graphs read and
write (the model, the engine's one KV cache and the extras' per-row `ExtrasBuffers`), not the engine.
A launched step's results, from a replay or the plain forward, reach the host through `LaunchedStep`.
"""
from __future__ import annotations

import sys
import warnings

import torch
from tqdm import tqdm

from . import gpt
from .gpt import KVCache
from .sampling import (N_SETTINGS, RANKED_K, TEMPERATURE, TOP_K, TOP_P, UNIFORM, ExtrasBuffers, extras_step, sample,
                       top_k_bound)


class DecodeGraphs:
    """One engine's graphs: their fixed input buffers, their capture and their replay.

    Decode: one graph per bucket (rows rounded up to a power of two, cache slots to a power of two of at
    least 64, and whether every row's top_k is within RANKED_K, so that only that many logits are
    sorted, or whether a row asks for extras: then `extras_step`, sorting all).

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

    def __init__(self, model, cache: KVCache, extras: ExtrasBuffers, prefill_chunk: int, compile_blocks: bool = True):
        """`cache`: the engine's, whose rows and length bound the buckets; `extras`: its extras' buffers,
        a row per cache row; `prefill_chunk`: the longest first chunk the engine prefills."""
        self.model, self.cache, self.extras = model, cache, extras
        self.max_batch, self.max_len = cache.batch, cache.max_len
        self.device = dev = cache.lengths.device
        n = self.max_batch
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
        self.prefill_max = min(prefill_chunk, self.PREFILL_MAX, self.max_len)
        self.prefill_top = self._bucket(self.prefill_max, 16, self.PREFILL_MAX)  # the longest padded chunk
        self.scratch = KVCache(model.config, 1, self.prefill_top, dev, cache.k[0].dtype, flex=cache.flex)
        self.prefill_ids = torch.zeros((1, self.prefill_top), dtype=torch.long, device=dev)
        self.prefill_last = torch.zeros(1, dtype=torch.long, device=dev)
        self.prefills: dict[int, tuple] = {}  # padded length -> (graph, last position's logits)
        self.prefill_replays = 0
        if compile_blocks:
            # block by block (the twenty blocks share each compile): the whole forward as one compile
            # fuses a little more but took minutes to compile for every bucket
            # (bench/results/serving.md, "One decode step")
            # one compile per kind of call the buckets make (one row or more, one new token, under 128 or
            # more, the cache's whole length or less): more than dynamo's default limit of 8
            # (bench/results/serving.md, "The cache read by FlexAttention"), past which a block runs uncompiled (and
            # FlexAttention as its reference: `KVCache`)
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            # a one-row step's Linears as Inductor reductions, their neighbours fused in: 1.06x a d20 step
            # at one stream on an H100 (bench/results/serving.md, "One decode step")
            gpt.ROW_PRODUCTS = True
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
        the device, valid until the next replay of the same graph: `LaunchedStep` copies them out first)."""
        n = len(settings)
        rows = self._bucket(n, 1, self.max_batch)
        slots = self._bucket(kv_len, 64, self.max_len)
        k_max = RANKED_K if not extras and 0 < top_k_bound(settings) <= RANKED_K else 0
        host = self.hosts[self.turn]
        self.turn ^= 1
        if torch.is_tensor(ids):  # the previous step's sampled ids, still on the device
            self.ids[:n, 0].copy_(ids)
            host[:n, 0] = 0
        else:
            host[:n, 0] = torch.tensor(ids, dtype=torch.float32)  # ids < 2**24: exact in fp32
        host[:n, 1:] = torch.tensor(settings, dtype=torch.float32)
        staged = host[:n].to(self.device, non_blocking=True)
        if not torch.is_tensor(ids):
            self.ids[:n, 0] = staged[:, 0].long()
        self.settings[:n] = staged[:, 1:]
        if rows > n:
            self.cache.lengths[n:rows].zero_()
        key = (rows, slots, k_max, extras)
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, out, info = self.graphs[key]
        graph.replay()
        return out[:n], None if info is None else info[:n]

    def can_prefill(self, chunks: list[list[int]], prompt_logprobs: bool) -> bool:
        """Whether this admission's prefill can be a graph replay: one request, a first chunk of at most
        prefill_max ids, and no prompt logprobs (they need every position's logits)."""
        return len(chunks) == 1 and not prompt_logprobs and len(chunks[0]) <= self.prefill_max

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
        c, s = self.cache, self.scratch
        torch._foreach_copy_([t[row:row + 1, :, :n] for t in c.k + c.v], [t[:, :, :n] for t in s.k + s.v])
        self.prefill_replays += 1
        return logits

    def warmup(self) -> None:
        """Compile the blocks for prefill shapes and capture every prefill and decode bucket now, so
        that no request waits for a compile or a capture. Most of a GPU engine's start, so it shows a
        progress bar with an ETA on stderr (the compiles come first: the early ETA runs long)."""
        prefills = [T for T in self._buckets(16, self.prefill_top) if T not in self.prefills]
        decodes = [key for rows in self._buckets(1, self.max_batch) for slots in self._buckets(64, self.max_len)
                   for key in ((rows, slots, RANKED_K, False), (rows, slots, 0, False), (rows, slots, 0, True))
                   if key not in self.graphs]
        # one row and several: the compiles a step of each takes (an engine of one row has only the first;
        # two rows' call on its one-row cache wrote past it: a device-side assert on a GPU)
        batches = [b for b in (1, 2) if b <= self.max_batch]
        with tqdm(total=len(batches) + len(prefills) + len(decodes), desc="engine warm-up: compile, capture graphs",
                  unit="graph", file=sys.stderr, mininterval=2.0) as bar:
            for b in batches:
                self.cache.lengths.zero_()  # kv_len bounds every row's length after the call
                view = self.cache.view(0, b)
                self.model(torch.zeros((b, 8), dtype=torch.long, device=self.device), kv_cache=view, kv_len=8)
                bar.update()
            self.cache.lengths.zero_()
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
        view = self.cache.view(0, rows)
        saved = view.lengths.clone()
        counts, bias, mask = self.extras.counts[:rows], self.extras.bias[:rows], self.extras.mask[:rows]
        saved_counts = counts.clone() if extras else None
        s = self.settings[:rows]

        def step():
            logits = self.model(self.ids[:rows], kv_cache=view, kv_len=slots)[:, -1]
            if extras:
                return extras_step(logits, s, counts, bias, self.ids[:rows, 0], mask)
            return self._sample(logits, s[:, TEMPERATURE], s[:, TOP_K].long(), s[:, TOP_P], s[:, UNIFORM], k_max), None

        def put_back():  # what the warm-up advanced: the cache lengths, and the counts it added to
            view.lengths.copy_(saved)
            if extras:
                counts.copy_(saved_counts)

        graph, (out, info) = self._graph(step, put_back)
        return graph, out, info

    def _capture_prefill(self, T: int):
        s = self.scratch

        def step():
            s.lengths.zero_()
            logits = self.model(self.prefill_ids[:, :T], kv_cache=s, kv_len=T)
            return logits[0].index_select(0, self.prefill_last)[None]

        return self._graph(step, s.lengths.zero_)

    def _graph(self, step, put_back):
        """A CUDA graph of `step()` (in the engine's one graph memory pool) and what it returns."""
        # warm up on a side stream (compiles; cuBLAS picks its kernels), then capture
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
                put_back()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        put_back()
        return graph, out


class LaunchedStep:
    """A launched decode step, from a graph's replay or the plain forward: the scheduler's requests by
    row at launch, and their sampled ids (and, with extras, `logprob_info`) on the device, being copied
    to the host (pinned memory, so the copy runs behind the step; one wait for both)."""

    def __init__(self, reqs: list, sampled: torch.Tensor, info: torch.Tensor | None = None):
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
