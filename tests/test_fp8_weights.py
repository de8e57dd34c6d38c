"""FP8 serving weights (model/precision/fp8_weights.py): refused with the reason where they cannot serve
(a CPU, a GPU below sm_89) before anything loads; the quantisation against the weights it came from;
both products (weight-only and W8A8) against float64 references built from the FP8 operands; the Triton
kernel under Triton's interpreter; a trained model's greedy ids within the tie rule (model/tie_rule.py).
The GPU's own tests: tests/test_fp8_weights_gpu.py."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.engine import Engine, EngineConfig
from model.model_dir import load_model_dir
from model.precision import BackendUnavailable, base, fp8_weights
from model.precision.formats import E4M3, E4M3_MAX
from model.requests import SamplingParams
from serve.settings import Settings
from model.tie_rule import FP8_WEIGHTS_MARGIN, agreement, reference_greedy

ROOT = Path(__file__).resolve().parent.parent


def test_refused_on_a_cpu_with_the_reason():
    why = fp8_weights.unavailable_reason("cpu")
    assert "CUDA GPU with FP8 tensor cores (sm_89+" in why and "not on cpu" in why and "--weights bf16" in why
    with pytest.raises(BackendUnavailable, match=r"--weights fp8 cannot serve on this machine \(cpu\).*not on cpu"):
        fp8_weights.check("cpu")


@pytest.mark.parametrize("cap, refused", [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_refused_below_sm89_with_the_gpu_named(monkeypatch, cap, refused):
    monkeypatch.setattr(base, "cuda_capability", lambda device: cap)
    why = fp8_weights.unavailable_reason(torch.device("cuda"))
    if refused:
        assert f"this GPU is sm_{cap[0]}{cap[1]}" in why and "sm_89+" in why and "--weights bf16" in why
    else:
        assert why is None


def test_load_refuses_before_reading_anything(tmp_path):
    """A directory that is not there: the refusal comes first, so nothing was read to find that out."""
    with pytest.raises(BackendUnavailable, match="not on cpu"):
        fp8_weights.load_model_dir(tmp_path / "not-there", "cpu", torch.float32)
    with pytest.raises(ValueError, match="--weights must be one of bf16, fp8, got 'int4'"):
        Settings(weights="int4")


def test_serve_refuses_fp8_on_a_cpu_before_the_model_loads(serve_model_dir):
    code = ("import sys\nfrom sparkchat.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print(e.code, file=sys.stderr)\nprint(sorted(m for m in ('fastapi', 'uvicorn', 'gradio') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code, "serve", "--model", str(serve_model_dir), "--port", "0",
                        "--device", "cpu", "--weights", "fp8"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "sparkchat serve: --weights fp8 cannot serve on this machine (cpu)" in r.stderr, r.stderr
    assert "--weights bf16 (the default)" in r.stderr
    assert r.stdout.strip().splitlines()[-1] == "[]"  # no server part had started


def test_quantised_rows_hold_the_weights_within_e4m3_rounding():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * torch.logspace(-3, 1, 96)[:, None]  # rows of very different sizes
    q, inv = fp8_weights.quantise_rows(w)
    assert q.dtype == E4M3 and inv.shape == (96,)
    # each row's largest weight lands on e4m3's largest value: its own scale, not the tensor's
    assert torch.equal(q.float().abs().amax(dim=1), torch.full((96,), E4M3_MAX))
    back = fp8_weights.dequantise_rows(q, inv, torch.float64)
    err = (back - w.double()).abs()
    # normal e4m3 values (>= 2^-6 once scaled): within half a unit of 3 mantissa bits; below, absolute
    scaled = w.double().abs() / inv.double()[:, None]
    normal = scaled >= 2 ** -6
    assert (err[normal] <= 2 ** -4 * w.double().abs()[normal] + 1e-12).all()
    assert (err[~normal] <= 2 ** -10 * inv.double()[:, None].expand_as(err)[~normal] + 1e-12).all()
    # against the bf16 copy of the same weights: the FP8 ones are within e4m3's rounding of them too
    bf16 = w.to(torch.bfloat16).double()
    assert ((back - bf16).abs()[normal] <= (2 ** -4 + 2 ** -8) * bf16.abs()[normal] + 1e-12).all()


def _reference_product(x: torch.Tensor, q: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    return x.double() @ (q.double() * inv.double()[:, None]).t()


@pytest.mark.parametrize("rows", [1, 5, fp8_weights.WEIGHT_ONLY_MAX_ROWS])
def test_weight_only_product_is_the_dequantised_one(rows):
    g = torch.Generator().manual_seed(rows)
    lin = torch.nn.Linear(64, 48, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=g) * 0.1)
    f = fp8_weights.Fp8WeightLinear.from_linear(lin)
    x = torch.randn(rows, 64, generator=g)
    want = _reference_product(x, f.qweight, f.inv_scale.reshape(-1))
    torch.testing.assert_close(f(x).double(), want, rtol=1e-5, atol=1e-6)
    # and it is not the high-precision product: the weights were really rounded
    assert (f(x).double() - x.double() @ lin.weight.double().t()).abs().max() > 1e-4


def test_w8a8_product_casts_each_row_of_the_activations_with_its_own_scale():
    rows = fp8_weights.WEIGHT_ONLY_MAX_ROWS + 3  # past the weight-only rows, and not a multiple of 16
    g = torch.Generator().manual_seed(1)
    lin = torch.nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(32, 64, generator=g) * 0.1)
    f = fp8_weights.Fp8WeightLinear.from_linear(lin)
    x = torch.randn(rows, 64, generator=g) * torch.logspace(-2, 2, rows)[:, None]
    # the reference: each row of x rounded to e4m3 on its own scale, independently of the module's code
    s = E4M3_MAX / x.abs().amax(dim=1, keepdim=True)
    xq = (x * s).to(E4M3).double() / s.double()
    want = xq @ (f.qweight.double() * f.inv_scale.double().reshape(-1)[:, None]).t()
    got = f(x.reshape(1, rows, 64))  # (B, T, K) in, as the model calls it
    assert got.shape == (1, rows, 32)
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=1e-6)


def test_convert_swaps_the_blocks_linears_and_keeps_the_head():
    from model.gpt import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, n_embd=64, n_head=2, n_kv_head=1, seq_len=64))
    model.init_weights(seed=0)
    before = fp8_weights.weight_bytes(model)
    assert fp8_weights.convert(model, torch.bfloat16) == 8  # c_qkv, c_proj, c_fc, c_proj in each of 2 blocks
    blocks = [m for n, m in model.named_modules() if isinstance(m, fp8_weights.Fp8WeightLinear)]
    assert len(blocks) == 8 and all(m.qweight.dtype == E4M3 and m.inv_scale.dtype == torch.float32 for m in blocks)
    assert isinstance(model.lm_head, torch.nn.Linear) and model.lm_head.weight.dtype == torch.bfloat16
    assert model.wte.weight.dtype == torch.bfloat16
    # bf16 head + FP8 blocks: the blocks' bytes a step went from 4 (fp32) to 1 per weight, plus a scale a row
    assert fp8_weights.weight_bytes(model) < before / 3


def test_a_trained_models_fp8_greedy_ids_agree_within_the_tie_rule(conv_tool_model_dir, conv_tool_chats):
    """The emulated products (this CPU) through the engine, against the fp32 model's eager forward."""
    from model.chat import render
    model, tok, _ = load_model_dir(conv_tool_model_dir)
    fp8 = copy.deepcopy(model)
    fp8_weights.convert(fp8, torch.float32)
    prompts = [render(tok, [chat[0]], for_completion=True)[0] for chat in conv_tool_chats]
    prompts += [tok.encode(t) for t in ("The quick brown fox", "Hello! How are", "Numbers: 12")]
    engine = Engine(fp8, EngineConfig(max_batch=8)).start()
    try:
        results = []
        for p in prompts:
            want, logits = reference_greedy(model, p, 24)
            got = engine.generate(p, SamplingParams(temperature=0.0, max_tokens=24))[0]
            results.append(agreement(want, logits, got, FP8_WEIGHTS_MARGIN))
    finally:
        engine.shutdown()
    assert all(r.within_ties for r in results), results
    # the chats it learned by heart are far from any tie: the same ids
    assert all(r.identical for r in results[:len(conv_tool_chats)]), results


def test_the_tie_rule_fails_a_path_that_parts_away_from_a_tie():
    logits = [torch.tensor([0.0, 5.0, 4.5]), torch.tensor([3.0, 0.0, 0.0])]
    assert agreement([1, 0], logits, [1, 0], 0.1).identical
    near = agreement([1, 0], logits, [2, 1], 1.0)
    assert not near.identical and near.parted_at == 0 and near.gap == 0.5 and near.within_ties
    assert not agreement([1, 0], logits, [2, 1], 0.4).within_ties
    assert not agreement([1, 0], logits, [1, 2], 1.0).within_ties  # 3.0 apart at position 1
    assert not agreement([1, 0], logits, [1], 10.0).within_ties  # ended early


KERNEL_CHECK = """
import triton.experimental.gluon  # before the first launch: the interpreter's lazy import of it is circular (3.9)
import torch
from model.precision import fp8_weights as fw
torch.manual_seed(0)
for M, N, K in [(1, 96, 64), (5, 80, 200), (16, 64, 128)]:
    q, inv = fw.quantise_rows(torch.randn(N, K) * 0.1)
    for dt, split in ((torch.float32, 1), (torch.bfloat16, 1), (torch.float32, 3), (torch.bfloat16, 2)):
        x = torch.randn(M, K).to(dt)
        y = fw.weight_only_triton(x, q, inv.reshape(1, -1), block_n=16, block_k=32, split_k=split)
        ref = x.double() @ fw.dequantise_rows(q, inv, torch.float64).t()
        # fp32: the sums' order; bf16: the output's rounding (a bf16 unit of the largest value)
        tol = 1e-5 if dt == torch.float32 else 2 ** -7 * float(ref.abs().max())
        assert y.dtype == dt and y.shape == (M, N)
        assert float((y.double() - ref).abs().max()) <= tol, (M, N, K, dt, split, float((y.double() - ref).abs().max()))
    # the MLP's squared ReLU in the epilogue (a split asked for is ignored: it needs the whole sum)
    x = torch.randn(M, K)
    y = fw.weight_only_triton(x, q, inv.reshape(1, -1), block_n=16, block_k=32, split_k=2, act=fw.ACTS["relu2"])
    ref = (x.double() @ fw.dequantise_rows(q, inv, torch.float64).t()).relu().square()
    assert float((y.double() - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), "relu2"
print("ok")
"""


def test_weight_only_triton_kernel_under_the_interpreter():
    """The CUDA kernel's code, run by Triton's interpreter on this CPU (TRITON_INTERPRET=1, read at import),
    in one piece and with K split in parts that add up (K=200 leaves a part shorter than the others)."""
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", KERNEL_CHECK], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1",
                            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_fp8_quality_compares_task_by_task_and_gates_on_the_tolerance():
    from bench.fp8_quality import compare
    bf16 = {"arithmetic": 0.50, "spelling": 0.80, "val_bpb": 2.10}
    ok = compare(bf16, {"arithmetic": 0.52, "spelling": 0.79, "val_bpb": 2.30})
    assert ok["within_tolerance"] and ok["largest_difference"] == 0.02  # val_bpb is shown, not gated
    assert ok["tasks"]["arithmetic"] == {"bf16": 0.50, "fp8": 0.52, "difference": 0.02}
    assert not compare(bf16, {"arithmetic": 0.47, "spelling": 0.80, "val_bpb": 2.10})["within_tolerance"]
    lost = compare(bf16, {"arithmetic": 0.50, "val_bpb": 2.10})
    assert not lost["within_tolerance"] and lost["missing"] == ["spelling"]


def test_fp8_quality_is_refused_on_a_cpu_with_the_reason():
    r = subprocess.run([sys.executable, "-m", "bench.fp8_quality"], capture_output=True, text=True, cwd=ROOT,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode != 0 and "bench/fp8_quality.py: serving FP8 weights needs a CUDA GPU" in r.stderr, r.stderr[-2000:]


ENGINE_UNDER_INTERPRETER = """
import triton.experimental.gluon  # the interpreter's lazy import of it is circular (3.9)
import copy, sys
import torch
from model.chat import render
from model.engine import Engine, EngineConfig
from model.model_dir import load_model_dir
from model.precision import fp8_weights
from model.requests import SamplingParams
from model.tie_rule import FP8_WEIGHTS_MARGIN, agreement, reference_greedy
model, tok, _ = load_model_dir(sys.argv[1])
fp8 = copy.deepcopy(model)
fp8_weights.convert(fp8, torch.float32)
assert sum(isinstance(m, fp8_weights.Fp8WeightMLP) for m in fp8.modules()) == 2
acts, kernel = [], fp8_weights.weight_only_triton
fp8_weights.weight_only_triton = lambda *a, **k: acts.append(k.get("act", 0)) or kernel(*a, **k)
engine = Engine(fp8, EngineConfig(max_batch=4)).start()
for q in sys.argv[2:]:
    p = render(tok, [{"role": "user", "content": q}], for_completion=True)[0]
    want, logits = reference_greedy(model, p, 12)
    got = engine.generate(p, SamplingParams(temperature=0.0, max_tokens=12))[0]
    r = agreement(want, logits, got, FP8_WEIGHTS_MARGIN)
    assert r.identical, (q, r)
engine.shutdown()
print("kernel calls", len(acts), "relu2", acts.count(fp8_weights.ACTS["relu2"]))
"""


def test_the_engine_decodes_through_the_triton_kernel_under_the_interpreter(conv_tool_model_dir, conv_tool_chats):
    """The decode path with the kernel in it (each step's products, the fused MLP's squared ReLU): a trained
    tiny model's greedy ids through the engine, the kernel run by Triton's interpreter on this CPU, equal to
    the fp32 model's eager forward on the chats it learned."""
    pytest.importorskip("triton")
    questions = [chat[0]["content"] for chat in conv_tool_chats]
    r = subprocess.run([sys.executable, "-c", ENGINE_UNDER_INTERPRETER, str(conv_tool_model_dir), *questions],
                       capture_output=True, text=True, cwd=ROOT, timeout=900,
                       env={**os.environ, "TRITON_INTERPRET": "1",
                            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    assert r.returncode == 0, r.stderr[-3000:]
    calls, relu2 = (int(v) for v in r.stdout.split()[-3::2])
    # every decode step ran its 2 blocks' products in the kernel: qkv, proj, the fused MLP's two
    assert calls >= 3 * 11 * 2 * 4 and relu2 == calls // 4, r.stdout
