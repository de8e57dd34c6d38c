"""The fp8 cast-transpose kernel's tile shapes, timed against a bf16 copy of the same tensor (CUDA).

A bf16 copy reads and writes 2 bytes an element, as the cast does (2 bytes in, 1 + 1 out; srelu_grad
reads 2 more), so `vs copy` is how close each tile shape gets to what the memory allows, in one run.
Shapes: the d20 model's casts at 65,536 tokens per micro-step (widths 1280, 3840, 5120; the MLP's
hidden width with the fused squared ReLU forward and backward). After the tile shapes: the op with the
tile shape Triton's autotuner picked, then the power-of-two op with a right and a wrong guess. Each is
timed in `--rounds` rounds of `--calls` calls: the median and range of a call's time, and the ratio to
the copy (of the medians; its range over every pair of rounds).

    python -m bench.cast_kernel [--tokens 65536] [--out DIR]
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from model.precision import fp8_cast

from .stats import fmt, save_json, speedup, spread
from .train_step import cuda_rounds

SHAPES = [(1280, "none"), (3840, "none"), (5120, "none"), (5120, "srelu"), (5120, "srelu_grad")]


def run(tokens: int, rounds: int = 5, calls: int = 20, log=print) -> list[dict]:
    import triton
    import triton.language as tl

    kernel = fp8_cast._cast_transpose_kernel  # the autotuner; .fn is the plain kernel
    rows = []
    for n, act in SHAPES:
        x = torch.randn(tokens, n, device="cuda", dtype=torch.bfloat16)
        h = torch.randn_like(x) if act == "srelu_grad" else None
        scale = torch.tensor(2.0, device="cuda")
        q = torch.empty(tokens, n, device="cuda", dtype=torch.uint8)
        qt = torch.empty(n, tokens, device="cuda", dtype=torch.uint8)
        am = torch.zeros((), device="cuda")
        bytes_moved = x.numel() * (2 + 2 + (2 if h is not None else 0))
        def timed(fn):
            return cuda_rounds(fn, rounds, calls)
        copy = timed(lambda: x.clone())

        def row(name, times):
            ms, vs = spread(times), speedup(times, copy)
            rows.append({"shape": f"{tokens}x{n}", "act": act, "variant": name, "ms": ms,
                         "GB/s": round(bytes_moved / ms["median"] / 1e6), "copy_vs": vs})
            log(f"{tokens}x{n} {act:10s} {name:22s} {fmt(ms, '.3f')} ms  {bytes_moved / ms['median'] / 1e6:6.0f} GB/s  "
                f"{fmt(vs, '.3f', 'x')} the copy's time")

        row("bf16 copy (reference)", copy)
        for cfg in kernel.configs:
            bm, bn, warps = cfg.kwargs["BLOCK_M"], cfg.kwargs["BLOCK_N"], cfg.num_warps
            grid = (triton.cdiv(tokens, bm), triton.cdiv(n, bn))

            def call():
                kernel.fn[grid](x, x if h is None else h, scale, q, qt, am, tokens, n, 448.0,
                                ACT=fp8_cast.ACTS[act], OUT_DTYPE=tl.float8e4nv, BLOCK_M=bm, BLOCK_N=bn,
                                num_warps=warps)
            row(f"{bm}x{bn}, {warps} warps", timed(call))
        op = timed(lambda: fp8_cast.cast_transpose(x, scale, torch.float8_e4m3fn, act, h))
        best = kernel.best_config
        row(f"op, autotuned: {best.kwargs['BLOCK_M']}x{best.kwargs['BLOCK_N']}, {best.num_warps} warps", op)
        # dynamic power-of-two scaling: a right guess should cost the op plus a tiny check, a wrong one a
        # second cast
        _, _, _, right = fp8_cast.cast_transpose_pow2(x, scale, torch.float8_e4m3fn, act, h)
        for name, guess in (("pow2 op, right guess", right), ("pow2 op, wrong guess", right * 2)):
            row(name, timed(lambda: fp8_cast.cast_transpose_pow2(x, guess, torch.float8_e4m3fn, act, h)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds: their median and range (default: %(default)s)")
    p.add_argument("--calls", type=int, default=20, help="calls a round (default: %(default)s)")
    p.add_argument("--out")
    a = p.parse_args()
    if not (torch.cuda.is_available() and fp8_cast.triton_available()):
        raise SystemExit("bench.cast_kernel times a Triton kernel: it needs a CUDA GPU with Triton")
    rows = run(a.tokens, a.rounds, a.calls)
    if a.out:
        save_json({"rows": rows}, Path(a.out) / "cast_kernel.json", indent=1)


if __name__ == "__main__":
    main()
