"""te-fp8: NVIDIA Transformer Engine's FP8 GEMMs under one of its scaling recipes.

Recipes (params `precision.te_fp8.recipe`), what they scale with, and where they run:
    delayed  DelayedScaling: per-tensor scale from an amax history of past steps (no extra pass over
             the tensor before casting; the scale lags by a step). sm_89+.
    current  Float8CurrentScaling: per-tensor scale from this step's amax (like our `fp8`). sm_89+.
    block    Float8BlockScaling: 1x128 blocks for activations/gradients, 128x128 for weights, FP32
             scales (DeepSeek-V3 style). sm_90+.
    mxfp8    MXFP8BlockScaling: 1x32 blocks with power-of-two E8M0 scales, the OCP MX format that
             Blackwell tensor cores read natively. sm_100+.
Modules (params `precision.te_fp8.modules`):
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
from .options import TEFp8Options, TERecipe, choices
from .te_common import TEMLP, import_te, swap_modules, te_linear, te_missing_reason

# recipe key -> (TE class name, minimum compute capability, where it runs)
RECIPES = {
    "delayed": ("DelayedScaling", (8, 9), "Ada, Hopper and Blackwell GPUs (sm_89+)"),
    "current": ("Float8CurrentScaling", (8, 9), "Ada, Hopper and Blackwell GPUs (sm_89+)"),
    "block": ("Float8BlockScaling", (9, 0), "Hopper and Blackwell GPUs (sm_90+)"),
    "mxfp8": ("MXFP8BlockScaling", (10, 0), "Blackwell GPUs (sm_100+: B200, GB200, B300, RTX 50xx)"),
}
assert tuple(RECIPES) == choices(TERecipe), "one row per recipe that options.TEFp8Options allows"
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
    """Options: `TEFp8Options` (params `precision.te_fp8`). Which recipe and modules are the defaults,
    and why: bench/results/precision.md, "Transformer Engine"."""
    name = "te-fp8"
    options: TEFp8Options

    def __init__(self, options=None, layer_filter=None):
        super().__init__(options, layer_filter)
        self._recipe = None

    compile_regions = True  # a TE module is a graph break: compile block by block around it
    supports_fsdp = False  # TE keeps FP8 metadata per module and needs its own FSDP2 hooks: not wired here

    @property
    def supports_compile(self) -> bool:  # instance property over the class attribute
        return self.options.compile

    @property
    def label(self) -> str:
        return f"{self.name}[{self.options.recipe},{self.options.modules}]"

    def unavailable_reason(self, device):
        cls_name, min_cap, where = RECIPES[self.options.recipe]
        return te_recipe_reason(self.options.recipe, cls_name, min_cap, where, device)

    def make_recipe(self):
        _, R, _ = import_te()
        o = self.options
        key = o.recipe
        if key == "delayed":
            return R.DelayedScaling(fp8_format=R.Format.HYBRID, amax_history_len=o.amax_history_len,
                                    amax_compute_algo=o.amax_compute_algo)
        if key == "current":
            return R.Float8CurrentScaling(fp8_format=R.Format.HYBRID)
        return getattr(R, RECIPES[key][0])()

    def convert(self, model: nn.Module) -> nn.Module:
        te, _, _ = import_te()
        self._recipe = self.make_recipe()
        make_mlp = (lambda mlp: TEMLP(te, mlp)) if self.options.modules == "fused" else None
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
        return [f"TE recipe {RECIPES[self.options.recipe][0]}, modules {self.options.modules}, "
                f"{'compiled block by block around TE (TE eager)' if self.supports_compile else 'eager'}"]
