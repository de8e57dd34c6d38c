"""The FP8 cast-transpose op (model/precision/fp8_cast.py) and the fp8 backend's use of it.

On CPU the op runs its torch implementation: these tests check its contract (shapes, contiguity, amax,
no aliased outputs, the custom-op registration) and that the backend gives bit-identical results
through it and through the inline casts (CPU activations are fp32 on both paths). The Triton kernel
runs only on a CUDA GPU, where this file also runs without pytest (`python tests/test_fp8_cast.py`, as
bench/gpu/fp8_cast.sh does on the H200): every FP8 code and every midpoint between two codes, from
bf16 and fp16 inputs, bit for bit against torch, NaN kept, and one tensor past 2^31 elements. On a GPU
the kernel path also rounds fp32 activations to bf16 before casting, so there the two paths differ by
that rounding; the script prints by how much.
"""
import copy

import torch

from model.precision import LayerFilter, get_backend
from model.precision import fp8_cast

FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)


def _bits(t):
    return t.view(torch.uint8)


def _hard_input(rows, cols, dtype, device):
    """Random values plus saturating, tiny and zero ones."""
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g) * 40
    x.view(-1)[:6] = torch.tensor([1e6, -1e6, 1e-30, 0.0, -0.0, 127.65 / 3.5])
    return x.to(dtype).to(device)


def _codes_and_midpoints(fmt, dtype, device):
    """Every finite value of `fmt`, both signs, the midpoints between neighbours (round-to-nearest-even
    ties), subnormals included, and values beyond the largest: as a (n, 16) tensor for scale 1."""
    codes = torch.arange(256, dtype=torch.uint8).view(fmt).float()
    vals = codes[torch.isfinite(codes)].unique()
    fmax = float(torch.finfo(fmt).max)
    exact = torch.cat([vals, (vals[1:] + vals[:-1]) / 2])
    assert torch.equal(exact.to(dtype).float(), exact), "the input format must hold every code and midpoint"
    x = torch.cat([exact, torch.tensor([1.5 * fmax, -1.5 * fmax, 1e30, -1e30])])
    x = torch.cat([x, x.new_zeros(-len(x) % 16)])
    return x.to(dtype).view(-1, 16).to(device)


def _check_op(device, x_dtype):
    for rows, cols in ((64, 64), (100, 72), (130, 48), (16, 2050), (1, 48), (48, 1)):
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
    for fmt in FORMATS:
        x = _codes_and_midpoints(fmt, x_dtype, device)
        q, qt, _ = fp8_cast.cast_transpose(x, torch.tensor(1.0, device=device), fmt)
        r, rt, _ = fp8_cast._reference(x, torch.tensor(1.0, device=device), fmt)
        assert torch.equal(_bits(q), _bits(r)) and torch.equal(_bits(qt), _bits(rt)), f"{fmt} codes from {x_dtype}"
        x = _hard_input(32, 32, x_dtype, device)
        x[3, 5] = x[30, 0] = float("nan")
        q, qt, _ = fp8_cast.cast_transpose(x, torch.tensor(1.0, device=device), fmt)
        assert q.float().isnan().sum() == 2 and q.float()[3, 5].isnan() and qt.float()[5, 3].isnan()


def test_op_contract_cpu():
    for x_dtype in (torch.float32, torch.bfloat16):
        _check_op("cpu", x_dtype)
    x = _hard_input(8, 32, torch.bfloat16, "cpu")
    for args in ((x, torch.tensor(2.0), "e4m3"), (x[:1], torch.tensor(2.0), "e5m2"), (x.t(), torch.tensor(2.0), "e4m3")):
        torch.library.opcheck(torch.ops.sparkchat.fp8_cast_transpose.default, args)


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
    for x_dtype in (torch.bfloat16, torch.float16):
        _check_op("cuda", x_dtype)


if __name__ == "__main__":  # the GPU machine has no pytest
    assert torch.cuda.is_available() and fp8_cast.triton_available(), "needs a CUDA GPU with Triton"
    for x_dtype in (torch.bfloat16, torch.float16):
        _check_op("cuda", x_dtype)
    big = torch.randn(65536, 32784, device="cuda", dtype=torch.bfloat16)  # 2^31 + 2^20 elements
    q, qt, _ = fp8_cast.cast_transpose(big, torch.tensor(8.0, device="cuda"), torch.float8_e4m3fn)
    r, rt, _ = fp8_cast._reference(big, torch.tensor(8.0, device="cuda"), torch.float8_e4m3fn)
    assert torch.equal(_bits(q), _bits(r)) and torch.equal(_bits(qt), _bits(rt)), "differs past 2^31 elements"
    del big, q, qt, r, rt
    print("triton cast-transpose: bit-exact against torch on", torch.cuda.get_device_name())
    for scaling, steps in (("dynamic", 1), ("delayed", 3)):
        for compiled in (False, True):
            a = _train_grads("kernel", "cuda", compiled, scaling, steps)
            b = _train_grads("inline", "cuda", compiled, scaling, steps)
            print(f"{scaling} compiled={compiled}: max |kernel - inline| / max |inline| per output:",
                  [f"{((x.float() - y.float()).abs().max() / y.float().abs().max()).item():.3g}" for x, y in zip(a, b)])
