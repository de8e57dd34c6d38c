"""FP8 cast with a transposed copy in one kernel: what each FP8 Linear's backward needs.

Hopper's FP8 GEMM takes only K-major operands, so the weight-gradient GEMM dW = dy^T @ x needs dy and
x stored transposed (tokens contiguous) next to the row-major copies the other GEMMs use. Left to
torch.compile, the cast and the transposed write land inside whatever kernel produced the tensor
(QK-norm/RoPE backward, squared-ReLU backward), whose iteration order suits the row-major write only:
on the H200 those kernels took far longer than their memory traffic needs (bench/results/precision.md,
"fp8's cast kernel"). Here the cast is one custom op, opaque to the
compiler: on CUDA a Triton kernel reads a tile from memory, scales, saturates and rounds it, and
writes it twice (as is and transposed, both coalesced; the transposed copy from a second read of the
same tile, which L2 serves); elsewhere the same arithmetic in plain torch. The producer then writes an
ordinary bf16 tensor, which costs one extra read and write of it.

Op: `sparkchat::fp8_cast_transpose(x, scale, fmt, act, h) -> (q, q^T, amax)`, with q = saturate(
act(x) * scale) in `fmt` (e4m3 or e5m2), q^T contiguous and amax = max |act(x)| from the same pass,
which is all delayed scaling needs: its scale comes from earlier steps, so nothing waits for a
separate amax pass. `act` lets the MLP's squared ReLU ride along instead of costing a pass of its own:
    none        act(x) = x
    srelu       act(x) = relu(x)^2                 (x: the first MLP GEMM's output)
    srelu_grad  act(x) = x * 2h where h > 0, else 0 (x: the gradient of relu(h)^2, h: that same output)
all in FP32 from the 16-bit input. Both implementations round to nearest even and agree bit for bit
(tests/test_fp8_cast.py, on a GPU). The kernel takes bf16/fp16 input; fp32 takes the torch path (see
the note in the op). One difference: the kernel's amax skips NaN, torch's returns NaN; q holds the NaN
in both. So with power-of-two scales (below) an input holding NaN can get another scale on the GPU
than on the torch path; a run with NaN activations or gradients has diverged either way.

Dynamic scaling without its amax pass: `sparkchat::fp8_cast_transpose_pow2(x, guess, fmt, act, h) ->
(q, q^T, amax, scale)` scales by a power of two (formats.pow2_scale), which depends only on the binade
amax falls in, so it is usually last step's. The kernel casts with that guess, finding amax on the
way; a second, persistent kernel derives this step's scale from that amax and, only if it differs
from the guess, casts again. The result is bit for bit that of an amax pass followed by a cast; a
right guess saves the pass (a full read of the tensor), a wrong one costs a second cast.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from .formats import AMAX_FLOOR, amax, fp8_max, fp8_max_fields, pow2_scale, scaled_cast

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs have no Triton; the torch implementation serves them
    triton = None

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FORMAT_NAMES = {dtype: name for name, dtype in FP8_DTYPES.items()}
ACTS = {"none": 0, "srelu": 1, "srelu_grad": 2}


def activate(x: torch.Tensor, act: str, h: torch.Tensor | None = None) -> torch.Tensor:
    """act(x) in FP32, the op's arithmetic in plain torch (also what dynamic scaling takes its amax of)."""
    x = x.float()
    if act == "srelu":
        r = x.relu()
        return r * r
    if act == "srelu_grad":  # selected as autograd's relu backward does: exactly 0 where h <= 0, even for
        h = h.float()        # an inf or NaN gradient, and NaN where h is NaN
        return torch.where(h <= 0, 0.0, x * (2 * h))
    return x


def _cast_both(y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
    """(q, q^T contiguous) of an already activated tensor, in plain torch."""
    q = scaled_cast(y, scale, dtype)
    # clone, not contiguous(): for one row or column the transpose is already contiguous, and a custom
    # op's outputs may not alias each other
    return q, q.t().clone(memory_format=torch.contiguous_format)


def _reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, act: str = "none",
               h: torch.Tensor | None = None):
    y = activate(x, act, h)
    return (*_cast_both(y, scale, dtype), amax(y))


if triton is not None:
    # Tile shapes tried once per (M, N, act) on the first call; the best is kept. Bigger tiles mean
    # longer contiguous byte runs in both FP8 writes and fewer atomics on the one amax word.
    _CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w)
                for bm, bn, w in ((64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 128, 4), (128, 128, 8),
                                  (64, 256, 8), (256, 64, 8))]

    SMALL, SMALL_CONFIG = 1 << 22, dict(BLOCK_M=64, BLOCK_N=64, num_warps=4)

    @triton.jit
    def _activated(x_ptr, h_ptr, offs, mask, ACT: tl.constexpr):
        """act(x) in FP32 for one tile of offsets."""
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if ACT == 1:  # relu(x)^2
            r = tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)
            x = r * r
        elif ACT == 2:  # x * 2h where h > 0, else 0 (see activate)
            h = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            x = tl.where(h <= 0, 0.0, x * (2 * h))
        return x

    @triton.jit
    def _to_fp8_bytes(x, scale, fmax, OUT_DTYPE: tl.constexpr):
        # saturate as torch's clamp does, NaN staying NaN (a NaN gradient must not turn into +-fmax)
        y = tl.minimum(tl.maximum(x * scale, -fmax, propagate_nan=tl.PropagateNan.ALL), fmax,
                       propagate_nan=tl.PropagateNan.ALL)
        return y.to(OUT_DTYPE).to(tl.uint8, bitcast=True)  # stored as raw bytes

    @triton.jit
    def _cast_tile(x_ptr, h_ptr, q_ptr, qt_ptr, amax_ptr, pid_m, pid_n, M, N, scale, fmax,
                   ACT: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   TRACK_AMAX: tl.constexpr):
        """Cast one tile of act(x) to q and q^T (and fold its amax into amax_ptr if TRACK_AMAX)."""
        # int64 offsets: an output head's gradient (65,536 tokens x 65,536 vocab) passes 2^31 elements
        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        offs = rows[:, None] * N + cols[None, :]
        x = _activated(x_ptr, h_ptr, offs, mask, ACT)
        if TRACK_AMAX:  # the amax skips NaN, so one NaN does not poison delayed scaling's history
            tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        tl.store(q_ptr + offs, _to_fp8_bytes(x, scale, fmax, OUT_DTYPE), mask=mask)
        # The transposed copy: the same tile read again (from L2) as a (cols, rows) tile and cast again,
        # so no FP8 tile is transposed in registers. Transposing the cast tile (tl.trans, or a store
        # through transposed pointers) gave wrong transposed bytes on the H200 with Triton 3.6 in two
        # cases we hit (fp32 tiles; srelu_grad at 64x64), cause not found; this way was right in every
        # case tried (bench/results/precision.md, "fp8's cast kernel") and in the GPU test.
        mask_t = (cols[:, None] < N) & (rows[None, :] < M)
        xt = _activated(x_ptr, h_ptr, rows[None, :] * N + cols[:, None], mask_t, ACT)
        tl.store(qt_ptr + cols[:, None] * M + rows[None, :], _to_fp8_bytes(xt, scale, fmax, OUT_DTYPE), mask=mask_t)

    @triton.autotune(configs=_CONFIGS, key=["M", "N", "ACT"], reset_to_zero=["amax_ptr"])
    @triton.jit
    def _cast_transpose_kernel(x_ptr, h_ptr, scale_ptr, q_ptr, qt_ptr, amax_ptr, M, N, fmax,
                               ACT: tl.constexpr, OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr):
        _cast_tile(x_ptr, h_ptr, q_ptr, qt_ptr, amax_ptr, tl.program_id(0), tl.program_id(1), M, N,
                   tl.load(scale_ptr), fmax, ACT, OUT_DTYPE, BLOCK_M, BLOCK_N, True)

    @triton.jit
    def _recast_kernel(x_ptr, h_ptr, guess_ptr, amax_ptr, scale_ptr, q_ptr, qt_ptr, M, N, fmax, floor,
                       EXP_MAX: tl.constexpr, MANT_MAX: tl.constexpr, ACT: tl.constexpr,
                       OUT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """After a cast with a guessed scale: this step's power-of-two scale from the amax that cast
        found (formats.pow2_scale, bit for bit), written to scale_ptr; if it is not the guess, cast
        again with it. Persistent: a few programs loop over the tiles, none when the guess was right."""
        bits = tl.maximum(tl.load(amax_ptr), floor).to(tl.int32, bitcast=True)
        k = EXP_MAX - ((bits >> 23) & 0xFF) - ((bits & 0x7FFFFF) > MANT_MAX).to(tl.int32)
        scale = ((tl.minimum(tl.maximum(k, -126), 127) + 127) << 23).to(tl.float32, bitcast=True)
        pid = tl.program_id(0)
        tl.store(scale_ptr, scale, mask=pid == 0)
        if scale != tl.load(guess_ptr):
            tiles_n = tl.cdiv(N, BLOCK_N)
            for t in range(pid, tl.cdiv(M, BLOCK_M) * tiles_n, tl.num_programs(0)):
                _cast_tile(x_ptr, h_ptr, q_ptr, qt_ptr, amax_ptr, t // tiles_n, t % tiles_n, M, N, scale, fmax,
                           ACT, OUT_DTYPE, BLOCK_M, BLOCK_N, False)


def _on_device(x):
    """Launch on x's GPU, not the current one (CPU tensors only under TRITON_INTERPRET=1)."""
    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _launch_args(x, h, dtype, act):
    return (x, x if h is None else h), dict(ACT=ACTS[act], OUT_DTYPE=tl.float8e4nv if dtype == torch.float8_e4m3fn
                                             else tl.float8e5)


def _triton_cast_transpose(x, scale, dtype, act, h):
    M, N = x.shape
    q = torch.empty((M, N), dtype=dtype, device=x.device)
    qt = torch.empty((N, M), dtype=dtype, device=x.device)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))  # noqa: E731
    inputs, kw = _launch_args(x, h, dtype, act)
    args = (*inputs, scale, q.view(torch.uint8), qt.view(torch.uint8), amax, M, N, fp8_max(dtype))
    if M * N < SMALL:  # not worth a tuning run: one fixed tile shape
        kernel, kw = _cast_transpose_kernel.fn, dict(kw, **SMALL_CONFIG)
    else:
        kernel = _cast_transpose_kernel
    with _on_device(x):
        kernel[grid](*args, **kw)
    return q, qt, amax


RECAST_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, num_warps=4)


@functools.lru_cache
def _recast_programs(device: torch.device) -> int:
    """The persistent recast kernel's grid: two programs per SM (asked once per device, not per cast)."""
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _triton_cast_transpose_pow2(x, guess, dtype, act, h):
    q, qt, amax = _triton_cast_transpose(x, guess, dtype, act, h)
    scale = torch.empty((), dtype=torch.float32, device=x.device)
    M, N = x.shape
    inputs, kw = _launch_args(x, h, dtype, act)
    exp_max, mant_max = fp8_max_fields(dtype)
    tiles = triton.cdiv(M, RECAST_CONFIG["BLOCK_M"]) * triton.cdiv(N, RECAST_CONFIG["BLOCK_N"])
    with _on_device(x):
        _recast_kernel[(min(tiles, _recast_programs(x.device)),)](
            *inputs, guess, amax, scale, q.view(torch.uint8), qt.view(torch.uint8), M, N, fp8_max(dtype),
            AMAX_FLOOR, EXP_MAX=exp_max, MANT_MAX=mant_max, **kw, **RECAST_CONFIG)
    return q, qt, amax, scale


def _triton_ok(x, h) -> bool:
    # 16-bit inputs only (what the backend passes): with fp32 tiles the transposed copy came out wrong on
    # the H200 (Triton 3.6), so fp32 takes the torch path
    return x.is_cuda and triton is not None and x.dtype in (torch.bfloat16, torch.float16) \
        and (h is None or h.dtype == x.dtype)


@torch.library.custom_op("sparkchat::fp8_cast_transpose", mutates_args=())
def _fp8_cast_transpose(x: torch.Tensor, scale: torch.Tensor, fmt: str, act: str,
                        h: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = FP8_DTYPES[fmt]
    x, h = x.contiguous(), None if h is None else h.contiguous()
    if _triton_ok(x, h):
        return _triton_cast_transpose(x, scale.float(), dtype, act, h)
    return _reference(x, scale, dtype, act, h)


@_fp8_cast_transpose.register_fake
def _(x, scale, fmt, act, h):
    dtype = FP8_DTYPES[fmt]
    M, N = x.shape
    return x.new_empty((M, N), dtype=dtype), x.new_empty((N, M), dtype=dtype), x.new_empty((), dtype=torch.float32)


@torch.library.custom_op("sparkchat::fp8_cast_transpose_pow2", mutates_args=())
def _fp8_cast_transpose_pow2(x: torch.Tensor, guess: torch.Tensor, fmt: str, act: str, h: torch.Tensor | None
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    dtype = FP8_DTYPES[fmt]
    x, h = x.contiguous(), None if h is None else h.contiguous()
    if _triton_ok(x, h):
        return _triton_cast_transpose_pow2(x, guess.float(), dtype, act, h)
    y = activate(x, act, h)  # once, for both the amax and the cast
    a = amax(y)
    scale = pow2_scale(dtype, a)
    return (*_cast_both(y, scale, dtype), a, scale)


@_fp8_cast_transpose_pow2.register_fake
def _(x, guess, fmt, act, h):
    dtype = FP8_DTYPES[fmt]
    M, N = x.shape
    scalar = x.new_empty((), dtype=torch.float32)
    return x.new_empty((M, N), dtype=dtype), x.new_empty((N, M), dtype=dtype), scalar, torch.empty_like(scalar)


def _check_args(act: str, h: torch.Tensor | None, x: torch.Tensor) -> None:
    if act not in ACTS:
        raise ValueError(f"act must be one of {list(ACTS)}, got {act!r}")
    if (h is not None) != (act == "srelu_grad") or (h is not None and h.shape != x.shape):
        raise ValueError("h (of x's shape) goes with act='srelu_grad' and only with it")


def cast_transpose(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, act: str = "none",
                   h: torch.Tensor | None = None):
    """(q, q^T contiguous, amax(|act(x)|)) of a 2-D tensor: q = saturate(act(x) * scale) in FP8 `dtype`,
    all in one kernel on CUDA (the amax feeds delayed scaling's history). `h`: srelu_grad's second input."""
    _check_args(act, h, x)
    return torch.ops.sparkchat.fp8_cast_transpose(x, scale.reshape(()).float(), FORMAT_NAMES[dtype], act, h)


def cast_transpose_pow2(x: torch.Tensor, guess: torch.Tensor, dtype: torch.dtype, act: str = "none",
                        h: torch.Tensor | None = None):
    """(q, q^T, amax, scale): per-tensor dynamic scaling with a power-of-two scale, scale =
    pow2_scale(amax(|act(x)|)), without a separate amax pass when `guess` (last step's scale) is right.
    The result does not depend on the guess, only the time: a wrong guess costs a second cast."""
    _check_args(act, h, x)
    return torch.ops.sparkchat.fp8_cast_transpose_pow2(x, guess.reshape(()).float(), FORMAT_NAMES[dtype], act, h)


def triton_available() -> bool:
    return triton is not None
