"""te-nvfp4: Transformer Engine's NVFP4BlockScaling recipe (Blackwell, sm_100+ only).

NVFP4 stores E2M1 values (4 bits: 0, 0.5, 1, 1.5, 2, 3, 4, 6) with one E4M3 scale per 16 elements and one
FP32 scale per tensor; Blackwell tensor cores multiply it natively (formats.py has the exact rounding,
emulated.py the same recipe for any device). TE's recommended training settings are exposed as options
(`Nvfp4Options`, params `precision.nvfp4`), defaults as TE and the NVFP4 paper (arXiv 2509.25149) recommend:
    weight_2d            16x16 weight tiles, so W and W^T quantise identically  (TE: disable_2d_quantization)
    stochastic_rounding  unbiased rounding of gradients                         (TE: disable_stochastic_rounding)
    rht                  random 16x16 Hadamard transform on the wgrad operands   (TE: disable_rht)
    bf16_last_blocks     the last N transformer blocks stay in BF16 (not converted; the paper keeps the
                         final ~15% of layers in higher precision; the head always stays)
On Hopper it refuses; `nvfp4-emulated` shows its effect on the loss there.

A known-bad combination is refused too: Transformer Engine up to 2.18 quantises NVFP4 gradients to
all-zero FP4 on sm_120/121 (GB10 in the DGX Spark, RTX 50xx), so a run there trains on zero gradients
without an error (the seed's failed DGX Spark run); TE PR #3281 fixed it, released in 2.19.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from packaging.version import Version

from . import base
from .emulated import nvfp4_label, skip_last_blocks
from .options import Nvfp4Options
from .te_common import import_te, swap_modules, te_linear, te_version
from .te_fp8 import TEFp8Backend, te_recipe_reason

WHERE = "Blackwell GPUs (sm_100+: B200, GB200, B300, RTX 50xx); on Hopper use nvfp4-emulated to see its effect on loss"


# (compute capabilities, first fixed TE version, what goes wrong, the fix): TE releases whose NVFP4 is known
# to train silently wrong on those cards
KNOWN_BAD = [
    ({(12, 0), (12, 1)}, "2.19",
     "quantises NVFP4 gradients to all-zero FP4 on {sm}, so a run trains on zero gradients without an error",
     "fixed upstream in TE PR #3281, released in 2.19"),
]


def known_bad_reason(device) -> str | None:
    """Why the installed TE must not train NVFP4 on this GPU (a known silent bug of its version), or None."""
    device = torch.device(device)
    cap = base.cuda_capability(device) if device.type == "cuda" else None
    version = te_version()
    if cap is None or version is None:
        return None
    for caps, fixed_in, what, fix in KNOWN_BAD:
        if cap in caps and Version(version) < Version(fixed_in):
            return (f"Transformer Engine {version} {what.format(sm=base.sm(cap))} ({fix}); install "
                    f"Transformer Engine {fixed_in} or newer: pip install 'transformer-engine[pytorch]>={fixed_in}'")
    return None


class TENvfp4Backend(TEFp8Backend):
    name = "te-nvfp4"
    options: Nvfp4Options
    supports_compile = True  # compiled block by block around TE, as te-fp8 by default

    @property
    def label(self) -> str:
        return nvfp4_label(self.name, self.options)

    def unavailable_reason(self, device):
        return known_bad_reason(device) or te_recipe_reason("nvfp4", "NVFP4BlockScaling", (10, 0), WHERE, device)

    def make_recipe(self):
        _, R, _ = import_te()
        o = self.options
        return R.NVFP4BlockScaling(disable_rht=not o.rht, disable_stochastic_rounding=not o.stochastic_rounding,
                                   disable_2d_quantization=not o.weight_2d)

    def convert(self, model: nn.Module) -> nn.Module:
        te, _, _ = import_te()
        self._recipe = self.make_recipe()
        filt = skip_last_blocks(self.layer_filter, model, self.options.bf16_last_blocks)
        self.converted = swap_modules(model, lambda lin: te_linear(te, lin), None, filt)
        return model

    def notes(self, device):
        return [f"TE recipe NVFP4BlockScaling ({self.label})"]
