"""The FP8 cast-transpose op (model/precision/fp8_cast.py): exact against plain torch, and the fp8
backend trains identically through it and through the inline casts.

The Triton kernel runs only on a CUDA GPU; there this file also runs without pytest
(`python tests/test_fp8_cast.py`, as bench/gpu/fp8_cast.sh does on the H200)."""
import copy

import torch

from model.precision import LayerFilter, get_backend
from model.precision import fp8_cast

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(t):
    return t.view(torch.uint8)


def _hard_input(rows, cols, dtype, device):
    """Values that exercise every rounding path: normal, saturating, subnormal, zero, ties."""
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * 40
    x.view(-1)[:6] = torch.tensor([1e6, -1e6, 1e-30, 0.0, -0.0, 127.65 / 3.5])
    return x.to(dtype).to(device)


def _check_op(device, x_dtype):
    for rows, cols in ((64, 64), (100, 72), (130, 48), (16, 2050)):
        x = _hard_input(rows, cols, x_dtype, device)
        for fmt in FORMATS:
            scale = torch.tensor(3.5, device=device)
            q, qt, am = fp8_cast.cast_transpose(x, scale, fmt)
            r, rt, ram = fp8_cast._reference(x, scale, fmt)
            assert am.item() == ram.item() == x.float().abs().max().item()
            assert q.dtype == fmt and qt.shape == (cols, rows) and qt.is_contiguous()
            assert torch.equal(_bits(q), _bits(r)), f"{fmt} cast differs at {rows}x{cols}"
            assert torch.equal(_bits(qt), _bits(rt)), f"{fmt} transpose differs at {rows}x{cols}"
            assert torch.isfinite(q.float()).all()


def test_op_matches_reference_cpu():
    _check_op("cpu", torch.float32)


def _train_grads(cast, device, compiled, scaling="dynamic", steps=1):
    """Outputs and gradients of the last of `steps` forward/backward passes (delayed scaling uses its
    history from the second step on)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.ReLU(),
                              torch.nn.Linear(64, 32, bias=False)).to(device)
    backend = get_backend("fp8", {"cast": cast, "scaling": scaling, "amax_history_len": 4}, LayerFilter(16, []))
    backend.convert(net)
    f = torch.compile(net) if compiled else net
    for step in range(steps):
        net.zero_grad()
        x = torch.randn(4, 8, 32, device=device, generator=torch.Generator(device).manual_seed(step),
                        requires_grad=True) * (1 + step)  # growing inputs: the history lags behind
        x.retain_grad()
        with backend.autocast(torch.device(device)):
            y = f(x)
        y.float().square().sum().backward()
    hist = [net[0].x_amax_history, net[0].g_amax_history] if scaling == "delayed" else []
    return [y.detach(), x.grad, net[0].weight.grad, net[2].weight.grad, *hist]


def test_backend_same_results_through_the_op_cpu():
    """Same forward, input gradient and weight gradients, eager and compiled, bit for bit (on CPU the
    activations stay fp32 in both paths, so nothing but the op's placement differs)."""
    for scaling, steps in (("dynamic", 1), ("delayed", 3)):
        ref = _train_grads("inline", "cpu", False, scaling, steps)
        for compiled in (False, True):
            got = _train_grads("kernel", "cpu", compiled, scaling, steps)
            assert len(got) == len(ref)
            for a, b in zip(got, ref):
                assert torch.equal(a, b), (scaling, compiled)


def test_unknown_cast_option_names_choices():
    try:
        get_backend("fp8", {"cast": "fast"}, LayerFilter())
    except ValueError as e:
        assert "precision.fp8.cast" in str(e) and "kernel" in str(e)
    else:
        raise AssertionError("cast=fast was accepted")


def test_kernel_without_triton_says_so_on_cuda(monkeypatch):
    from model.precision import fp8 as fp8_mod
    monkeypatch.setattr(fp8_mod, "triton_available", lambda: False)
    notes = get_backend("fp8", {}, LayerFilter()).notes(torch.device("cuda"))
    assert any("without Triton" in n for n in notes)
    assert not get_backend("fp8", {"cast": "inline"}, LayerFilter()).notes(torch.device("cuda"))


def test_triton_kernel_matches_reference_gpu():
    import pytest
    if not (torch.cuda.is_available() and fp8_cast.triton_available()):
        pytest.skip("needs a CUDA GPU with Triton")
    for x_dtype in (torch.bfloat16, torch.float32):
        _check_op("cuda", x_dtype)


if __name__ == "__main__":  # the GPU machine has no pytest
    assert torch.cuda.is_available() and fp8_cast.triton_available(), "needs a CUDA GPU with Triton"
    for x_dtype in (torch.bfloat16, torch.float32):
        _check_op("cuda", x_dtype)
    print("triton cast-transpose: bit-exact against torch on", torch.cuda.get_device_name())
    for scaling, steps in (("dynamic", 1), ("delayed", 3)):
        for compiled in (False, True):
            a = _train_grads("kernel", "cuda", compiled, scaling, steps)
            b = _train_grads("inline", "cuda", compiled, scaling, steps)
            print(f"{scaling} compiled={compiled}: max |kernel - inline| / max |inline| per output:",
                  [f"{((x.float() - y.float()).abs().max() / y.float().abs().max()).item():.3g}" for x, y in zip(a, b)])
