"""Where a stage runs: device choice, the process group under torchrun, and rank-0 logging.
Shared by every stage (a stage never imports another stage)."""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def log(msg: str) -> None:
    if int(os.environ.get("RANK", 0)) == 0:
        print(msg, file=sys.stderr, flush=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"runtime.device={name} but torch sees no CUDA GPU (torch {torch.__version__}); "
                         f"set runtime.device=cpu or auto")
    return torch.device(name)


def setup_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return 0, 1, device
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    if device.type == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


