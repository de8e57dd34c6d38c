"""`sparkchat serve`'s processes: the engine's, N front ends', and this one, which starts and watches them.

    supervisor ── engine process (serve.engine_proc): the model, the scheduler thread, the channel's thread
               └─ front end 1..N (serve.api under uvicorn, all accepting on the one socket bound here)

Each process has its own GIL: the engine's scheduler thread is not slowed by HTTP, rendering,
detokenizing or SSE framing, and N front ends use N cores for them. Faults (docs/serving.md, "Faults"):
the engine process gone ends the server with exit code 1 within seconds (nothing can serve without it;
a process manager restarts the whole); so does an engine that stays hung (serve.watchdog); a front end
gone loses only its own connections and is started again: at once if it had reached the engine (killed
while serving, by an OOM killer, say), while one that keeps failing before it does backs off, then ends
the server. Every child leaves when this process does (serve.processes.exit_with_parent); folders
in the temp directory left by a supervisor killed with -9 are removed at the next start.
"""
from __future__ import annotations

import asyncio
import dataclasses
import getpass
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
from pathlib import Path

from .limits import http_protocol, raise_fd_limit
from .metrics import MULTIPROC_ENV
from .settings import Settings
from .watchdog import EngineWatch

log = logging.getLogger("sparkchat.serve")


LEAVE_AFTER_S = 1.0  # a front end whose channel to the engine ended exits this much later
# A front end that exits before it reached the engine (within QUICK_EXIT_S of its start, or still waiting
# for the load) is failing at its start, not hit by a fault once (a process manager's start limit does the
# same): each such exit in a row waits twice as long before the restart (0, 1, 2, 4 s), and the
# QUICK_EXITS-th stops the server with code 1 instead of restarting it forever. One that had reached the
# engine (it served: killed by an OOM killer under load, say) is started again at once, and resets the count.
QUICK_EXIT_S = 30.0
QUICK_EXITS = 5
TEMP_PREFIXES = ("sparkchat-metrics-", "sparkchat-")  # a supervisor's folders: PREFIX + its pid + "-" + random
STOP_S = 10.0  # on SIGINT/SIGTERM the front ends have this long, together, to finish their streams


def frontend_main(settings: Settings, sock: socket.socket, log_level: str, ready=None) -> None:
    """One front-end process: the FastAPI app over the running engine process, served by uvicorn on `sock`
    with serve.limits' protocol. `ready` (an Event) is set once the app has reached the engine."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from .processes import exit_with_parent, freeze_heap
    threading.Thread(target=exit_with_parent, daemon=True).start()
    import uvicorn

    from .api import create_app
    app = create_app(settings)

    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=settings.access_log,
                                           http=http_protocol(settings), timeout_keep_alive=settings.keep_alive_timeout))

    def leave(why: str) -> None:  # on the loop: give the open streams a moment to send their error
        server.should_exit = True  # and take no new connection meanwhile (the other front ends do)
        asyncio.get_running_loop().call_later(LEAVE_AFTER_S, os._exit, 1)

    # the channel ended: if the engine process died, the supervisor is ending the server; if the engine
    # dropped this front end (it had stopped reading), the supervisor starts it again
    app.state.on_engine_lost = leave
    app.state.on_ready = ready.set if ready is not None else None
    freeze_heap()
    server.run(sockets=[sock])


def remove_stale_folders(temp: str | None = None) -> list[str]:
    """Remove the temp folders (engine socket, metrics) of supervisors that are gone; the ones removed."""
    removed = []
    for d in Path(temp or tempfile.gettempdir()).glob("sparkchat-*"):
        prefix = next(p for p in TEMP_PREFIXES if d.name.startswith(p))
        pid = d.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or not d.is_dir() or d.owner() != getpass.getuser():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # its supervisor lives (or another process has its pid: leave it)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(d, ignore_errors=True)
        removed.append(str(d))
    if removed:
        log.info("removed %d temp folder(s) of servers that were killed: %s", len(removed), ", ".join(removed))
    return removed


def run(settings: Settings, sock: socket.socket, log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM (exit code 0) or until the engine process dies or hangs (1), with
    `settings.api_servers` front ends on `sock`; this function fills in the engine's address."""
    from .processes import EngineProcess
    remove_stale_folders()
    raise_fd_limit()  # before the front ends start: they inherit it
    metrics_dir = tempfile.mkdtemp(prefix=f"sparkchat-metrics-{os.getpid()}-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # the front ends add up each other's counters (serve.metrics)
    engine = EngineProcess(settings.model_dir, settings.device, settings.max_batch, settings.max_queue,
                           exit_on_failed_load=True, weights=settings.weights)
    frontend = dataclasses.replace(settings, engine_address=engine.address, engine_authkey=engine.authkey)
    ctx = multiprocessing.get_context("spawn")

    api_servers = settings.api_servers
    ready = [ctx.Event() for _ in range(api_servers)]  # front end i has reached the engine since its start

    def start(i: int, first: bool = False):
        # only the first front end answers "loading" while the engine loads; the others, and any started
        # again, join once they reach it (serve.api.Settings.serve_while_loading)
        ready[i].clear()
        p = ctx.Process(target=frontend_main,
                        args=(dataclasses.replace(frontend, serve_while_loading=first), sock, log_level, ready[i]),
                        name=f"sparkchat-frontend-{i}")
        p.start()
        return p

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    hung: list[str] = []

    def on_hung(why: str) -> None:
        hung.append(why)
        stop.set()

    watch = EngineWatch(engine.address, engine.authkey, settings.engine_timeout, on_hung,
                        engine.process)
    frontends = [start(i, first=i == 0) for i in range(api_servers)]
    started = [time.monotonic()] * api_servers
    quick = [0] * api_servers  # exits in a row before reaching the engine (within QUICK_EXIT_S of the start)
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
                    served = ready[i].is_set()
                    quick[i] = quick[i] + 1 if not served and now - started[i] < QUICK_EXIT_S else 0
                    if quick[i] >= QUICK_EXITS:
                        log.error("front end %d exited %d times in a row within %.0f s of its start (last code %s; "
                                  "its log above says why): stopping the server", i, quick[i], QUICK_EXIT_S,
                                  p.exitcode)
                        stop.set()
                        code = 1
                        break
                    delay = 2.0 ** (quick[i] - 2) if quick[i] >= 2 else 0.0
                    log.warning("front end %d exited (code %s%s): its connections are lost; starting it again%s",
                                i, p.exitcode, "" if served else ", before it reached the engine",
                                f" in {delay:.0f} s" if delay else "")
                    restart_at[i] = now + delay
                if restart_at[i] is not None and now >= restart_at[i] and not stop.is_set():
                    frontends[i], started[i], restart_at[i] = start(i), now, None
        if hung:
            log.error("%s: stopping the server", hung[0])
            code = 1
    finally:
        watch.stop()
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
