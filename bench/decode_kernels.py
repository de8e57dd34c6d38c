"""Candidates for the two large parts of a decode step, each timed alone in a CUDA graph.

The weight products: the four of a d20 layer (q/k/v, attention out, MLP in, MLP out) chained over 20
layers' distinct weights (786 MB, far past the L2 cache, as in a real step), by cuBLAS through
`F.linear` (the engine's way), by cuBLAS without cuBLASLt, by Triton kernels that torch.compile picks
by autotuning for static shapes, and by `F.linear` with the next matrices read into the L2 cache on a
side stream while one is multiplied. The cache attention: 20 layers of one query a row against 256
cache slots, each row masked to its own length, by SDPA (cuDNN, the engine's way) and by FlexAttention
compiled for static shapes (its decoding kernel splits the slots across the GPU), with and without a
block mask that skips the blocks past each row's length.

    python -m bench.decode_kernels [--rows 1,16,128] [--out bench/results/x.json]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.decode_step import replay_ms
from bench.serve_gpu import save

LAYERS, WIDTH, HEADS, HEAD_DIM, SLOTS = 20, 1280, 10, 128, 256


def graph_ms(fn) -> float:
    """Median time of one call of `fn` replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph, reps=7, n=20)


def weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(3 * WIDTH, WIDTH), (WIDTH, WIDTH), (4 * WIDTH, WIDTH), (WIDTH, 4 * WIDTH)]
    return [[torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for s in shapes]
            for _ in range(LAYERS)]


def chain(x, ws, linear=F.linear, before=None):
    """The layers' weight products in order (the q/k/v output cut to the width of the next input),
    calling `before(j)` ahead of the j-th."""
    for j, w in enumerate(w for layer in ws for w in layer):
        if before is not None:
            before(j)
        x = linear(x, w)
        x = x[:, :WIDTH] if x.shape[1] == 3 * WIDTH else x
    return x


def prefetched_chain(x, ws, side: torch.cuda.Stream, ahead: int):
    """`chain`, with matrix j + ahead read once (a sum) on a side stream while matrix j is multiplied, so
    that its product finds it in the L2 cache. A step's weights are about 16x the L2, but one matrix is
    at most 13 MB, and the products of one row leave most multiprocessors idle."""
    flat = [w for layer in ws for w in layer]
    main = torch.cuda.current_stream()
    sinks = torch.empty(len(flat), device=x.device)

    def fetch(j):
        side.wait_stream(main)  # after the product before j: the reads overlap product j
        with torch.cuda.stream(side):
            for i in (range(1, ahead + 1) if j == 0 else [j + ahead]):
                if i < len(flat):
                    torch.sum(flat[i], dtype=torch.float32, out=sinks[i])

    x = chain(x, ws, before=fetch)
    main.wait_stream(side)
    return x


def caches(rows: int):
    g = torch.Generator(device="cuda").manual_seed(1)
    shape = (rows, HEADS, SLOTS, HEAD_DIM)
    return [(torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16),
             torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16)) for _ in range(LAYERS)]


def sdpa_layers(q, kvs, pos):
    mask = torch.arange(SLOTS, device=q.device)[None, None, None, :] <= pos[:, None, None, None]
    for k, v in kvs:
        q = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return q


def flex_layers(q, kvs, pos, blocks: bool):
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= pos[b]

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= pos[b], score, -float("inf"))

    mask = None
    if blocks:  # each row reads only the 128-slot blocks its length reaches
        B = q.shape[0]
        n = SLOTS // 128
        mask = BlockMask.from_kv_blocks((pos // 128 + 1).view(B, 1, 1).int(),
                                        torch.arange(n, device=q.device).view(1, 1, 1, n).expand(B, 1, 1, n).int(),
                                        BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(1, SLOTS))
    for k, v in kvs:
        q = flex_attention(q, k, v, block_mask=mask) if blocks else flex_attention(q, k, v, score_mod=score_mod)
    return q


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--autotune", action="store_true",
                    help="also Triton GEMMs autotuned, up to 16 rows (slow to compile)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    ws = weights()
    wbytes = sum(w.numel() * 2 for layer in ws for w in layer)
    for rows in [int(r) for r in args.rows.split(",")]:
        r = res["rows"][str(rows)] = {}
        x = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16)
        cands = {"F.linear (cuBLASLt)": lambda: chain(x, ws)}
        cands["F.linear (cuBLAS)"] = "cublas"
        if rows == 1:
            cands["torch.mv"] = lambda: chain(x, ws, lambda a, w: torch.mv(w, a[0])[None])
        side = torch.cuda.Stream()
        for ahead in (1, 2):
            cands[f"F.linear, L2 prefetch {ahead} ahead"] = lambda ahead=ahead: prefetched_chain(x, ws, side, ahead)
        if args.autotune and rows <= 16:
            cands["compiled, max-autotune"] = torch.compile(lambda: chain(x, ws), dynamic=False,
                                                            mode="max-autotune-no-cudagraphs")
        for name, fn in cands.items():
            try:
                if fn == "cublas":
                    torch.backends.cuda.preferred_blas_library("cublas")
                    try:
                        ms = graph_ms(lambda: chain(x, ws))
                    finally:
                        torch.backends.cuda.preferred_blas_library("default")
                else:
                    ms = graph_ms(fn)
            except Exception as e:
                print(f"{rows:4d} rows, weights, {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            r["weights: " + name] = {"ms": round(ms, 4), "TBps": round(wbytes / ms / 1e9, 2)}
            print(f"{rows:4d} rows, weights, {name:26s}: {ms:.4f} ms, {wbytes / ms / 1e9:.2f} TB/s", flush=True)
        q = torch.randn(rows, HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        kvs = caches(rows)
        pos = torch.randint(SLOTS // 2, SLOTS, (rows,), device="cuda")
        want = sdpa_layers(q, kvs, pos)
        cands = {"SDPA (cuDNN)": lambda: sdpa_layers(q, kvs, pos),
                 "flex, score_mod": torch.compile(lambda: flex_layers(q, kvs, pos, False), dynamic=False),
                 "flex, block mask": torch.compile(lambda: flex_layers(q, kvs, pos, True), dynamic=False)}
        for name, fn in cands.items():
            try:
                err = (fn().float() - want.float()).abs().max().item()
                ms = graph_ms(fn)
            except Exception as e:
                print(f"{rows:4d} rows, attention, {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            r["attention: " + name] = {"ms": round(ms, 4), "max_abs_diff": err}
            print(f"{rows:4d} rows, attention, {name:18s}: {ms:.4f} ms for 20 layers (max diff {err:.2e})",
                  flush=True)
    save(res, args.out)
    return res


if __name__ == "__main__":
    main()
