"""The backends by name (params `precision.backend`), and how to build one with its typed options."""
from __future__ import annotations

import torch

from .auto import AutoBackend
from .base import PrecisionBackend
from .bf16 import BF16Backend
from .emulated import Fp8EmulatedBackend, Nvfp4EmulatedBackend
from .fp8 import Fp8Backend
from .options import BACKEND_NAMES, LayerFilter, Options, options_for
from .te_fp8 import TEFp8Backend
from .te_nvfp4 import TENvfp4Backend

BACKENDS: dict[str, type[PrecisionBackend]] = {
    cls.name: cls for cls in (BF16Backend, Fp8Backend, TEFp8Backend, TENvfp4Backend, Fp8EmulatedBackend,
                              Nvfp4EmulatedBackend, AutoBackend)
}
assert tuple(BACKENDS) == BACKEND_NAMES, "options.BACKEND_OPTIONS names every backend, in this order"


def get_backend(name: str, options: Options | dict | None = None,
                layer_filter: LayerFilter | None = None) -> PrecisionBackend:
    """Backend `name` with its typed options (options.BACKEND_OPTIONS[name]; a mapping of its fields is
    built into one, None gives the defaults) and layer filter."""
    options = options_for(name, options)  # an unknown name fails here, naming the known ones
    return BACKENDS[name](options, layer_filter)


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
