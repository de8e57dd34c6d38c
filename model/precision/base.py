"""The one interface every precision backend implements.

A backend is a model converter applied after the model is built and before `torch.compile`: it swaps
whole `nn.Linear` modules (those the layer filter accepts) for its own, and may wrap the forward in an
autocast context. Before any of that, `check(device)` says whether it can run here at all; the training
loop calls it before reading data or writing anything, so a backend that cannot run fails first.
"""
from __future__ import annotations

import contextlib
from typing import Callable, ClassVar

import torch
import torch.nn as nn

from .options import LayerFilter, Options, options_for


class BackendUnavailable(RuntimeError):
    """Raised by `check`: this backend cannot run on this machine. The message says why and what runs."""


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
    """(major, minor) of a CUDA device, None when `device` is not an available CUDA device.

    Every backend asks this one helper (as `base.cuda_capability`), so tests simulate a GPU by
    monkeypatching it rather than by mocking the backends' own checks."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def sm(cap: tuple[int, int] | None) -> str:
    return "no CUDA GPU" if cap is None else f"sm_{cap[0]}{cap[1]}"


# Evaluation switch: converted modules fall back to their high-precision path while this is off.
_LOW_PRECISION = {"enabled": True}


def low_precision_enabled() -> bool:
    return _LOW_PRECISION["enabled"]


@contextlib.contextmanager
def disable_low_precision():
    """Run converted modules in the compute dtype (e.g. for evaluation): `with disable_low_precision():`."""
    old = _LOW_PRECISION["enabled"]
    _LOW_PRECISION["enabled"] = False
    try:
        yield
    finally:
        _LOW_PRECISION["enabled"] = old


class PrecisionBackend:
    name: ClassVar[str]
    emulated: ClassVar[bool] = False  # numerics emulated in high precision: never faster, labelled so
    supports_compile: ClassVar[bool] = True
    # compile block by block (and the head) instead of the whole model: for modules torch.compile must
    # not trace (TE), whose graph break inside the layer loop would leave everything outside the
    # blocks (embedding, head, loss) uncompiled
    compile_regions: ClassVar[bool] = False
    # runs under FSDP2 (model/parallel.py): its converted modules compute from the model's own weight
    # Parameters, which FSDP gathers before each forward
    supports_fsdp: ClassVar[bool] = True

    def __init__(self, options: Options | None = None, layer_filter: LayerFilter | None = None):
        if options is not None and not isinstance(options, Options):
            raise TypeError(f"{self.name} takes typed options (options.BACKEND_OPTIONS), got {type(options).__name__}")
        self.options = options_for(self.name, options)  # this backend's dataclass (defaults when None); None if it has none
        self.layer_filter = layer_filter or LayerFilter()
        self.converted = 0

    # -- capability ---------------------------------------------------------------------------
    def unavailable_reason(self, device: torch.device) -> str | None:
        """None when the backend can run on `device`, else why not (missing package, capability...)."""
        return None

    def check_parallel(self, parallel: str) -> None:
        """Raises BackendUnavailable when this backend cannot train under `parallel` (ddp | fsdp)."""
        if parallel == "fsdp" and not self.supports_fsdp:
            raise BackendUnavailable(
                f"precision backend '{self.label}' does not run under runtime.parallel=fsdp (its modules keep "
                f"weights of their own, which FSDP would not shard); use runtime.parallel=ddp, or a backend that "
                f"does: {', '.join(fsdp_backends())}")

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
        """The dtype non-converted ops (and the high-precision side of converted ones) compute in.
        The one place this is decided; `compute_dtype_reason` says why."""
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32

    def compute_dtype_reason(self, device: torch.device) -> str:
        if torch.device(device).type == "cuda":
            return "CUDA: bf16 autocast over fp32 master weights"
        return "CPU: fp32 (CPU bf16 matmuls are slower than fp32 on most CPUs; keeps the baseline exact)"

    def notes(self, device: torch.device) -> list[str]:
        """Extra lines for the log (e.g. 'real FP8 on CPU: no speedup')."""
        return []

    def convert(self, model: nn.Module) -> nn.Module:
        return model

    def sync_ranks(self, model: nn.Module) -> None:
        """Once a step, after backward, under data parallelism: make per-rank state that steers the
        numerics agree on every rank (DDP all-reduces gradients, not such state). Nothing by default."""

    def autocast(self, device: torch.device):
        device = torch.device(device)
        dtype = self.compute_dtype(device)
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    def describe(self, device: torch.device) -> str:
        """One line for the log: what runs, in what dtype, and why."""
        label = " (EMULATED numerics: high-precision matmuls, no speedup)" if self.emulated else ""
        line = (f"precision backend {self.label}{label}: compute dtype {self.compute_dtype(device)} "
                f"({self.compute_dtype_reason(device)}), {self.converted} Linear layers converted")
        return "; ".join([line] + self.notes(device))

    @property
    def label(self) -> str:
        """Name plus the options that change numerics, e.g. 'te-fp8[current]'."""
        return self.name


def fsdp_backends() -> list[str]:
    from .registry import BACKENDS  # late import: the registry imports this module
    return [n for n, cls in BACKENDS.items() if cls.supports_fsdp]


def compile_model(model: nn.Module, regional: bool = False) -> nn.Module:
    """torch.compile for a GPT: the whole model, or (regional) each block and the head on their own.
    Every block is the same code, so regional compiles one block once and reuses it."""
    if not regional:
        return torch.compile(model, dynamic=False)
    for block in model.blocks:
        block.compile(dynamic=False)
    model.head = torch.compile(model.head, dynamic=False)
    return model


def describe_device(device: torch.device) -> str:
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)}, sm_{major}{minor}"
    return str(device)


class ConvertedLinear(nn.Linear):
    """Base of our own swapped-in Linears: same `weight`/`bias` Parameters (same objects, so names,
    checkpoints and an optimizer built afterwards are unchanged), a different forward."""
    is_low_precision = True

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs) -> "ConvertedLinear":
        new = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        new.weight = linear.weight
        if linear.bias is not None:
            new.bias = linear.bias
        new.configure(**kwargs)
        return new

    def configure(self, **kwargs) -> None:
        for k, v in kwargs.items():
            setattr(self, k, v)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", {type(self).__name__}"


# FP8 and FP4 tensor-core GEMMs want every dimension divisible by 16, the token count included: it is the
# inner dimension of the weight-gradient GEMM. A batch of any other count (the rl stage's rows) runs with
# zero rows added, which change no amax, no scale and no gradient.
ROW_MULTIPLE = 16


def pad_rows(t: torch.Tensor, multiple: int = ROW_MULTIPLE) -> torch.Tensor:
    """t (2-D) with zero rows added up to a multiple of `multiple` rows; t itself when it has one."""
    extra = (-t.shape[0]) % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, t.shape[1])])


def matmul_dtype(x: torch.Tensor) -> torch.dtype:
    """The high-precision dtype a converted Linear computes in: the autocast dtype when autocast is on
    for x's device, else x's own dtype (fp32 on CPU)."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype
