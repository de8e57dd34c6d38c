"""The channel between a front end and the engine process: its messages, their framing and its constants.

Both sides import this file and nothing else of each other, and it needs no torch. The channel is a
`multiprocessing.connection` per front end (a Unix socket; pickled records, why not JSON: docs/serving.md,
"The channel"). A front end sends commands; the engine answers within its step messages:

    front end -> engine                              engine -> front end
    Submit(jobs)   a request's generations,          Hello(info, error)   once, when the model has loaded
                   all or none -> an ack             Step(...)            the events since the last one,
    Cancel(rid)                                                           as columns (below)
    Pace(stream_interval, events_per_s)
    Stats(key)     -> a stats answer

A `Step` carries everything one front end has had since its last message, in columns read by name: the
answers to its commands (`acks`, `stats`), prompt logprobs, the tokens (`rids[i]` got `ids[i]`, with
`logprobs[i]` when any token of the message has them), and the requests that ended. One message per step
and front end, not one per token: a send is a system call and a wake-up on the other side. Within a
request, its prompt logprobs come before its tokens and its end after them, so a reader that takes the
columns in that order keeps every request's order.
"""
from __future__ import annotations

import pickle
import time
from multiprocessing.connection import Client, Connection
from typing import NamedTuple

from model.requests import EngineError, EngineStopped, PromptTooLong, QueueFull, SamplingParams

# ---- front end -> engine ----


class Submit(NamedTuple):
    """A request's generations, (rid, prompt ids, SamplingParams) each, queued together or not at all (they
    share a step's prefill). Answered by an ack keyed by the first rid."""
    jobs: list[tuple[int, list[int], SamplingParams]]


class Cancel(NamedTuple):
    rid: int


class Pace(NamedTuple):
    """This front end's streams' spacing (serve settings `stream_interval`, `events_per_s`), by which the
    engine spaces its step messages here (`message_due`)."""
    stream_interval: float
    events_per_s: float


class Stats(NamedTuple):
    """Asks for the engine's counters; answered in `Step.stats` under `key` without waiting for a pace."""
    key: int


# ---- engine -> front end ----


class Hello(NamedTuple):
    """The first message: what a front end needs of the model (context length, vocabulary size, queue
    size, generation defaults, the tokenizer's JSON), or `info` None and the load's `error`."""
    info: dict | None
    error: str | None


class Step(NamedTuple):
    acks: list[tuple[int, tuple[str, str] | None]]
    """(a submit's first rid, None, or the refusal: (exception name from REFUSED, message))."""
    stats: list[tuple[int, dict]]
    """(a Stats key, the counters)."""
    prompts: list[tuple[int, list[float], list]]
    """(rid, each prompt id's logprob after the first, the likeliest ids with theirs)."""
    rids: list[int]
    ids: list[int]
    """Token columns: request `rids[i]` generated `ids[i]`, in the order generated."""
    logprobs: list[tuple[float, list] | None] | None
    """(logprob, likeliest ids with theirs) of each token, None for a request that did not ask; the column
    itself is None when no token of this message has them."""
    finished: list[tuple[int, str, int, int, str | None]]
    """(rid, reason, prompt tokens, completion tokens, error): requests that ended (model.requests.Finished)."""


class StepBuilder:
    """The engine's side of a Step: the events of one front end since its last message, gathered as columns."""
    __slots__ = ("acks", "stats", "prompts", "rids", "ids", "logprobs", "finished")

    def __init__(self):
        self.acks, self.stats, self.prompts, self.finished = [], [], [], []
        self.rids: list[int] = []
        self.ids: list[int] = []
        self.logprobs: list | None = None

    def token(self, rid: int, id: int, logprob: float | None = None, top: list | None = None) -> None:
        self.rids.append(rid)
        self.ids.append(id)
        if logprob is not None and self.logprobs is None:
            self.logprobs = [None] * (len(self.ids) - 1)
        if self.logprobs is not None:
            self.logprobs.append(None if logprob is None else (logprob, top))

    def __bool__(self) -> bool:
        return bool(self.ids or self.finished or self.acks or self.stats or self.prompts)

    def message(self) -> Step:
        return Step(self.acks, self.stats, self.prompts, self.rids, self.ids, self.logprobs, self.finished)


# ---- refusals: a submit's errors, sent back by name ----

REFUSED: dict[str, type[Exception]] = {"QueueFull": QueueFull, "PromptTooLong": PromptTooLong,
                                       "EngineStopped": EngineStopped, "ValueError": ValueError}


def refusal_error(refusal: tuple[str, str]) -> Exception:
    """The exception a front end raises for an ack's refusal (EngineError for a name it does not know)."""
    kind, message = refusal
    return REFUSED.get(kind, EngineError)(message)


# ---- pacing ----

# a front end whose streams' events are spaced gets a message at most every this share of that spacing
# (its tokens wait in the engine meanwhile) instead of one each step: it wakes a few times a stream's
# spacing, not each step, and every wake-up costs it (a loop that slept runs its first work several times
# slower: bench/results/serving.md, "The front end's wake-ups"). A token then reaches its client at most
# this share of its spacing later; with one stream, or a few, that is under a step.
PACE_SHARE = 0.25


def spacing(streams: int, stream_interval: float, events_per_s: float) -> float:
    """Least seconds between two events of one stream: `stream_interval`, or more while `streams` streams
    would together send more than `events_per_s` events a second (0: no limit)."""
    return max(stream_interval, streams / events_per_s if events_per_s else 0.0)


def message_due(since_last: float, streams: int, pace: Pace) -> bool:
    """Whether a front end with `streams` open, paced by `pace`, may get its next message `since_last`
    seconds after its last one."""
    return since_last >= PACE_SHARE * spacing(streams, *pace)


NO_PACE = Pace(0.0, 0.0)  # a front end that sent no Pace: a message every step

# what a front end may leave unread before the engine drops it (it stopped reading: its process is
# stopped or stuck); below this its events wait for it, and the engine never waits on a front end
MAX_BACKLOG = 256 * 2 ** 20

# ---- framing ----


def frame(msg) -> bytes:
    """`msg` as Connection.send puts it on the wire (what Connection.recv reads), for a writer that is not
    the Connection: its pickle, after its length in 4 big-endian bytes, or -1 and the length in 8 when it
    does not fit 31 bits. Plain pickle: Connection.send's pickler copies its table of reducers (torch
    registers dozens) for every message."""
    payload = pickle.dumps(msg, pickle.HIGHEST_PROTOCOL)
    n = len(payload)
    head = n.to_bytes(4, "big") if n < 2 ** 31 else (-1).to_bytes(4, "big", signed=True) + n.to_bytes(8, "big")
    return head + payload


def unframe(buf: bytearray) -> tuple[list, int]:
    """The whole messages at the start of `buf` (removed from it), and how many bytes `buf` must hold
    before the next one can be read: `frame`'s format, read by a reader that is not a Connection."""
    pos, end, msgs = 0, len(buf), []
    while True:
        if end - pos < 4:
            need = 4
            break
        size, head = int.from_bytes(buf[pos:pos + 4], "big", signed=True), 4
        if size == -1:
            if end - pos < 12:
                need = 12
                break
            size, head = int.from_bytes(buf[pos + 4:pos + 12], "big"), 12
        if end - pos < head + size:
            need = head + size
            break
        msgs.append(pickle.loads(buf[pos + head:pos + head + size]))
        pos += head + size
    del buf[:pos]
    return msgs, need


def connect(address: str, authkey: bytes, process=None, timeout: float = 120.0) -> Connection:
    """A connection to the engine process at `address`, waiting for it to listen (it starts listening at
    once, then loads; the hello waits for the load). `process`: give up if it exits meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Client(address, "AF_UNIX", authkey=authkey)
        except (FileNotFoundError, ConnectionRefusedError):
            if process is not None and not process.is_alive():
                raise RuntimeError(f"the engine process exited (code {process.exitcode}) before it listened") from None
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
