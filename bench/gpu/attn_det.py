"""Is cached-decode attention bitwise repeatable? SDPA with a boolean mask, one query row, 10 heads of
128, bf16, at 256/512/1024 slots, 200 calls on the same inputs: distinct outputs per backend. Run on the
H200 (run7 in bench/results/h200-engine-2026-12-04c: one output each); part of
bench/gpu/determinism_h200.sh."""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

torch.manual_seed(0)
for slots in (256, 512, 1024):
    q = torch.randn(1, 10, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 10, slots, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 10, slots, 128, device="cuda", dtype=torch.bfloat16)
    mask = (torch.arange(slots, device="cuda") <= slots // 2 + 20)[None, None, None, :]
    for name, backends, det in (("default", None, False), ("default, cudnn.deterministic", None, True),
                                ("cudnn", [SDPBackend.CUDNN_ATTENTION], False),
                                ("efficient", [SDPBackend.EFFICIENT_ATTENTION], False)):
        torch.backends.cudnn.deterministic = det
        try:
            outs = set()
            for _ in range(200):
                if backends:
                    with sdpa_kernel(backends):
                        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                else:
                    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                outs.add(y.float().cpu().numpy().tobytes())
            print(f"{slots} slots, {name}: {len(outs)} distinct outputs of 200", flush=True)
        except Exception as e:
            print(f"{slots} slots, {name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.backends.cudnn.deterministic = False

# the same query and filled slots, other values in the masked slots each call (as stale cache rows)
for slots in (512, 1024):
    q = torch.randn(1, 10, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 10, slots, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 10, slots, 128, device="cuda", dtype=torch.bfloat16)
    n = slots // 2 + 21
    mask = (torch.arange(slots, device="cuda") < n)[None, None, None, :]
    for name, backends in (("default", None), ("cudnn", [SDPBackend.CUDNN_ATTENTION]),
                           ("efficient", [SDPBackend.EFFICIENT_ATTENTION]), ("flash", [SDPBackend.FLASH_ATTENTION]),
                           ("math", [SDPBackend.MATH])):
        try:
            outs = set()
            for i in range(20):
                k[:, :, n:].normal_(); v[:, :, n:].normal_()
                with sdpa_kernel(backends or [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                outs.add(y.float().cpu().numpy().tobytes())
            print(f"{slots} slots, {name}, other stale values past {n}: {len(outs)} distinct outputs of 20", flush=True)
        except Exception as e:
            print(f"{slots} slots, {name}, stale: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
