"""Where a training step's time goes, per precision backend, as ratios against bf16 in the same run.

For each variant on the same model, seed and tokens, written backend[:key=value,...][@modifier] with the
modifier one of: an SDPA kernel (flash, cudnn, efficient, math) or `regional` (compile block by block):
  - micro-step: forward + backward of one `batch x seq_len` micro-batch, compiled, the median and range
    of `--iters` CUDA-event timings after warm-up (this is what precision changes; the optimizer is the
    same for every backend), and each variant's ratio to the first over every pair of micro-steps;
  - optimizer step (Muon + AdamW), and on the first variant the one-matrix-at-a-time Muon for reference;
  - a kernel breakdown of one micro-step from torch.profiler (GEMMs, FP8 GEMMs, attention, fused
    elementwise, ...), so a shortfall can be placed;
and, before the models, every SDPA attention kernel alone (forward + backward at the model's shape).

    python -m bench.train_step --depth 20 --batch 32 --variants bf16 bf16@cudnn fp8@cudnn --out DIR
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

from model.gpt import GPT
from model.optim import orthogonalize
from model.peak_flops import peak_flops
from model.precision import LayerFilter
from model.precision.options import TEFp8Options
from model.precision.base import compile_model
from model.precision.probe import build_under, entry_filter, expand_entries, markov_tokens, model_config

from .stats import fmt, save_json, speedup, spread

ATTENTION = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
             "math": "MATH"}


def sdpa_backend(name: str):
    from torch.nn.attention import SDPBackend
    return getattr(SDPBackend, ATTENTION[name])


def cuda_rounds(fn, rounds: int, calls: int, warmup: int = 3) -> list[float]:
    """Milliseconds a call in each of `rounds` rounds of `calls` calls back to back (CUDA events), after
    `warmup` calls: a round of many calls for a kernel of microseconds, one call for a training step."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / calls)
    return out


def attention_bench(batch, heads, seq, head_dim, iters, log) -> list[dict]:
    from torch.nn.attention import sdpa_kernel
    rows = []
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    flops = 4 * batch * heads * seq * seq * head_dim / 2 * 3.5  # causal half; backward 2.5x forward
    for name in ("flash", "cudnn", "efficient"):
        def step():
            with sdpa_kernel([sdpa_backend(name)]):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            y.backward(go)
        try:
            ms = statistics.median(cuda_rounds(step, iters, 1))
        except Exception as e:
            log(f"attention {name:9s} FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        rows.append(dict(kernel=name, ms=ms, tflops=flops / ms / 1e9))
        log(f"attention {name:9s} fwd+bwd {ms:7.2f} ms  {flops / ms / 1e9:6.0f} TFLOP/s (causal FLOPs)")
    return rows


def per_matrix_muon_ms(model, iters) -> float:
    """The earlier Muon: one Newton-Schulz per matrix, eager. Reference for the batched one."""
    mats = [p for n, p in model.named_parameters() if n.startswith("blocks.") and p.ndim == 2]
    grads = [torch.randn_like(p) for p in mats]

    def step():
        for g in grads:
            orthogonalize(g)
    return statistics.median(cuda_rounds(step, iters, 1))


def kernel_breakdown(fn) -> tuple[dict, list, float]:
    """CUDA time of one call of fn by kernel category, the top kernels, and that call's own wall time
    (CUDA events; the profiler slows a call, so compare kernel time with this, not the timed median)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
    per_kernel = defaultdict(float)
    for ev in prof.events():
        if str(ev.device_type).endswith("CUDA"):
            per_kernel[ev.name] += ev.time_range.elapsed_us() / 1e3
    cats = defaultdict(float)
    for name, ms in per_kernel.items():
        n = name.lower()
        if "flash" in n or "fmha" in n or "attention" in n or "cudnn" in n and "sdpa" in n:
            c = "attention"
        elif ("gemm" in n or "sm90" in n or "cutlass" in n or "nvjet" in n) and ("e4m3" in n or "e5m2" in n or "f8" in n or "fp8" in n):
            c = "fp8 gemm"
        elif "gemm" in n or "sm90" in n or "cutlass" in n or "nvjet" in n or "xmma" in n:
            c = "gemm"
        elif "transformer_engine" in n:  # TE's own casts, transposes, norms, activations, amax updates
            c = "te kernels"
        elif "triton" in n:
            c = "triton (fused elementwise/reductions)"
        elif "memcpy" in n or "memset" in n:
            c = "copy/memset"
        else:
            c = "other"
        cats[c] += ms
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:25]
    return dict(cats), top, a.elapsed_time(b)


def parse_variant(v: str):
    spec, _, attn = v.partition("@")
    if attn and attn not in (*ATTENTION, "regional"):
        raise ValueError(f"unknown variant modifier @{attn}; known: {[*ATTENTION, 'regional']}")
    (entry,) = expand_entries([spec], [TEFp8Options().recipe])
    # layer filter: fp8:skip=lm_head+attn.c_proj keeps those in bf16, fp8:skip= converts the head too
    layer_filter, _ = entry_filter(entry, LayerFilter())
    return entry.name, entry.options, attn or "default", layer_filter


def run_variant(v, cfg, data, batch, iters, profile, seed, log, train_steps=0) -> dict:
    from torch.nn.attention import sdpa_kernel
    name, opts, attn, layer_filter = parse_variant(v)
    dev = torch.device("cuda")
    backend, model, opt = build_under(name, opts, layer_filter, cfg, seed, dev)
    regional = backend.supports_compile and (backend.compile_regions or attn == "regional")
    run = compile_model(model, regional) if backend.supports_compile else model
    x, y = data[:batch, :-1].contiguous(), data[:batch, 1:].contiguous()
    def micro():
        kernel = sdpa_kernel([sdpa_backend(attn)]) if attn in ATTENTION else contextlib.nullcontext()
        with kernel, backend.autocast(dev):
            loss = run(x, y)
        loss.backward()
        return loss

    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    micro()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    micro_ms = cuda_rounds(micro, iters, 1)
    opt_ms = cuda_rounds(opt.step, max(3, iters // 2), 1)
    opt.zero_grad(set_to_none=True)
    micro()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    res = dict(variant=v, label=backend.label, attention=attn, regional=regional, compile_s=compile_s,
               micro_ms=statistics.median(micro_ms), micro_ms_all=micro_ms, micro_ms_spread=spread(micro_ms, 2),
               micro_tok_s=batch * cfg.seq_len / statistics.median(micro_ms) * 1e3,
               optimizer_ms=statistics.median(opt_ms), peak_gib=peak)
    if train_steps:
        # at init the output projections are zero, so most of a block's GEMMs get an all-zero operand
        # (measured faster on the H200, likely lower power and higher clocks); time again on real weights
        for _ in range(train_steps):
            opt.zero_grad(set_to_none=True)
            micro()
            opt.step()
        opt.zero_grad(set_to_none=True)
        trained = cuda_rounds(micro, iters, 1)
        res.update(train_steps=train_steps, micro_ms_trained=statistics.median(trained), micro_ms_trained_all=trained,
                   micro_tok_s_trained=batch * cfg.seq_len / statistics.median(trained) * 1e3)
    if profile:
        try:
            res["breakdown_ms"], res["top_kernels"], res["profiled_ms"] = kernel_breakdown(micro)
        except Exception as e:  # the timings above still count
            log(f"    profiler failed: {type(e).__name__}: {e}")
            profile = False
    trained_txt = f"  after {train_steps} steps {res['micro_ms_trained']:7.1f} ms" if train_steps else ""
    log(f"{v:32s} micro {fmt(res['micro_ms_spread'], '.1f')} ms {res['micro_tok_s']:9,.0f} tok/s  opt {res['optimizer_ms']:6.1f} ms  "
        f"peak {peak:5.1f} GiB  compile {compile_s:5.0f} s{trained_txt}")
    if profile:
        # kernel time well below the profiled call's wall time is GPU idle: the host launching too slowly
        busy = sum(res["breakdown_ms"].values())
        log("    " + "  ".join(f"{k}: {ms:.1f}" for k, ms in sorted(res["breakdown_ms"].items(), key=lambda kv: -kv[1]))
            + f"  | kernels {busy:.1f} ms in a profiled call of {res['profiled_ms']:.1f} ms")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=65536)
    p.add_argument("--iters", type=int, default=8, help="timed micro-steps: their median and range (default: %(default)s)")
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--no-attention", action="store_true")
    p.add_argument("--flops-peak", type=float,
                   help="TFLOP/s that MFU divides by (default: this GPU's dense BF16 peak, model/peak_flops.py)")
    p.add_argument("--train-steps", type=int, default=0,
                   help="after timing at init, train this many steps and time the micro-step again")
    p.add_argument("--out")
    a = p.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = True
    log = lambda s: print(s, flush=True)  # noqa: E731
    cfg = model_config(a.depth, a.seq_len, a.vocab)
    flops = GPT.flops_per_token(type("M", (), {"config": cfg})())
    peak, peak_about = (a.flops_peak * 1e12, f"MFU against --flops-peak {a.flops_peak} TFLOP/s") if a.flops_peak \
        else peak_flops("cuda")
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}: depth {a.depth} width {cfg.n_embd}, "
        f"{a.batch}x{a.seq_len} tokens per micro-step, {flops / 1e9:.2f} GFLOP/token; {peak_about}")
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, depth=a.depth, batch=a.batch,
               seq_len=a.seq_len, flops_per_token=flops)
    if not a.no_attention:
        out["attention"] = attention_bench(a.batch, cfg.n_head, a.seq_len, cfg.head_dim, a.iters, log)
    data = markov_tokens(a.batch, a.seq_len + 1, a.vocab, 0, "cuda")
    rows = []
    for i, v in enumerate(a.variants):
        try:
            rows.append(run_variant(v, cfg, data, a.batch, a.iters, not a.no_profile, 0, log, a.train_steps))
        except Exception as e:
            log(f"{v}: FAILED {type(e).__name__}: {str(e)[:300]}")
            rows.append(dict(variant=v, error=f"{type(e).__name__}: {str(e)[:300]}"))
        torch._dynamo.reset()  # the variant's model is gone with run_variant's frame: free its memory
        torch.cuda.empty_cache()
        if i == 0 and "error" not in rows[-1]:
            torch.manual_seed(0)
            with torch.device("cuda"):
                ref = GPT(cfg)
            rows[-1]["per_matrix_muon_ms"] = per_matrix_muon_ms(ref, 3)
            log(f"    one-matrix-at-a-time Muon (earlier optimizer, NS only): {rows[-1]['per_matrix_muon_ms']:.1f} ms")
            del ref
        if a.out:
            save_json({**out, "variants": rows}, Path(a.out) / "train_step.json", indent=1)
    base = next((r for r in rows if "error" not in r), None)
    trained = " | after training: ms | tok/s | vs first" if a.train_steps else ""
    log(f"\n| variant | micro-step ms, median (range) of {a.iters} | tok/s | vs first (range over pairs) | MFU | optimizer ms "
        f"| peak GiB{trained} |")
    log("| --- | --- | --- | --- | --- | --- | ---" + " | --- | --- | ---" * bool(a.train_steps) + " |")
    for r in rows:
        if "error" in r:
            log(f"| {r['variant']} | failed: {r['error'][:120]} | | | | | |")
            continue
        mfu = f"{100 * flops * r['micro_tok_s'] / peak:.1f}%" if peak else "n/a"
        after = (f" | {fmt(spread(r['micro_ms_trained_all'], 2), '.1f')} | {r['micro_tok_s_trained']:,.0f} | "
                 f"{fmt(speedup(base['micro_ms_trained_all'], r['micro_ms_trained_all']), '.3f', 'x')}") if a.train_steps else ""
        vs = fmt(speedup(base["micro_ms_all"], r["micro_ms_all"]), ".3f", "x")
        log(f"| {r['variant']} | {fmt(r['micro_ms_spread'], '.1f')} | {r['micro_tok_s']:,.0f} | {vs} | "
            f"{mfu} | {r['optimizer_ms']:.1f} | {r['peak_gib']:.1f}{after} |")


if __name__ == "__main__":
    main()
