"""The engine process: the engine, and the channel's engine side that serves its front ends.

`sparkchat serve` runs three kinds of process (docs/serving.md, "Processes"): a supervisor, this engine
process, and one or more front ends (FastAPI + uvicorn) that render, tokenize, detokenize and frame SSE.
The engine's scheduler thread then shares its GIL with nothing but this file's one small thread. What
travels on the channel, and how, is serve.wire's; starting this process is serve.processes'.

The engine never waits on a front end: what a front end's socket cannot take yet waits in its backlog (a
front end that leaves wire.MAX_BACKLOG unread is dropped). Commands are read between steps by the
engine's scheduler thread while it has work (`before_step`), and by the host's own thread only while it
has none: a command to a busy engine wakes no thread, and its answer goes out with the next step's
events. `EngineHost` serves the channel over a started Engine; it runs in the engine process (`main`),
or in the front end's own process when a caller builds the engine itself (serve.runtime, tests).
"""
from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener

import torch

from model.chat_engine import chat_engine
from model.device import resolve_device
from model.model_dir import load_model_dir
from model.requests import Finished, PromptLogprobs, Token

from . import wire
from .processes import exit_with_parent, freeze_heap

log = logging.getLogger("sparkchat.serve")

READABLE = select.POLLIN | select.POLLHUP | select.POLLERR  # a command, or the connection's end


class _Peer:
    """One front end's connection: its requests by rid, the events not yet sent (`outbox`, a step message
    being built), and the bytes of sent messages that its socket has not taken yet (`backlog`)."""

    def __init__(self, conn: Connection):
        self.conn, self.requests, self.outbox, self.open = conn, {}, wire.StepBuilder(), True
        self.sock = socket.socket(fileno=os.dup(conn.fileno()))  # for sends that never block
        self.backlog = bytearray()
        self.pace = wire.NO_PACE  # its Pace command's; none: a message every step
        self.sent_at = 0.0  # time.monotonic() of its last message
        self.urgent = False  # an answer waits that may not be held (stats)


class EngineHost:
    """The channel's engine side over a started `model.engine.Engine`: `add(conn)` serves one more front
    end until its connection closes (then its requests are cancelled). The engine's hooks read the
    commands before each step and send each front end its events after it; while the engine is idle,
    the host's thread waits for commands instead. `info`: what a front end needs to know of the model
    (hello)."""

    def __init__(self, engine, info: dict):
        self.engine, self.info = engine, info
        self.lock = threading.Lock()  # the peers' outboxes and every send
        self.read_lock = threading.Lock()  # one thread reads the connections at a time
        self.state_lock = threading.Lock()  # `idle` against the engine's work
        self.peers: dict[int, _Peer] = {}  # by the connection's file descriptor
        # a poll object each reading thread (poll() may not run in two threads at once)
        self.step_ready, self.idle_ready = select.poll(), select.poll()
        self.wake_r, self.wake_w = os.pipe()  # a new front end wakes the idle thread's wait
        os.set_blocking(self.wake_r, False)
        self.idle_ready.register(self.wake_r, select.POLLIN)
        self.writing: set[int] = set()  # connections idle_ready also waits on for room to write
        self.idle = threading.Event()  # set while the engine has no work: the host's thread reads then
        self.idle.set()
        engine.before_step, engine.after_step, engine.on_idle = self.read_commands, self.flush, self._went_idle
        threading.Thread(target=self._wait_for_commands, name="sparkchat-channel", daemon=True).start()

    def add(self, conn: Connection) -> None:
        peer = _Peer(conn)
        with self.read_lock, self.lock:
            self._send(peer, wire.Hello(self.info, None))
            self.peers[conn.fileno()] = peer
            for ready in (self.step_ready, self.idle_ready):
                ready.register(conn.fileno(), select.POLLIN)
        os.write(self.wake_w, b"+")

    def _wait_for_commands(self) -> None:  # the host's thread
        while True:
            self.idle.wait()
            self._watch_writes()
            ready = self.idle_ready.poll()  # a command, a front end gone, a new one, or room to write
            with contextlib.suppress(BlockingIOError):
                os.read(self.wake_r, 4096)
            if any(ev & select.POLLOUT for _, ev in ready):
                with self.lock:
                    for fd, ev in ready:
                        if ev & select.POLLOUT and fd in self.peers:
                            self._drain(self.peers[fd])
            self.read_commands(self.idle_ready)
            with self.state_lock:
                busy = self._busy()
                if busy:  # the scheduler reads from now on, until it calls _went_idle
                    self.idle.clear()
            if not busy:  # no step will come to carry the answers
                self.flush(force=True)

    def _watch_writes(self) -> None:  # the host's thread, before it waits
        """Wait for room to write too on the connections with a backlog: with no step to come, nothing
        else would send it."""
        with self.lock:
            want = {fd for fd, peer in self.peers.items() if peer.backlog}
        for fd in want ^ self.writing:
            with contextlib.suppress(KeyError, OSError):  # (a peer dropped meanwhile)
                self.idle_ready.modify(fd, select.POLLIN | (select.POLLOUT if fd in want else 0))
        self.writing = want

    def _busy(self) -> bool:
        return bool(self.engine.waiting or self.engine.active)

    def _went_idle(self) -> None:  # the scheduler thread, out of work
        self.flush(force=True)  # what its pace held: no step will come to carry it
        with self.state_lock:
            if not self._busy():
                self.idle.set()

    def read_commands(self, ready=None) -> None:
        """Every command that has arrived (the scheduler thread before a step, or the host's thread)."""
        ready = ready or self.step_ready
        with self.read_lock:
            while fds := [fd for fd, ev in ready.poll(0) if ev & READABLE and fd in self.peers]:
                for fd in fds:
                    peer = self.peers[fd]
                    try:
                        self._command(peer, peer.conn.recv())
                    except (EOFError, OSError):  # the front end went away
                        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:  # under read_lock
        fd = peer.conn.fileno()
        with self.lock:
            peer.open = False
            del self.peers[fd]
        for ready in (self.step_ready, self.idle_ready):
            ready.unregister(fd)
        for req in list(peer.requests.values()):  # only its own connections end
            self.engine.cancel(req)
        peer.conn.close()
        peer.sock.close()

    def _command(self, peer: _Peer, msg) -> None:
        kind = type(msg)
        if kind is wire.Submit:  # a request's generations, all or none (they share a step's prefill)
            jobs = msg.jobs
            try:
                reqs = self.engine.submit_all([(prompt, params, self._sink(peer, rid)) for rid, prompt, params in jobs])
                peer.requests.update((rid, req) for (rid, _, _), req in zip(jobs, reqs))
                refusal = None
            except Exception as e:  # QueueFull, PromptTooLong, ... (wire.REFUSED); any other is the server's error
                refusal = (type(e).__name__, str(e))
            with self.lock:
                peer.outbox.acks.append((jobs[0][0], refusal))
        elif kind is wire.Cancel:
            req = peer.requests.get(msg.rid)
            if req is not None:
                self.engine.cancel(req)
        elif kind is wire.Pace:
            peer.pace = msg
        elif kind is wire.Stats:
            e = self.engine
            stats = {"queue_depth": e.queue_depth, "num_active": e.num_active, "steps": e.steps,
                     "cpu_seconds": e.cpu_seconds, "step_cpu_seconds": e.step_cpu_seconds,
                     "process_cpu_seconds": time.process_time(), "steps_ahead": e.steps_ahead,
                     "phase_seconds": dict(e.phase_seconds), "admissions": e.admissions,
                     "admitted_rows": e.admitted_rows}
            with self.lock:
                peer.outbox.stats.append((msg.key, stats))
                peer.urgent = True
        else:
            log.warning("a front end sent %r, which is not a command: ignored", kind.__name__)

    def _sink(self, peer: _Peer, rid: int):
        return lambda ev: self._event(peer, rid, ev)

    def _event(self, peer: _Peer, rid: int, ev) -> None:  # the engine's sink (its thread, or a cancel's)
        kind = type(ev)
        with self.lock:
            out = peer.outbox
            if kind is Token:
                out.token(rid, ev.id, ev.logprob, ev.top)
            elif kind is Finished:
                out.finished.append((rid, ev.reason, ev.prompt_tokens, ev.completion_tokens, ev.error))
                peer.requests.pop(rid, None)
            else:
                assert kind is PromptLogprobs, kind
                out.prompts.append((rid, ev.logprobs, ev.top))

    def flush(self, force: bool = False) -> None:
        """Send each front end the events gathered since its last message, as one message, unless its pace
        holds them a while longer (`force`: send them all; nothing else may come to carry them)."""
        now = time.monotonic()
        with self.lock:
            for peer in self.peers.values():
                if peer.outbox and (force or peer.urgent
                                    or wire.message_due(now - peer.sent_at, len(peer.requests), peer.pace)):
                    batch, peer.outbox = peer.outbox, wire.StepBuilder()
                    peer.sent_at, peer.urgent = now, False
                    self._send(peer, batch.message())
                elif peer.backlog:
                    self._drain(peer)

    def _send(self, peer: _Peer, msg) -> None:  # under self.lock
        """Send without waiting: what the socket cannot take now waits in the peer's backlog, sent first
        at the next flush (or by the host's thread when the engine is idle)."""
        if peer.open:
            peer.backlog += wire.frame(msg)
            self._drain(peer)

    def _drain(self, peer: _Peer) -> None:  # under self.lock
        try:
            while peer.backlog:
                n = peer.sock.send(peer.backlog, socket.MSG_DONTWAIT)
                del peer.backlog[:n]
        except BlockingIOError:
            if len(peer.backlog) > wire.MAX_BACKLOG:
                log.error("a front end left %d MiB unread: dropping it (its requests are cancelled)",
                          len(peer.backlog) >> 20)
                self._hang_up(peer)
        except OSError:  # it died: the next read drops it
            self._hang_up(peer)

    def _hang_up(self, peer: _Peer) -> None:  # under self.lock
        """Stop sending to a peer; its connection reads as ended from now on, so the next read of the
        commands drops it (and cancels its requests)."""
        peer.open, peer.backlog = False, bytearray()
        with contextlib.suppress(OSError):
            peer.sock.shutdown(socket.SHUT_RDWR)


def load_engine(model_dir, device: str | None, max_batch: int, max_queue: int, weights: str = "bf16"):
    """(a started chat engine over the model directory, its hello info); `weights`: serve.settings'."""
    dev = resolve_device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    t = time.perf_counter()
    if weights == "fp8":
        from model.precision import fp8_weights
        model, tok, gen = fp8_weights.load_model_dir(model_dir, dev, dtype)
    else:
        model, tok, gen = load_model_dir(model_dir, dev, dtype)
    engine = chat_engine(model, tok, gen, max_batch=max_batch, max_queue=max_queue)
    log.info("loaded %s on %s (%s%s) in %.2fs: %.1fM parameters, context %d", model_dir, dev, dtype,
             ", FP8 Linear weights" if weights == "fp8" else "", time.perf_counter() - t, model.num_params() / 1e6,
             engine.max_len)
    info = {"context_len": engine.max_len, "vocab_size": engine.vocab_size, "max_queue": engine.config.max_queue,
            "defaults": gen,
            "tokenizer": tok.to_str()}  # what a front end needs to render, check and sample: no weights
    return engine, info


def main(model_dir: str, device: str | None, max_batch: int, max_queue: int, address: str, authkey: bytes,
         exit_on_failed_load: bool = False, weights: str = "bf16") -> None:
    """The engine process: listen at `address` at once, load the model, then serve every front end that
    connects. A load that fails is said to every front end instead, or with `exit_on_failed_load` ends
    this process with code 1 (`sparkchat serve`: a server that can never answer stops, saying why)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # Ctrl-C, and a service manager's SIGTERM, reach the whole group: the parent stops this one (EngineProcess.stop)
    # once the front ends have finished their streams, which an engine gone first would cut with an error
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    listener = Listener(address, "AF_UNIX", backlog=64, authkey=authkey)
    try:
        host, error = EngineHost(*load_engine(model_dir, device, max_batch, max_queue, weights)), None
        freeze_heap()
    except Exception as e:
        log.exception("loading the model failed")
        if exit_on_failed_load:
            sys.exit(1)
        host, error = None, f"{type(e).__name__}: {e}"
    while True:
        try:  # the handshake: a front end that died while queued here, or a wrong key, fails only itself
            conn = listener.accept()
            if host is None:
                conn.send(wire.Hello(None, error))  # (once a connection: Connection.send's pickler will do)
                continue
            host.add(conn)
        except (OSError, EOFError, AuthenticationError) as e:
            log.warning("a front end's connection failed at its start (%s: %s): it is not served",
                        type(e).__name__, e)
