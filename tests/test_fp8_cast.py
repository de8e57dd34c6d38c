"""The FP8 cast-transpose op (model/precision/fp8_cast.py) and the fp8 backend's use of it.

On CPU the op runs its torch implementation: these tests check its contract (shapes, contiguity, amax,
no aliased outputs, the custom-op registration) and that the backend gives bit-identical results
through it and through the inline casts (CPU activations are fp32 on both paths). The Triton kernel
runs only on a CUDA GPU, where this file also runs without pytest (`python tests/test_fp8_cast.py`, as
bench/gpu/fp8_cast.sh does on the H200): every FP8 code and every midpoint between two codes, from
bf16 and fp16 inputs, bit for bit against torch, NaN kept, and one tensor past 2^31 elements. On a GPU
the kernel path also rounds fp32 activations to bf16 before casting, so there the two paths differ by
that rounding; the script prints by how much. The op's fused squared ReLU (forward and backward) is
checked bit for bit the same ways; the fp8 backend's fused MLP is checked against its two Fp8Linears
exactly on CPU, while on a GPU the script prints how far apart they are (there the unfused MLP rounds
relu(h)^2 to bf16 before its cast, the fused one does not) and asserts that the Triton kernel ran.
"""

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
        h = _hard_input(rows, cols, x_dtype, device).flip(0) / 8
        for fmt in FORMATS:
            scale = torch.tensor(3.5, device=device)
            q, qt, am = fp8_cast.cast_transpose(x, scale, fmt)
            r, rt, ram = fp8_cast._reference(x, scale, fmt)
            assert am.item() == ram.item() == x.float().abs().max().item()
            assert q.dtype == fmt and qt.shape == (cols, rows) and qt.is_contiguous()
            assert torch.equal(_bits(q), _bits(r)), f"{fmt} cast differs at {rows}x{cols}"
            assert torch.equal(_bits(qt), _bits(rt)), f"{fmt} transpose differs at {rows}x{cols}"
            assert torch.isfinite(q.float()).all()
            for act, hh in (("srelu", None), ("srelu_grad", h)):
                q, qt, am = fp8_cast.cast_transpose(x, scale, fmt, act, hh)
                r, rt, ram = fp8_cast._reference(x, scale, fmt, act, hh)
                a = fp8_cast.activate(x, act, hh).abs()
                if a.isnan().any():  # fp16's inf (from 1e6) times 0: the kernel's amax skips NaN, torch's keeps it
                    assert ram.isnan() and (am.isnan() or am.item() == a[~a.isnan()].max().item()), act
                else:
                    assert am.item() == ram.item() == a.max().item(), act
                bad = (_bits(q) != _bits(r)).nonzero()[:3].tolist()
                assert not bad and torch.equal(_bits(qt), _bits(rt)), f"{fmt} {act} differs at {rows}x{cols}: " + \
                    ", ".join(f"x={x[i, j].item()} h={None if hh is None else hh[i, j].item()} kernel "
                              f"{q[i, j].float().item()} torch {r[i, j].float().item()}" for i, j in bad)
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
    two = torch.tensor(2.0)
    for args in ((x, two, "e4m3", "none", None), (x[:1], two, "e5m2", "none", None),
                 (x.t(), two, "e4m3", "srelu", None), (x, two, "e5m2", "srelu_grad", x.flip(1))):
        torch.library.opcheck(torch.ops.sparkchat.fp8_cast_transpose.default, args)


def test_op_activations_cpu():
    """srelu and srelu_grad are relu(x)^2 and what autograd gives for the gradient of relu(h)^2, in
    FP32, before the scale, inf and NaN included; a misplaced h is refused."""
    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[-2.0, -0.5, 0.0, 0.5, 3.0, 7.0, inf, -inf, nan, 1.0, inf, 2.0, -0.0, 1.0, nan, 0.0]] * 16)
    h = torch.tensor([[1.0, -1.0, 2.0, 0.25, -3.0, 0.5, -1.0, 0.0, -2.0, nan, 2.0, -0.0, 3.0, inf, 1.0, -inf]] * 16)
    assert torch.allclose(fp8_cast.activate(x, "srelu"), torch.relu(x) ** 2, rtol=0, atol=0, equal_nan=True)
    hh = h.clone().requires_grad_()
    torch.relu(hh).square().backward(x)
    got = fp8_cast.activate(x, "srelu_grad", h)
    assert torch.equal(got.isnan(), hh.grad.isnan()) and torch.equal(got.nan_to_num(), hh.grad.nan_to_num())
    x, h = x.nan_to_num(posinf=5.0, neginf=-5.0), h.nan_to_num(posinf=5.0, neginf=-5.0)
    q, _, am = fp8_cast.cast_transpose(x, torch.tensor(1.0), torch.float8_e4m3fn, "srelu")
    assert am.item() == 49.0 and torch.equal(q.float(), (torch.relu(x) ** 2).to(torch.float8_e4m3fn).float())
    for act, hh in (("srelu_grad", None), ("none", h), ("gelu", None)):
        try:
            fp8_cast.cast_transpose(x, torch.tensor(1.0), torch.float8_e4m3fn, act, hh)
        except ValueError as e:
            assert "act" in str(e) or "h " in str(e)
        else:
            raise AssertionError(f"act={act} with h={hh is not None} was accepted")


def _check_pow2_op(device, x_dtype=torch.bfloat16, shapes=((64, 64), (130, 200), (1, 48))):
    """The guessing op gives, for any guess, bit for bit what an amax pass and a cast with
    pow2_scale(amax) give; its scale is that power of two."""
    from model.precision.formats import pow2_scale
    for rows, cols in shapes:
        x = _hard_input(rows, cols, x_dtype, device)
        h = _hard_input(rows, cols, x_dtype, device).flip(0) / 8
        for act, hh in (("none", None), ("srelu", None), ("srelu_grad", h)):
            for fmt in FORMATS:
                a = fp8_cast.activate(x, act, hh)
                a = a[~a.isnan()].abs().max()
                want = pow2_scale(fmt, a)
                r, rt, _ = fp8_cast._reference(x, want, fmt, act, hh)
                for guess in (want, want * 2, want / 2, torch.tensor(1.0), torch.tensor(0.0)):
                    q, qt, am, s = fp8_cast.cast_transpose_pow2(x, guess.to(device), fmt, act, hh)
                    assert s.item() == want.item() and am.item() == a.item(), (act, fmt, guess.item())
                    assert torch.equal(_bits(q), _bits(r)) and torch.equal(_bits(qt), _bits(rt)), \
                        f"{fmt} {act} {rows}x{cols}, guess {guess.item()} (scale {want.item()})"


def test_pow2_op_cpu():
    _check_pow2_op("cpu", torch.float32)
    _check_pow2_op("cpu", torch.bfloat16, ((8, 32),))
    x = _hard_input(8, 32, torch.bfloat16, "cpu")
    for args in ((x, torch.tensor(2.0), "e4m3", "none", None), (x, torch.tensor(0.5), "e5m2", "srelu_grad", x.flip(1))):
        torch.library.opcheck(torch.ops.sparkchat.fp8_cast_transpose_pow2.default, args)


def test_pow2_guesses_follow_the_scales_cpu():
    """After a step, each guess is the scale that step used: the power of two for the tensor's amax; the
    weight is scaled by a power of two too (the output is exactly that of both pow2 casts)."""
    from model.precision.formats import E4M3, cast_fp8, pow2_scale
    net = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False))
    backend = get_backend("fp8", {}, LayerFilter(16, []))
    backend.convert(net)
    assert backend.label == "fp8"  # the default
    assert get_backend("fp8", {"pow2_scales": False}, LayerFilter()).label == "fp8[exact_scales]"
    x = torch.randn(8, 32) * 5
    with backend.autocast(torch.device("cpu")):
        y = net(x)
        y.sum().backward()
    w = net[0].weight
    (xq, xs), (wq, ws) = cast_fp8(x, E4M3, x.abs().max(), pow2=True), cast_fp8(w, E4M3, w.abs().max(), pow2=True)
    assert torch.equal(y, torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.float32))
    (wq, ws) = cast_fp8(w, E4M3, w.abs().max())  # exact scales: not what the layer did
    assert not torch.equal(y, torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=torch.float32))
    assert net[0].x_scale_guess.item() == pow2_scale(E4M3, x.abs().max()).item()
    assert net[0].g_scale_guess.item() == 2.0 ** 15  # the output gradient is all ones: 57344 = 1.75 * 2^15
    with torch.no_grad(), backend.autocast(torch.device("cpu")):  # evaluation leaves the guesses alone
        net(x * 100)
    assert net[0].x_scale_guess.item() == pow2_scale(E4M3, x.abs().max()).item()


# (scaling, steps, pow2_scales): delayed from its second step; power-of-two dynamic scaling through the
# op guesses from its second step (on a GPU; on CPU the op's torch path takes the amax first, so only
# the GPU run of this file exercises right and wrong guesses)
SCALINGS = (("dynamic", 1, False), ("delayed", 3, False), ("dynamic", 3, True), ("delayed", 3, True))


def _train_grads(cast, device, compiled, scaling="dynamic", steps=1, pow2=False):
    """Outputs and gradients of the last of `steps` forward/backward passes (delayed scaling uses its
    history from the second step on; power-of-two dynamic scaling through the op its guesses)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 64, bias=False), torch.nn.ReLU(),
                              torch.nn.Linear(64, 32, bias=False)).to(device)
    backend = get_backend("fp8", {"cast": cast, "scaling": scaling, "amax_history_len": 4, "pow2_scales": pow2},
                          LayerFilter(16, []))
    backend.convert(net)
    torch._dynamo.reset()  # each configuration compiles afresh (the recompile limit counts them all)
    f = torch.compile(net, fullgraph=True) if compiled else net  # a graph break fails here, not only slows
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
    for scaling, steps, pow2 in SCALINGS:
        ref = _train_grads("inline", "cpu", False, scaling, steps, pow2)
        for compiled in (False, True):
            got = _train_grads("kernel", "cpu", compiled, scaling, steps, pow2)
            assert len(got) == len(ref)
            for a, b in zip(got, ref):
                assert torch.equal(a, b), (scaling, pow2, compiled)


class _Wrap(torch.nn.Module):
    """The GPT's MLP as a child (the backend swaps children), fed through a norm as in a block."""

    def __init__(self, d):
        super().__init__()
        from model.gpt import MLP, GPTConfig
        self.mlp = MLP(GPTConfig(n_embd=d, n_head=1, n_kv_head=1))

    def forward(self, x):
        return self.mlp(torch.nn.functional.rms_norm(x, (x.size(-1),)))


def _mlp_grads(mlp_mode, device, compiled, scaling="dynamic", steps=1, pow2=False):
    torch.manual_seed(0)
    net = _Wrap(32).to(device)
    backend = get_backend("fp8", {"scaling": scaling, "amax_history_len": 4, "mlp": mlp_mode, "pow2_scales": pow2},
                          LayerFilter(16, []))
    backend.convert(net)
    torch._dynamo.reset()  # each configuration compiles afresh (the recompile limit counts them all)
    f = torch.compile(net, fullgraph=True) if compiled else net
    for step in range(steps):
        net.zero_grad()
        # 48 tokens of width 32: a GEMM operand given its transpose by mistake fails on shape
        x = torch.randn(6, 8, 32, device=device, generator=torch.Generator(device).manual_seed(step),
                        requires_grad=True) * (1 + step)
        x.retain_grad()
        with backend.autocast(torch.device(device)):
            y = f(x)
        y.float().square().sum().backward()
    fc, proj = net.mlp.c_fc, net.mlp.c_proj
    state = ("amax_history" if scaling == "delayed" else "scale_guess" if pow2 else None)
    hist = [getattr(m, f"{t}_{state}") for m in (fc, proj) for t in "xg"] if state else []
    return net, [y.detach(), x.grad, fc.weight.grad, proj.weight.grad, *hist]


def test_fused_mlp_same_results_cpu():
    """The fused MLP gives the two Fp8Linears' outputs, gradients and amax histories exactly (on CPU
    both see the same fp32 hidden tensor), eager and compiled, dynamic and delayed scaling; and it
    keeps the plain MLP's parameter names."""
    for scaling, steps, pow2 in SCALINGS:
        for compiled in (False, True):  # compiled against compiled: the norm's rounding may differ
            plain, ref = _mlp_grads("linear", "cpu", compiled, scaling, steps, pow2)
            assert type(plain.mlp).__name__ == "MLP"
            net, got = _mlp_grads("fused", "cpu", compiled, scaling, steps, pow2)
            assert type(net.mlp).__name__ == "Fp8MLP"
            assert list(net.state_dict()) == list(plain.state_dict()) == ["mlp.c_fc.weight", "mlp.c_proj.weight"]
            for a, b in zip(got, ref, strict=True):
                assert torch.equal(a, b), (scaling, pow2, compiled)
    hists = [b.clone() for b in net.buffers()]
    with torch.no_grad():  # evaluation leaves the training histories alone
        net(torch.randn(2, 8, 32))
    assert all(torch.equal(a, b) for a, b in zip(hists, net.buffers()))


def test_any_token_count_trains_in_gemms_of_multiples_of_16(monkeypatch):
    """CUDA's FP8 GEMM refuses a token count not divisible by 16 (the rl stage's rows have any length): the
    backend adds zero rows, so every GEMM here has such shapes (checked as _scaled_mm does), and the output
    and gradients are those of the same tokens padded by the caller."""
    from model.precision import fp8 as fp8_mod
    real = fp8_mod.scaled_mm

    def strict(a, b, **kw):
        assert not (a.shape[0] % 16 or a.shape[1] % 16 or b.shape[1] % 16), (tuple(a.shape), tuple(b.shape))
        return real(a, b, **kw)

    monkeypatch.setattr(fp8_mod, "scaled_mm", strict)
    for options in ({"mlp": "fused"}, {"mlp": "linear"}, {"cast": "inline"}):
        torch.manual_seed(0)
        net = _Wrap(32)
        backend = get_backend("fp8", options, LayerFilter(16, []))
        backend.convert(net)
        x = torch.randn(5, 13, 32, requires_grad=True)  # 65 tokens
        padded = torch.cat([x.detach().reshape(65, 32), torch.zeros(15, 32)]).requires_grad_()
        out = []
        for inp, take in ((x, lambda y: y.reshape(65, 32)), (padded, lambda y: y[:65])):
            net.zero_grad()
            with backend.autocast(torch.device("cpu")):
                y = take(net(inp))
            y.float().square().sum().backward()
            out.append([y.detach(), inp.grad.reshape(-1, 32)[:65], *[p.grad.clone() for p in net.parameters()]])
        for a, b in zip(*out, strict=True):
            assert torch.equal(a, b), options


def test_fused_mlp_only_with_the_kernel_and_relu2():
    net = _Wrap(32)
    get_backend("fp8", {"cast": "inline"}, LayerFilter(16, [])).convert(net)
    assert type(net.mlp).__name__ == "MLP"  # inline casts: the compiler fuses the MLP itself
    net = _Wrap(32)
    net.mlp.activation = "gelu"
    get_backend("fp8", {}, LayerFilter(16, [])).convert(net)
    assert type(net.mlp).__name__ == "MLP"
    net = _Wrap(32)
    get_backend("fp8", {}, LayerFilter(16, ["c_proj"])).convert(net)  # half converted: not fused
    assert type(net.mlp).__name__ == "MLP"
    assert get_backend("fp8", {"mlp": "linear"}, LayerFilter()).label == "fp8[mlp=linear]"


def test_unknown_cast_or_mlp_option_names_choices():
    import pytest
    for key, choice in (("cast", "kernel"), ("mlp", "fused")):
        with pytest.raises(ValueError, match=rf"precision\.fp8\.{key} must be one of .*{choice}"):
            get_backend("fp8", {key: "fast"}, LayerFilter())


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


def _check_every_tile_shape():
    """Large tensors take the autotuner's pick, so every tile shape it may pick must be right: each on
    a shape that ends mid-tile in both dimensions, for the casts training makes."""
    kernel = fp8_cast._cast_transpose_kernel
    for M, N in ((130, 200), (64, 64), (256, 384)):  # mid-tile ends; multiples of 16 (64x64 failed a version)
        _check_tile_shapes(kernel, M, N)


def _check_tile_shapes(kernel, M, N):
    import triton
    import triton.language as tl
    x = _hard_input(M, N, torch.bfloat16, "cuda")
    h = _hard_input(M, N, torch.bfloat16, "cuda").flip(1) / 8
    for cfg in kernel.configs:
        bm, bn = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"]
        for act, fmt, out in (("none", torch.float8_e4m3fn, tl.float8e4nv), ("srelu", torch.float8_e4m3fn, tl.float8e4nv),
                              ("srelu_grad", torch.float8_e5m2, tl.float8e5)):
            hh = h if act == "srelu_grad" else None
            q, qt = torch.empty(M, N, dtype=fmt, device="cuda"), torch.empty(N, M, dtype=fmt, device="cuda")
            am, scale = torch.zeros((), device="cuda"), torch.tensor(0.5, device="cuda")
            kernel.fn[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
                x, x if hh is None else hh, scale, _bits(q), _bits(qt), am, M, N, torch.finfo(fmt).max,
                ACT=fp8_cast.ACTS[act], OUT_DTYPE=out, BLOCK_M=bm, BLOCK_N=bn, num_warps=cfg.num_warps)
            r, rt, ram = fp8_cast._reference(x, scale, fmt, act, hh)
            assert torch.equal(_bits(q), _bits(r)) and torch.equal(_bits(qt), _bits(rt)) and am.item() == ram.item(), \
                f"tile {bm}x{bn} ({cfg.num_warps} warps), {act}, {M}x{N}"


if __name__ == "__main__":  # the GPU machine has no pytest
    assert torch.cuda.is_available() and fp8_cast.triton_available(), "needs a CUDA GPU with Triton"
    for x_dtype in (torch.bfloat16, torch.float16):
        _check_op("cuda", x_dtype)
    _check_every_tile_shape()
    big = torch.randn(65536, 32784, device="cuda", dtype=torch.bfloat16)  # 2^31 + 2^20 elements (autotuned)
    q, qt, _ = fp8_cast.cast_transpose(big, torch.tensor(8.0, device="cuda"), torch.float8_e4m3fn)
    r, rt, _ = fp8_cast._reference(big, torch.tensor(8.0, device="cuda"), torch.float8_e4m3fn)
    assert torch.equal(_bits(q), _bits(r)) and torch.equal(_bits(qt), _bits(rt)), "differs past 2^31 elements"
    del big, q, qt, r, rt
    for x_dtype in (torch.bfloat16, torch.float16):  # the guessing op: small, and autotuned with many tiles
        _check_pow2_op("cuda", x_dtype, ((64, 64), (130, 200), (1, 48), (4096, 1040), (2051, 2064)))
    print("triton cast-transpose: bit-exact against torch on", torch.cuda.get_device_name())
    torch_path = []  # the op's torch implementation must not run for these bf16 tensors on a GPU
    reference = fp8_cast._reference
    fp8_cast._reference = lambda *a, **k: torch_path.append(1) or reference(*a, **k)
    for scaling, steps, pow2 in SCALINGS:
        for compiled in (False, True):
            a = _mlp_grads("fused", "cuda", compiled, scaling, steps, pow2)[1]
            b = _mlp_grads("linear", "cuda", compiled, scaling, steps, pow2)[1]
            print(f"mlp {scaling} pow2={pow2} compiled={compiled}: max |fused - linear| / max |linear| per output:",
                  [f"{((x.float() - y.float()).abs().max() / y.float().abs().max()).item():.3g}" for x, y in zip(a, b)])
            a = _train_grads("kernel", "cuda", compiled, scaling, steps, pow2)
            b = _train_grads("inline", "cuda", compiled, scaling, steps, pow2)
            print(f"{scaling} pow2={pow2} compiled={compiled}: max |kernel - inline| / max |inline| per output:",
                  [f"{((x.float() - y.float()).abs().max() / y.float().abs().max()).item():.3g}" for x, y in zip(a, b)])
    fp8_cast._reference = reference
    assert not torch_path, f"the op fell back to torch {len(torch_path)} times on the GPU"
    print("fused MLP and Linears cast through the Triton kernel")
