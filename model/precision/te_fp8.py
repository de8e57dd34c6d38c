"""te-fp8: NVIDIA Transformer Engine's FP8 GEMMs under one of its scaling recipes.

Recipes (params `precision.te_recipe`), what they scale with, and where they run:
    delayed  DelayedScaling: per-tensor scale from an amax history of past steps (no extra pass over
             the tensor before casting; the scale lags by a step). sm_89+.
    current  Float8CurrentScaling: per-tensor scale from this step's amax (like our `fp8`). sm_89+.
    block    Float8BlockScaling: 1x128 blocks for activations/gradients, 128x128 for weights, FP32
             scales (DeepSeek-V3 style). sm_90+.
    mxfp8    MXFP8BlockScaling: 1x32 blocks with power-of-two E8M0 scales, the OCP MX format that
             Blackwell tensor cores read natively. sm_100+.
Modules (params `precision.te_modules`):
    linear   every accepted nn.Linear becomes a te.Linear;
    fused    each MLP becomes one te.LayerNormMLP (norm, casts, fc1, squared ReLU, fc2 fused by TE) and the
             attention projections te.Linear: fewer, larger TE calls and no separate cast kernels.
TE modules run eagerly inside a compiled model; the rest is compiled around them (te_common.py).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from . import base
from .base import PrecisionBackend, low_precision_enabled, sm
from .te_common import TEMLP, import_te, swap_modules, te_linear, te_missing_reason

# recipe key -> (TE class name, minimum compute capability, where it runs)
RECIPES = {
    "delayed": ("DelayedScaling", (8, 9), "Ada, Hopper and Blackwell GPUs (sm_89+)"),
    "current": ("Float8CurrentScaling", (8, 9), "Ada, Hopper and Blackwell GPUs (sm_89+)"),
    "block": ("Float8BlockScaling", (9, 0), "Hopper and Blackwell GPUs (sm_90+)"),
    "mxfp8": ("MXFP8BlockScaling", (10, 0), "Blackwell GPUs (sm_100+: B200, GB200, B300, RTX 50xx)"),
}
MODULES = ("linear", "fused")
# TE's own availability check per recipe (runs once TE imports)
_TE_CHECK = {"delayed": "is_fp8_available", "current": "is_fp8_available",
             "block": "is_fp8_block_scaling_available", "mxfp8": "is_mxfp8_available", "nvfp4": "is_nvfp4_available"}


def te_recipe_reason(recipe_key: str, class_name: str, min_cap, where: str, device) -> str | None:
    """Why a TE recipe cannot run on `device`, or None. Order: device, capability, TE, recipe, TE's check."""
    device = torch.device(device)
    if device.type != "cuda":
        return f"Transformer Engine needs an NVIDIA GPU; {class_name} runs on {where}"
    cap = base.cuda_capability(device)
    if cap is None:
        return f"CUDA is not available; {class_name} runs on {where}"
    if cap < min_cap:
        return (f"{class_name} needs compute capability {min_cap[0]}.{min_cap[1]} or higher ({where}); "
                f"this GPU is {sm(cap)}")
    missing = te_missing_reason()
    if missing:
        return missing
    te, recipe_mod, version = import_te()
    if not hasattr(recipe_mod, class_name):
        return f"recipe {class_name} is not in the installed Transformer Engine {version}"
    check = getattr(te, _TE_CHECK[recipe_key], None)
    if check is not None:
        ok, why = check(return_reason=True)
        if not ok:
            return f"Transformer Engine {version} says: {why}"
    return None


def _data_parallel_group():
    """Under several ranks, the group TE reduces its amaxes over, so every rank scales alike (our fp8
    does the same in `sync_ranks`); None on one process."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None


class TEFp8Backend(PrecisionBackend):
    """Options: recipe (delayed|current|block|mxfp8, default delayed), modules (linear|fused, default
    fused), amax_history_len and amax_compute_algo (delayed only), compile (true: compile block by block
    around TE; false: leave the whole model eager)."""
    name = "te-fp8"
    # H200, d20, 64k tokens per micro-step, 200 steps (bench/results/h200-d20-2026-12-03c): delayed
    # fused 1.17x bf16 (te.Linear everywhere 1.10x), current fused 1.10x, block fused 1.00x; every loss
    # within 0.2% of bf16's
    DEFAULTS = {"recipe": "delayed", "modules": "fused", "amax_history_len": 16, "amax_compute_algo": "max",
                "compile": True}

    def __init__(self, options=None, layer_filter=None):
        super().__init__(options, layer_filter)
        unknown = set(self.options) - set(self.DEFAULTS)
        if unknown:
            raise ValueError(f"unknown te-fp8 option(s) {sorted(unknown)}; known: {sorted(self.DEFAULTS)}")
        self.cfg = {**self.DEFAULTS, **self.options}
        if self.cfg["recipe"] not in RECIPES:
            raise ValueError(f"precision.te_recipe must be one of {list(RECIPES)}, got {self.cfg['recipe']!r}")
        if self.cfg["modules"] not in MODULES:
            raise ValueError(f"precision.te_modules must be one of {MODULES}, got {self.cfg['modules']!r}")
        self._recipe = None

    compile_regions = True  # a TE module is a graph break: compile block by block around it

    @property
    def supports_compile(self) -> bool:  # instance property over the class attribute
        return bool(self.cfg["compile"])

    @property
    def label(self) -> str:
        return f"{self.name}[{self.cfg['recipe']},{self.cfg['modules']}]"

    def unavailable_reason(self, device):
        cls_name, min_cap, where = RECIPES[self.cfg["recipe"]]
        return te_recipe_reason(self.cfg["recipe"], cls_name, min_cap, where, device)

    def make_recipe(self):
        _, R, _ = import_te()
        key = self.cfg["recipe"]
        if key == "delayed":
            return R.DelayedScaling(fp8_format=R.Format.HYBRID, amax_history_len=int(self.cfg["amax_history_len"]),
                                    amax_compute_algo=self.cfg["amax_compute_algo"])
        if key == "current":
            return R.Float8CurrentScaling(fp8_format=R.Format.HYBRID)
        return getattr(R, RECIPES[key][0])()

    def convert(self, model: nn.Module) -> nn.Module:
        te, _, _ = import_te()
        self._recipe = self.make_recipe()
        make_mlp = (lambda mlp: TEMLP(te, mlp)) if self.cfg["modules"] == "fused" else None
        self.converted = swap_modules(model, lambda lin: te_linear(te, lin), make_mlp, self.layer_filter)
        return model

    def autocast(self, device):
        device = torch.device(device)
        te, _, _ = import_te()
        stack = contextlib.ExitStack()
        stack.enter_context(super().autocast(device))
        if self._recipe is None:
            self._recipe = self.make_recipe()
        stack.enter_context(te.autocast(enabled=low_precision_enabled(), recipe=self._recipe,
                                        amax_reduction_group=_data_parallel_group()))
        return stack

    def notes(self, device):
        return [f"TE recipe {RECIPES[self.cfg['recipe']][0]}, modules {self.cfg['modules']}, "
                f"{'compiled block by block around TE (TE eager)' if self.supports_compile else 'eager'}"]
