"""te-nvfp4: Transformer Engine's NVFP4BlockScaling recipe (Blackwell, sm_100+ only).

NVFP4 stores E2M1 values (4 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6) with one E4M3 scale per 16 elements and one
FP32 scale per tensor; Blackwell tensor cores multiply it natively (formats.py has the exact rounding,
emulated.py the same recipe for any device). TE's recommended training settings are exposed as options
(params `precision.nvfp4.*`), defaults as TE and the NVFP4 paper (arXiv 2509.25149) recommend:
    weight_2d            16x16 weight tiles, so W and W^T quantise identically  (TE: disable_2d_quantization)
    stochastic_rounding  unbiased rounding of gradients                         (TE: disable_stochastic_rounding)
    rht                  random 16x16 Hadamard transform on the wgrad operands   (TE: disable_rht)
    bf16_last_blocks     the last N transformer blocks stay in BF16 (not converted; the paper keeps the
                         final ~15% of layers in higher precision; the head always stays)
On Hopper it refuses; `nvfp4-emulated` shows its effect on the loss there.
"""
from __future__ import annotations

import torch.nn as nn

from .emulated import Nvfp4EmulatedBackend, skip_last_blocks
from .te_common import import_te, swap_modules, te_linear
from .te_fp8 import TEFp8Backend, te_recipe_reason

WHERE = "Blackwell GPUs (sm_100+: B200, GB200, B300, RTX 50xx); on Hopper use nvfp4-emulated to see its effect on loss"


class TENvfp4Backend(TEFp8Backend):
    name = "te-nvfp4"
    DEFAULTS = {**Nvfp4EmulatedBackend.OPTIONS, "compile": True}

    def __init__(self, options=None, layer_filter=None):
        options = dict(options or {})
        unknown = set(options) - set(self.DEFAULTS)
        if unknown:
            raise ValueError(f"unknown te-nvfp4 option(s) {sorted(unknown)}; known: {sorted(self.DEFAULTS)}")
        super(TEFp8Backend, self).__init__(options, layer_filter)
        self.cfg = {**self.DEFAULTS, **self.options, "recipe": "nvfp4", "modules": "linear"}
        self._recipe = None

    @property
    def label(self) -> str:
        c = self.cfg
        return (f"{self.name}[2d={int(c['weight_2d'])},sr={int(c['stochastic_rounding'])},"
                f"rht={int(c['rht'])},bf16_last={c['bf16_last_blocks']}]")

    def unavailable_reason(self, device):
        return te_recipe_reason("nvfp4", "NVFP4BlockScaling", (10, 0), WHERE, device)

    def make_recipe(self):
        _, R, _ = import_te()
        c = self.cfg
        return R.NVFP4BlockScaling(disable_rht=not c["rht"], disable_stochastic_rounding=not c["stochastic_rounding"],
                                   disable_2d_quantization=not c["weight_2d"])

    def convert(self, model: nn.Module) -> nn.Module:
        te, _, _ = import_te()
        self._recipe = self.make_recipe()
        filt = skip_last_blocks(self.layer_filter, model, int(self.cfg["bf16_last_blocks"]))
        self.converted = swap_modules(model, lambda lin: te_linear(te, lin), None, filt)
        return model

    def notes(self, device):
        return [f"TE recipe NVFP4BlockScaling ({self.label})"]
