"""A front end's side of the channel to the engine (serve.wire says what travels on it).

After the hello (read blocking, before the event loop serves anything), the connection's socket is the
event loop's: an asyncio protocol (`_Channel`) takes the bytes as they arrive, cuts them into messages
by the wire's framing (`wire.unframe`), and hands each to the link; commands go out through the loop's
transport, which buffers what the socket cannot take yet.
(Connection.recv and send on the loop's socket would not do: the loop makes it non-blocking, and a
message larger than the socket's buffer, as prompt logprobs for a long prompt are, then breaks off.)

Each message is an engine step's events for this front end, answers to commands among them; each
answer resolves its waiting command, each other event goes to its stream (`push`), which wakes its
reader when due. Every message that has arrived is handed over before any reader runs: a loop that fell
behind hands each stream the tokens of several steps at once (one event, not one a step).

When the connection ends (the engine process died, or it dropped this front end), every open stream
ends with an error and `dead` says why: /health then fails, and the supervisor ends the server or starts
the front end again (docs/serving.md, "Faults").
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from multiprocessing.connection import Connection
from typing import Callable

from model.requests import EngineStopped, Finished, PromptLogprobs, Token

from . import wire

log = logging.getLogger("sparkchat.serve")


class EngineStalled(EngineStopped):
    """The engine lives but has not answered for longer than the front end waits (serve.watchdog)."""


class _Channel(asyncio.Protocol):
    """The bytes from the engine, cut into messages (wire.frame's format)."""

    def __init__(self, link: "EngineLink"):
        self.link = link
        self.buf = bytearray()
        self.need = 4  # bytes the next message needs before it can be read
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        if len(buf) < self.need:  # the rest of a large message is still coming
            return
        msgs, self.need = wire.unframe(buf)
        for msg in msgs:
            self.link._on_message(msg)

    def connection_lost(self, exc: Exception | None) -> None:
        why = "the connection to the engine closed (its process is gone, or it dropped this front end)"
        self.link._on_death(why if exc is None else f"{why}: {type(exc).__name__}")


class EngineLink:
    """Requests to the engine over `conn`, from one event loop. `info` is the engine's hello (context
    length, vocabulary size, generation defaults, the tokenizer's JSON). Start it with `start(loop)`."""

    def __init__(self, conn: Connection, info: dict):
        self.conn, self.info = conn, info
        self.loop: asyncio.AbstractEventLoop | None = None
        self.channel: _Channel | None = None
        # rid -> its stream: anything with push(event, now), event a token id (int), a Token (one with
        # logprobs), a PromptLogprobs, and last a Finished
        self.streams: dict[int, object] = {}
        self.waiting: dict[int, asyncio.Future] = {}  # acks and stats answers, by rid / token
        self.rids = itertools.count()
        self.dead: str | None = None
        self.stalled: str | None = None  # why the engine is taken for hung (serve.watchdog); None: it answers
        self.answer_timeout: float | None = None  # the longest a submit waits for its answer (None: no limit)
        self.on_death: Callable[[str], None] | None = None  # called once, when the link dies

    @classmethod
    def open(cls, conn: Connection) -> "EngineLink":
        """Read the hello (blocks until the engine has loaded). Raises RuntimeError with the engine's
        load error."""
        hello = conn.recv()
        if hello.info is None:
            raise RuntimeError(hello.error)
        return cls(conn, hello.info)

    def start(self, loop: asyncio.AbstractEventLoop, pace: tuple[float, float] | None = None) -> "EngineLink":
        """Hand the connection to `loop`, running in another thread (this one waits until it is done).
        `pace`: this front end's (stream_interval, events_per_s), by which the engine then spaces its
        messages here (wire.Pace); None: a message every step."""
        if pace is not None:
            self.conn.send(wire.Pace(*pace))
        self.loop = loop
        sock = socket.socket(fileno=os.dup(self.conn.fileno()))  # from now on the loop's
        self.conn.close()

        async def attach() -> None:
            _, self.channel = await loop.connect_accepted_socket(lambda: _Channel(self), sock)

        asyncio.run_coroutine_threadsafe(attach(), loop).result()
        return self

    def _on_message(self, step: wire.Step) -> None:  # the only message after the hello
        waiting = self.waiting
        for key, answer in step.acks + step.stats:
            fut = waiting.pop(key, None)
            if fut is not None and not fut.done():
                fut.set_result(answer)
        streams, now = self.streams, self.loop.time()
        for rid, logprobs, top in step.prompts:  # before the tokens: a request's first event
            s = streams.get(rid)
            if s is not None:
                s.push(PromptLogprobs(logprobs, top), now)
        if step.logprobs is None:
            for rid, id in zip(step.rids, step.ids):
                s = streams.get(rid)
                if s is not None:
                    s.push(id, now)
        else:
            for rid, id, lp in zip(step.rids, step.ids, step.logprobs):
                s = streams.get(rid)
                if s is not None:
                    s.push(id if lp is None else Token(id, logprob=lp[0], top=lp[1]), now)
        for rid, reason, prompt_tokens, completion_tokens, error in step.finished:  # after its tokens
            s = streams.pop(rid, None)
            if s is not None:
                s.push(Finished(reason, prompt_tokens, completion_tokens, error), now)

    def _on_death(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        if self.on_death is not None:
            self.on_death(why)
        log.error("%s: every open stream ends with an error", why)
        for s in list(self.streams.values()):
            s.push(Finished("error", 0, 0, why))
        self.streams.clear()
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(EngineStopped(why))
        self.waiting.clear()

    def _send(self, msg) -> None:  # on the loop
        if self.dead is not None:
            raise EngineStopped(self.dead)
        self.channel.transport.write(wire.frame(msg))

    async def _ask(self, key: int, msg) -> object:
        fut = self.loop.create_future()
        self.waiting[key] = fut
        try:
            self._send(msg)
        except EngineStopped:
            self.waiting.pop(key, None)
            raise
        return await fut

    async def submit(self, jobs: list[tuple[list[int], object, object]]) -> list[int]:
        """Submit a request's generations, each (prompt ids, SamplingParams, the stream whose `push` gets
        its events), all or none; their rids. Raises what the engine refused them with (QueueFull,
        PromptTooLong, EngineStopped, ValueError)."""
        rids = [next(self.rids) for _ in jobs]
        for rid, (_, _, stream) in zip(rids, jobs):
            self.streams[rid] = stream  # before the ack: their first tokens may come in the same message
        if self.stalled is not None:
            raise EngineStalled(self.stalled)
        try:
            refusal = await asyncio.wait_for(self._ask(rids[0], wire.Submit([
                (rid, prompt, params) for rid, (prompt, params, _) in zip(rids, jobs)])), self.answer_timeout)
        except asyncio.CancelledError:  # the client went away meanwhile: the engine must not run them
            for rid in rids:
                self.cancel(rid)
            raise
        except asyncio.TimeoutError:  # it may yet take them: it must not run them
            self.waiting.pop(rids[0], None)
            for rid in rids:
                self.cancel(rid)
            raise EngineStalled(f"the engine did not answer within {self.answer_timeout:g} s (stopped or "
                                f"stuck; --engine-timeout)") from None
        except EngineStopped:
            for rid in rids:
                self.streams.pop(rid, None)
            raise
        if refusal is not None:
            for rid in rids:
                self.streams.pop(rid, None)
            raise wire.refusal_error(refusal)
        return rids

    def stall(self, why: str) -> None:
        """The engine is taken for hung: every open stream ends with an error (and is cancelled, should it
        wake), each waiting command fails, and new requests are refused until `unstall`."""
        self.stalled = why
        log.error("%s: every open stream ends with an error, new requests get 503", why)
        for rid, s in list(self.streams.items()):
            self.cancel(rid)
            s.push(Finished("error", 0, 0, why))
        for key, fut in list(self.waiting.items()):
            if key >= 0 and not fut.done():  # (the watchdog's own pings time out by themselves)
                fut.set_exception(EngineStalled(why))

    def unstall(self) -> None:
        if self.stalled is not None:
            log.warning("the engine answers again: serving")
            self.stalled = None

    def cancel(self, rid: int) -> None:
        if self.streams.pop(rid, None) is not None:
            try:
                self._send(wire.Cancel(rid))
            except EngineStopped:
                pass

    async def stats(self, timeout: float = 2.0) -> dict | None:
        """The engine's counters (queue depth, rows, steps, CPU seconds); None if it does not answer."""
        key = -next(self.rids) - 1  # apart from the rids, in the same table
        try:
            return await asyncio.wait_for(self._ask(key, wire.Stats(key)), timeout)
        except (EngineStopped, asyncio.TimeoutError):
            return None
        finally:
            self.waiting.pop(key, None)  # (an answer that never came)

    def close(self) -> None:
        self.dead = self.dead or "closed"
        if self.channel is not None:
            if not self.loop.is_closed():
                self.loop.call_soon_threadsafe(self.channel.transport.close)
        else:
            self.conn.close()
