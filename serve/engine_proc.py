"""The engine's side of the server: the engine in a process of its own, and the channel to the front ends.

`sparkchat serve` runs three kinds of process (docs/serving.md, "Processes"): a supervisor, this engine
process, and one or more front ends (FastAPI + uvicorn) that render, tokenize, detokenize and frame SSE.
The engine's scheduler thread then shares its GIL with nothing but this file's small reader threads.

The channel is a `multiprocessing.connection` per front end (a Unix socket, pickled tuples; why not
JSON: docs/serving.md, "The channel"). A front end sends commands, the engine answers:

    ("submit", rid, prompt ids, SamplingParams)  ->  ("ack", rid, None | (error class name, message))
    ("cancel", rid)
    ("stats", token)                              ->  ("stats", token, {queue_depth, num_active, ...})
                                                  <-  ("hello", info | None, load error | None) on connect
                                                  <-  ("step", [event, ...]) once per engine step

A step's message holds every event of that front end's requests in that step, as plain tuples:
(rid, id) a token, (rid, id, logprob, top) a token with its logprobs, (rid, PROMPT, logprobs, top) a
prompt's logprobs, (rid, FINISH, reason, completion tokens, error) a request's end. One message per step
and front end, not one per token: a send is a system call and a wake-up on the other side.

`EngineHost` serves the channel over a started Engine; it runs in the engine process (`main`), or in a
thread of the front end's own process when a caller builds the engine itself (serve.runtime, tests).
"""
from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import secrets
import signal
import tempfile
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path

import torch

from model.chat_engine import chat_engine
from model.model_dir import load_model_dir

log = logging.getLogger("sparkchat.serve")

FINISH, PROMPT = -1, -2  # an event's second field: a token id, or one of these
REFUSALS = ("QueueFull", "PromptTooLong", "EngineStopped", "ValueError")  # submit errors sent back by name


class _Peer:
    """One front end's connection: its requests by rid, and the events not yet sent."""

    def __init__(self, conn: Connection):
        self.conn, self.requests, self.outbox, self.open = conn, {}, [], True


class EngineHost:
    """The channel's engine side over a started `model.engine.Engine`. `serve(conn)` answers one front
    end until its connection closes (then its requests are cancelled); the engine's `after_step` sends
    each front end its step's events. `info`: what a front end needs to know of the model (hello)."""

    def __init__(self, engine, info: dict):
        self.engine, self.info = engine, info
        self.lock = threading.Lock()  # the peers' outboxes and every send
        self.peers: list[_Peer] = []
        engine.after_step = self.flush

    def serve(self, conn: Connection) -> None:
        peer = _Peer(conn)
        with self.lock:
            self.peers.append(peer)
            self._send(peer, ("hello", self.info, None))
        try:
            while peer.open:
                self._command(peer, conn.recv())
                self.flush()  # a cancel's Finished comes from this thread, and the engine may be idle
        except (EOFError, OSError):
            pass  # the front end went away
        finally:
            with self.lock:
                peer.open = False
                self.peers.remove(peer)
            for req in list(peer.requests.values()):  # only its own connections end
                self.engine.cancel(req)
            conn.close()

    def _command(self, peer: _Peer, msg: tuple) -> None:
        kind = msg[0]
        if kind == "submit":
            _, rid, prompt, params = msg
            try:
                peer.requests[rid] = self.engine.submit(prompt, params, lambda ev: self._event(peer, rid, ev))
                refusal = None
            except Exception as e:  # QueueFull, PromptTooLong, ... (REFUSALS); any other is the server's error
                refusal = (type(e).__name__, str(e))
            with self.lock:
                self._send(peer, ("ack", rid, refusal))
        elif kind == "cancel":
            req = peer.requests.get(msg[1])
            if req is not None:
                self.engine.cancel(req)
        elif kind == "stats":
            e = self.engine
            stats = {"queue_depth": e.queue_depth, "num_active": e.num_active, "steps": e.steps,
                     "cpu_seconds": e.cpu_seconds, "step_cpu_seconds": e.step_cpu_seconds,
                     "process_cpu_seconds": time.process_time()}
            with self.lock:
                self._send(peer, ("stats", msg[1], stats))

    def _event(self, peer: _Peer, rid: int, ev) -> None:  # the engine's sink (its thread, or a cancel's)
        logprob = getattr(ev, "logprob", None)
        if hasattr(ev, "forced"):  # a Token
            item = (rid, ev.id) if logprob is None else (rid, ev.id, logprob, ev.top)
        elif hasattr(ev, "reason"):  # Finished
            item = (rid, FINISH, ev.reason, ev.completion_tokens, ev.error)
            peer.requests.pop(rid, None)
        else:  # PromptLogprobs
            item = (rid, PROMPT, ev.logprobs, ev.top)
        with self.lock:
            peer.outbox.append(item)

    def flush(self) -> None:
        """Send each front end the events gathered since the last flush, as one message."""
        with self.lock:
            for peer in self.peers:
                if peer.outbox:
                    batch, peer.outbox = peer.outbox, []
                    self._send(peer, ("step", batch))

    def _send(self, peer: _Peer, msg) -> None:  # under self.lock
        if peer.open:
            try:
                peer.conn.send(msg)
            except OSError:  # it died: its reader thread cleans up
                peer.open = False


def pick_device(device: str | None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_engine(model_dir, device: str | None, max_batch: int, max_queue: int):
    """(a started chat engine over the model directory, its hello info)."""
    dev = pick_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    t = time.perf_counter()
    model, tok, gen = load_model_dir(model_dir, dev, dtype)
    engine = chat_engine(model, tok, gen, max_batch=max_batch, max_queue=max_queue)
    log.info("loaded %s on %s (%s) in %.2fs: %.1fM parameters, context %d", model_dir, dev, dtype,
             time.perf_counter() - t, model.num_params() / 1e6, engine.max_len)
    info = {"context_len": engine.max_len, "vocab_size": engine.vocab_size, "defaults": gen,
            "tokenizer": tok.to_str()}  # what a front end needs to render, check and sample: no weights
    return engine, info


def freeze_heap() -> None:
    """Leave what start-up built (modules, the app, the model) out of the collector's passes from now on:
    a full pass otherwise walks every object of torch, FastAPI and Gradio, and stops a front end's
    streams, or the engine's decode step, for as long (bench/results/serving.md, "The collector")."""
    gc.collect()
    gc.freeze()


def _exit_with_parent() -> None:
    """Leave when the process that started this one is gone (killed with -9: nothing else tells us)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main(model_dir: str, device: str | None, max_batch: int, max_queue: int, address: str, authkey: bytes) -> None:
    """The engine process: listen at `address` at once, load the model, then serve every front end that
    connects (each in a thread of its own). A load that fails is said to every front end instead."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the parent stops this one
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    listener = Listener(address, "AF_UNIX", backlog=64, authkey=authkey)
    try:
        host, error = EngineHost(*load_engine(model_dir, device, max_batch, max_queue)), None
        freeze_heap()
    except Exception as e:
        log.exception("loading the model failed")
        host, error = None, f"{type(e).__name__}: {e}"
    while True:
        conn = listener.accept()
        if host is None:
            conn.send(("hello", None, error))
            continue
        threading.Thread(target=host.serve, args=(conn,), name="sparkchat-frontend", daemon=True).start()


class EngineProcess:
    """An engine process started from here (multiprocessing, 'spawn': a fresh interpreter, no copy of
    this one's threads), and where front ends connect to it (`address`, `authkey`)."""

    def __init__(self, model_dir, device: str | None, max_batch: int, max_queue: int):
        self.dir = tempfile.mkdtemp(prefix="sparkchat-")
        self.address, self.authkey = str(Path(self.dir) / "engine.sock"), secrets.token_bytes(16)
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=main, name="sparkchat-engine", daemon=True,
                                   args=(str(model_dir), device, max_batch, max_queue, self.address, self.authkey))
        self.process.start()

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join(10)
        for f in Path(self.dir).glob("*"):
            f.unlink()
        os.rmdir(self.dir)


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
