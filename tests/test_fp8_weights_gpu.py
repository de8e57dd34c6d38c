"""FP8 serving weights on a GPU (sm_89+): the Triton weight-only kernel and the W8A8 `_scaled_mm` product
against float64 references at the d20 shapes, and a trained model's greedy ids through the serving
engine (CUDA graphs, compiled blocks) with FP8 weights against the bf16 model's eager forward, within
the tie rule (model/tie_rule.py; docs/serving.md, "FP8 weights"). Skipped without such a GPU (CI);
`bash bench/gpu/serve.sh` runs it. SPARKCHAT_TRAINED_MODEL=DIR adds a trained model of your own (the
h200-small profile's artifacts/model, say) to the greedy test."""
from __future__ import annotations

import os

import pytest
import torch

from model.engine import Engine, EngineConfig
from model.model_dir import load_model_dir
from model.precision import fp8_weights
from model.requests import Finished, SamplingParams, Token
from model.tie_rule import FP8_WEIGHTS_MARGIN, agreement, reference_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_weights.unavailable_reason("cuda") is not None,
    reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")]

D20 = [(1280, 3840), (1280, 1280), (5120, 1280), (1280, 5120)]  # (N, K) of c_qkv, c_proj, c_fc, mlp.c_proj


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n, k", D20)
def test_weight_only_kernel_against_float64(rows, n, k):
    g = torch.Generator(device="cuda").manual_seed(rows)
    q, inv = fp8_weights.quantise_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(rows, k, device="cuda", generator=g).to(torch.bfloat16)
    y = fp8_weights.weight_only_triton(x, q, inv.reshape(1, -1))
    want = x.double() @ fp8_weights.dequantise_rows(q, inv, torch.float64).t()
    assert y.dtype == torch.bfloat16
    assert float((y.double() - want).abs().max()) <= 2 ** -7 * float(want.abs().max())


@pytest.mark.parametrize("rows", [17, 64, 128, 512])
def test_w8a8_scaled_mm_equals_the_cpu_emulation(rows):
    """torch._scaled_mm with row-wise scales against this file's CPU path (the same FP8 operands and scales
    dequantised into float64): only the order of the sums and the bf16 output may differ."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    lin = torch.nn.Linear(1280, 5120, bias=False, device="cuda")
    with torch.no_grad():
        lin.weight.copy_(torch.randn(5120, 1280, device="cuda", generator=g) * 0.02)
    f = fp8_weights.Fp8WeightLinear.from_linear(lin)
    x = torch.randn(rows, 1280, device="cuda", generator=g).to(torch.bfloat16)
    got = f(x)
    cpu = copy_to_cpu(f)(x.cpu().float()).double()
    assert got.dtype == torch.bfloat16
    assert float((got.cpu().double() - cpu).abs().max()) <= 2 ** -7 * float(cpu.abs().max())


def copy_to_cpu(f: fp8_weights.Fp8WeightLinear) -> fp8_weights.Fp8WeightLinear:
    return fp8_weights.Fp8WeightLinear(f.qweight.cpu(), f.inv_scale.cpu())


def trained_dirs(conv_tool_model_dir) -> list:
    extra = os.environ.get("SPARKCHAT_TRAINED_MODEL")
    return [conv_tool_model_dir] + ([extra] if extra else [])


def test_fp8_weights_give_the_bf16_greedy_ids(conv_tool_model_dir, conv_tool_chats):
    """Through the serving engine (graphs, requests batched together) with FP8 weights, against the bf16
    model's eager forward, one prompt at a time: every prompt within the tie rule; the chats the tiny
    model learned by heart (far from any tie) the same ids."""
    from model.chat import render
    for path in trained_dirs(conv_tool_model_dir):
        ref, tok, _ = load_model_dir(path, "cuda", torch.bfloat16)
        fp8, _, _ = fp8_weights.load_model_dir(path, "cuda", torch.bfloat16)
        assert any(isinstance(m, fp8_weights.Fp8WeightLinear) for m in fp8.modules())
        chats = [render(tok, [chat[0]], for_completion=True)[0] for chat in conv_tool_chats]
        prompts = chats + [tok.encode(t) for t in ("The quick brown fox", "Hello! How are", "Numbers: 12",
                                                   "What is the capital of France?")]
        new = 24
        want = [reference_greedy(ref, p, new) for p in prompts]
        engine = Engine(fp8, EngineConfig(max_batch=16)).start()
        try:
            got = generate_together(engine, prompts, SamplingParams(temperature=0.0, max_tokens=new))
        finally:
            engine.shutdown()
        results = [agreement(w, logits, g, FP8_WEIGHTS_MARGIN) for (w, logits), g in zip(want, got)]
        assert all(r.within_ties for r in results), (path, results)
        if path == conv_tool_model_dir:
            assert all(r.identical for r in results[:len(chats)]), results
        del ref, fp8
        torch._dynamo.reset()


def generate_together(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Every prompt submitted at once (so they share decode steps); each one's ids."""
    import threading
    out: list[list[int]] = [[] for _ in prompts]
    left = threading.Semaphore(0)

    def sink(i, ev):
        if isinstance(ev, Token):
            out[i].append(ev.id)
        elif isinstance(ev, Finished):
            left.release()

    engine.submit_all([(p, params, lambda ev, i=i: sink(i, ev)) for i, p in enumerate(prompts)])
    for _ in prompts:
        assert left.acquire(timeout=300)
    return out
