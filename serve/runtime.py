"""The model as a front end uses it: tokenizer + defaults + the link to the engine, and text streams.

This is the one place where text meets token ids. `Runtime.open_stream` renders nothing itself: it takes
prompt ids (rendered by model.chat, the training renderer), submits them to the engine and returns a
`TextStream`, an async iterator of the reply's words (model.chat.ReplyReader: whole UTF-8 pieces, no
tool calls, no answer marker), cut at any stop string; its `tool_uses` and `parts` (the reply as
trained, for the history) fill in as it goes. Both the OpenAI routes and the Gradio page read
generations through it.

The engine runs in a process of its own (serve.engine_proc), reached through serve.engine_link; a
Runtime built `in_process` runs it in a thread of this process instead, over the same channel (tests,
and callers that want to reach into the engine). Only those two imports torch, when called: a front
end that connects to an engine process never loads it. A stream reads what arrived since it last read as one
piece: a stream that fell behind catches up in one SSE event, not one per token.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from model.chat import ReplyReader, ToolUse, cut_parts, render
from model.grammar import Grammars
from model.requests import Finished, PromptLogprobs, SamplingParams, Token, sampling_params
from model.tokenizer import SparkTokenizer, StreamDecoder

from .engine_link import EngineLink
from .metrics import Metrics
from .processes import EngineProcess
from .settings import Settings
from .wire import connect, spacing

if TYPE_CHECKING:
    from model.engine import Engine

log = logging.getLogger("sparkchat.serve")
# uvloop's loop.time() is libuv's clock, cached at each loop iteration in whole milliseconds: a stream
# counts as due up to this much before its time, so that a clock read a millisecond early does not hold
# its tokens for another engine step
CLOCK_SLACK = 0.001


class PlainReader:
    """What TextStream reads of ReplyReader (read, finish, parts, tool_uses, done), over plain text
    (/v1/completions): every word the model wrote, as one text part; special ids are left out."""

    def __init__(self, tok: SparkTokenizer):
        self.decoder = StreamDecoder(tok)
        self.tool_uses: list[ToolUse] = []
        self.words, self.done = "", False

    def read(self, ids: list[int]) -> list:
        return self._show(self.decoder.read(ids))

    def finish(self) -> list:
        self.done = True
        return self._show(self.decoder.flush())

    def _show(self, text: str) -> list:
        self.words += text
        return [text] if text else []

    @property
    def parts(self) -> list[dict]:
        return [{"type": "text", "text": self.words}] if self.words else []


class Wake:
    """Wakes the one task that reads a request's streams (`merged`) when any of them has events due: a
    bare future, set at most once a wait (an asyncio.Event plus wait_for cost more, once a token a stream)."""

    def __init__(self):
        self.waiter: asyncio.Future | None = None

    def set(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class TextStream:
    """One generation as async text: iterate it for the words (or read several with `merged`). A piece
    is also yielded (possibly "") when a tool use completes, which is then in `tool_uses`. Afterwards
    `finish_reason` ('stop', 'length', 'error' or 'cancelled'), `prompt_tokens`, `completion_tokens` and
    `parts` (the reply as content parts, cut where a stop string cut the words) are set. `cancel()`
    frees the engine row at once.
    When the params ask for logprobs, `prompt_logprobs` and `tokens` (every generated id with its
    logprobs, calculator and answer line included) fill in as pieces come; `take_tokens()` gives those
    since its last call. `chat=False` (/v1/completions) reads the ids as plain text, special ids left
    out, as vLLM does by default. Streams of one request share `wake`, set when any of them has events
    due. Pieces are spaced by `Runtime.spacing()`: the events in between join the next piece, which goes
    out with the first engine step after its time (a running stream gets a token every step, so no
    timer is needed: one would cost a wake-up more an event)."""

    def __init__(self, runtime: "Runtime", prompt_len: int, stop: list[str], chat: bool = True,
                 wake: Wake | None = None):
        self.runtime = runtime
        self.wake = wake or Wake()
        self.pending: list = []  # events from the engine not read yet (EngineLink.streams says which)
        self.reader = ReplyReader(runtime.tokenizer) if chat else PlainReader(runtime.tokenizer)
        self.tool_uses: list[ToolUse] = self.reader.tool_uses
        self.stop = [s for s in stop if s]
        self.held = ""  # decoded text not yet released (could be the start of a stop string)
        self.shown = 0  # characters of words released
        self.cut: int | None = None  # where a stop string cut the words
        self.prompt_tokens = prompt_len
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0  # the last delivery of tokens (perf_counter): the inter-token histogram's start
        self.prompt_logprobs: PromptLogprobs | None = None
        self.tokens: list[Token] = []  # kept only when logprobs were asked
        self._taken = 0
        self.rid: int | None = None
        self.next_at = 0.0  # loop time before which no piece goes out (see spacing()); 0: none
        self.loop: asyncio.AbstractEventLoop | None = None
        self.t0 = time.perf_counter()

    def push(self, ev, now: float = 0.0) -> None:
        """An event from the link, on the loop (`now`: the loop time its engine step arrived; 0: read the
        clock if needed). Wakes the reader if the stream is due, else the event waits for a later one."""
        self.pending.append(ev)
        if self.wake.waiter is not None and self.due(now or self.loop.time()):
            self.wake.set()

    def take_tokens(self) -> list[Token]:
        new, self._taken = self.tokens[self._taken:], len(self.tokens)
        return new

    def cancel(self) -> None:
        """Free the engine row now; the stream then ends (as 'stop', as if the model had)."""
        if self.finish_reason is None and self.rid is not None and self.rid in self.runtime.link.streams:
            self.runtime.link.cancel(self.rid)
            self.push(Finished("cancelled", self.prompt_tokens, self.completion_tokens))

    def close(self) -> None:
        """The consumer went away (client disconnect, stop button): cancel, and count it as cancelled."""
        if self.finish_reason is None:
            self.cancel()
            self._end("cancelled")

    def _end(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.runtime.metrics.completion_tokens.inc(self.completion_tokens)
            if reason != "cancelled":  # a request the client gave up on has no end-to-end time
                self.runtime.metrics.e2e.observe(time.perf_counter() - self.t0)
            if not self.reader.done:  # a stop string ended it: the parts read so far are complete
                self.reader.finish()

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

    @property
    def parts(self) -> list[dict]:
        """The reply as content parts: render() gives back its ids (up to a stop string's cut)."""
        parts = self.reader.parts
        return parts if self.cut is None else cut_parts(parts, self.cut)

    def due(self, now: float) -> bool:
        """Events are waiting and may go out now (its spacing has passed, or the stream has ended)."""
        return bool(self.pending) and (now + CLOCK_SLACK >= self.next_at or type(self.pending[-1]) is Finished)

    def take(self) -> str | None:
        """Read every pending event: the words they make, as one piece ("" when only a tool use
        completed), or None when they show nothing yet."""
        events, self.pending = self.pending, []
        now = time.perf_counter()  # the latency histograms' clock for tokens delivered now (before any end)
        out: list[str] = []
        ids: list[int] = []  # tokens not read yet: read together (one at a time when a stop string may cut)
        used, tokens = False, self.completion_tokens
        for ev in events:
            if self.finish_reason is not None:  # a stop string ended it
                break
            kind = type(ev)
            if kind is int or kind is Token:  # a token (a Token when it carries logprobs)
                self.completion_tokens += 1
                if kind is Token:
                    self.tokens.append(ev)
                    ev = ev.id
                if self.stop:
                    used |= self._read([ev], out)
                else:
                    ids.append(ev)
            elif kind is PromptLogprobs:
                self.prompt_logprobs = ev
            else:  # Finished
                if ids:
                    used |= self._read(ids, out)
                    ids = []
                if ev.reason == "error":
                    log.error("generation failed: %s", ev.error)
                used |= self._read(None, out)
                self._end("stop" if ev.reason in ("stop", "cancelled") else ev.reason)
        if ids:
            used |= self._read(ids, out)
        if self.completion_tokens > tokens:  # tokens delivered: the first, or the gap since the last delivery
            if self.first_token_at is None:
                self.first_token_at = now
                self.runtime.metrics.ttft.observe(now - self.t0)
            else:
                self.runtime.metrics.itl.observe(now - self.last_token_at)
            self.last_token_at = now
        spacing = self.runtime.spacing()
        self.next_at = self.loop.time() + spacing if spacing else 0.0
        piece = "".join(out)
        return piece if piece or used else None

    def _read(self, ids: list[int] | None, out: list[str]) -> bool:
        """Read token ids (None: the reply's end) into `out` as words, cut at a stop string; True when a
        tool use completed (it is a piece even with no words)."""
        final = ids is None
        words, used = "", False
        for e in self.reader.finish() if final else self.reader.read(ids):
            if isinstance(e, str):
                words += e
            else:
                used = True
        if words or final:
            if self.stop:
                out.append(self._release(words, final))
            else:  # nothing to cut or hold back
                out.append(words)
                self.shown += len(words)
        return used

    def __aiter__(self):
        return self._pieces()

    async def _pieces(self):
        async with contextlib.aclosing(merged([self])) as pieces:
            async for _, piece in pieces:
                if piece is not None:
                    yield piece


async def merged(streams: list[TextStream]):
    """(stream index, text piece) as pieces come from any stream, then (index, None) when one ends.
    Right after a piece, that stream's `take_tokens()` gives the tokens it came from. Every stream's
    events since its last piece make one piece, so a reader that fell behind gets fewer, larger ones.
    Ending early (the client went away) cancels every stream still running."""
    loop, wake, left = asyncio.get_running_loop(), streams[0].wake, set(range(len(streams)))
    try:
        while left:
            now, moved = loop.time(), False
            for i in sorted(left):
                s = streams[i]
                if not s.due(now):
                    continue
                moved = True
                piece = s.take()
                if piece is not None:
                    yield i, piece
                if s.finish_reason is not None:
                    left.discard(i)
                    yield i, None
            if not moved:  # no await since the scan: every event pushed meanwhile was seen
                await wake.wait()
    finally:
        for s in streams:
            s.close()


@dataclass
class Runtime:
    tokenizer: SparkTokenizer
    link: EngineLink
    defaults: dict
    metrics: Metrics
    model_id: str = Settings.model_id
    stream_interval: float = Settings.stream_interval
    """Least seconds between two pieces of one stream (0: each as soon as it is there)."""
    events_per_s: float = Settings.events_per_s
    """The most pieces a second over all this front end's streams (0: no limit): with many streams each
    stream's pieces are spaced (streams / events_per_s) seconds apart."""
    engine: "Engine | None" = None
    """The engine itself, when it runs in this process (`in_process`); else None."""
    process: EngineProcess | None = None
    """The engine process this runtime started (and stops on close), if any."""

    def __post_init__(self):
        # a prompt of B UTF-8 bytes has at least B / longest token ids: a prompt that long is refused
        # before it is tokenized (a 1 MB prompt would hold the loop, GIL included, for seconds)
        # (the ids' bytes table is built here, not on the loop at the first stream's first tokens)
        self.max_token_bytes = max(1, max(map(len, self.tokenizer.bytes_table)))

    @classmethod
    def over(cls, link: EngineLink, metrics: Metrics, **fields) -> "Runtime":
        """A runtime over an open link (its hello gives the tokenizer and defaults)."""
        tok = SparkTokenizer(Tokenizer.from_str(link.info["tokenizer"]))
        return cls(tok, link, link.info["defaults"], metrics, **fields)

    @classmethod
    def connect(cls, address: str, authkey: bytes, metrics: Metrics, **fields) -> "Runtime":
        """Over the engine process listening at `address` (`sparkchat serve`'s front ends)."""
        return cls.over(EngineLink.open(connect(address, authkey)), metrics, **fields)

    @classmethod
    def spawn(cls, model_dir, metrics: Metrics, device: str | None = None, max_batch: int = Settings.max_batch,
              max_queue: int = Settings.max_queue, weights: str = Settings.weights, **fields) -> "Runtime":
        """Start an engine process of its own (stopped on close) and connect to it."""
        proc = EngineProcess(model_dir, device, max_batch, max_queue, weights=weights)
        try:
            link = EngineLink.open(connect(proc.address, proc.authkey, proc.process))
        except BaseException:
            proc.stop()
            raise
        return cls.over(link, metrics, process=proc, **fields)

    @classmethod
    def in_process(cls, model_dir, metrics: Metrics, device: str | None = None, max_batch: int = Settings.max_batch,
                   max_queue: int = Settings.max_queue, **fields) -> "Runtime":
        """The engine in a thread of this process, over the same channel (a pipe)."""
        from .engine_proc import EngineHost, load_engine
        engine, info = load_engine(model_dir, device, max_batch, max_queue)
        ours, theirs = multiprocessing.Pipe()
        EngineHost(engine, info).add(theirs)
        return cls.over(EngineLink.open(ours), metrics, engine=engine, **fields)

    def spacing(self) -> float:
        """Least seconds between two pieces of a stream now: the interval asked for, or more while the
        front end's streams would together send more than `events_per_s` pieces a second."""
        return spacing(len(self.link.streams), self.stream_interval, self.events_per_s)

    def start(self, loop: asyncio.AbstractEventLoop) -> "Runtime":
        # the engine paces its messages to this front end by the same spacing (EngineHost.flush)
        self.link.start(loop, pace=(self.stream_interval, self.events_per_s))
        return self

    @property
    def context_len(self) -> int:
        return self.link.info["context_len"]

    @property
    def max_queue(self) -> int:
        """Generations the engine queues at once: a request of more can never run."""
        return self.link.info["max_queue"]

    @property
    def vocab_size(self) -> int:
        """Ids the model takes (its embedding rows; may exceed the tokenizer's)."""
        return self.link.info["vocab_size"]

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Grammars over this model's tokenizer, as its engine compiles them (the front end checks a
        request's schema with it, so a bad one is a 400 naming its field)."""
        return Grammars(self.tokenizer.to_str(), self.vocab_size, self.tokenizer.special["<|assistant_end|>"])

    def fewest_tokens(self, texts) -> int:
        """A floor on the ids `texts` encode to, without encoding them (see __post_init__)."""
        return sum(len(t.encode("utf-8", "surrogatepass")) for t in texts) // self.max_token_bytes

    def render(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Prompt ids for `messages` (and `tools`' definitions), by the training renderer. Raises
        model.chat.ChatFormatError."""
        ids, _ = render(self.tokenizer, messages, for_completion=True, tools=tools)
        return ids

    def sampling(self, temperature=None, top_k=None, top_p=None, max_tokens=None, seed=None,
                 **extras) -> SamplingParams:
        return sampling_params(self.defaults, temperature, top_k, top_p, max_tokens, seed, **extras)

    async def open_streams(self, jobs: list[tuple[list[int], SamplingParams]], stop: list[str] | None = None,
                           chat: bool = True) -> list[TextStream]:
        """Submit every (prompt ids, settings) job now, all or none (raises QueueFull / PromptTooLong /
        EngineStopped / ValueError): they share a wake-up (`merged` reads them together) and the engine
        queues them together (they share a step's prefill)."""
        wake, loop = Wake(), asyncio.get_running_loop()
        streams = [TextStream(self, len(prompt), stop or [], chat, wake) for prompt, _ in jobs]
        for s in streams:
            s.loop = loop
        rids = await self.link.submit([(prompt, params, s) for (prompt, params), s in zip(jobs, streams)])
        for s, rid in zip(streams, rids):
            s.rid = rid
        self.metrics.prompt_tokens.inc(sum(len(prompt) for prompt, _ in jobs))
        return streams

    async def open_stream(self, prompt: list[int], params: SamplingParams, stop: list[str] | None = None,
                          chat: bool = True) -> TextStream:
        """One job's open_streams; iterate the result for text."""
        return (await self.open_streams([(prompt, params)], stop, chat))[0]

    def close(self) -> None:
        self.link.close()
        if self.engine is not None:
            self.engine.shutdown()
        if self.process is not None:
            self.process.stop()
