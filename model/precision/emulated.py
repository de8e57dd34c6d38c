"""Emulated FP8 and NVFP4: exact low-precision numerics, high-precision matmuls. Runs anywhere.

Each converted Linear rounds its GEMM operands to exactly the values the format can hold
(model/precision/formats.py), then multiplies them in the compute dtype (fp32 on CPU; bf16 operands
with fp32 accumulation on CUDA), as the tensor core would after dequantising. The loss therefore moves
as it would on hardware with that format, but nothing gets faster: every quantisation is extra work.
Use it to (a) let CPU tests exercise the quantisation code, and (b) see on Hopper or a laptop what
NVFP4 would do to the loss before renting a Blackwell. Logs and results always say EMULATED.

fp8-emulated   y = q4(x) @ q4(W)^T;  dX = q5(dY) @ q4(W);  dW = q5(dY)^T @ q4(x)
               (q4: e4m3, q5: e5m2, one dynamic FP32 scale per tensor)
nvfp4-emulated TE's NVFP4 training recipe, written out:
               forward  x in 1x16 blocks along K, W in 16x16 tiles (so W and W^T round identically);
               dgrad    dY in 1x16 blocks along N, stochastic rounding;
               wgrad    dY and x rotated by one random 16x16 Hadamard transform along the token
                        dimension, then 1x16 blocks along tokens, stochastic rounding for dY.
               Each operand is quantised from the high-precision tensor for each use (as TE does),
               never re-quantised from an already-quantised copy. The last `bf16_last_blocks`
               transformer blocks stay unconverted (the NVFP4 paper keeps the final layers in BF16).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from . import formats as fm
from .base import (ConvertedLinear, LayerFilter, PrecisionBackend, low_precision_enabled, matmul_dtype, pad_rows,
                   swap_linears)
from .options import Nvfp4Options


def _2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


class _FakeFp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, cdtype):
        xq = fm.fake_quant_fp8(x.to(cdtype), fm.E4M3)
        wq = fm.fake_quant_fp8(w.to(cdtype), fm.E4M3)
        ctx.save_for_backward(xq, wq)
        ctx.in_dtypes = (x.dtype, w.dtype)
        return xq @ wq.t()

    @staticmethod
    def backward(ctx, gy):
        xq, wq = ctx.saved_tensors
        gq = fm.fake_quant_fp8(gy.to(wq.dtype), fm.E5M2)
        gx = (gq @ wq).to(ctx.in_dtypes[0])
        gw = (_2d(gq).t() @ _2d(xq)).to(ctx.in_dtypes[1])
        return gx, gw, None


class _FakeNvfp4Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, cdtype, tile_2d, stochastic, rht):
        xc, wc = x.to(cdtype), w.to(cdtype)
        xq = fm.fake_quant_nvfp4(xc)
        wq = fm.fake_quant_nvfp4(wc, tile_2d=tile_2d)
        ctx.save_for_backward(xc, wc, wq if tile_2d else None)
        ctx.cfg = (tile_2d, stochastic, rht, x.dtype, w.dtype)
        return xq @ wq.t()

    @staticmethod
    def backward(ctx, gy):
        xc, wc, wq = ctx.saved_tensors
        tile_2d, stochastic, rht, xdt, wdt = ctx.cfg
        g = _2d(gy.to(wc.dtype))
        # dgrad: contraction over N (out features)
        gq = fm.fake_quant_nvfp4(g, stochastic=stochastic)
        w_n = wq if tile_2d else fm.fake_quant_nvfp4(wc.t()).t()  # W blocked along N
        gx = (gq @ w_n).reshape(*gy.shape[:-1], wc.shape[1]).to(xdt)
        # wgrad: contraction over tokens M
        x2 = pad_rows(_2d(xc), fm.NVFP4_BLOCK)
        g2 = pad_rows(g, fm.NVFP4_BLOCK)
        if rht:
            signs = torch.randint(0, 2, (fm.NVFP4_BLOCK,), device=g.device).float() * 2 - 1
            rot = fm.random_hadamard(signs)
            x2, g2 = fm.rotate_blocks(x2, rot).to(xc.dtype), fm.rotate_blocks(g2, rot).to(g.dtype)
        gw = fm.fake_quant_nvfp4(g2.t(), stochastic=stochastic) @ fm.fake_quant_nvfp4(x2.t()).t()
        return gx, gw.to(wdt), None, None, None, None


class Fp8EmulatedLinear(ConvertedLinear):
    def forward(self, x):
        if not low_precision_enabled():
            return super().forward(x)
        y = _FakeFp8Matmul.apply(x, self.weight, matmul_dtype(x))
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Nvfp4EmulatedLinear(ConvertedLinear):
    tile_2d, stochastic, rht = True, True, True

    def forward(self, x):
        if not low_precision_enabled():
            return super().forward(x)
        y = _FakeNvfp4Matmul.apply(x, self.weight, matmul_dtype(x), self.tile_2d, self.stochastic, self.rht)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def skip_last_blocks(layer_filter: LayerFilter, model: nn.Module, n: int) -> LayerFilter:
    """The same filter, also skipping the last n transformer blocks (kept in higher precision)."""
    n_layer = len(getattr(model, "blocks", []))
    extra = [f"blocks.{i}." for i in range(max(0, n_layer - n), n_layer)] if n > 0 else []
    return LayerFilter(layer_filter.dim_multiple, list(layer_filter.skip) + extra)


# Emulated quantisation is a long chain of elementwise ops per Linear, slow to compile as one model.
# Block by block compiles one block's chain once (`python -m bench.compile_time` measures both);
# speed is not what these backends are for.
class Fp8EmulatedBackend(PrecisionBackend):
    name = "fp8-emulated"
    emulated = True
    compile_regions = True

    def convert(self, model: nn.Module) -> nn.Module:
        self.converted = swap_linears(model, self.layer_filter, Fp8EmulatedLinear.from_linear)
        return model


def nvfp4_label(name: str, o: Nvfp4Options) -> str:
    return (f"{name}[2d={int(o.weight_2d)},sr={int(o.stochastic_rounding)},rht={int(o.rht)},"
            f"bf16_last={o.bf16_last_blocks}]")


class Nvfp4EmulatedBackend(PrecisionBackend):
    """Options: `Nvfp4Options` (params `precision.nvfp4`, shared with te-nvfp4)."""
    name = "nvfp4-emulated"
    emulated = True
    compile_regions = True
    options: Nvfp4Options

    def __init__(self, options=None, layer_filter=None):
        super().__init__(options, layer_filter)
        if self.layer_filter.dim_multiple % fm.NVFP4_BLOCK:
            raise ValueError(f"NVFP4 needs the layer filter's dim_multiple to be a multiple of {fm.NVFP4_BLOCK}")

    @property
    def label(self) -> str:
        return nvfp4_label(self.name, self.options)

    def convert(self, model: nn.Module) -> nn.Module:
        o = self.options
        filt = skip_last_blocks(self.layer_filter, model, o.bf16_last_blocks)
        self.converted = swap_linears(model, filt, lambda lin: Nvfp4EmulatedLinear.from_linear(
            lin, tile_2d=o.weight_2d, stochastic=o.stochastic_rounding, rht=o.rht))
        return model
