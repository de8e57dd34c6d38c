"""A front end's side of the channel to the engine (serve.engine_proc says what travels on it).

The event loop reads the connection when it is readable (`add_reader`: no thread of its own, so no
thread wake-up and GIL hand-over an engine step; the engine writes each message whole, so a read does not
wait). Each message is an engine step's events for this front end, answers to commands among them; each
answer resolves its waiting command, each other event goes to its stream (`push`), which wakes its
reader when due. Commands are sent from the loop.

When the connection ends (the engine process died), every open stream ends with an error and `dead`
says why: /health then fails, and the supervisor ends the server (docs/serving.md, "Faults").
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import select
import threading
from multiprocessing.connection import Connection

from model.requests import EngineError, EngineStopped, PromptTooLong, QueueFull

from .engine_proc import ACK, FINISH, send

log = logging.getLogger("sparkchat.serve")
REFUSED = {"QueueFull": QueueFull, "PromptTooLong": PromptTooLong, "EngineStopped": EngineStopped,
           "ValueError": ValueError}


class EngineLink:
    """Requests to the engine over `conn`, from one event loop. `info` is the engine's hello (context
    length, vocabulary size, generation defaults, the tokenizer's JSON). Start it with `start(loop)`."""

    def __init__(self, conn: Connection, info: dict):
        self.conn, self.info = conn, info
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[int, object] = {}  # rid -> its stream (anything with push(event))
        self.waiting: dict[int, asyncio.Future] = {}  # acks and stats answers, by rid / token
        self.rids = itertools.count()
        self.send_lock = threading.Lock()
        self.dead: str | None = None

    @classmethod
    def open(cls, conn: Connection) -> "EngineLink":
        """Read the hello (blocks until the engine has loaded). Raises RuntimeError with the engine's
        load error."""
        kind, info, error = conn.recv()
        if info is None:
            raise RuntimeError(error)
        return cls(conn, info)

    def start(self, loop: asyncio.AbstractEventLoop) -> "EngineLink":
        self.loop = loop  # (called from the thread that loaded the model: the loop adds the reader itself)
        # "is another message there?" after each read: Connection.poll() builds a selector a call
        self.ready = select.poll()
        self.ready.register(self.conn.fileno(), select.POLLIN)
        loop.call_soon_threadsafe(loop.add_reader, self.conn.fileno(), self._read)
        return self

    def _read(self) -> None:  # on the loop, when the connection is readable
        """Every message that has arrived, before any reader runs: a loop that fell behind hands each
        stream the tokens of several steps at once (one event, not one a step)."""
        try:
            while True:
                self._on_message(self.conn.recv())
                if not self.ready.poll(0):
                    return
        except (EOFError, OSError) as e:
            self.loop.remove_reader(self.conn.fileno())
            self._on_death(f"the engine process is gone ({type(e).__name__})")

    def _on_message(self, msg: tuple) -> None:  # ("step", events): the only message after the hello
        streams, now = self.streams, self.loop.time()
        for ev in msg[1]:
            if ev[1] <= ACK:  # (rid, ACK, refusal) or (key, STATS, stats): an answer
                fut = self.waiting.pop(ev[0], None)
                if fut is not None and not fut.done():
                    fut.set_result(ev[2])
                continue
            s = streams.get(ev[0])
            if s is not None:
                if ev[1] == FINISH:
                    del streams[ev[0]]
                s.push(ev, now)

    def _on_death(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        log.error("%s: every open stream ends with an error", why)
        for rid, s in list(self.streams.items()):
            s.push((rid, FINISH, "error", 0, why))
        self.streams.clear()
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(EngineStopped(why))
        self.waiting.clear()

    def _send(self, msg) -> None:
        if self.dead is not None:
            raise EngineStopped(self.dead)
        try:
            with self.send_lock:
                send(self.conn, msg)
        except OSError as e:
            self._on_death(f"the engine process is gone ({type(e).__name__})")
            raise EngineStopped(self.dead) from None

    async def _ask(self, key: int, msg) -> object:
        fut = self.loop.create_future()
        self.waiting[key] = fut
        try:
            self._send(msg)
        except EngineStopped:
            self.waiting.pop(key, None)
            raise
        return await fut

    async def submit(self, prompt: list[int], params, stream) -> int:
        """Submit a request whose events go to `stream.push`; its rid. Raises what the engine's submit
        raised (QueueFull, PromptTooLong, EngineStopped, ValueError)."""
        rid = next(self.rids)
        self.streams[rid] = stream  # before the ack: its first tokens may come in the same message
        try:
            refusal = await self._ask(rid, ("submit", rid, prompt, params))
        except asyncio.CancelledError:  # the client went away meanwhile: the engine must not run it
            self.cancel(rid)
            raise
        except EngineStopped:
            self.streams.pop(rid, None)
            raise
        if refusal is not None:
            self.streams.pop(rid, None)
            kind, message = refusal
            raise REFUSED.get(kind, EngineError)(message)
        return rid

    def cancel(self, rid: int) -> None:
        if self.streams.pop(rid, None) is not None:
            try:
                self._send(("cancel", rid))
            except EngineStopped:
                pass

    async def stats(self, timeout: float = 2.0) -> dict | None:
        """The engine's counters (queue depth, rows, steps, CPU seconds); None if it does not answer."""
        key = -next(self.rids) - 1  # apart from the rids, in the same table
        try:
            return await asyncio.wait_for(self._ask(key, ("stats", key)), timeout)
        except (EngineStopped, asyncio.TimeoutError):
            return None

    def close(self) -> None:
        self.dead = self.dead or "closed"
        if self.loop is not None and not self.loop.is_closed() and not self.conn.closed:
            self.loop.remove_reader(self.conn.fileno())
        self.conn.close()
