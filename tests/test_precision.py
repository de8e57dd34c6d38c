"""Precision backends on CPU: refusal messages, exact formats against float64, short training runs.

GPUs are simulated only by monkeypatching `base.cuda_capability` (the one helper every backend asks);
the backends' own checks and quantisation code run for real.
"""
from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from model.gpt import GPT, GPTConfig
from model.model_dir import portable_state_dict
from model.optim import build_optimizer
from model.precision import BACKENDS, BackendUnavailable, LayerFilter, available_backends, get_backend
from model.precision.options import (BACKEND_OPTIONS, AutoOptions, Fp8Options, Nvfp4Options, OptionError, ProbeOptions,
                                     TEFp8Options, parse_entry)
from model.precision import base
from model.precision import formats as fm
from project_files import committed_text

ROOT = Path(__file__).resolve().parent.parent

CPU = torch.device("cpu")
CUDA = torch.device("cuda")


@pytest.fixture
def gpu(monkeypatch):
    """Pretend a CUDA GPU of a given capability is present (for the checks only)."""
    def set_cap(cap):
        monkeypatch.setattr(base, "cuda_capability", lambda device: cap if torch.device(device).type == "cuda" else None)
    return set_cap


def _te_installed() -> bool:
    try:
        import transformer_engine.pytorch  # noqa: F401
        return True
    except Exception:
        return False


# -- refusals -----------------------------------------------------------------------------------

@pytest.mark.skipif(_te_installed(), reason="Transformer Engine is installed here")
def test_te_not_installed_message(gpu):
    gpu((9, 0))
    be = get_backend("te-fp8", {"recipe": "current"})
    with pytest.raises(BackendUnavailable) as e:
        be.check(CUDA)
    msg = str(e.value)
    assert "Transformer Engine is not installed" in msg and "pip install '.[te]'" in msg
    assert "Backends that run here:" in msg and "bf16" in msg and "fp8" in msg


def test_nvfp4_refused_on_hopper(gpu):
    gpu((9, 0))
    with pytest.raises(BackendUnavailable) as e:
        get_backend("te-nvfp4").check(CUDA)
    msg = str(e.value)
    assert "NVFP4BlockScaling needs compute capability 10.0" in msg and "sm_90" in msg
    assert "Blackwell" in msg and "nvfp4-emulated" in msg


@pytest.fixture
def te_release(monkeypatch):
    """Pretend this Transformer Engine release is installed (its package metadata; TE itself is not loaded)."""
    import importlib.metadata as md
    real = md.version

    def set_version(v):
        monkeypatch.setattr(md, "version", lambda dist: v if dist.replace("-", "_").startswith("transformer_engine")
                            else real(dist))
    return set_version


@pytest.mark.parametrize("cap", [(12, 1), (12, 0)])
def test_nvfp4_refused_where_te_zeroes_its_gradients(gpu, te_release, cap):
    """TE up to 2.18 trains NVFP4 on zero gradients on sm_120/121 without an error: refused, with the reason
    and the fix to install; 2.19 (the fix) and other Blackwell cards are not refused for it."""
    gpu(cap)
    te_release("2.18.0")
    with pytest.raises(BackendUnavailable) as e:
        get_backend("te-nvfp4").check(CUDA)
    msg = str(e.value)
    assert f"Transformer Engine 2.18.0 quantises NVFP4 gradients to all-zero FP4 on sm_{cap[0]}{cap[1]}" in msg
    assert "trains on zero gradients without an error" in msg
    assert "TE PR #3281, released in 2.19" in msg and "pip install 'transformer-engine[pytorch]>=2.19'" in msg
    for version, cap_ in (("2.19.0", cap), ("2.20.1", cap), ("2.18.0", (10, 0))):
        gpu(cap_)
        te_release(version)
        reason = get_backend("te-nvfp4").unavailable_reason(CUDA) or ""
        assert "all-zero" not in reason, (version, cap_)
    gpu(cap)
    te_release("2.8.1")  # older still: refused too
    assert "Transformer Engine 2.8.1 quantises" in get_backend("te-nvfp4").unavailable_reason(CUDA)


def test_mxfp8_refused_on_hopper(gpu):
    gpu((9, 0))
    with pytest.raises(BackendUnavailable) as e:
        get_backend("te-fp8", {"recipe": "mxfp8"}).check(CUDA)
    msg = str(e.value)
    assert "MXFP8BlockScaling needs compute capability 10.0" in msg and "this GPU is sm_90" in msg
    assert "Backends that run here:" in msg


def test_fp8_refused_below_sm89(gpu):
    gpu((8, 0))
    with pytest.raises(BackendUnavailable) as e:
        get_backend("fp8").check(CUDA)
    msg = str(e.value)
    assert "8.9 or higher" in msg and "sm_80" in msg and "fp8-emulated" in msg
    # the list of what does run here is real: emulated backends and bf16, not fp8
    runs = msg.split("Backends that run here:")[1]
    assert "bf16" in runs and "fp8-emulated" in runs and " fp8," not in runs


def test_te_refused_without_gpu():
    with pytest.raises(BackendUnavailable, match="needs an NVIDIA GPU"):
        get_backend("te-fp8").check(CPU)


def test_fp8_runs_on_cpu_and_says_no_speedup():
    be = get_backend("fp8")
    be.check(CPU)
    assert "no speedup" in be.describe(CPU)
    assert set(available_backends(CPU)) >= {"bf16", "fp8", "fp8-emulated", "nvfp4-emulated"}


def test_bad_options_fail_up_front():
    with pytest.raises(OptionError, match=r"precision\.te_fp8\.recipe must be one of delayed, current"):
        get_backend("te-fp8", {"recipe": "fancy"})
    with pytest.raises(OptionError, match=r"unknown key 'precision\.nvfp4\.hadamard'"):
        get_backend("nvfp4-emulated", {"hadamard": True})
    with pytest.raises(OptionError, match="unknown precision backend 'int4'"):
        get_backend("int4")
    with pytest.raises(OptionError, match=r"precision\.fp8\.scaling must be one of dynamic, delayed; got 'lazy'"):
        get_backend("fp8", {"scaling": "lazy"})
    with pytest.raises(OptionError, match=r"precision\.fp8\.amax_history_len must be >= 1"):
        Fp8Options(amax_history_len=0)
    with pytest.raises(OptionError, match=r"precision\.nvfp4\.rht must be true or false"):
        Nvfp4Options(rht="yes")
    with pytest.raises(OptionError, match="'bf16' takes no options"):
        get_backend("bf16", {"fast_accum": "all"})
    with pytest.raises(TypeError, match="typed options"):  # a backend itself takes only its dataclass
        BACKENDS["fp8"]({"scaling": "delayed"})
    with pytest.raises(OptionError, match="takes Fp8Options, got TEFp8Options"):
        get_backend("fp8", TEFp8Options())


@pytest.mark.parametrize("text, name, changed, skip", [
    ("fp8", "fp8", {}, None),
    ("fp8:scaling=delayed,amax_history_len=4", "fp8", {"scaling": "delayed", "amax_history_len": 4}, None),
    ("fp8:pow2_scales=false", "fp8", {"pow2_scales": False}, None),
    ("te-fp8:current,modules=linear", "te-fp8", {"recipe": "current", "modules": "linear"}, None),
    ("fp8:skip=", "fp8", {}, []),
    ("fp8-emulated:skip=lm_head+attn.c_proj", "fp8-emulated", {}, ["lm_head", "attn.c_proj"]),
    ("nvfp4-emulated:bf16_last_blocks=0", "nvfp4-emulated", {"bf16_last_blocks": 0}, None),
])
def test_probe_entries_parse_into_typed_options(text, name, changed, skip):
    entry = parse_entry(text)
    assert entry.name == name and entry.skip == skip
    assert entry.options is None if BACKEND_OPTIONS[name] is None else isinstance(entry.options, BACKEND_OPTIONS[name])
    assert (entry.options.changed() if entry.options else {}) == changed
    get_backend(entry.name, entry.options)  # the backend takes them as they are


@pytest.mark.parametrize("text, message", [
    ("fp8:scaling=lazy", "probe entry 'fp8:scaling=lazy': precision.fp8.scaling must be one of dynamic, delayed"),
    ("fp8:pow2_scales=maybe", "probe entry 'fp8:pow2_scales=maybe': precision.fp8.pow2_scales must be true or false"),
    ("fp8:amax_history_len=x", "precision.fp8.amax_history_len must be an integer, got 'x'"),
    ("fp8:fastacc=all", "probe entry 'fp8:fastacc=all': unknown key 'precision.fp8.fastacc'"),
    ("te-fp8:fancy", "probe entry 'te-fp8:fancy': precision.te_fp8.recipe must be one of"),
    ("fp8:delayed", "probe entry 'fp8:delayed': 'delayed' is not key=value"),
    ("bf16:cast=inline", "probe entry 'bf16:cast=inline': backend 'bf16' takes no options"),
    ("auto", "probe entry 'auto': unknown backend 'auto'"),
])
def test_bad_probe_entry_names_entry_and_key(text, message):
    with pytest.raises(OptionError) as e:
        parse_entry(text)
    assert message in str(e.value)


def test_auto_on_cpu_picks_bf16(tmp_path):
    be = get_backend("auto", {"probe_file": str(tmp_path / "none.json")})
    be.check(CPU)
    assert be.chosen.name == "bf16" and "auto -> bf16" in be.describe(CPU)


def test_emulated_always_labelled():
    for name in ("fp8-emulated", "nvfp4-emulated"):
        assert "EMULATED" in get_backend(name).describe(CPU)


# -- formats against float64 ----------------------------------------------------------------------

def _e4m3_values() -> torch.Tensor:
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    v = bits.view(torch.float8_e4m3fn).double()
    return v[torch.isfinite(v)]


@pytest.mark.parametrize("dtype", [fm.E4M3, fm.E5M2])
def test_fp8_error_bound(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(4096, generator=g, dtype=torch.float64) * torch.exp(torch.randn(4096, generator=g, dtype=torch.float64) * 2))
    q = fm.fake_quant_fp8(x.float(), dtype).double()
    s = fm.fp8_max(dtype) / x.abs().max()
    tiny = torch.finfo(dtype).smallest_normal
    sub_step = tiny * 2.0 ** -(3 if dtype == fm.E4M3 else 2)
    bound = fm.REL_ERROR[dtype] * x.abs() + sub_step / 2 / s + 1e-6 * x.abs()  # + fp32 scale arithmetic
    assert torch.all((q - x).abs() <= bound)


def test_fp8_exact_on_representable_values():
    vals = _e4m3_values()
    x = torch.cat([vals, torch.tensor([448.0], dtype=torch.float64)]) * 2.0 ** -7  # amax = 448 * 2^-7
    q = fm.fake_quant_fp8(x.float(), fm.E4M3).double()
    assert torch.equal(q, x)


@pytest.mark.parametrize("dtype", [fm.E4M3, fm.E5M2])
def test_fp8_no_nan_on_extremes(dtype):
    for x in (torch.tensor([3e38, -3e38, 1.0]), torch.tensor([1e-40, -1e-42, 0.0]), torch.zeros(8)):
        q = fm.fake_quant_fp8(x, dtype)
        assert torch.isfinite(q).all()
    q = fm.fake_quant_fp8(torch.tensor([3e38, 1.5e38]), dtype)
    assert abs(q[0].item() - 3e38) / 3e38 < 0.07


@pytest.mark.parametrize("dtype", [fm.E4M3, fm.E5M2])
def test_pow2_scale_is_the_largest_power_of_two_that_fits(dtype):
    """pow2_scale(amax) = 2^k for the largest k with amax * 2^k <= max, against exact Python floats,
    at binade edges (just above and below max / 2^j) and random amaxes; non-finite amax: a tiny one."""
    fmax = fm.fp8_max(dtype)
    edges = [fmax * 2.0 ** j for j in range(-60, 40)]
    amaxes = edges + [math.nextafter(e, math.inf) for e in edges] + [math.nextafter(e, 0) for e in edges]
    g = torch.Generator().manual_seed(0)
    amaxes += torch.exp(torch.randn(2000, generator=g, dtype=torch.float64) * 20).tolist()
    a = torch.tensor(amaxes, dtype=torch.float32)
    a = a[(a >= fm.AMAX_FLOOR) & (a < 1e38)]  # below the floor counts as the floor (last line)
    got = torch.stack([fm.pow2_scale(dtype, v) for v in a]).double()
    for v, s in zip(a.double().tolist(), got.tolist()):
        assert math.frexp(s)[0] == 0.5, f"{s} is not a power of two"
        assert v * s <= fmax < v * s * 2, (v, s)
    inf, nan = torch.tensor(float("inf")), torch.tensor(float("nan"))
    assert fm.pow2_scale(dtype, inf).item() == fm.pow2_scale(dtype, nan).item() < 2.0 ** -100
    assert fm.pow2_scale(dtype, torch.tensor(0.0)).item() == fm.pow2_scale(dtype, torch.tensor(fm.AMAX_FLOOR)).item()


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)


def _round_e2m1_ref(v: torch.Tensor) -> torch.Tensor:
    """float64 reference: nearest grid value, ties to the even mantissa."""
    a = v.abs().clamp(max=6.0)
    d = (a[:, None] - E2M1_GRID[None, :]).abs()
    best = d.min(dim=1, keepdim=True).values
    cand = (d <= best + 1e-12)
    even = torch.tensor([1, 0, 1, 0, 1, 0, 1, 0], dtype=torch.bool)  # 0, 1, 2, 4 and 0.5.. by mantissa bit
    pick = torch.where(cand.sum(1) > 1, (cand & even).float().argmax(1), cand.float().argmax(1))
    return torch.copysign(E2M1_GRID[pick], v)


def test_e2m1_rounding_matches_reference():
    v = torch.linspace(-7, 7, 2801, dtype=torch.float64)
    v = torch.cat([v, torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0])])
    assert torch.equal(fm.round_e2m1(v.float()).double(), _round_e2m1_ref(v))


def test_e2m1_stochastic_rounding_unbiased():
    v = torch.full((200_000,), 2.3)
    torch.manual_seed(0)
    r = fm.round_e2m1(v, stochastic=True)
    assert set(r.unique().tolist()) == {2.0, 3.0}
    assert abs(r.mean().item() - 2.3) < 0.01


def test_nvfp4_exact_on_representable_values():
    g = torch.Generator().manual_seed(0)
    scales = _e4m3_values()
    scales = scales[(scales > 2.0 ** -6) & (scales <= 448)]
    rows = []
    for i in range(16):
        s = 448.0 if i == 0 else scales[torch.randint(len(scales), (1,), generator=g)].item()
        vals = E2M1_GRID[torch.randint(8, (16,), generator=g)] * torch.where(torch.rand(16, generator=g) < .5, -1.0, 1.0)
        vals[0] = 6.0  # block amax = 6 * s: the quantiser finds scale s exactly
        rows.append(vals * s)
    x = torch.stack(rows).double()  # tensor amax = 6 * 448 -> FP32 tensor scale 1
    q = fm.fake_quant_nvfp4(x.float()).double()
    assert torch.equal(q, x)


@pytest.mark.parametrize("tile_2d", [False, True])
def test_nvfp4_error_bound(tile_2d):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g, dtype=torch.float64) * torch.exp(torch.randn(64, 1, generator=g, dtype=torch.float64))
    q = fm.fake_quant_nvfp4(x.float(), tile_2d=tile_2d).double()
    if tile_2d:
        bamax = x.reshape(4, 16, 8, 16).abs().amax(dim=(1, 3), keepdim=True).expand(4, 16, 8, 16).reshape(64, 128)
    else:
        bamax = x.reshape(64, 8, 16).abs().amax(-1, keepdim=True).expand(64, 8, 16).reshape(64, 128)
    # half a grid step: 25% of |x| above the block scale, 0.25 * scale below it; the E4M3 block scale
    # itself is rounded (<= 2^-4) and may clip the block max by that much; underflowed scales give 0
    s_block = bamax / 6 * (1 + 2 ** -4)
    bound = 0.25 * x.abs() + 0.25 * s_block + 2 ** -4 * bamax + 1e-9 * x.abs().max()
    assert torch.all((q - x).abs() <= bound)
    rel = (q - x).norm() / x.norm()
    assert rel < (0.25 if tile_2d else 0.12)  # tiles share a scale across rows of different size


def test_nvfp4_no_nan_on_extremes():
    for x in (torch.tensor([3e38, -1e38] + [1.0] * 14), torch.tensor([1e-40] * 16), torch.zeros(32),
              torch.tensor([1e30] + [1e-30] * 15)):
        q = fm.fake_quant_nvfp4(x)
        assert torch.isfinite(q).all()


def test_hadamard_is_orthogonal():
    signs = torch.tensor([1.0, -1] * 8)
    h = fm.random_hadamard(signs)
    assert torch.allclose(h @ h.t(), torch.eye(16), atol=1e-6)


# -- the real fp8 path and training under each backend ----------------------------------------------

def test_fp8_scaled_mm_matches_emulation():
    from model.precision.emulated import Fp8EmulatedLinear
    from model.precision.fp8 import Fp8Linear
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 32, bias=False)
    a, b = Fp8Linear.from_linear(lin), Fp8EmulatedLinear.from_linear(lin)
    x = torch.randn(8, 16, 64, requires_grad=True)
    ya = a(x)
    ya.square().sum().backward()
    ga, gwa = x.grad.clone(), lin.weight.grad.clone()
    x.grad = None
    lin.weight.grad = None
    yb = b(x)
    yb.square().sum().backward()
    assert torch.allclose(ya, yb, rtol=1e-5, atol=1e-5)
    assert torch.allclose(ga, x.grad, rtol=1e-4, atol=1e-5)
    assert torch.allclose(gwa, lin.weight.grad, rtol=1e-4, atol=1e-5)
    assert a.weight is lin.weight  # same Parameter: names and optimizer unaffected


FP32_EPS = 2.0 ** -24  # fp32's unit roundoff


@pytest.mark.parametrize("pow2", [True, False], ids=["pow2_scales", "exact_scales"])
@pytest.mark.parametrize("fmt_a", [fm.E4M3, fm.E5M2])
def test_fp8_cpu_gemm_is_scaled_mm_up_to_the_fp32_sums(fmt_a, pow2):
    """fp8.scaled_mm on a CPU and torch._scaled_mm take the same FP8 operands and scales; each product is
    exact in fp32 either way, so both must lie within the error bound of an fp32 sum of K terms
    (K u sum|products|, u = 2^-24) plus the scale multiplies' roundings (2u |y|) of the exact result."""
    from model.precision.fp8 import scaled_mm
    torch.manual_seed(0)
    M, K, N = 64, 256, 96  # the backward's operand layouts: a row-major, b column-major (a transposed copy)
    a, sa = fm.quantize_fp8(torch.randn(M, K) * torch.logspace(-3, 3, K), fmt_a, pow2)
    b, sb = fm.quantize_fp8(torch.randn(N, K), fm.E4M3, pow2)
    got = scaled_mm(a, b.t(), sa.reciprocal(), sb.reciprocal(), torch.float32)
    ref = torch._scaled_mm(a, b.t(), scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32)
    scale = sa.reciprocal().double() * sb.reciprocal().double()
    exact = a.double() @ b.double().t() * scale
    bound = K * FP32_EPS * (a.double().abs() @ b.double().abs().t()) * scale + 2 * FP32_EPS * exact.abs()
    assert ((got - exact).abs() <= bound).all() and ((ref - exact).abs() <= bound).all()
    assert scaled_mm(a, b.t(), sa.reciprocal(), sb.reciprocal(), torch.bfloat16).dtype == torch.bfloat16
    # its fake (what torch.compile traces) agrees with it; test_schema cannot perturb FP8 inputs (no mul)
    torch.library.opcheck(torch.ops.sparkchat.dequantised_mm.default,
                          (a, b.t(), sa.reciprocal(), sb.reciprocal(), torch.bfloat16),
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("entry", ["fp8", "fp8:pow2_scales=false", "fp8:scaling=delayed"])
def test_fp8_cpu_training_loss_matches_scaled_mm(entry, monkeypatch):
    """The probe's fp8 entries trained for 4 steps through fp8.scaled_mm and through torch._scaled_mm:
    the same losses within 1e-4 relative. The GEMMs differ only in the order of their fp32 sums (test
    above); that can move a value across an FP8 rounding boundary, and training amplifies it step by step
    (on this CPU: identical losses with power-of-two scales, 1.1e-5 apart at step 4 with exact ones). 1e-4
    is 100x below the 1% loss difference `auto` accepts a backend by (precision.auto.max_loss_diff_pct)."""
    from model.precision import fp8
    from model.precision.probe import build_under, markov_tokens, model_config
    e = parse_entry(entry)
    cfg = model_config(depth=1, seq_len=32, vocab=128, head_dim=32)
    data = markov_tokens(16, 33, 128, seed=0, device=CPU)

    def losses() -> list[float]:
        _, model, opt = build_under(e.name, e.options, LayerFilter(16, ["lm_head"]), cfg, 0, CPU)
        out = []
        for step in range(4):
            rows = data[4 * step:4 * step + 4]
            loss = model(rows[:, :-1].contiguous(), rows[:, 1:].contiguous())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
        return out

    fast = losses()
    monkeypatch.setattr(fp8, "scaled_mm", lambda a, b, scale_a, scale_b, out_dtype, use_fast_accum=False:
                        torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype,
                                         use_fast_accum=use_fast_accum))
    assert fast == pytest.approx(losses(), rel=1e-4)


RUNNABLE = [n for n in BACKENDS if n not in ("te-fp8", "te-nvfp4", "auto")] + ["auto", "fp8:scaling=delayed"]


@pytest.mark.parametrize("name", RUNNABLE)
def test_training_reduces_loss(name, tmp_path):
    cfg = GPTConfig(vocab_size=128, n_layer=2, n_embd=32, n_head=2, n_kv_head=2, seq_len=32)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(seed=0)
    plain_keys = set(portable_state_dict(model))
    if name == "auto":
        opts = AutoOptions(probe_file=str(tmp_path / "probe.json"))
    else:
        entry = parse_entry("nvfp4-emulated:bf16_last_blocks=0" if name == "nvfp4-emulated" else name)
        name, opts = entry.name, entry.options
    be = get_backend(name, opts, LayerFilter())
    be.check(CPU)
    model = be.convert(model)
    if name not in ("bf16", "auto"):
        assert be.converted == 8  # 2 blocks x (qkv, attn proj, fc, mlp proj); lm_head skipped
    # AdamW only: Muon's Newton-Schulz is slow on a busy CPU and is not what is tested here
    opt = build_optimizer(model, 0.2, 0.2, 0.04, use_muon=False)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 16, (4, 33), generator=g)  # 16 of 128 tokens used: learnable fast
    losses = []
    for _ in range(6):
        with be.autocast(CPU):
            loss = model(data[:, :-1].contiguous(), data[:, 1:].contiguous())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0] - 0.5
    assert set(portable_state_dict(model)) == plain_keys  # checkpoints stay portable


def test_disable_low_precision_gives_bf16_path():
    from model.precision import disable_low_precision
    torch.manual_seed(0)
    lin = torch.nn.Linear(32, 16, bias=False)
    from model.precision.fp8 import Fp8Linear
    q = Fp8Linear.from_linear(lin)
    x = torch.randn(4, 32)
    with disable_low_precision():
        assert torch.equal(q(x), lin(x))
    assert not torch.equal(q(x), lin(x))


def test_probe_cpu_tiny(tmp_path):
    from model.precision.probe import run_probe
    tiny = ProbeOptions(steps=3, depth=1, seq_len=16, batch=2, vocab=64, backends=["bf16", "fp8", "te-fp8", "te-nvfp4"])
    out = run_probe(tiny, device="cpu", out_dir=str(tmp_path), log=lambda *_: None)
    rows = {r["label"]: r for r in out["results"]}
    assert rows["bf16"]["ran"] and rows["fp8"]["ran"] and rows["fp8"]["speedup"] > 0
    assert not rows["te-fp8[mxfp8,fused]"]["available"] and "NVIDIA GPU" in rows["te-fp8[mxfp8,fused]"]["reason"]
    md = (tmp_path / "probe.md").read_text()
    assert (tmp_path / "probe.json").is_file() and "| bf16 | yes | 0 |" in md and "| fp8 | yes | 4 |" in md
    # the micro-step (forward + backward) is part of the whole step (which adds the optimizer)
    assert 0 < rows["bf16"]["micro_ms"] <= rows["bf16"]["step_ms"]
    # every timed step is kept (a run's speed has a range), and the medians are theirs
    import statistics
    each = rows["bf16"]["step_ms_each"]
    assert len(each) == len(rows["bf16"]["micro_ms_each"]) >= 1
    assert statistics.median(each) == pytest.approx(rows["bf16"]["step_ms"], abs=1e-3)


def test_probe_merge(tmp_path):
    """Probes of one configuration run in separate processes merge into one table against bf16."""
    import json

    from model.precision.probe import merge_probes, run_probe
    from pipeline.probe import main as probe_main
    tiny = ProbeOptions(steps=2, depth=1, seq_len=16, batch=2, vocab=64, backends=["bf16"])
    kw = dict(device="cpu", log=lambda *_: None)
    run_probe(tiny, out_dir=str(tmp_path / "a"), **kw)
    run_probe(replace(tiny, backends=["fp8-emulated"]), out_dir=str(tmp_path / "b"), **kw)
    probe_main(["--merge", str(tmp_path / "a/probe.json"), str(tmp_path / "b/probe.json"), "--out", str(tmp_path / "m")])
    merged = json.loads((tmp_path / "m/probe.json").read_text())
    rows = {r["label"]: r for r in merged["results"]}
    assert set(rows) == {"bf16", "fp8-emulated"} and rows["fp8-emulated"]["speedup"] > 0
    # a row that failed or was refused in a later run does not hide the earlier result
    failed = json.loads((tmp_path / "b/probe.json").read_text())
    failed["results"][0].update(ran=False, error="RuntimeError: out of memory")
    again = merge_probes([merged, failed])
    assert {r["label"]: r["ran"] for r in again["results"]} == {"bf16": True, "fp8-emulated": True}
    run_probe(replace(tiny, steps=3), out_dir=str(tmp_path / "c"), **kw)
    with pytest.raises(ValueError, match="different steps"):
        probe_main(["--merge", str(tmp_path / "a/probe.json"), str(tmp_path / "c/probe.json"), "--out", str(tmp_path / "x")])


def test_probe_params_file(tmp_path):
    """`sparkchat probe --params` reads the `probe:` section through the params loader: its values are
    used, and a misspelt key stops with the key's name before anything runs."""
    import shutil

    import yaml

    from pipeline.probe import main as probe_main
    shutil.copytree(ROOT / "profiles", tmp_path / "profiles")
    params = yaml.safe_load(committed_text(ROOT, "params.yaml"))
    params["probe"].update(steps=2, depth=1, seq_len=16, batch=2, vocab=64)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    probe_main(["--params", str(tmp_path / "params.yaml"), "--backends", "bf16", "--device", "cpu",
                "--out", str(tmp_path / "ok")])
    assert '"steps": 2' in (tmp_path / "ok/probe.json").read_text()
    params["probe"]["stepz"] = params["probe"].pop("steps")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(SystemExit, match="unknown key 'probe.stepz'"):
        probe_main(["--params", str(tmp_path / "params.yaml"), "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()
    # a bad entry on the command line stops before anything runs, naming the entry and the key
    with pytest.raises(SystemExit, match=r"probe entry 'fp8:scaling=lazy': precision\.fp8\.scaling must be one of"):
        probe_main(["--backends", "bf16", "fp8:scaling=lazy", "--out", str(tmp_path / "bad")])
    assert not (tmp_path / "bad").exists()


def test_probe_writes_under_artifacts_where_git_does_not_look(tmp_path, monkeypatch):
    """`sparkchat probe` without --out writes under artifacts/probe (where `auto` reads it), a path git
    ignores: a probe in a checkout leaves `git status` clean."""
    import subprocess

    from pipeline.probe import main as probe_main
    from sparkchat import paths
    monkeypatch.chdir(tmp_path)
    probe_main(["--backends", "bf16", "--device", "cpu", "--steps", "2", "--depth", "1", "--seq-len", "16",
                "--batch", "2", "--vocab", "64"])
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert written == [str(paths.PROBE / name) for name in ("probe.json", "probe.md", "probe.partial.json")]
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", *written], capture_output=True, text=True)
    assert ignored.stdout.split() == written


def test_probe_entry_layer_filter(tmp_path):
    """`fp8:skip=` converts every Linear, the head too (as nanochat's fp8 does), for that entry only;
    auto never picks such an entry, since the run would convert other layers."""
    import json

    from model.precision.probe import run_probe
    logs = []
    tiny = ProbeOptions(steps=2, depth=1, seq_len=16, batch=2, vocab=64, backends=["fp8", "fp8:skip="])
    out = run_probe(tiny, device="cpu", out_dir=str(tmp_path), log=lambda *a: logs.append(" ".join(map(str, a))))
    rows = {r["label"]: r for r in out["results"]}
    assert set(rows) == {"fp8", "fp8[skip=none]"} and all(r["ran"] for r in rows.values())
    assert any("4 Linear layers converted" in line for line in logs)  # c_qkv, c_proj, c_fc, c_proj
    assert any("5 Linear layers converted" in line for line in logs)  # ... and lm_head
    # no bf16 in this run: the comparison cells stay empty rather than a bare "%" or "x"
    md = (tmp_path / "probe.md").read_text()
    assert "| % |" not in md and "| x |" not in md
    # auto leaves the per-entry-filter row out even when it is the fastest
    data = json.loads((tmp_path / "probe.json").read_text())
    for r in data["results"]:
        r.update(loss_diff_pct=0.0, tokens_per_s=2.0 if "skip" in r["options"] else 1.0)
    (tmp_path / "probe.json").write_text(json.dumps(data))
    be = get_backend("auto", {"probe_file": str(tmp_path / "probe.json")})
    pick, _ = be._from_probe(CPU)
    assert pick == ("fp8", {})


def test_te_wrapper_hands_te_the_autocast_dtype():
    """TE modules run eagerly behind a wrapper that casts their input to the autocast dtype on the
    compiled side; the wrapper is generic, so a plain Linear stands in for the TE module here."""
    from model.precision.te_common import eager
    seen = []

    class Recording(torch.nn.Linear):
        def forward(self, x):
            seen.append(x.dtype)
            return super().forward(x)
    lin = eager(Recording(8, 4))
    x = torch.randn(2, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lin(x)
    lin(x)
    assert seen == [torch.bfloat16, torch.float32]


def test_te_wrapper_hands_te_a_multiple_of_16_tokens():
    """TE's FP8 and FP4 GEMMs refuse other token counts (the rl stage's rows have any length): the wrapper
    adds zero rows and drops their outputs, so the result and gradients are a plain Linear's."""
    from model.precision.te_common import eager
    rows = []

    class Recording(torch.nn.Linear):
        def forward(self, x):
            rows.append(x.numel() // x.shape[-1])
            return super().forward(x)
    torch.manual_seed(0)
    ref = torch.nn.Linear(8, 4)
    lin = eager(Recording(8, 4))
    lin.load_state_dict(ref.state_dict())
    for shape in ((5, 13, 8), (2, 16, 8)):
        x = torch.randn(*shape, requires_grad=True)
        x_ref = x.detach().clone().requires_grad_()
        y, y_ref = lin(x), ref(x_ref)
        assert y.shape == y_ref.shape and torch.equal(y, y_ref)
        y.square().sum().backward()
        y_ref.square().sum().backward()
        assert torch.equal(x.grad, x_ref.grad)
    assert rows == [80, 32]
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)


def _delayed_linear(history_len=4):
    from model.precision.fp8 import Fp8Linear
    torch.manual_seed(0)
    return Fp8Linear.from_linear(torch.nn.Linear(32, 16, bias=False), history_len=history_len)


def test_fp8_delayed_scaling_uses_the_last_steps_amax():
    """Step 1 scales by its own amax and starts the histories; later steps scale by the histories' max
    (so a tensor larger than before saturates) and record their own amax."""
    from model.precision.formats import E4M3, cast_fp8
    lin = _delayed_linear()
    x1, x2 = torch.randn(8, 32), 3 * torch.randn(8, 32)
    lin(x1).sum().backward()
    assert torch.isclose(lin.x_amax_history[0], x1.abs().amax()) and lin.x_amax_history[1:].eq(0).all()
    assert lin.g_amax_history[0] == 1.0  # d(sum)/dy = 1 everywhere
    y2 = lin(x2)
    assert torch.isclose(lin.x_amax_history[0], x2.abs().amax()) and torch.isclose(lin.x_amax_history[1], x1.abs().amax())
    xq, xs = cast_fp8(x2, E4M3, x1.abs().amax())  # the scale of step 1, so x2's largest values saturate
    wq, ws = cast_fp8(lin.weight, E4M3, lin.weight.abs().amax())
    torch.testing.assert_close(y2, (xq.float() * xs) @ (wq.float() * ws).t(), rtol=1e-5, atol=1e-5)


def test_fp8_delayed_scaling_under_torch_compile():
    """Compiled, the histories (one updated inside backward) advance exactly as in eager mode."""
    eager_lin, comp_lin = _delayed_linear(), _delayed_linear()
    run = torch.compile(comp_lin)
    torch.manual_seed(1)
    for step in range(3):
        x = torch.randn(8, 32) * (step + 1)
        g = torch.randn(8, 16) * (step + 1)
        eager_lin(x).backward(g)
        run(x).backward(g)
    torch.testing.assert_close(comp_lin.x_amax_history, eager_lin.x_amax_history)
    torch.testing.assert_close(comp_lin.g_amax_history, eager_lin.g_amax_history)
    assert comp_lin.g_amax_history[2] > 0
    torch.testing.assert_close(comp_lin.weight.grad, eager_lin.weight.grad, rtol=1e-4, atol=1e-4)


def test_fp8_delayed_scaling_after_a_zero_gradient_and_eval():
    """A zero gradient at step 1 (zero-initialised projections do that) must not zero the next step's
    gradient, and a no-grad (evaluation) forward must leave the histories alone."""
    lin = _delayed_linear()
    x = torch.randn(8, 32)
    lin(x).backward(torch.zeros(8, 16))
    with torch.no_grad():
        lin(10 * x)
    assert torch.isclose(lin.x_amax_history[0], x.abs().amax()) and lin.x_amax_history[1] == 0
    lin.weight.grad = None
    g = torch.randn(8, 16)
    lin(x).backward(g)
    ref = g.t() @ x
    rel = (lin.weight.grad - ref).norm() / ref.norm()
    assert rel < 0.15, rel  # e5m2 at scale 1 for one step, e4m3 activations


def _ranks_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    be = get_backend("fp8", {"scaling": "delayed", "amax_history_len": 4}, LayerFilter(16, []))
    model = be.convert(torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False)))
    torch.manual_seed(0)
    x, g = torch.randn(8, 32), torch.randn(8, 16)
    # rank 1's activations are larger, rank 0's gradients: each history's max comes from another rank
    model(x * (3 if rank else 1)).backward(g * (1 if rank else 5))
    lin = model[0]
    before = (lin.x_amax_history.clone(), lin.g_amax_history.clone())
    be.sync_ranks(model)
    torch.save({"before": before, "after": (lin.x_amax_history, lin.g_amax_history)}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_fp8_delayed_amax_agrees_across_ranks(tmp_path):
    """Under data parallelism every rank scales by the largest amax any rank saw (DDP no longer
    broadcasts rank 0's histories; the backend reduces them after backward)."""
    import time

    import torch.multiprocessing as mp
    # spawn, not fork: a fork of a process whose thread pools earlier tests started can deadlock
    ctx = mp.start_processes(_ranks_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
                             start_method="spawn", join=False)
    deadline = time.time() + 120
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two ranks did not finish within 120 s")
    r0, r1 = (torch.load(tmp_path / f"{r}.pt") for r in (0, 1))
    for i in (0, 1):  # x history, g history
        assert not torch.equal(r0["before"][i], r1["before"][i])
        torch.testing.assert_close(r0["after"][i], torch.maximum(r0["before"][i], r1["before"][i]))
        torch.testing.assert_close(r1["after"][i], r0["after"][i])
    assert r0["after"][0][0] > r0["before"][0][0] and r1["after"][1][0] > r1["before"][1][0]


def test_bench_variant_modifiers():
    """An unknown `@modifier` is refused rather than silently timing the default attention."""
    from bench.train_step import parse_variant
    assert parse_variant("fp8:skip=@cudnn")[2:] == ("cudnn", LayerFilter(16, []))
    with pytest.raises(ValueError, match="unknown variant modifier @bthd"):
        parse_variant("bf16@bthd")


def test_peak_flops_by_device_and_none_for_an_unknown_gpu(monkeypatch):
    """MFU's denominator comes from one table by device name (a variant before its family); a GPU not in
    it, or a CPU, gets no peak and a reason naming the device and the table, never another GPU's peak."""
    from model.peak_flops import peak_flops

    for name, tflops in [("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989),
                         ("NVIDIA H200 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA B200", 2250)]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, n=name: n)
        peak, about = peak_flops("cuda")
        assert peak == tflops * 1e12 and name in about, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GB10")
    peak, about = peak_flops("cuda")
    assert peak is None and "no MFU" in about and "NVIDIA GB10" in about and "PEAK_BF16_TFLOPS" in about
    assert peak_flops("cpu")[0] is None
