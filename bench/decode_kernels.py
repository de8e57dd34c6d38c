"""Candidates for the large parts of a decode step, each timed alone in a CUDA graph.

The weight products: the four of a d20 layer (q/k/v, attention out, MLP in, MLP out) chained over 20
layers' distinct weights (786 MB, far past the L2 cache, as in a real step), by cuBLAS through
`F.linear` (the engine's way), by cuBLAS without cuBLASLt, by our Triton kernel (bench/gemv.py), by
Triton kernels that torch.compile picks by autotuning for static shapes, and by `F.linear` with the next
matrices read into the L2 cache on a side stream while one is multiplied; `sweep` times each shape
alone, cuBLAS against our kernel at each of a few block shapes. The sampling: the engine's top-k
sampler, compiled, against the one before ties were ordered by id, and its whole-vocabulary sort;
bitwise repeatability on logits full of ties. The cache attention: 20 layers of one query a row
against 256 cache slots, each row masked to its own length, by SDPA (cuDNN, as SDPA picks it in a
process with no engine: an engine turns that kernel off, see model/engine.py) and by FlexAttention
compiled for static shapes, with and without a block mask.

    python -m bench.decode_kernels [--rows 1,16,128] [--parts weights,sampling,attention,sweep] [--out x.json]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.decode_step import replay_ms
from bench.gemv import MAX_ROWS, gemv
from bench.serve_gpu import save
from model.sampling import sample, sample_sorted

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
                    sinks[i].copy_(torch.sum(flat[i], dtype=torch.float32))

    x = chain(x, ws, before=fetch)
    main.wait_stream(side)
    return x


SHAPES = {"qkv": (3 * WIDTH, WIDTH), "attn out": (WIDTH, WIDTH), "mlp in": (4 * WIDTH, WIDTH),
          "mlp out": (WIDTH, 4 * WIDTH), "head": (65536, WIDTH)}


def sweep(rows: int, res: dict) -> None:
    """Each shape's products alone (distinct matrices, as in a step) by `F.linear` and by our kernel at
    each of a few block shapes, warp counts and pipeline depths."""
    one = rows == 1
    configs = [(bn, bk, nw, ns) for bn in ((2, 4, 8, 16) if one else (16, 32)) for bk in (256, 512, 1024)
               for nw in (4, 8) for ns in (2, 4)]
    for name, (n, k) in SHAPES.items():
        count = 4 if name == "head" else LAYERS
        g = torch.Generator(device="cuda").manual_seed(2)
        ws = [torch.randn(n, k, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02 for _ in range(count)]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        gb = count * n * k * 2 / 1e9
        want = F.linear(x, ws[0]).float()
        line = {"F.linear": graph_ms(lambda: [F.linear(x, w) for w in ws]) / count * 1e3}
        for cfg in configs:
            try:
                err = (gemv(x, ws[0], *cfg).float() - want).abs().max().item()
                line[str(cfg)] = graph_ms(lambda: [gemv(x, w, *cfg) for w in ws]) / count * 1e3
            except Exception as e:
                print(f"  {name} {cfg}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            if err > 0.05 * want.abs().max().item():
                print(f"  {name} {cfg}: wrong (max diff {err:.3g})", flush=True)
        best = min((v, c) for c, v in line.items() if c != "F.linear")
        res[f"sweep {name}"] = {"us_each": {c: round(v, 2) for c, v in line.items()}, "best": best[1]}
        print(f"{rows:4d} rows, {name:8s} ({n}x{k}): F.linear {line['F.linear']:.2f} us ({gb / count / line['F.linear'] * 1e6:.0f} GB/s), "
              f"ours best {best[0]:.2f} us ({gb / count / best[0] * 1e6:.0f} GB/s) at {best[1]}; "
              f"top 5: {sorted((round(v, 2), c) for c, v in line.items() if c != 'F.linear')[:5]}", flush=True)


def old_sample(logits, temperature, top_k, top_p, uniform, k_max):
    """The sampler as it was before ties were ordered by id: topk sorted by CUDA's own kernel."""
    scaled = logits.float() / temperature.clamp(min=1e-5)[:, None]
    vals, idx = scaled.topk(k_max, dim=-1)
    return sample_sorted(vals, idx, temperature, top_k, top_p, uniform)


def sampling(rows: int, res: dict) -> None:
    """The top-k sampler (compiled, as the engine runs it) before and after ordering ties by id, and the
    engine's whole-vocabulary sort (rows with no top_k): time in a CUDA graph, and how many of 50 calls
    on logits full of bf16 ties give the first call's ids."""
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = (torch.randn(rows, 65536, device="cuda", generator=g) * 0.05).bfloat16().float()
    t = torch.full((rows,), 1.0, device="cuda")
    t[0] = 0.0  # one greedy row
    k = torch.full((rows,), 50, device="cuda", dtype=torch.long)
    p = torch.full((rows,), 0.9, device="cuda")
    u = torch.rand(rows, device="cuda", generator=g)
    want = None
    for name, fn, k_max in (("topk sorted (old)", old_sample, 256), ("ties by id, places counted (engine)", sample, 256),
                            ("whole vocabulary sorted (engine)", sample, 0)):
        f = torch.compile(fn, dynamic=True)
        try:
            first = f(logits, t, k, p, u, k_max)
        except Exception as e:
            print(f"{rows:4d} rows, sampling, {name}: failed: {type(e).__name__}: {str(e)[:400]}", flush=True)
            continue
        want = first if want is None else want
        same = sum(bool((f(logits, t, k, p, u, k_max) == first).all()) for _ in range(50))
        ms = graph_ms(lambda: f(logits, t, k, p, u, k_max))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            f(logits, t, k, p, u, k_max)
            torch.cuda.synchronize()
        kernels = [(e.key[:60], round(e.device_time_total, 1)) for e in prof.key_averages() if e.device_time_total > 0]
        res[f"sampling: {name}"] = {"us": round(ms * 1e3, 2), "same_of_50": same, "kernels": kernels}
        print(f"{rows:4d} rows, sampling, {name:30s}: {ms * 1e3:.2f} us, {same}/50 calls equal to the first; "
              f"greedy row equal to the old: {bool(first[0] == want[0])}; kernels {kernels}", flush=True)


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


def weight_chains(rows: int, ws, res: dict, autotune: bool) -> None:
    wbytes = sum(w.numel() * 2 for layer in ws for w in layer)
    x = torch.randn(rows, WIDTH, device="cuda", dtype=torch.bfloat16)
    cands = {"F.linear (cuBLASLt)": lambda: chain(x, ws), "F.linear (cuBLAS)": "cublas"}
    if rows <= MAX_ROWS:
        cands["ours (bench/gemv.py)"] = lambda: chain(x, ws, gemv)
    if rows == 1:
        cands["torch.mv"] = lambda: chain(x, ws, lambda a, w: torch.mv(w, a[0])[None])
    side = torch.cuda.Stream()
    for ahead in (1, 2):
        cands[f"F.linear, L2 prefetch {ahead} ahead"] = lambda ahead=ahead: prefetched_chain(x, ws, side, ahead)
    if autotune and rows <= 16:
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
        res["weights: " + name] = {"ms": round(ms, 4), "TBps": round(wbytes / ms / 1e9, 2)}
        print(f"{rows:4d} rows, weights, {name:26s}: {ms:.4f} ms, {wbytes / ms / 1e9:.2f} TB/s", flush=True)


def attention(rows: int, res: dict) -> None:
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
        res["attention: " + name] = {"ms": round(ms, 4), "max_abs_diff": err}
        print(f"{rows:4d} rows, attention, {name:18s}: {ms:.4f} ms for 20 layers (max diff {err:.2e})", flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,16,128")
    ap.add_argument("--parts", default="weights,sampling,attention",
                    help="comma list of: weights, sampling, attention, sweep (each shape and block shape of our "
                         "kernel alone, at the rows given)")
    ap.add_argument("--autotune", action="store_true",
                    help="also Triton GEMMs autotuned, up to 16 rows (slow to compile)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    ws = weights() if "weights" in parts else None
    for rows in [int(r) for r in args.rows.split(",")]:
        r = res["rows"][str(rows)] = {}
        if "sweep" in parts:
            sweep(rows, r)
        if "sampling" in parts:
            sampling(rows, r)
        if "weights" in parts:
            weight_chains(rows, ws, r, args.autotune)
        if "attention" in parts:
            attention(rows, r)
    save(res, args.out)
    return res


if __name__ == "__main__":
    main()
