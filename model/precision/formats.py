"""Exact low-precision number formats, written out in PyTorch so they run on any device.

FP8 (OCP 8-bit floating point)
    e4m3 ("float8_e4m3fn"): 4 exponent bits, 3 mantissa bits, no infinities, largest value 448.
        Relative rounding error at most 2^-4 for normal values; used for weights and activations.
    e5m2: 5 exponent bits, 2 mantissa bits, largest value 57344. Relative error at most 2^-3, but a
        range wide enough for gradients.
    A tensor is stored as `q = round(x * s)` with one FP32 scale per tensor, s = format_max / amax(x),
    so the largest magnitude lands on the format's largest value ("per-tensor dynamic scaling").
    Power-of-two scales instead take the largest 2^k with amax * 2^k <= format_max: the largest value
    lands in the format's top binade, multiplying by the scale is exact, and the scale changes only
    when amax crosses a power of two (which lets a cast start before its amax is known: fp8_cast.py).
    PyTorch's `.to(float8_*)` rounds to nearest even, which is what the hardware does.

NVFP4 (NVIDIA 4-bit floating point, Blackwell tensor cores)
    Values are E2M1: sign, 2 exponent bits, 1 mantissa bit -> {0, 0.5, 1, 1.5, 2, 3, 4, 6}.
    Four bits cannot hold a range, so scaling is two-level:
      - one E4M3 scale per block of 16 consecutive elements along the contraction dimension
        (weights may instead share one scale per 16x16 tile, so W and W^T quantise the same way);
      - one FP32 scale per tensor, chosen so the largest block scale lands near E4M3's top (448):
        tensor_scale = amax / (6 * 448).
    x ~= e2m1_value * e4m3_block_scale * fp32_tensor_scale.
    Gradients may be rounded stochastically (unbiased on average), and the operands of the weight
    gradient GEMM may be rotated by a random 16x16 Hadamard transform first (spreads outliers over
    the block; the rotation cancels in the product because H^T H = I).

Everything here is quantise-dequantise ("fake quant"): the result is a float tensor holding exactly the
values the low-precision format can represent. model/precision/emulated.py builds backends on it; the
tests compare it against float64 references.
"""
from __future__ import annotations

import math
import struct

import torch

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
E2M1_MAX = 6.0
NVFP4_BLOCK = 16
# amax below this is treated as this (an all-zero or denormal tensor must not give an infinite scale)
AMAX_FLOOR = 1e-30

# worst-case relative rounding error for normal values: 2^-(mantissa bits + 1)
REL_ERROR = {E4M3: 2.0 ** -4, E5M2: 2.0 ** -3, "e2m1": 0.25}


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in `dtype`, inverse scale) such that x ~= q.float() * inv_scale."""
    return cast_fp8(x, dtype, amax(x), pow2)


def amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of x, as an FP32 scalar tensor (no gradient)."""
    return x.detach().abs().amax().float()


def cast_fp8(x: torch.Tensor, dtype: torch.dtype, amax: torch.Tensor,
             pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale so that `amax` lands on the format's largest value (in its top binade if pow2), saturate,
    cast: (q, inverse scale). With amax = amax(x) this is per-tensor dynamic scaling; delayed scaling
    passes an amax from earlier steps, and values beyond it saturate."""
    s = fp8_scale(dtype, amax, pow2)
    return scaled_cast(x, s, dtype), s.reciprocal()


def scaled_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x * scale, saturated to the format's range and rounded to nearest even, in FP8 `dtype`."""
    fmax = fp8_max(dtype)
    return (x.float() * scale).clamp(-fmax, fmax).to(dtype)


def fp8_scale(dtype: torch.dtype, amax: torch.Tensor, pow2: bool = False) -> torch.Tensor:
    """The FP32 scale that puts `amax` on the format's largest value, or with pow2 the largest power of
    two that keeps it within (pow2_scale)."""
    if pow2:
        return pow2_scale(dtype, amax)
    return fp8_max(dtype) / amax.float().clamp(min=AMAX_FLOOR)


def _fp32_fields(v: float) -> tuple[int, int]:
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    return bits >> 23, bits & 0x7FFFFF


# computed once here: inside a compiled model a tensor's .item() would break the graph at every Linear
_MAX_FIELDS = {E4M3: _fp32_fields(E4M3_MAX), E5M2: _fp32_fields(E5M2_MAX)}


def fp8_max_fields(dtype: torch.dtype) -> tuple[int, int]:
    """(biased exponent, mantissa bits) of the format's largest value as an FP32 number."""
    return _MAX_FIELDS[dtype]


def pow2_scale(dtype: torch.dtype, amax: torch.Tensor) -> torch.Tensor:
    """The largest 2^k (an FP32 tensor) with amax * 2^k <= the format's max, from the FP32 bit fields
    alone, so the Triton kernel (fp8_cast.py) computes the same bits. With amax = (1 + a) 2^ea and
    max = (1 + m) 2^em: k = em - ea, one less if a > m. k is kept within FP32's normal range; an
    inf or NaN amax gives a tiny scale (2^-120 for e4m3, 2^-113 for e5m2)."""
    exp_max, mant_max = fp8_max_fields(dtype)
    bits = amax.float().clamp(min=AMAX_FLOOR).view(torch.int32)
    k = exp_max - ((bits >> 23) & 0xFF) - ((bits & 0x7FFFFF) > mant_max).int()
    return ((k.clamp(-126, 127) + 127) << 23).view(torch.float32)


def fake_quant_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round x to what a per-tensor-scaled FP8 tensor of `dtype` holds; returns x's dtype."""
    q, inv = quantize_fp8(x, dtype)
    return (q.float() * inv).to(x.dtype)


def round_e2m1(v: torch.Tensor, stochastic: bool = False) -> torch.Tensor:
    """Round fp32 values (already scaled into [-6, 6]) to the E2M1 grid.

    The grid's spacing is 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; round-to-nearest-even per spacing
    matches the hardware (a tie goes to the value with an even mantissa bit). Stochastic rounding picks
    the upper neighbour with probability equal to the distance from the lower one."""
    a = v.abs().clamp(max=E2M1_MAX)
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    if stochastic:
        lower = torch.floor(a / step) * step
        up = torch.rand_like(a) < (a - lower) / step
        r = lower + step * up
    else:
        r = torch.round(a / step) * step
    return torch.copysign(r.clamp(max=E2M1_MAX), v)


def _nvfp4_blocks(xf: torch.Tensor, tile_2d: bool) -> tuple[torch.Tensor, tuple]:
    """View a 2-D fp32 tensor as blocks whose last dim holds one scale group."""
    rows, cols = xf.shape
    if tile_2d:  # (R/16, 16, C/16, 16) -> (R/16, C/16, 256)
        b = xf.reshape(rows // NVFP4_BLOCK, NVFP4_BLOCK, cols // NVFP4_BLOCK, NVFP4_BLOCK)
        return b.permute(0, 2, 1, 3).reshape(rows // NVFP4_BLOCK, cols // NVFP4_BLOCK, -1), (rows, cols)
    return xf.reshape(rows, cols // NVFP4_BLOCK, NVFP4_BLOCK), (rows, cols)


def _nvfp4_unblocks(b: torch.Tensor, shape: tuple, tile_2d: bool) -> torch.Tensor:
    rows, cols = shape
    if tile_2d:
        b = b.reshape(rows // NVFP4_BLOCK, cols // NVFP4_BLOCK, NVFP4_BLOCK, NVFP4_BLOCK)
        return b.permute(0, 2, 1, 3).reshape(rows, cols)
    return b.reshape(rows, cols)


def fake_quant_nvfp4(x: torch.Tensor, tile_2d: bool = False, stochastic: bool = False) -> torch.Tensor:
    """Round x to NVFP4 along its last dimension (blocks of 16; 16x16 tiles if tile_2d, 2-D x only).

    Returns x's dtype. The last dimension (and the first, for tiles) must be a multiple of 16."""
    shape = x.shape
    xf = x.float().reshape(-1, shape[-1])
    if shape[-1] % NVFP4_BLOCK or (tile_2d and xf.shape[0] % NVFP4_BLOCK):
        raise ValueError(f"NVFP4 needs dimensions divisible by {NVFP4_BLOCK}, got {tuple(shape)}")
    # level 2: FP32 tensor scale, so the largest block scale is E4M3's largest value
    tscale = (xf.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp(min=AMAX_FLOOR)
    blocks, bshape = _nvfp4_blocks(xf, tile_2d)
    # level 1: one E4M3 scale per block, stored relative to the tensor scale
    bamax = blocks.abs().amax(dim=-1, keepdim=True)
    bscale = (bamax / E2M1_MAX / tscale).clamp(max=E4M3_MAX).to(E4M3).float()
    decode = bscale * tscale
    safe = torch.where(decode > 0, decode, torch.ones_like(decode))
    v = torch.where(decode > 0, blocks / safe, torch.zeros_like(blocks))
    q = round_e2m1(v, stochastic) * decode
    return _nvfp4_unblocks(q, bshape, tile_2d).reshape(shape).to(x.dtype)


def hadamard(n: int = NVFP4_BLOCK, device=None, dtype=torch.float32) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size n (a power of two)."""
    h = torch.ones(1, 1, device=device, dtype=dtype)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(n)


def random_hadamard(signs: torch.Tensor) -> torch.Tensor:
    """H @ diag(signs): a random orthogonal 16x16 rotation (signs is a +-1 vector of length 16)."""
    return hadamard(signs.numel(), signs.device) * signs[None, :].float()


def rotate_blocks(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Apply the 16x16 rotation to consecutive groups of 16 along dim 0 of a 2-D tensor."""
    n = rot.shape[0]
    rows, cols = x.shape
    xb = x.float().reshape(rows // n, n, cols)
    return torch.einsum("ij,bjc->bic", rot, xb).reshape(rows, cols)
