"""Precision backends, keyed by the name used in params.yaml (`precision.backend`).

Every backend implements `base.PrecisionBackend`: `check(device)` (runs here, or says exactly why not),
`convert(model)` (swap Linear modules), `autocast(device)`; its options are one typed dataclass in
options.py. See each file's docstring for the format.

The registry (and with it torch) loads on first use, so the options alone load without torch.
"""
from __future__ import annotations

from .options import BACKEND_NAMES, BACKEND_OPTIONS, LayerFilter, OptionError, Options, options_for

_REGISTRY = ("BACKENDS", "get_backend", "available_backends")
_BASE = ("BackendUnavailable", "PrecisionBackend", "disable_low_precision")


def __getattr__(name: str):
    if name in _REGISTRY:
        from . import registry
        return getattr(registry, name)
    if name in _BASE:
        from . import base
        return getattr(base, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKENDS", "BACKEND_NAMES", "BACKEND_OPTIONS", "BackendUnavailable", "LayerFilter", "OptionError",
           "Options", "PrecisionBackend", "available_backends", "disable_low_precision", "get_backend",
           "options_for"]
