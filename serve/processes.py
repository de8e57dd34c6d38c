"""Starting and keeping the server's processes: the engine process's handle, and what every process of
`sparkchat serve` does at its start (leave with its parent, freeze its start-up heap).

Nothing here imports torch: the engine process loads it itself (serve.engine_proc), so a supervisor or
a front end that starts one stays small.
"""
from __future__ import annotations

import gc
import multiprocessing
import os
import secrets
import tempfile
import time
from pathlib import Path


def freeze_heap() -> None:
    """Leave what start-up built (modules, the app, the model) out of the collector's passes from now on:
    a full pass otherwise walks every object of torch, FastAPI and Gradio, and stops a front end's
    streams, or the engine's decode step, for as long (bench/results/serving.md, "The collector")."""
    gc.collect()
    gc.freeze()


def exit_with_parent() -> None:
    """Leave when the process that started this one is gone (killed with -9: nothing else tells us)."""
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def _engine_main(*args) -> None:  # the engine process's target: imports torch there, not here
    from .engine_proc import main
    main(*args)


class EngineProcess:
    """An engine process started from here (multiprocessing, 'spawn': a fresh interpreter, no copy of
    this one's threads), and where front ends connect to it (`address`, `authkey`: serve.wire.connect)."""

    def __init__(self, model_dir, device: str | None, max_batch: int, max_queue: int,
                 exit_on_failed_load: bool = False, weights: str = "bf16"):
        self.dir = tempfile.mkdtemp(prefix=f"sparkchat-{os.getpid()}-")  # (the pid: serve.supervisor.remove_stale_folders)
        self.address, self.authkey = str(Path(self.dir) / "engine.sock"), secrets.token_bytes(16)
        ctx = multiprocessing.get_context("spawn")
        self.process = ctx.Process(target=_engine_main, name="sparkchat-engine", daemon=True,
                                   args=(str(model_dir), device, max_batch, max_queue, self.address, self.authkey,
                                         exit_on_failed_load, weights))
        self.process.start()

    def stop(self) -> None:
        """End the engine process: SIGKILL, since it ignores SIGTERM (serve.engine_proc.main) and holds nothing
        to save."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join()
        for f in Path(self.dir).glob("*"):
            f.unlink()
        os.rmdir(self.dir)
