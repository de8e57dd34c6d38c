"""The weight products of a decode step at a few rows, FP8 weights against bf16: which of the weight-only
kernel's tiles and splits of K (model/precision/fp8_weights.py) pays, and where W8A8 overtakes it.

At the d20 shapes (c_qkv, attn c_proj, c_fc, mlp c_proj) and `--rows` (1, 4, 16, 32, 64), each round
times, back to back on the same input: bf16 `F.linear` (cuBLAS, the reference), the weight-only kernel
at every (BLOCK_N, BLOCK_K, SPLIT_K) of the grid, and W8A8 (`torch._scaled_mm`, the activation's cast
included). Per variant: microseconds a call (CUDA events over `--iters` calls), the weight bytes it read
over that time (GB/s), and its speed over bf16's in the same round: the median (min-max) over `--rounds`
rounds (bench/stats.py). The best weight-only configuration per shape and rows is printed; the module's
BLOCK_N, BLOCK_K, SPLIT_K and WEIGHT_ONLY_MAX_ROWS are then set from these figures.

    python -m bench.fp8_gemv [--rows 1,4,16,32,64] [--out bench/results/serving/fp8_gemv_<gpu>.json]
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time

import torch
import torch.nn.functional as F

from bench.provenance import run_id
from bench.stats import fmt, save_json, spread

D20 = {"c_qkv": (3840, 1280), "attn.c_proj": (1280, 1280), "c_fc": (5120, 1280), "mlp.c_proj": (1280, 5120)}
GRID = list(itertools.product((16, 32, 64), (64, 128, 256), (1, 2, 4)))


def time_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / iters


def main(argv=None) -> dict:
    from model.precision import fp8_weights as fw
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,4,16,32,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    reason = fw.unavailable_reason("cuda")
    if reason:
        raise SystemExit(f"bench/fp8_gemv.py: {reason}")
    rows = [int(r) for r in args.rows.split(",")]
    res = {"command": "python -m bench.fp8_gemv " + " ".join(argv if argv is not None else sys.argv[1:]),
           "commit": run_id(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "rounds": args.rounds, "iters": args.iters, "shapes": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in D20.items():
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        lin.weight.data.copy_(w)
        f = fw.Fp8WeightLinear.from_linear(lin)
        for m in rows:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            variants = {"bf16": lambda: F.linear(x, w), "w8a8": lambda: fw.w8a8(x, f.qweight, f.inv_scale)}
            if m <= fw.WEIGHT_ONLY_MAX_ROWS:
                for bn, bk, sk in GRID:
                    variants[f"weight_only_n{bn}_k{bk}_s{sk}"] = (
                        lambda bn=bn, bk=bk, sk=sk: fw.weight_only_triton(x, f.qweight, f.inv_scale, bn, bk, sk))
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, fn in variants.items():
                    times[v].append(time_us(fn, args.iters))
            out = {}
            for v, ts in times.items():
                nbytes = n * k * (2 if v == "bf16" else 1)
                out[v] = {"us": spread(ts, 2), "GBps": spread([nbytes / t / 1e3 for t in ts], 1),
                          "over_bf16": spread([b / t for b, t in zip(times["bf16"], ts)])}
            best = max((v for v in out if v.startswith("weight_only")), key=lambda v: out[v]["over_bf16"]["median"],
                       default=None)
            res["shapes"][f"{name}_{m}rows"] = {"n": n, "k": k, "rows": m, "best_weight_only": best, "variants": out}
            line = f"{name:>12} {m:3d} rows: bf16 {fmt(out['bf16']['us'], '.1f')} us, w8a8 {fmt(out['w8a8']['over_bf16'], '.2f', 'x')}"
            if best:
                line += f", weight-only best {best} {fmt(out[best]['over_bf16'], '.2f', 'x')} ({fmt(out[best]['GBps'], ',.0f')} GB/s)"
            print(line, flush=True)
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
