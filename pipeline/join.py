"""`sparkchat join --node-rank N`: this machine's part of every training stage that node 0 runs.

In a job of several machines (`runtime.nnodes` > 1, the project directory on a filesystem they all
mount), node 0 runs the pipeline (`dvc repro`, `dvc exp run`): each training stage it starts waits at
`runtime.rdzv_endpoint` for the other machines. Every other machine runs this command once, in the
project directory: it starts this machine's `runtime.nproc` ranks under torchrun (as machine N), they
learn from global rank 0 which stage runs and run it, and when the stage ends the command waits for
the next one. Ctrl-C ends it; stopping it mid-stage stops that stage on every machine, and the next
`dvc repro` resumes from the last checkpoint.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="sparkchat join", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--node-rank", type=int, required=True,
                    help="this machine's rank, 1 .. runtime.nnodes-1 (node 0 runs the pipeline)")
    ap.add_argument("--once", action="store_true", help="join one stage, then exit with its status")
    return ap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    from model.model_dir import ModelDirError
    from model.precision import BackendUnavailable

    from .config import ConfigError, load_params
    from .data import DataError
    from .runtime import LaunchError, join_env, torchrun_command
    try:
        p = load_params()
        joined = join_env(p.runtime)
        if joined:  # one of the ranks started below
            os.environ.update(joined)
            from .rl import STAGE as RL, rl_started
            from .stage import start
            from .train import train_started
            started = start(None, p)  # global rank 0 says which stage runs
            (rl_started if started[0] == RL else train_started)(*started)
            return
        if p.runtime.nnodes < 2:
            raise ConfigError("runtime.nnodes is 1 in params.yaml: there is no job of several machines to join")
        if a.node_rank == 0:
            raise ConfigError("--node-rank 0 is the machine that runs the pipeline (dvc repro); the others join it")
        if not 0 < a.node_rank < p.runtime.nnodes:
            raise ConfigError(f"--node-rank must be in 1..{p.runtime.nnodes - 1} (runtime.nnodes={p.runtime.nnodes}), "
                              f"got {a.node_rank}")
        runtime = dataclasses.replace(p.runtime, node_rank=a.node_rank)
        cmd = torchrun_command(runtime, "pipeline.join", ["--node-rank", str(a.node_rank)])
        while True:
            print(f"join: machine {a.node_rank} of {runtime.nnodes}, waiting at {runtime.rdzv_endpoint} for node 0's "
                  f"next training stage", file=sys.stderr, flush=True)
            rc = subprocess.call(cmd)
            if a.once:
                raise SystemExit(rc)
            print(f"join: the stage ended with status {rc}", file=sys.stderr, flush=True)
            time.sleep(2)
    except (ConfigError, BackendUnavailable, ModelDirError, DataError, LaunchError) as e:
        raise SystemExit(f"join: {e}") from None


if __name__ == "__main__":
    main()
