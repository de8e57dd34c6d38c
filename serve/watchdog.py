"""A hung engine is seen: the engine process alive but making no progress (stopped, stuck in a call).

Its death is seen at once (its channel ends); a hang is not, so each front end pings it and so does the
supervisor. A ping is the channel's `Stats` command (serve.wire), which the engine answers between two steps, or at
once when it has no work: an engine that leaves one unanswered for `timeout` seconds (`--engine-timeout`)
is making no progress.

- A front end (`watch_link`) then answers /health with 503 and the reason, refuses new requests with 503
  and ends its open streams with an error event; a submit waiting for the engine fails after `timeout`
  too. If the engine answers again, it serves again.
- The supervisor (`EngineWatch`, over a channel of its own) stops the server with exit code 1 when the
  engine has not answered for STOP_AFTER times `timeout`: the engine's state cannot be trusted, and, as
  for an engine that died, a process manager restarts the whole server (docs/serving.md, "Faults").
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time

from . import wire

log = logging.getLogger("sparkchat.serve")

STOP_AFTER = 3  # the supervisor stops the server after this many engine timeouts without an answer


def ping_every(timeout: float) -> float:
    """Seconds between two pings: a few a timeout, at most one a second."""
    return min(1.0, timeout / 4)


def hung(timeout: float) -> str:
    return f"the engine has not answered for {timeout:g} s (stopped or stuck; --engine-timeout)"


async def watch_link(link, timeout: float) -> None:
    """Ping the engine over a front end's link until the link ends (a task on its loop)."""
    link.answer_timeout = timeout
    while link.dead is None:
        asked = time.monotonic()
        answer = await link.stats(timeout)
        if link.dead is not None:
            return
        if answer is None:
            if link.stalled is None:
                link.stall(hung(timeout))
        else:
            link.unstall()
        await asyncio.sleep(max(0.0, ping_every(timeout) - (time.monotonic() - asked)))


class EngineWatch:
    """The supervisor's pings, from a thread: `on_hung(why)` is called once the engine has not answered for
    `stop_after` (seconds). The first ping waits for the engine's hello, that is for its load."""

    def __init__(self, address: str, authkey: bytes, timeout: float, on_hung, process=None):
        self.address, self.authkey, self.timeout, self.on_hung = address, authkey, timeout, on_hung
        self.stop_after = STOP_AFTER * timeout
        self.process = process
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="sparkchat-engine-watch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            conn = wire.connect(self.address, self.authkey, self.process, timeout=float("inf"))
            hello = conn.recv()  # the engine has loaded (or not: then it exits)
        except (OSError, EOFError, RuntimeError):
            return  # the engine is gone: the supervisor sees its exit
        if hello.info is None:
            return
        keys = itertools.count()
        try:
            while not self.stopped.is_set():
                key, asked = next(keys), time.monotonic()
                conn.send(wire.Stats(key))
                while not self._answered(conn, key):
                    if time.monotonic() - asked > self.stop_after:
                        self.on_hung(f"the engine has not answered for {self.stop_after:g} s (stopped or stuck; "
                                     f"{STOP_AFTER} times --engine-timeout)")
                        return
                    if self.stopped.is_set():
                        return
                self.stopped.wait(ping_every(self.timeout))
        except (OSError, EOFError):
            return  # the engine is gone (or stopping): the supervisor sees it
        finally:
            conn.close()

    def _answered(self, conn, key: int) -> bool:
        """Read what the engine sent within a short wait; True once it holds the answer to ping `key`."""
        if not conn.poll(ping_every(self.timeout)):
            return False
        step = conn.recv()
        return any(k == key for k, _ in step.stats)

    def stop(self) -> None:
        self.stopped.set()
