"""Which step inside the decode attention gives different bits for equal inputs? op_locate.py (run5)
found the attention module's output, between its q/k/v projection and its output projection, differing
in 1-4% of repeats. Here layer 3's attention of one decode step is written out step by step (as
model/gpt.py's Attention does it) on a saved input and cache, 1,000 times, comparing each intermediate
with the first (run7 of bench/results/h200-determinism-2026-12-04: all repeatable; the cause, cuDNN's
SDPA kernel parting only in context, was found later: h200-determinism-2026-12-04b)."""
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, "tests")
from test_engine_gpu import fill, gpu_model_bf16  # noqa: E402

from model.gpt import KVCache, apply_rope, norm  # noqa: E402

N = 1000
model = gpu_model_bf16()
cache = KVCache(model.config, 1, 1024, "cuda", torch.bfloat16)
grab = {}


def keep(mod, args):  # the attention's inputs at the step below
    grab["args"] = [a.clone() if torch.is_tensor(a) else a for a in args]


model.blocks[3].attn.register_forward_pre_hook(keep)
with torch.inference_mode():
    fill(model, cache, 620)
    grab.clear()
    model(torch.tensor([[620]], device="cuda"), kv_cache=cache, kv_len=1024)
    xin, cos, sin, _, positions, given_mask = grab["args"]
    kv_len = given_mask.shape[-1]
    attn = model.blocks[3].attn
    kc0, vc0 = cache.k[3].clone(), cache.v[3].clone()
    kc, vc = cache.k[3], cache.v[3]
    names = ["qkv", "q rope", "k rope", "q norm", "k norm", "cache keys after write", "cache values after write",
             "mask", "SDPA out"]
    first, differ = None, [0] * len(names)
    for i in range(N):
        kc.copy_(kc0); vc.copy_(vc0)
        B, T, _ = xin.shape
        qkv = attn.c_qkv(xin)
        q, k, v = qkv.split(attn.qkv_rows, dim=-1)
        q = q.reshape(B, T, attn.n_head, attn.head_dim)
        k = k.reshape(B, T, attn.n_kv_head, attn.head_dim)
        v = v.reshape(B, T, attn.n_kv_head, attn.head_dim)
        qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        qn, kn = norm(qr), norm(kr)
        rows = torch.arange(B, device="cuda")[:, None]
        kc[rows, :, positions] = kn.to(kc.dtype)
        vc[rows, :, positions] = v.to(vc.dtype)
        keys, values = kc[:, :, :kv_len], vc[:, :, :kv_len]
        mask = torch.arange(kv_len, device="cuda")[None, None, :] <= positions[:, :, None]
        y = F.scaled_dot_product_attention(qn.transpose(1, 2), keys, values, attn_mask=mask[:, None])
        outs = [qkv, qr, kr, qn, kn, keys.clone(), values.clone(), mask, y]
        if first is None:
            first = [o.clone() for o in outs]
            continue
        for j, (a, b) in enumerate(zip(outs, first)):
            differ[j] += not torch.equal(a, b)
    print(f"layer 3, position 620, {kv_len} slots, {N - 1} repeats on the same input and cache; repeats that "
          f"differ from the first: " + ", ".join(f"{n} {d}" for n, d in zip(names, differ)), flush=True)
    # the same SDPA call on the first repeat's own inputs, again and again
    q1, k1, v1, m1 = first[3].transpose(1, 2), first[5], first[6], first[7][:, None]
    ys = sum(not torch.equal(F.scaled_dot_product_attention(q1, k1, v1, attn_mask=m1), first[8]) for _ in range(N))
    print(f"SDPA alone on those saved inputs: {ys} of {N} calls differ from the first", flush=True)
