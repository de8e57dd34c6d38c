"""Muon's batched update (one Newton-Schulz per shape) equals the one-matrix-at-a-time update."""
import torch

from model.optim import Muon, NS_COEFFS, orthogonalize


def reference_muon_step(params, bufs, lr, momentum=0.95):
    """Muon written one matrix at a time, straight from its definition."""
    for p, buf in zip(params, bufs):
        buf.lerp_(p.grad, 1 - momentum)
        g = p.grad.lerp(buf, momentum)
        scale = max(1.0, p.size(-2) / p.size(-1)) ** 0.5
        p.data.add_(orthogonalize(g), alpha=-lr * scale)


def test_batched_muon_matches_per_matrix():
    torch.manual_seed(0)
    shapes = [(32, 32), (32, 32), (64, 32), (32, 64), (32, 32)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    bufs = [torch.zeros_like(p) for p in b]
    opt = Muon(a, lr=0.02)
    for _ in range(3):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        reference_muon_step(b, bufs, 0.02)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_split_parameter_is_orthogonalised_part_by_part():
    """A fused q/k/v weight gets exactly the update its three parts would get as separate matrices."""
    torch.manual_seed(2)
    rows = [32, 16, 16]
    fused = torch.nn.Parameter(torch.randn(64, 32))
    parts = [torch.nn.Parameter(t.detach().clone()) for t in fused.split(rows)]
    bufs = [torch.zeros_like(p) for p in parts]
    opt = Muon([fused], lr=0.02, splits={fused: rows})
    for _ in range(3):
        g = torch.randn(64, 32)
        fused.grad = g.clone()
        for p, gp in zip(parts, g.split(rows)):
            p.grad = gp.clone()
        opt.step()
        reference_muon_step(parts, bufs, 0.02)
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in parts]), rtol=1e-5, atol=1e-6)


def test_orthogonalize_stack_equals_each():
    torch.manual_seed(1)
    g = torch.randn(4, 48, 16)
    stacked = orthogonalize(g)
    for i in range(4):
        torch.testing.assert_close(stacked[i], orthogonalize(g[i]), rtol=1e-5, atol=1e-6)
    # Newton-Schulz pushes singular values towards 1 (into roughly [0.7, 1.2] after 5 steps)
    sv = torch.linalg.svdvals(stacked[0].double())
    assert sv.min() > 0.5 and sv.max() < 1.3, (sv.min(), sv.max(), NS_COEFFS)


def test_old_model_dirs_with_separate_qkv_still_load(tmp_path):
    """Model directories saved before q/k/v were fused (c_q, c_k, c_v) load into the fused model."""
    from model.gpt import GPT, GPTConfig
    from model.model_dir import upgrade_state_dict

    cfg = GPTConfig(vocab_size=64, n_layer=2, n_embd=32, n_head=4, n_kv_head=2, seq_len=16)
    model = GPT(cfg)
    model.init_weights(seed=0)
    old = {}
    for k, v in model.state_dict().items():
        if k.endswith("c_qkv.weight"):
            for name, part in zip(("c_q", "c_k", "c_v"), v.split(cfg.qkv_rows)):
                old[k.replace("c_qkv", name)] = part.clone()
        else:
            old[k] = v.clone()
    fresh = GPT(cfg)
    fresh.load_state_dict(upgrade_state_dict(old), strict=True)
    x = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(fresh(x), model(x))
