"""The loaded model as the server uses it: tokenizer + engine + defaults, and text streams over it.

This is the one place where text meets token ids. `Runtime.open_stream` renders nothing itself: it takes
prompt ids (rendered by model.chat, the training renderer), submits them to the engine and returns a
`TextStream`, an async iterator of the reply's words (model.chat.ReplyReader: whole UTF-8 pieces, no
tool calls, no answer marker), cut at any stop string; its `tool_uses` and `parts` (the reply as
trained, for the history) fill in as it goes. Both the OpenAI routes and the Gradio page read
generations through it, in-process.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from model.chat import ReplyReader, ToolUse, cut_parts, render
from model.chat_engine import chat_engine, sampling_params
from model.engine import Engine, Finished, PromptLogprobs, SamplingParams, Token
from model.model_dir import load_model_dir
from model.tokenizer import SparkTokenizer, StreamDecoder

from . import MAX_BATCH, MAX_QUEUE, MODEL_ID
from .metrics import Metrics

log = logging.getLogger("sparkchat.serve")


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class PlainReader:
    """ReplyReader's interface over plain text (/v1/completions): every word the model wrote, as one
    text part; special ids are left out."""

    def __init__(self, tok: SparkTokenizer):
        self.decoder = StreamDecoder(tok)
        self.tool_uses: list[ToolUse] = []
        self.words, self.done = "", False

    def push(self, i: int) -> list:
        return self._show(self.decoder.push(i))

    def finish(self) -> list:
        self.done = True
        return self._show(self.decoder.flush())

    def _show(self, text: str) -> list:
        self.words += text
        return [text] if text else []

    @property
    def parts(self) -> list[dict]:
        return [{"type": "text", "text": self.words}] if self.words else []


class _Handoff:
    """Engine events to one event loop's stream queues, a batch per wake-up of the loop. The engine
    thread emits one event per row per step; a wake-up each (call_soon_threadsafe: a pipe write) cost
    that thread, which must launch the next step, several times the CPU (bench/serve_path.py). The
    first event into an empty batch schedules the flush; the rest of that step's rows join the batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.pending = loop, threading.Lock(), []

    def put(self, queue: asyncio.Queue, ev) -> None:  # engine thread
        with self.lock:
            self.pending.append((queue, ev))
            if len(self.pending) > 1:
                return  # a flush is already scheduled
        self.loop.call_soon_threadsafe(self._flush)

    def _flush(self) -> None:  # the loop
        with self.lock:
            batch, self.pending = self.pending, []
        for queue, ev in batch:
            queue.put_nowait(ev)


_handoffs: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Handoff]" = weakref.WeakKeyDictionary()


def loop_handoff(loop: asyncio.AbstractEventLoop) -> _Handoff:
    if loop not in _handoffs:
        _handoffs[loop] = _Handoff(loop)
    return _handoffs[loop]


class TextStream:
    """One generation as async text: iterate it for the words. A piece is also yielded (possibly "")
    when a tool use completes, which is then in `tool_uses`. Afterwards `finish_reason` ('stop' or
    'length'), `prompt_tokens`, `completion_tokens` and `parts` (the reply as content parts, cut where
    a stop string cut the words) are set. `cancel()` frees the engine row at once.
    When the params ask for logprobs, `prompt_logprobs` and `tokens` (the Token events, with their
    logprobs: every generated id, calculator and answer line included) fill in as pieces come;
    `take_tokens()` gives those since its last call. `chat=False` (/v1/completions) reads the ids as
    plain text, special ids left out, as vLLM does by default."""

    def __init__(self, runtime: "Runtime", prompt: list[int], params: SamplingParams, stop: list[str],
                 chat: bool = True):
        self.runtime = runtime
        self.handoff = loop_handoff(asyncio.get_running_loop())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reader = ReplyReader(runtime.tokenizer) if chat else PlainReader(runtime.tokenizer)
        self.tool_uses: list[ToolUse] = self.reader.tool_uses
        self.stop = [s for s in stop if s]
        self.held = ""  # decoded text not yet released (could be the start of a stop string)
        self.shown = 0  # characters of words released
        self.cut: int | None = None  # where a stop string cut the words
        self.prompt_tokens = len(prompt)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.tokens: list[Token] = []  # kept only when logprobs were asked
        self._taken = 0
        self.t0 = time.perf_counter()
        self.request = runtime.engine.submit(prompt, params, self._sink)  # may raise QueueFull
        runtime.metrics.prompt_tokens.inc(len(prompt))

    def _sink(self, ev) -> None:  # engine thread
        self.handoff.put(self.queue, ev)

    def take_tokens(self) -> list[Token]:
        new, self._taken = self.tokens[self._taken:], len(self.tokens)
        return new

    def cancel(self) -> None:
        if self.finish_reason is None:
            self.runtime.engine.cancel(self.request)

    def _end(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.runtime.metrics.completion_tokens.inc(self.completion_tokens)

    def _release(self, text: str, final: bool) -> str:
        """Append decoded text; return what may be shown now (stop strings cut, ends held back)."""
        buf = self.held + text
        if not self.stop:
            self.held = ""
            self.shown += len(buf)
            return buf
        cut = min((j for j in (buf.find(s) for s in self.stop) if j >= 0), default=-1)
        if cut >= 0:
            self.held = ""
            self.cut = self.shown + cut
            self.cancel()
            self._end("stop")
            return buf[:cut]
        keep = 0
        if not final:  # hold the longest tail that could still become a stop string
            for k in range(min(len(buf), max(map(len, self.stop)) - 1), 0, -1):
                if any(s.startswith(buf[-k:]) for s in self.stop):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        self.shown += len(buf) - keep
        return buf[:len(buf) - keep]

    def _read(self, events: list, final: bool) -> tuple[str, bool]:
        """ReplyReader events -> (words to show, whether a tool use completed)."""
        words = "".join(e for e in events if isinstance(e, str))
        return self._release(words, final), any(isinstance(e, ToolUse) for e in events)

    @property
    def parts(self) -> list[dict]:
        """The reply as content parts: render() gives back its ids (up to a stop string's cut)."""
        parts = self.reader.parts
        return parts if self.cut is None else cut_parts(parts, self.cut)

    def __aiter__(self):
        return self._pieces()

    async def _pieces(self):
        try:
            while self.finish_reason is None:
                events = [await self.queue.get()]
                while not self.queue.empty():  # coalesce what arrived meanwhile into one piece
                    events.append(self.queue.get_nowait())
                out, used = [], False
                for ev in events:
                    if isinstance(ev, Token):
                        if self.first_token_at is None:
                            self.first_token_at = time.perf_counter()
                            self.runtime.metrics.ttft.observe(self.first_token_at - self.t0)
                        self.completion_tokens += 1
                        if ev.logprob is not None:
                            self.tokens.append(ev)
                        words, tool = self._read(self.reader.push(ev.id), final=False)
                    elif isinstance(ev, PromptLogprobs):
                        self.prompt_logprobs = ev
                        continue
                    else:  # Finished
                        if ev.reason == "error":
                            log.error("generation failed: %s", ev.error)
                        words, tool = self._read(self.reader.finish(), final=True)
                        self._end("stop" if ev.reason in ("stop", "cancelled") else ev.reason)
                    out.append(words)
                    used = used or tool
                    if self.finish_reason is not None:
                        break
                piece = "".join(out)
                if piece or used:
                    yield piece
            if not self.reader.done:  # a stop string ended it: the parts read so far are complete
                self.reader.finish()
        finally:
            if self.finish_reason is None:  # the consumer went away (client disconnect, stop button)
                self.cancel()
                self._end("cancelled")


@dataclass
class Runtime:
    model: torch.nn.Module
    tokenizer: SparkTokenizer
    engine: Engine
    defaults: dict
    metrics: Metrics
    model_id: str = MODEL_ID

    @classmethod
    def load(cls, model_dir, metrics: Metrics, device: str | None = None, max_batch: int = MAX_BATCH,
             max_queue: int = MAX_QUEUE, model_id: str = MODEL_ID) -> "Runtime":
        dev = pick_device(device)
        dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
        t = time.perf_counter()
        model, tok, gen = load_model_dir(model_dir, dev, dtype)
        engine = chat_engine(model, tok, gen, max_batch=max_batch, max_queue=max_queue)
        metrics.watch_engine(engine)
        metrics.loaded.set(1)
        log.info("loaded %s on %s (%s) in %.2fs: %.1fM parameters, context %d", model_dir, dev, dtype,
                 time.perf_counter() - t, model.num_params() / 1e6, engine.max_len)
        return cls(model, tok, engine, gen, metrics, model_id)

    @property
    def context_len(self) -> int:
        return self.engine.max_len

    @property
    def vocab_size(self) -> int:
        """Ids the model takes (its embedding rows; may exceed the tokenizer's)."""
        return self.engine.vocab_size

    def render(self, messages: list[dict]) -> list[int]:
        """Prompt ids for `messages`, by the training renderer. Raises model.chat.ChatFormatError."""
        ids, _ = render(self.tokenizer, messages, for_completion=True)
        return ids

    def sampling(self, temperature=None, top_k=None, top_p=None, max_tokens=None, seed=None,
                 **extras) -> SamplingParams:
        return sampling_params(self.defaults, temperature, top_k, top_p, max_tokens, seed, **extras)

    def open_stream(self, prompt: list[int], params: SamplingParams, stop: list[str] | None = None,
                    chat: bool = True) -> TextStream:
        """Submit now (raises QueueFull / PromptTooLong at once); iterate the result for text."""
        return TextStream(self, prompt, params, stop or [], chat)

    def close(self) -> None:
        self.engine.shutdown()
