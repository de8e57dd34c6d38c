"""`sparkchat serve`'s processes: the engine's, N front ends', and this one, which starts and watches them.

    supervisor ── engine process (serve.engine_proc): the model, the scheduler thread, the channel's thread
               └─ front end 1..N (serve.api under uvicorn, all accepting on the one socket bound here)

Each process has its own GIL: the engine's scheduler thread is not slowed by HTTP, rendering,
detokenizing or SSE framing, and N front ends use N cores for them. Faults (docs/serving.md, "Faults"):
the engine process gone ends the server with exit code 1 within seconds (nothing can serve without it;
a process manager restarts the whole); a front end gone loses only its own connections and is started
again, at once the first time; one that keeps failing at its start backs off, then ends the server.
Every child leaves when this process does (serve.processes.exit_with_parent).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait

from .metrics import MULTIPROC_ENV
from .settings import Settings

log = logging.getLogger("sparkchat.serve")


LEAVE_AFTER_S = 1.0  # a front end whose channel to the engine ended exits this much later
# A front end that exits within QUICK_EXIT_S of its start is failing, not hit by a fault once (a process
# manager's start limit does the same): each such exit in a row waits twice as long before the restart
# (0, 1, 2, 4 s), and the QUICK_EXITS-th stops the server with code 1 instead of restarting it forever.
QUICK_EXIT_S = 30.0
QUICK_EXITS = 5
STOP_S = 10.0  # on SIGINT/SIGTERM the front ends have this long, together, to finish their streams


def frontend_main(settings: Settings, sock: socket.socket, log_level: str) -> None:
    """One front-end process: the FastAPI app over the running engine process, served by uvicorn on `sock`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .processes import exit_with_parent, freeze_heap
    threading.Thread(target=exit_with_parent, daemon=True).start()
    import uvicorn

    from .api import create_app
    app = create_app(settings)

    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=settings.access_log))

    def leave(why: str) -> None:  # on the loop: give the open streams a moment to send their error
        server.should_exit = True  # and take no new connection meanwhile (the other front ends do)
        asyncio.get_running_loop().call_later(LEAVE_AFTER_S, os._exit, 1)

    # the channel ended: if the engine process died, the supervisor is ending the server; if the engine
    # dropped this front end (it had stopped reading), the supervisor starts it again
    app.state.on_engine_lost = leave
    freeze_heap()
    server.run(sockets=[sock])


def run(settings: Settings, sock: socket.socket, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or until the engine process dies (1), with
    `settings.api_servers` front ends on `sock`; this function fills in the engine's address."""
    from .processes import EngineProcess
    metrics_dir = tempfile.mkdtemp(prefix="sparkchat-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # the front ends add up each other's counters (serve.metrics)
    engine = EngineProcess(settings.model_dir, settings.device, settings.max_batch, settings.max_queue,
                           exit_on_failed_load=True, weights=settings.weights)
    frontend = dataclasses.replace(settings, engine_address=engine.address, engine_authkey=engine.authkey)
    ctx = multiprocessing.get_context("spawn")

    def start(i: int, first: bool = False):
        # only the first front end answers "loading" while the engine loads; the others, and any started
        # again, join once they reach it (serve.api.Settings.serve_while_loading)
        p = ctx.Process(target=frontend_main,
                        args=(dataclasses.replace(frontend, serve_while_loading=first), sock, log_level),
                        name=f"sparkchat-frontend-{i}")
        p.start()
        return p

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    api_servers = settings.api_servers
    frontends = [start(i, first=i == 0) for i in range(api_servers)]
    started = [time.monotonic()] * api_servers
    quick = [0] * api_servers  # exits in a row within QUICK_EXIT_S of the start
    restart_at: list[float | None] = [None] * api_servers  # when a front end that exited starts again
    code = 0
    try:
        while not stop.is_set():
            wait([engine.process.sentinel] + [p.sentinel for p in frontends if p.is_alive()], timeout=0.2)
            if stop.is_set():
                break
            if not engine.process.is_alive():
                log.error("the engine process exited (code %s; its log above says why): stopping the server",
                          engine.process.exitcode)
                code = 1
                break
            now = time.monotonic()
            for i, p in enumerate(frontends):
                if restart_at[i] is None and not p.is_alive():
                    quick[i] = quick[i] + 1 if now - started[i] < QUICK_EXIT_S else 0
                    if quick[i] >= QUICK_EXITS:
                        log.error("front end %d exited %d times in a row within %.0f s of its start (last code %s; "
                                  "its log above says why): stopping the server", i, quick[i], QUICK_EXIT_S,
                                  p.exitcode)
                        stop.set()
                        code = 1
                        break
                    delay = 2.0 ** (quick[i] - 2) if quick[i] >= 2 else 0.0
                    log.warning("front end %d exited (code %s): its connections are lost; starting it again%s",
                                i, p.exitcode, f" in {delay:.0f} s" if delay else "")
                    restart_at[i] = now + delay
                if restart_at[i] is not None and now >= restart_at[i] and not stop.is_set():
                    frontends[i], started[i], restart_at[i] = start(i), now, None
    finally:
        sock.close()  # once each front end has closed its copy too, a new connection is refused, not queued
        for p in frontends:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn stops taking connections, lets its streams end and leaves
        deadline = time.monotonic() + STOP_S
        for p in frontends:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
        engine.stop()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code
