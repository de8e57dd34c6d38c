"""Native FP8 training through `torch._scaled_mm`: per-tensor dynamic scaling, written here.

The format. FP8 e4m3 (max 448, 3 mantissa bits) holds weights and activations; e5m2 (max 57344, 2
mantissa bits) holds gradients, which need range more than precision. Each tensor gets one FP32 scale
per step, s = fmt_max / amax(tensor), so its largest value lands at the top of the format; the GEMM
multiplies FP8 operands on the tensor cores, accumulates in FP32 and multiplies the result by the two
inverse scales before writing bf16 (or fp32 for the weight gradient, straight into the master dtype).

The three GEMMs of a Linear y = x W^T (x: M x K tokens-by-features, W: N x K):
    forward  y  = x  @ W^T     e4m3 x e4m3  -> bf16
    dgrad    dx = dy @ W       e5m2 x e4m3  -> bf16
    wgrad    dW = dy^T @ x     e5m2 x e4m3  -> fp32
They live in one autograd Function under torch.compile. Where the casts run (`cast`):
  - `kernel`: each activation and gradient goes through one cast-transpose op
    (fp8_cast.py; a Triton kernel on CUDA) that writes the row-major FP8 copy and the transposed one
    the weight-gradient GEMM needs in a single pass, and finds the tensor's amax on the way. The
    activation is handed over in the matmul dtype (bf16 on a GPU), so an fp32 activation is rounded
    to bf16 before FP8, as TE's inputs are; inline casts round fp32 straight to FP8. Its FP8 copy
    of each input is saved for the backward, where the compiler would recompute an inline cast:
    more memory than inline casts, still below bf16 (bench/saved_activations.py shows the saved
    tensors: bench/results/precision.md, "Saved activations");
  - `inline`: the casts are plain tensor code that Inductor fuses into the neighbouring kernels. It
    then writes the transposed copy from kernels whose iteration order suits only the row-major one,
    and those kernels cost more than the GEMMs save (bench/results/precision.md, "Where the
    micro-step goes").
Uncompiled, the inline casts are separate memory passes and FP8 is slower than bf16.
With `cast: kernel`, `mlp: fused` also runs each relu^2 MLP as one autograd Function whose
squared ReLU (and its backward) happens inside the cast op: the first GEMM's bf16 output goes
straight into the cast of the second GEMM's input, and the second GEMM's input gradient straight into
the cast of the first's output gradient, so the two elementwise passes of the 4x-wide hidden tensor
that the compiler would write in bf16 and the op read back are gone. `mlp: linear` keeps two Fp8Linears.

What the kernel requires (cuBLASLt on sm_89+): the first operand row-major, the second column-major
(`b.t()` of a contiguous tensor), inner dimension and both outer dimensions divisible by 16, FP32
scalar scales, and at most one e5m2 operand. Hence the layer filter's dim_multiple=16, and the
`.t().contiguous().t()` calls below that produce the column-major copies.
`use_fast_accum` (a cheaper accumulation in the tensor core) is on for the forward GEMM only with
`fast_accum: forward`, so gradients accumulate at full precision (`none`: nowhere, `all`: everywhere).
The options and their defaults: `Fp8Options` (options.py, params `precision.fp8`).

Delayed scaling (`scaling: delayed`), TE's DelayedScaling recipe: the activation and
gradient scales come from the largest amax of the last `amax_history_len` steps, so the cast need not
wait for this step's amax. With `cast: kernel` that removes the separate amax passes over activations
and gradients (the op records the amax it finds while casting; the small weights keep theirs); with
inline casts it bought nothing (bench/results/precision.md, "fp8's cast kernel"). The first step (and the
first after a resume) scales dynamically. Under data parallelism the histories are reduced to their
maximum over ranks every step (`sync_ranks`).

Power-of-two scales (`pow2_scales: true`): every scale is the largest power of two that
keeps the tensor's amax within the format (formats.pow2_scale), so the largest value lands in the top
binade rather than on the maximum; relative precision is the same. Such a scale changes only when
amax crosses a power of two, so with dynamic scaling and `cast: kernel` the cast op starts from last
step's scale and casts again only when this step's differs (fp8_cast.cast_transpose_pow2): dynamic
scaling, bit for bit, without the separate amax passes: faster than exact scales at the same loss
(bench/results/precision.md, "fp8's cast kernel": the reason it is the default).

On a CPU the GEMMs go through `scaled_mm` below: the same FP8 operands and scales, dequantised into
one fp32 matmul. Every cast, scale and saved tensor is the GPU path's, so the tests and the probe run
this code; only the order of the fp32 sums differs from `_scaled_mm` (tests/test_precision.py compares
the losses). torch's own CPU `_scaled_mm` is exact too but has no FP8 arithmetic to use on most CPUs:
one 512x256x1024 product took 2.2 s against about 1 ms in fp32, 70 s for one step of the probe's model.
fp8 on a CPU is no faster than bf16 (the log says so). Backend name: `fp8`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import base
from .base import (ConvertedLinear, PrecisionBackend, low_precision_enabled, matmul_dtype, pad_rows, sm,
                   swap_linears)
from .formats import E4M3, E5M2, amax, cast_fp8, fp8_max, fp8_scale, quantize_fp8
from .fp8_cast import activate, cast_transpose, cast_transpose_pow2, triton_available
from .options import Fp8Options

def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b of FP8 operands, in `out_dtype`: torch._scaled_mm on CUDA. Elsewhere the
    operands are widened to fp32, which holds each FP8 value, and each product of two (at most 4 x 4
    significant bits), exactly; an fp32 GEMM adds them up, in its own order (the one difference from
    _scaled_mm, whose CPU kernel is ~2000x slower: see the module docstring). `use_fast_accum` is a
    tensor-core setting; a CPU has none."""
    if a.is_cuda:
        return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                use_fast_accum=use_fast_accum)
    return torch.ops.sparkchat.dequantised_mm(a, b, scale_a, scale_b, out_dtype)


# One op, opaque to torch.compile as _scaled_mm is. Traced as plain tensor code, compiled delayed scaling
# gave other weight gradients than eager from its second step (test_fp8_delayed_scaling_under_torch_compile),
# as if the input's scale were recomputed in the backward from the amax history the forward had advanced
@torch.library.custom_op("sparkchat::dequantised_mm", mutates_args=())
def _dequantised_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    return (torch.mm(a.float(), b.float()) * (scale_a * scale_b)).to(out_dtype)


@_dequantised_mm.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def _col_major(t: torch.Tensor) -> torch.Tensor:
    """Same values, column-major storage (what _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


def _history_amax(history: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Delayed scaling's amax: the largest of the last steps'. A history of zeros (a gradient that was
    exactly zero, as behind a zero-initialised projection at step 1) gives scale 1, as TE does, rather
    than falling back to this step's own amax."""
    past = history.amax()
    return torch.where(past > 0, past, torch.full_like(past, fp8_max(dtype)))


def _record(history: torch.Tensor, current: torch.Tensor) -> None:
    history.copy_(torch.cat([current.reshape(1), history[:-1]]))


# How a cast finds its scale (`how`, per forward; `state` is the tensor it reads and updates):
#   dynamic  this tensor's amax (state: an amax history to record into, or None)
#   delayed  the largest amax of the history in `state`, recording this step's
#   guess    dynamic with power-of-two scales through the cast op that starts from a guess (state:
#            last step's scale), so no amax pass runs first (fp8_cast.cast_transpose_pow2)


def _inline_cast(t: torch.Tensor, dtype: torch.dtype, state: torch.Tensor | None, how: str, pow2: bool):
    """(q, inverse scale) of t with the cast left to the compiler, recording this step's amax."""
    current = amax(t)
    source = _history_amax(state, dtype) if how == "delayed" else current
    if state is not None:
        _record(state, current)
    return cast_fp8(t, dtype, source, pow2)


def _kernel_cast(t: torch.Tensor, dtype: torch.dtype, state: torch.Tensor | None, how: str, pow2: bool,
                 act: str = "none", h: torch.Tensor | None = None):
    """(q, q^T, inverse scale) of act(t) through the cast-transpose op. Delayed scaling reads its scale
    from the history and records the amax the op found in the same pass, so no pass waits for an amax;
    so does `guess`; plain dynamic scaling needs this tensor's amax first."""
    if how == "guess":
        q, qt, _, s = cast_transpose_pow2(t, state, dtype, act, h)
        state.copy_(s)
        return q, qt, s.reciprocal()
    if how == "delayed":
        source = _history_amax(state, dtype)
    else:  # no FP32 copy of a plain tensor just for its amax
        source = amax(t) if act == "none" else amax(activate(t, act, h))
    s = fp8_scale(dtype, source, pow2)
    q, qt, current = cast_transpose(t, s, dtype, act, h)
    if state is not None:
        _record(state, current)
    return q, qt, s.reciprocal()


class _Fp8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, out_dtype, fast_fwd, fast_bwd, x_state, g_state, how, pow2, cast_kernel):
        x2 = pad_rows(x.reshape(-1, x.shape[-1]))
        if cast_kernel:
            # the producer hands over bf16 (half the bytes of the fp32 residual stream); the op writes
            # x^T too, which only the weight-gradient GEMM reads
            xq, xqt, xs = _kernel_cast(x2.to(out_dtype), E4M3, x_state, how, pow2)
        else:
            xq, xs = _inline_cast(x2, E4M3, x_state, how, pow2)
            xqt = None
        wq, ws = quantize_fp8(w, E4M3, pow2)  # weights: always this step's amax (a small tensor, cheap)
        y = scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=out_dtype, use_fast_accum=fast_fwd)
        # keep one FP8 copy of x for backward (a quarter of the bf16 activation memory): the transposed
        # one when the cast op made it, else the row-major one, transposed in backward
        ctx.save_for_backward(xqt if cast_kernel else xq, xs, wq, ws)
        ctx.fast_bwd, ctx.g_state, ctx.how, ctx.pow2, ctx.cast_kernel = fast_bwd, g_state, how, pow2, cast_kernel
        ctx.dtypes, ctx.rows = (x.dtype, w.dtype), x.numel() // x.shape[-1]
        return y[:ctx.rows].reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy):
        xsaved, xs, wq, ws = ctx.saved_tensors
        xdt, wdt = ctx.dtypes
        g2 = pad_rows(gy.reshape(-1, gy.shape[-1]))
        if ctx.cast_kernel:
            gq, gqt, gs = _kernel_cast(g2, E5M2, ctx.g_state, ctx.how, ctx.pow2)
            x_col = xsaved.t()  # x^T contiguous = x column-major
        else:
            gq, gs = _inline_cast(g2, E5M2, ctx.g_state, ctx.how, ctx.pow2)
            gqt, x_col = gq.t().contiguous(), _col_major(xsaved)
        gx = scaled_mm(gq, _col_major(wq), scale_a=gs, scale_b=ws, out_dtype=gy.dtype,
                              use_fast_accum=ctx.fast_bwd)
        gw = scaled_mm(gqt, x_col, scale_a=gs, scale_b=xs, out_dtype=torch.float32,
                              use_fast_accum=ctx.fast_bwd)
        return gx[:ctx.rows].reshape(*gy.shape[:-1], wq.shape[1]).to(xdt), gw.to(wdt), *[None] * 8


class _Fp8MLP(torch.autograd.Function):
    """y = relu(x W1^T)^2 W2^T with four FP8 GEMMs and the squared ReLU inside the casts (cast op's
    `srelu` forward, `srelu_grad` backward). Saved for backward: x^T and a^T in FP8 (a = relu(h)^2) and
    the hidden h in bf16, which the compiled unfused MLP saves too."""

    @staticmethod
    def forward(ctx, x, w1, w2, out_dtype, fast_fwd, fast_bwd, x_state, h_state, a_state, g_state, how, pow2):
        x2 = pad_rows(x.reshape(-1, x.shape[-1]).to(out_dtype))
        xq, xqt, xs = _kernel_cast(x2, E4M3, x_state, how, pow2)
        w1q, w1s = quantize_fp8(w1, E4M3, pow2)
        h = scaled_mm(xq, w1q.t(), scale_a=xs, scale_b=w1s, out_dtype=out_dtype, use_fast_accum=fast_fwd)
        aq, aqt, as_ = _kernel_cast(h, E4M3, a_state, how, pow2, "srelu")
        w2q, w2s = quantize_fp8(w2, E4M3, pow2)
        y = scaled_mm(aq, w2q.t(), scale_a=as_, scale_b=w2s, out_dtype=out_dtype, use_fast_accum=fast_fwd)
        ctx.save_for_backward(xqt, xs, w1q, w1s, h, aqt, as_, w2q, w2s)
        ctx.fast_bwd, ctx.states, ctx.how, ctx.pow2 = fast_bwd, (h_state, g_state), how, pow2
        ctx.dtypes, ctx.rows = (x.dtype, w1.dtype, w2.dtype), x.numel() // x.shape[-1]
        return y[:ctx.rows].reshape(*x.shape[:-1], w2.shape[0])

    @staticmethod
    def backward(ctx, gy):
        xqt, xs, w1q, w1s, h, aqt, as_, w2q, w2s = ctx.saved_tensors
        (h_state, g_state), how, pow2 = ctx.states, ctx.how, ctx.pow2
        xdt, w1dt, w2dt = ctx.dtypes
        g2 = pad_rows(gy.reshape(-1, gy.shape[-1]))
        gq, gqt, gs = _kernel_cast(g2, E5M2, g_state, how, pow2)
        ga = scaled_mm(gq, _col_major(w2q), scale_a=gs, scale_b=w2s, out_dtype=h.dtype,
                              use_fast_accum=ctx.fast_bwd)
        gw2 = scaled_mm(gqt, aqt.t(), scale_a=gs, scale_b=as_, out_dtype=torch.float32,
                               use_fast_accum=ctx.fast_bwd)
        # dL/dh = dL/da * 2 relu(h), cast straight to e5m2 for the first GEMM's gradients
        hq, hqt, hs = _kernel_cast(ga, E5M2, h_state, how, pow2, "srelu_grad", h)
        gx = scaled_mm(hq, _col_major(w1q), scale_a=hs, scale_b=w1s, out_dtype=gy.dtype,
                              use_fast_accum=ctx.fast_bwd)
        gw1 = scaled_mm(hqt, xqt.t(), scale_a=hs, scale_b=xs, out_dtype=torch.float32,
                               use_fast_accum=ctx.fast_bwd)
        return (gx[:ctx.rows].reshape(*gy.shape[:-1], w1q.shape[1]).to(xdt), gw1.to(w1dt), gw2.to(w2dt), *[None] * 9)


class Fp8Linear(ConvertedLinear):
    fast_fwd, fast_bwd = True, False
    cast_kernel = False  # True: casts through the cast-transpose op (fp8_cast.py), False: inline
    history_len = 0  # > 0: delayed scaling of activations and gradients over this many steps
    pow2 = False  # power-of-two scales (formats.pow2_scale)

    @property
    def guesses_scales(self) -> bool:
        """Dynamic power-of-two scales through the cast op, which starts from last step's scale."""
        return self.pow2 and self.cast_kernel and not self.history_len

    def configure(self, **kwargs) -> None:
        super().configure(**kwargs)
        if self.history_len:
            # amax histories of the input and of the output gradient; not in checkpoints (a resumed run
            # scales its first step dynamically again, as a fresh one does)
            dev = self.weight.device
            self.register_buffer("x_amax_history", torch.zeros(self.history_len, device=dev), persistent=False)
            self.register_buffer("g_amax_history", torch.zeros(self.history_len, device=dev), persistent=False)
            self.calibrated = False
        elif self.guesses_scales:
            # last step's scales are the op's guesses (any start
            # value gives the same result; a wrong guess only costs a second cast)
            dev = self.weight.device
            self.register_buffer("x_scale_guess", torch.ones((), device=dev), persistent=False)
            self.register_buffer("g_scale_guess", torch.ones((), device=dev), persistent=False)

    def scaling_state(self):
        """((input state, output-gradient state), how) for this forward (see `how` above `_inline_cast`):
        evaluation (no grad) scales dynamically and leaves the training state alone."""
        if not torch.is_grad_enabled():
            return (None, None), "dynamic"
        if self.history_len:
            how = "delayed" if self.calibrated else "dynamic"
            self.calibrated = True  # the first step scales dynamically and starts the histories
            return (self.x_amax_history, self.g_amax_history), how
        if self.guesses_scales:
            return (self.x_scale_guess, self.g_scale_guess), "guess"
        return (None, None), "dynamic"

    def forward(self, x):
        if not low_precision_enabled():
            return super().forward(x)
        states, how = self.scaling_state()
        # the transposed copies serve only the backward, so evaluation casts inline
        kernel = self.cast_kernel and torch.is_grad_enabled()
        y = _Fp8Matmul.apply(x, self.weight, matmul_dtype(x), self.fast_fwd, self.fast_bwd, *states, how,
                             self.pow2, kernel)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class Fp8MLP(nn.Module):
    """A relu^2 MLP whose two Fp8Linears run as one `_Fp8MLP` while training (the squared ReLU inside
    the cast op). Same children, same parameter names, same delayed-scaling histories (c_fc's input and
    hidden gradient, c_proj's input and output gradient) as the unfused MLP; evaluation runs the
    children one by one."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.c_fc, self.c_proj = mlp.c_fc, mlp.c_proj

    def forward(self, x):
        fc, proj = self.c_fc, self.c_proj
        if not (low_precision_enabled() and torch.is_grad_enabled()):
            return proj(F.relu(fc(x)).square())
        (x_state, h_state), how = fc.scaling_state()
        (a_state, g_state), how_proj = proj.scaling_state()
        assert how == how_proj, "the two Linears of a fused MLP share their options and their first step"
        return _Fp8MLP.apply(x, fc.weight, proj.weight, matmul_dtype(x), fc.fast_fwd, fc.fast_bwd,
                             x_state, h_state, a_state, g_state, how, fc.pow2)


def _fusable_mlp(module: nn.Module) -> bool:
    """A relu^2 MLP (it says so) of two bias-free Fp8Linears that cast through the op."""
    children = [getattr(module, name, None) for name in ("c_fc", "c_proj")]
    return getattr(module, "activation", None) == "relu2" and all(
        isinstance(c, Fp8Linear) and c.cast_kernel and c.bias is None for c in children)


MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell
FP8_GPUS = "Ada L4/L40/RTX 40xx, Hopper H100/H200, Blackwell"


def unavailable_reason(device, what: str, instead: str, cpu_runs: bool) -> str | None:
    """The one FP8 capability check (training's `fp8` backend here, serving's FP8 weights in
    fp8_weights.py): None when FP8 products run on `device`, else why `what` cannot, ending with `instead`
    (what runs instead). `cpu_runs`: the caller's CPU path (dequantised products, no speedup) counts."""
    device = torch.device(device)
    if not hasattr(torch, "float8_e4m3fn") or not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no float8 dtypes / torch._scaled_mm (needs torch >= 2.5)"
    if device.type == "cpu" and cpu_runs:
        return None
    major, minor = MIN_CAPABILITY
    need = f"a CUDA GPU with FP8 tensor cores (sm_{major}{minor}+, compute capability {major}.{minor} or higher: {FP8_GPUS})"
    if device.type != "cuda":
        return f"{what} needs {need}{' or a CPU' if cpu_runs else ''}, not on {device.type}: {instead}"
    cap = base.cuda_capability(device)
    if cap is None:
        return "CUDA is not available"
    if cap < MIN_CAPABILITY:
        return f"{what} needs {need}; this GPU is {sm(cap)}: {instead}"
    return None


class Fp8Backend(PrecisionBackend):
    """Options: `Fp8Options` (params `precision.fp8`), each explained in this file's docstring."""
    name = "fp8"
    options: Fp8Options

    def unavailable_reason(self, device):
        # on a CPU: the casts as on a GPU, the products in fp32 (scaled_mm): no speedup
        return unavailable_reason(device, "native FP8", "fp8-emulated shows the same numerics here, without speedup", cpu_runs=True)

    def notes(self, device):
        if torch.device(device).type == "cpu":
            return ["fp8 on CPU: the FP8 casts and scales of the GPU path, each product dequantised into an fp32 "
                    "matmul (fp8.scaled_mm): the numerics of FP8 training, no speedup over bf16"]
        if self.options.cast == "kernel" and not triton_available():
            return ["fp8 cast: kernel without Triton installed runs the cast-transpose op in plain torch, "
                    "slower than cast: inline; install triton (CUDA builds of torch bring it)"]
        return []

    @property
    def label(self) -> str:
        o, changed = self.options, self.options.changed()
        opts = [f"fast_accum={o.fast_accum}"] if "fast_accum" in changed else []
        opts += [f"delayed,history={o.amax_history_len}"] if o.scaling == "delayed" else []
        opts += [f"cast={o.cast}"] if "cast" in changed else []
        opts += [f"mlp={o.mlp}"] if o.cast == "kernel" and "mlp" in changed else []
        opts += ["exact_scales"] if not o.pow2_scales else []  # before this default, plain `fp8` rows meant these
        return f"{self.name}[{','.join(opts)}]" if opts else self.name

    def sync_ranks(self, model: nn.Module) -> None:
        # delayed scaling: every rank scales by the largest amax any rank saw, so a rank whose
        # activations or gradients outgrow another's does not saturate (TE reduces its amaxes too)
        hists = [h for m in model.modules() if isinstance(m, Fp8Linear) and m.history_len
                 for h in (m.x_amax_history, m.g_amax_history)]
        if not hists:
            return
        flat = torch.cat(hists)
        torch.distributed.all_reduce(flat, op=torch.distributed.ReduceOp.MAX)
        for h, v in zip(hists, flat.split([h.numel() for h in hists])):
            h.copy_(v)

    def convert(self, model: nn.Module) -> nn.Module:
        o = self.options
        kw = dict(fast_fwd=o.fast_accum in ("forward", "all"), fast_bwd=o.fast_accum == "all",
                  history_len=o.amax_history_len if o.scaling == "delayed" else 0, cast_kernel=o.cast == "kernel",
                  pow2=o.pow2_scales)
        self.converted = swap_linears(model, self.layer_filter, lambda lin: Fp8Linear.from_linear(lin, **kw))
        if o.cast == "kernel" and o.mlp == "fused":  # inline casts: the compiler fuses the MLP itself
            for name, mod in list(model.named_modules()):
                if name and _fusable_mlp(mod):
                    parent, _, child = name.rpartition(".")
                    setattr(model.get_submodule(parent), child, Fp8MLP(mod))
        return model
