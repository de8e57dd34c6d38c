"""The loaded model as the server uses it: tokenizer + engine + defaults, and text streams over it.

This is the one place where text meets token ids. `Runtime.open_stream` renders nothing itself: it takes
prompt ids (rendered by model.chat, the training renderer), submits them to the engine and returns a
`TextStream`, an async iterator of text pieces that are always whole UTF-8, cut at any stop string.
Both the OpenAI routes and the Gradio page read generations through it, in-process.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from model.chat import TOOL_DISPLAY, render
from model.chat_engine import chat_engine, sampling_params
from model.engine import Engine, Finished, PromptLogprobs, SamplingParams, Token
from model.model_dir import load_model_dir
from model.tokenizer import SparkTokenizer, StreamDecoder

from .metrics import Metrics

log = logging.getLogger("sparkchat.serve")


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class TextStream:
    """One generation as async text. Iterate it; afterwards `finish_reason` ('stop' or 'length'),
    `prompt_tokens` and `completion_tokens` are set. `cancel()` frees the engine row at once.
    When the params ask for logprobs, `prompt_logprobs` and `tokens` (the Token events, with their
    logprobs) fill in as pieces come; `take_tokens()` gives those since its last call."""

    def __init__(self, runtime: "Runtime", prompt: list[int], params: SamplingParams, stop: list[str]):
        self.runtime = runtime
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.decoder = StreamDecoder(runtime.tokenizer, TOOL_DISPLAY)
        self.stop = [s for s in stop if s]
        self.held = ""  # decoded text not yet released (could be the start of a stop string)
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
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)

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
            return buf
        cut = min((j for j in (buf.find(s) for s in self.stop) if j >= 0), default=-1)
        if cut >= 0:
            self.held = ""
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
        return buf[:len(buf) - keep]

    def __aiter__(self):
        return self._pieces()

    async def _pieces(self):
        try:
            while self.finish_reason is None:
                events = [await self.queue.get()]
                while not self.queue.empty():  # coalesce what arrived meanwhile into one piece
                    events.append(self.queue.get_nowait())
                out = []
                for ev in events:
                    if isinstance(ev, Token):
                        if self.first_token_at is None:
                            self.first_token_at = time.perf_counter()
                            self.runtime.metrics.ttft.observe(self.first_token_at - self.t0)
                        self.completion_tokens += 1
                        if ev.logprob is not None:
                            self.tokens.append(ev)
                        out.append(self._release(self.decoder.push(ev.id), final=False))
                    elif isinstance(ev, PromptLogprobs):
                        self.prompt_logprobs = ev
                    elif isinstance(ev, Finished):
                        if ev.reason == "error":
                            log.error("generation failed: %s", ev.error)
                        out.append(self._release(self.decoder.flush(), final=True))
                        self._end("stop" if ev.reason in ("stop", "cancelled") else ev.reason)
                    if self.finish_reason is not None:
                        break
                piece = "".join(out)
                if piece:
                    yield piece
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
    model_id: str = "sparkchat"

    @classmethod
    def load(cls, model_dir, metrics: Metrics, device: str | None = None, max_batch: int = 16,
             max_queue: int = 64, model_id: str = "sparkchat") -> "Runtime":
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

    def open_stream(self, prompt: list[int], params: SamplingParams, stop: list[str] | None = None) -> TextStream:
        """Submit now (raises QueueFull / PromptTooLong at once); iterate the result for text."""
        return TextStream(self, prompt, params, stop or [])

    def close(self) -> None:
        self.engine.shutdown()
