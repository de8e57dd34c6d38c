"""The one interface every precision backend implements.

A backend is a model converter applied after the model is built and before `torch.compile`: it swaps
whole `nn.Linear` modules (those the layer filter accepts) for its own, and may wrap the forward in an
autocast context. Before any of that, `check(device)` says whether it can run here at all; the training
loop calls it before reading data or writing anything, so a backend that cannot run fails first.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
import torch.nn as nn


class BackendUnavailable(RuntimeError):
    """Raised by `check`: this backend cannot run on this machine. The message says why and what runs."""


@dataclass
class LayerFilter:
    """Which Linear layers a backend converts. FP8/FP4 GEMMs need dims divisible by 16; the output head
    (and embeddings, which are not Linears) stay in higher precision by default."""
    dim_multiple: int = 16
    skip: list[str] = field(default_factory=lambda: ["lm_head"])

    def __call__(self, fqn: str, module: nn.Module) -> bool:
        if not isinstance(module, nn.Linear):
            return False
        if any(s and s in fqn for s in self.skip):
            return False
        return module.in_features % self.dim_multiple == 0 and module.out_features % self.dim_multiple == 0


def swap_linears(model: nn.Module, layer_filter: Callable[[str, nn.Module], bool],
                 make: Callable[[nn.Linear], nn.Module]) -> int:
    """Replace every Linear that the filter accepts by make(linear); returns how many were swapped."""
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            fqn = f"{parent_name}.{name}" if parent_name else name
            if layer_filter(fqn, child):
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


class PrecisionBackend:
    name: ClassVar[str]
    emulated: ClassVar[bool] = False  # numerics emulated in high precision: never faster, labelled so
    supports_compile: ClassVar[bool] = True

    def __init__(self, options: dict | None = None, layer_filter: LayerFilter | None = None):
        self.options = dict(options or {})
        self.layer_filter = layer_filter or LayerFilter()
        self.converted = 0

    # -- capability ---------------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when the backend can run on `device`, else why not (missing package, capability...)."""
        return None

    def check(self, device: torch.device) -> None:
        reason = self.unavailable_reason(device)
        if reason is not None:
            from . import available_backends  # late import: the registry imports this module
            runs = [n for n in available_backends(device) if n != self.name]
            raise BackendUnavailable(
                f"precision backend '{self.name}' cannot run on this machine ({describe_device(device)}): "
                f"{reason}. Backends that run here: {', '.join(runs) or 'none'}.")

    # -- what the training loop uses ------------------------------------------------------------
    def compute_dtype(self, device: torch.device) -> torch.dtype:
        return torch.bfloat16 if device.type == "cuda" else torch.float32

    def convert(self, model: nn.Module) -> nn.Module:
        return model

    def autocast(self, device: torch.device):
        dtype = self.compute_dtype(device)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def describe(self, device: torch.device) -> str:
        """One line for the log: what runs, in what dtype, and why."""
        label = " (EMULATED numerics: high-precision matmuls, no speedup)" if self.emulated else ""
        return f"precision backend {self.name}{label}: compute dtype {self.compute_dtype(device)}, " \
               f"{self.converted} Linear layers converted"


def describe_device(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}"
    return str(device)
