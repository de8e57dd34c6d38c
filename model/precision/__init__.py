"""Precision backends, keyed by the name used in params.yaml (`precision.backend`).

Every backend implements `base.PrecisionBackend`: `check(device)` (runs here, or says exactly why not),
`convert(model)` (swap Linear modules), `autocast(device)`. See each file's docstring for the format.
"""
from __future__ import annotations

import torch

from .auto import AutoBackend
from .base import BackendUnavailable, LayerFilter, PrecisionBackend, disable_low_precision
from .bf16 import BF16Backend
from .emulated import Fp8EmulatedBackend, Nvfp4EmulatedBackend
from .fp8 import Fp8Backend
from .te_fp8 import TEFp8Backend
from .te_nvfp4 import TENvfp4Backend

BACKENDS: dict[str, type[PrecisionBackend]] = {
    cls.name: cls for cls in (BF16Backend, Fp8Backend, TEFp8Backend, TENvfp4Backend, Fp8EmulatedBackend,
                              Nvfp4EmulatedBackend, AutoBackend)
}


def get_backend(name: str, options: dict | None = None, layer_filter: LayerFilter | None = None) -> PrecisionBackend:
    if name not in BACKENDS:
        raise ValueError(f"unknown precision backend '{name}'; choose one of {', '.join(BACKENDS)}")
    return BACKENDS[name](options, layer_filter)


def options_from_params(name: str, precision: dict) -> dict:
    """Backend options from params.yaml's `precision:` section:
    fp8 <- precision.fp8; te-fp8 <- te_recipe, te_modules, te_compile; te-nvfp4 and nvfp4-emulated <-
    precision.nvfp4; auto <- precision.auto."""
    p = precision or {}
    if name == "fp8":
        return dict(p.get("fp8") or {})
    if name == "te-fp8":
        keys = {"te_recipe": "recipe", "te_modules": "modules", "te_compile": "compile"}
        return {opt: p[k] for k, opt in keys.items() if k in p}
    if name in ("te-nvfp4", "nvfp4-emulated"):
        return dict(p.get("nvfp4") or {})
    if name == "auto":
        return dict(p.get("auto") or {})
    return {}


def available_backends(device: torch.device) -> list[str]:
    out = []
    for name, cls in BACKENDS.items():
        if cls is AutoBackend:
            continue
        try:
            if cls().unavailable_reason(device) is None:
                out.append(name)
        except Exception:  # a broken optional install must not hide the others
            pass
    return out


__all__ = ["BACKENDS", "BackendUnavailable", "LayerFilter", "PrecisionBackend", "get_backend", "available_backends",
           "disable_low_precision", "options_from_params"]
