"""FP8 weights for serving: a bf16/fp32 checkpoint's Linear layers held in FP8 e4m3, one scale per
output channel (`sparkchat serve --weights fp8`).

Why. A decode step at a few streams reads every weight once and does little else with it, so its time
is the bytes of the weights over the memory bandwidth; e4m3 halves bf16's bytes. At many streams the
products become compute-bound, and FP8 tensor cores (sm_89+) multiply at twice bf16's rate.

The format. Each weight row n (an output channel) is cast as training's fp8 backend casts a tensor
(formats.fp8_scale and formats.scaled_cast, the same code): q[n] = saturate(W[n] * s[n]) in e4m3 with
s[n] = 448 / amax(|W[n]|), so each row's largest weight lands on e4m3's largest value and W[n] ~= q[n] /
s[n]; every weight keeps a relative rounding error of at most 2^-4 (smaller ones, below e4m3's normal
range, an absolute one). One scale a row rather than one a tensor: a row of small weights beside a row
of large ones keeps its own precision. The quantisation reads the fp32 checkpoint, not a bf16 copy.

The products, by the rows (tokens) of a call:
  - weight-only (at most WEIGHT_ONLY_MAX_ROWS rows: decode at a few streams): the activations stay in
    bf16 and the weights are dequantised inside the product. On CUDA, a Triton kernel reads each FP8
    weight once, widens it in registers and multiplies; elsewhere (a CPU) the weights are dequantised
    into one matmul in the activations' dtype (the numerics, without the saving).
  - W8A8 (more rows: many streams, prefill): the activations are cast to e4m3 too, one scale a row
    (token), and torch._scaled_mm multiplies the FP8 operands with row-wise scales into bf16 (on a CPU,
    fp8.scaled_mm's exact dequantised product).
  Which rows pay for which path, and which of the kernel's tiles, is the GPU benchmarks' to say
  (bench/fp8_gemv.py, bench/serve_client.py --weights bf16,fp8); WEIGHT_ONLY_MAX_ROWS is the kernel's
  one tile of rows, not a measured crossover.
A relu^2 MLP whose two Linears converted becomes an Fp8WeightMLP: at the weight-only rows the squared
ReLU runs in the first product's epilogue, one kernel a layer fewer in a decode step (unmeasured).

Which layers: training's LayerFilter (options.py): the output head stays in high precision, as in
training, and so does the embedding (a lookup, not a product).

Where it runs: a CUDA GPU with FP8 tensor cores (sm_89+); refused with the reason on older GPUs and on
a CPU, before anything loads (`check`). The conversion and its products run anywhere, so the CPU tests
exercise this code (tests/test_fp8_weights.py).
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import base
from .base import BackendUnavailable, swap_linears
from .formats import E4M3, fp8_scale, scaled_cast
from . import fp8
from .fp8 import scaled_mm
from .fp8_cast import triton_available
from .options import SERVE_WEIGHTS, LayerFilter

WEIGHT_ONLY_MAX_ROWS = 16  # calls of up to this many rows take the weight-only product (one tile of the kernel)


def unavailable_reason(device) -> str | None:
    """None when FP8 weights can serve on `device`, else why not and what to do instead (fp8.py's check:
    a CPU does not count, it would only dequantise the weights again, slower than the default)."""
    cpu = torch.device(device).type == "cpu"
    return fp8.unavailable_reason(device, "serving FP8 weights", "serve with --weights bf16 (the default)" + (
        "; on a CPU FP8 weights are only dequantised again, slower" if cpu else ""), cpu_runs=False)


def check(device) -> None:
    """Raises BackendUnavailable, saying why, when FP8 weights cannot serve on `device`."""
    reason = unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailable(f"--weights fp8 cannot serve on this machine ({base.describe_device(torch.device(device))}): "
                                 f"{reason}")


def quantise_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q in e4m3, inverse scales (N,) fp32) of a weight (N x K): one scale per row, W[n] ~= q[n] * inv[n]."""
    s = fp8_scale(E4M3, w.detach().float().abs().amax(dim=1, keepdim=True))
    return scaled_cast(w.detach(), s, E4M3), s.reciprocal().reshape(-1)


def dequantise_rows(q: torch.Tensor, inv_scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * inv_scale[:, None]).to(dtype)


class Fp8WeightLinear(nn.Module):
    """A bias-free Linear whose weight is e4m3 with one fp32 scale per output row (buffers `qweight`,
    `inv_scale`; no high-precision copy kept). Build it with `from_linear`."""

    def __init__(self, qweight: torch.Tensor, inv_scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        # as a (1, N) row: the shape torch._scaled_mm takes for row-wise scales of its second operand
        self.register_buffer("inv_scale", inv_scale.float().reshape(1, -1).contiguous())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8WeightLinear":
        if linear.bias is not None:
            raise ValueError("FP8 weights: a Linear with a bias is not supported (sparkchat's have none)")
        return cls(*quantise_rows(linear.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= WEIGHT_ONLY_MAX_ROWS:
            y = torch.ops.sparkchat.fp8_weight_mm(x2, self.qweight, self.inv_scale)
        else:
            y = w8a8(x2, self.qweight, self.inv_scale)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 weights, a scale per row"


class Fp8WeightMLP(nn.Module):
    """A relu^2 MLP of two Fp8WeightLinears (children c_fc, c_proj, as the MLP's): up to
    WEIGHT_ONLY_MAX_ROWS rows, the squared ReLU runs in the first product's epilogue instead of a kernel
    of its own between the two (a decode step at a few streams: one kernel a layer fewer); more rows,
    the children one by one."""

    def __init__(self, c_fc: Fp8WeightLinear, c_proj: Fp8WeightLinear):
        super().__init__()
        self.c_fc, self.c_proj = c_fc, c_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.c_fc.in_features)
        if x2.shape[0] > WEIGHT_ONLY_MAX_ROWS:
            return self.c_proj(F.relu(self.c_fc(x)).square())
        h = torch.ops.sparkchat.fp8_weight_mm(x2, self.c_fc.qweight, self.c_fc.inv_scale, ACTS["relu2"])
        y = torch.ops.sparkchat.fp8_weight_mm(h, self.c_proj.qweight, self.c_proj.inv_scale)
        return y.reshape(*x.shape[:-1], self.c_proj.out_features)


def w8a8(x: torch.Tensor, qweight: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """x (M x K) @ W^T with x cast to e4m3 one scale a row, the product through fp8.scaled_mm (torch._scaled_mm
    on CUDA) with row-wise scales, in x's dtype. Rows padded with zeros to a multiple of 16 (FP8 GEMM shapes)."""
    m = x.shape[0]
    xp = F.pad(x, (0, 0, 0, (-m) % base.ROW_MULTIPLE))  # no branch on the row count (compiled: dynamic)
    s = fp8_scale(E4M3, xp.float().abs().amax(dim=1, keepdim=True))
    xq = scaled_cast(xp, s, E4M3)
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16
    y = scaled_mm(xq, qweight.t(), scale_a=s.reciprocal(), scale_b=inv_scale, out_dtype=out_dtype)
    return y[:m].to(x.dtype)


# -- the weight-only product ------------------------------------------------------------------------

ACTS = {"none": 0, "relu2": 1}  # what the product's epilogue applies (relu2: the MLP's relu(y)^2)


@torch.library.custom_op("sparkchat::fp8_weight_mm", mutates_args=())
def _fp8_weight_mm(x: torch.Tensor, qweight: torch.Tensor, inv_scale: torch.Tensor, act: int = 0) -> torch.Tensor:
    """act(x (M x K, bf16/fp32) @ (q * inv_scale)^T) in x's dtype (act: ACTS' codes): the Triton kernel on
    CUDA (or on a CPU under Triton's interpreter, TRITON_INTERPRET=1, which tests it), else a dequantised
    matmul. An op of its own: opaque to torch.compile, as the kernel must be."""
    if triton_available() and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return weight_only_triton(x, qweight, inv_scale, act=act)
    y = x @ dequantise_rows(qweight, inv_scale.reshape(-1), x.dtype).t()
    return F.relu(y).square() if act == ACTS["relu2"] else y


@_fp8_weight_mm.register_fake
def _(x, qweight, inv_scale, act=0):
    return x.new_empty((x.shape[0], qweight.shape[0]))


try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def _weight_only_kernel(x_ptr, q_ptr, s_ptr, y_ptr, M, N, K, K_SPLIT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr, ACT: tl.constexpr):
        """y[:, n-tile] (+)= x[:, k-range] @ (q[n-tile, k-range] * s[n-tile])^T for all M (<= BLOCK_M) rows:
        each weight byte read once and widened in registers, fp32 sums, the row scale applied at the end.
        Program (n-tile, split): with several splits of K (ATOMIC) each adds its part into an fp32 output.
        ACT 1: relu(y)^2 on the way out (one split only: the whole sum first)."""
        pid, split = tl.program_id(0), tl.program_id(1)
        rows = tl.arange(0, BLOCK_M)
        cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.minimum(K, (split + 1) * K_SPLIT)
        for k0 in range(split * K_SPLIT, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < k_end),
                        other=0.0).to(tl.float32)
            # the weight as raw bytes, bitcast to e4m3 and widened: (BLOCK_K, BLOCK_N), W^T's tile
            qb = tl.load(q_ptr + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < k_end),
                         other=0)
            w = qb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            # tf32 holds a bf16 activation and an e4m3 weight exactly: exact products, fp32 sums (a few
            # rows: the loads, not the tensor-core rate, set the pace)
            acc += tl.dot(x, w, input_precision="tf32", out_dtype=tl.float32)
        s = tl.load(s_ptr + cols, mask=cols < N, other=0.0)
        y = acc * s[None, :]
        if ACT == 1:
            y = tl.maximum(y, 0.0)
            y = y * y
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        if ATOMIC:
            tl.atomic_add(y_ptr + rows[:, None] * N + cols[None, :], y, mask=mask)
        else:
            tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


# Tiles of the weight-only kernel: a first choice, not tuned (bench/fp8_gemv.py measures the others on a GPU)
BLOCK_N, BLOCK_K, SPLIT_K = 32, 128, 1


def weight_only_triton(x: torch.Tensor, qweight: torch.Tensor, inv_scale: torch.Tensor, block_n: int = 0,
                       block_k: int = 0, split_k: int = 0, act: int = 0) -> torch.Tensor:
    """The weight-only product through the Triton kernel (x: at most WEIGHT_ONLY_MAX_ROWS rows). Tiles and
    splits of K: the module's BLOCK_N, BLOCK_K and SPLIT_K unless given. With split_k > 1 the splits add
    into an fp32 buffer (zeroed first, cast after: two more small kernels) so that a narrow weight still
    spreads over the GPU's cores. `act` (ACTS' codes) needs the whole sum, so it runs K in one piece."""
    block_n, block_k, split_k = block_n or BLOCK_N, block_k or BLOCK_K, 1 if act else (split_k or SPLIT_K)
    M, K = x.shape
    N = qweight.shape[0]
    if M > WEIGHT_ONLY_MAX_ROWS:
        raise ValueError(f"the weight-only kernel takes at most {WEIGHT_ONLY_MAX_ROWS} rows, got {M}")
    k_split = triton.cdiv(triton.cdiv(K, split_k), block_k) * block_k  # each split a whole number of tiles
    splits = triton.cdiv(K, k_split)
    y = torch.zeros((M, N), dtype=torch.float32, device=x.device) if splits > 1 else \
        torch.empty((M, N), dtype=x.dtype, device=x.device)
    _weight_only_kernel[(triton.cdiv(N, block_n), splits)](
        x.contiguous(), qweight.view(torch.uint8), inv_scale.reshape(-1), y, M, N, K, k_split,
        BLOCK_M=WEIGHT_ONLY_MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=splits > 1, ACT=act)
    return y.to(x.dtype)


# -- the conversion ---------------------------------------------------------------------------------

def convert(model: nn.Module, dtype: torch.dtype, layer_filter: LayerFilter | None = None) -> int:
    """Serve `model` with FP8 weights: every Linear the filter accepts quantised (from its weights as they
    are: load the checkpoint in fp32), then everything else cast to `dtype`, then the Linears swapped for
    Fp8WeightLinears (after the cast, which would otherwise widen the FP8 buffers too). Returns how many
    Linears were converted. Call it last: a later `model.to(dtype)` would cast the FP8 buffers."""
    layer_filter = layer_filter or LayerFilter()
    made: dict[int, Fp8WeightLinear] = {}

    def quantise(linear: nn.Linear):
        made[id(linear)] = Fp8WeightLinear.from_linear(linear)
        return linear  # swapped below, once the rest is cast

    swap_linears(model, layer_filter, quantise)
    model.to(dtype)
    converted = swap_linears(model, lambda fqn, m: id(m) in made, lambda lin: made[id(lin)])
    for name, mod in list(model.named_modules()):  # relu^2 MLPs whose two Linears converted: fused (Fp8WeightMLP)
        children = [getattr(mod, c, None) for c in ("c_fc", "c_proj")]
        if name and getattr(mod, "activation", None) == "relu2" and all(isinstance(c, Fp8WeightLinear) for c in children):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Fp8WeightMLP(*children))
    return converted


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a decode step reads (parameters and FP8 buffers, the embedding aside)."""
    tensors = [(n, p) for n, p in model.named_parameters()] + [
        (n, b) for n, b in model.named_buffers() if n.endswith(("qweight", "inv_scale"))]
    return sum(t.numel() * t.element_size() for n, t in tensors if not n.startswith("wte"))


__all__ = ["ACTS", "SERVE_WEIGHTS", "WEIGHT_ONLY_MAX_ROWS", "Fp8WeightLinear", "Fp8WeightMLP", "check", "convert", "dequantise_rows",
           "quantise_rows", "unavailable_reason", "w8a8", "weight_bytes", "weight_only_triton"]


def load_model_dir(path, device, dtype: torch.dtype):
    """model.model_dir.load_model_dir with the Linear weights in FP8, a scale per row, quantised from the
    checkpoint's fp32 and the rest in `dtype`; BackendUnavailable, before anything loads, where FP8 weights
    cannot serve."""
    from model.model_dir import load_model_dir as load_full
    check(device)
    model, tok, gen = load_full(path, device, torch.float32)
    convert(model, dtype)
    return model, tok, gen
