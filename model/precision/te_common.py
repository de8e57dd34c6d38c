"""Shared plumbing of the Transformer Engine backends (te-fp8, te-nvfp4).

How TE is used here. TE's modules (`te.Linear`, `te.LayerNormMLP`) run their GEMMs in FP8/FP4 while
`te.autocast(recipe=...)` is active; outside it they are plain bf16 modules. With torch 2.11 TE cannot
register its ops with torch.compile (shared/gpu/README.md), so a TE module inside a compiled model is
a graph break. We make that explicit: each TE module's forward is wrapped in `torch.compiler.disable`,
so dynamo compiles everything *around* TE (norms, RoPE, attention, residuals, the head) and TE runs
its own fused cast/GEMM kernels eagerly. `te.autocast` is entered outside the compiled region, which
is also what lets DelayedScaling run: TE refuses that recipe only when it sees itself being traced.

Weights keep the plain GPT's names: te.Linear already calls its weight `weight`; fused modules
(`te.LayerNormMLP`, whose parameters are `fc1_weight`, `fc2_weight`, `layer_norm_weight`) get
state-dict hooks that save them as `c_fc.weight` / `c_proj.weight` and drop the norm weight, which
is frozen at 1 because the GPT's RMSNorm has no parameters.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn as nn

from .base import ROW_MULTIPLE, pad_rows

TE_INSTALL_HINT = "pip install '.[te]' (it builds a PyTorch extension against the installed torch; README 'GPU')"


def import_te():
    """(transformer_engine.pytorch, transformer_engine.common.recipe, version) or raise ImportError."""
    te = importlib.import_module("transformer_engine.pytorch")
    recipe = importlib.import_module("transformer_engine.common.recipe")
    version = getattr(importlib.import_module("transformer_engine"), "__version__", "?")
    return te, recipe, version


def te_version() -> str | None:
    """The installed Transformer Engine's version, from the package metadata (so it answers without
    loading TE's extension, which may not load on this machine); None when TE is not installed."""
    from importlib import metadata
    for dist in ("transformer_engine", "transformer-engine-torch", "transformer_engine_torch"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def te_missing_reason() -> str | None:
    try:
        import_te()
    except Exception as e:  # ImportError, or a broken extension build (OSError, RuntimeError)
        kind = "not installed" if isinstance(e, ModuleNotFoundError) else f"not importable ({type(e).__name__}: {e})"
        return f"Transformer Engine is {kind}; install it with {TE_INSTALL_HINT}"
    return None


def eager(module: nn.Module) -> nn.Module:
    """Keep torch.compile out of this module: dynamo compiles around it (one clean graph break).

    The input is cast to the autocast dtype here, on the compiled side, where the cast fuses into the
    kernel that produced it. Left to TE, an fp32 input (our RMSNorm output under autocast) is cast
    eagerly on the way in, and its gradient on the way out (on the H200 at d20, eager dtype copies were
    the largest non-GEMM kernels of a te-fp8 micro-step before this)."""
    inner = torch.compiler.disable(module.forward, recursive=True)

    def forward(x, *args, **kwargs):
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        rows = x.numel() // x.shape[-1]
        if rows % ROW_MULTIPLE:  # TE's FP8 and FP4 GEMMs refuse other token counts
            y = inner(pad_rows(x.reshape(rows, x.shape[-1])), *args, **kwargs)
            return y[:rows].reshape(*x.shape[:-1], y.shape[-1])
        return inner(x, *args, **kwargs)

    module.forward = forward
    return module


def te_linear(te, lin: nn.Linear) -> nn.Module:
    m = te.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None,
                  params_dtype=lin.weight.dtype, device=lin.weight.device)
    with torch.no_grad():
        m.weight.copy_(lin.weight)
        if lin.bias is not None:
            m.bias.copy_(lin.bias)
    m.is_low_precision = True
    return eager(m)


class _Renames:
    """state_dict hooks mapping TE's parameter names to the plain model's (and back on load)."""

    def __init__(self, to_plain: dict[str, str | None]):
        self.to_plain = to_plain  # TE name -> plain name (None: drop)
        self.to_te = {v: k for k, v in to_plain.items() if v}

    def save_hook(self, module, state_dict, prefix, local_metadata):
        for te_name, plain in self.to_plain.items():
            key = prefix + te_name
            if key in state_dict:
                value = state_dict.pop(key)
                if plain:
                    state_dict[prefix + plain] = value
        return state_dict

    def load_pre_hook(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for plain, te_name in self.to_te.items():
            if prefix + plain in state_dict:
                state_dict[prefix + te_name] = state_dict.pop(prefix + plain)


class TEMLP(nn.Module):
    """GPT MLP (relu^2) as one `te.LayerNormMLP`: RMSNorm + FP8 cast + fc1 + squared ReLU + cast + fc2,
    fused by TE. The block already normalised its input; RMSNorm of a unit-RMS vector is the identity
    (up to eps), so the extra norm changes nothing but gives TE the kernel that writes FP8 directly."""
    is_low_precision = True

    def __init__(self, te, mlp: nn.Module):
        super().__init__()
        fc, proj = mlp.c_fc, mlp.c_proj
        d, hidden = fc.in_features, fc.out_features
        self.inner = te.LayerNormMLP(d, hidden, bias=False, normalization="RMSNorm", activation="srelu",
                                     params_dtype=fc.weight.dtype, device=fc.weight.device)
        with torch.no_grad():
            self.inner.fc1_weight.copy_(fc.weight)
            self.inner.fc2_weight.copy_(proj.weight)
            self.inner.layer_norm_weight.fill_(1.0)
        self.inner.layer_norm_weight.requires_grad_(False)
        eager(self.inner)
        ren = _Renames({"inner.fc1_weight": "c_fc.weight", "inner.fc2_weight": "c_proj.weight",
                        "inner.layer_norm_weight": None})
        self._register_state_dict_hook(ren.save_hook)
        self._register_load_state_dict_pre_hook(ren.load_pre_hook, with_module=False)
        self._keep = ren

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        # the frozen norm weight is not in a plain checkpoint: not "missing"
        key = prefix + "inner.layer_norm_weight"
        if key not in state_dict:
            state_dict[key] = self.inner.layer_norm_weight.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def forward(self, x):
        return self.inner(x)


def swap_modules(model: nn.Module, make_linear, make_mlp=None, layer_filter=None) -> int:
    """te.Linear for every Linear the filter accepts; with make_mlp, whole MLPs (c_fc and c_proj both
    accepted) become fused TE MLPs. Returns the number of GEMM layers converted."""
    from .base import swap_linears
    n = 0
    if make_mlp is not None:
        for name, mod in list(model.named_modules()):
            if (name == "mlp" or name.endswith(".mlp")) and hasattr(mod, "c_fc") and hasattr(mod, "c_proj") \
                    and layer_filter(f"{name}.c_fc", mod.c_fc) and layer_filter(f"{name}.c_proj", mod.c_proj):
                parent_name, _, child = name.rpartition(".")
                parent = model.get_submodule(parent_name)
                setattr(parent, child, make_mlp(mod))
                n += 2
    return n + swap_linears(model, layer_filter, make_linear)
