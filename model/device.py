"""The torch device a command runs on: one reading of `--device` and `runtime.device` for every command."""
from __future__ import annotations

import torch


def resolve_device(name: str | None) -> torch.device:
    """`name` as a torch device; None or "auto": cuda when torch sees a GPU, else cpu. A name torch does
    not know, or a GPU this machine does not have, is a ValueError that says so (before any model loads,
    rather than a load failing deep inside)."""
    if name in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"'{name}' is not a torch device (cpu, cuda, cuda:N, mps, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"'{name}': torch sees no CUDA GPU here (torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"'{name}': this machine has {torch.cuda.device_count()} CUDA GPU(s), numbered from 0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"'{name}': torch sees no Apple GPU (MPS) here")
    return device
