"""Where a stage runs: device choice, the launch (one process, torchrun on one or several machines, or a
job some other launcher started), the process group, and rank-0 logging. Shared by every stage (a stage
never imports another stage).

Three ways a training stage runs on several processes:
- it relaunches itself under torchrun from the `runtime` keys (`nproc` per machine, `nnodes`, this
  machine's `node_rank`, node 0's `rdzv_endpoint`): torchrun's static rendezvous, so node 0's first
  process is global rank 0, and no restarts (a dead rank ends the job; the next run resumes from the
  last checkpoint);
- torchrun, Slurm's `srun` or `mpirun` started it (their environment variables say so): it joins that
  job as the rank the launcher gave it and relaunches nothing;
- neither: one process.
"""
from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from model.device import resolve_device as _device

# what each external launcher calls a process's global rank, the job's size and the rank on its machine
LAUNCHERS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK"),
    "srun": ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID"),  # STEP_: set in a job step, not sbatch's script
    "mpirun (Open MPI)": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    "mpirun (MPICH, Intel MPI)": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
}


class LaunchError(RuntimeError):
    """The job cannot be joined or started as configured; the message says what is missing."""


def log(msg: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(msg, file=sys.stderr, flush=True)


def resolve_device(name: str) -> torch.device:
    try:
        return _device(name)
    except ValueError as e:
        raise SystemExit(f"runtime.device: {e}; set runtime.device=cpu or auto") from None


def external_launcher(env=os.environ) -> str | None:
    """The launcher that started this process (a key of LAUNCHERS), or None."""
    return next((name for name, keys in LAUNCHERS.items() if all(k in env for k in keys[:2])), None)


def join_env(runtime, env=os.environ) -> dict[str, str]:
    """torch.distributed's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) for a
    process an external launcher started; {} when none did. srun and mpirun give no meeting point:
    MASTER_ADDR/MASTER_PORT from the environment, else `runtime.rdzv_endpoint`."""
    name = external_launcher(env)
    if name is None:
        return {}
    rank, world, local = (env.get(k, "0") for k in LAUNCHERS[name])
    out = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": local}
    if int(world) > 1:
        if "MASTER_ADDR" in env and "MASTER_PORT" in env:
            out |= {"MASTER_ADDR": env["MASTER_ADDR"], "MASTER_PORT": env["MASTER_PORT"]}
        elif runtime.rdzv_endpoint:
            host, port = runtime.master
            out |= {"MASTER_ADDR": host, "MASTER_PORT": str(port)}
        else:
            raise LaunchError(f"started by {name} as rank {rank} of {world}, but there is no address to meet at: "
                              f"set MASTER_ADDR and MASTER_PORT (e.g. node 0's hostname and 29500) or "
                              f"runtime.rdzv_endpoint")
    return out


def torchrun_command(runtime, module: str, args: list[str] = ()) -> list[str] | None:
    """The torchrun command that runs `python -m module *args` as this machine's part of the job the
    runtime keys describe; None when they describe one process."""
    if runtime.nproc == 1 and runtime.nnodes == 1:
        return None
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={runtime.nproc}", "--max-restarts=0"]
    if runtime.nnodes == 1:
        cmd.append("--standalone")
    else:
        host, port = runtime.master
        cmd += [f"--nnodes={runtime.nnodes}", f"--node-rank={runtime.node_rank}", f"--master-addr={host}",
                f"--master-port={port}"]
    return cmd + ["-m", module, *args]


def launch(runtime, module: str, run, args: list[str] = ()) -> None:
    """Runs `run()` in this process when it is one of a launcher's ranks or the only one; otherwise starts
    torchrun for this machine's ranks (each runs `python -m module *args`) and exits with its status."""
    joined = join_env(runtime)
    if joined:
        os.environ.update(joined)
        return run()
    cmd = torchrun_command(runtime, module, args)
    if cmd is None:
        return run()
    import subprocess
    where = f"machine {runtime.node_rank} of {runtime.nnodes}, meeting at {runtime.rdzv_endpoint}" \
        if runtime.nnodes > 1 else "this machine"
    print(f"{module}: {runtime.nproc} process(es) on {where}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    raise SystemExit(subprocess.call(cmd))


def setup_distributed(device: torch.device, timeout_s: int = 60, always: bool = False) -> tuple[int, int, torch.device]:
    """(rank, world size, device) of this process; joins the process group when there are several
    processes (or, with `always`, makes a group of this one process)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    if world == 1:
        if always:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, 1, device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timeout)
    return rank, world, device
