"""Precision backends timed against bf16 within one run, at GEMM level.

One Linear (forward + both backward GEMMs, casts included) at the shapes of a GPT block (width d: d->d
attention projections, d->4d and 4d->d MLP), and one whole MLP (norm + fc + relu^2 + proj), for bf16
(compiled), our fp8 (compiled), and every TE recipe that runs here (TE eager, as it runs inside our
compiled model). Each is timed in `--rounds` rounds of `--calls` calls; reported: the median and range
of a call's time, and the ratio to bf16 in the same process (of the medians; its range over every pair
of rounds). The whole model: `python -m bench.probe_spread`.

    python -m bench.precision --width 1280 --tokens 65536 [--out DIR]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn as nn

from model.gpt import MLP, GPTConfig, norm
from model.precision import LayerFilter, get_backend

from .stats import fmt, save_json, speedup, spread
from .train_step import cuda_rounds


class _MLP(nn.Module):
    """norm + the GPT's MLP, as in a block (te-fp8 fused turns `mlp` into one te.LayerNormMLP)."""

    def __init__(self, d):
        super().__init__()
        self.mlp = MLP(GPTConfig(n_embd=d, n_head=max(1, d // 128), n_kv_head=max(1, d // 128)))

    def forward(self, x):
        return self.mlp(norm(x))


class _One(nn.Module):
    def __init__(self, k, n):
        super().__init__()
        self.lin = nn.Linear(k, n, bias=False)

    def forward(self, x):
        return self.lin(x)


def variants():
    out = [("bf16", {}), ("fp8", {})]
    for r in ("delayed", "current", "block", "mxfp8"):
        out.append(("te-fp8", {"recipe": r, "modules": "fused"}))
    return out


def gemm_bench(width: int, tokens: int, rounds: int = 5, calls: int = 10, log=print) -> list[dict]:
    dev = torch.device("cuda")
    shapes = [("attn d->d", _One, (width, width)), ("mlp d->4d", _One, (width, 4 * width)),
              ("mlp 4d->d", _One, (4 * width, width)), ("whole MLP", _MLP, (width,))]
    rows = []
    for label, cls, args in shapes:
        k = args[0]
        flops = 6 * tokens * (args[0] * args[1] if cls is _One else 8 * width * width)
        base = None
        for name, opts in variants():
            be = get_backend(name, opts, LayerFilter(16, []))
            why = be.unavailable_reason(dev)
            if why:
                continue
            torch.manual_seed(0)
            mod = cls(*args).to(dev)
            mod = be.convert(mod)
            run = torch.compile(mod) if be.supports_compile else mod
            x = torch.randn(tokens, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
            gy = torch.randn(tokens, args[1] if cls is _One else width, device=dev, dtype=torch.bfloat16)

            def step():
                with be.autocast(dev):
                    y = run(x)
                y.backward(gy)
            try:
                times = cuda_rounds(step, rounds, calls)
            except Exception as e:
                log(f"{label:10s} {be.label:28s} FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            finally:
                torch._dynamo.reset()
            base = base or times
            ms = spread(times)
            row = dict(shape=label, tokens=tokens, width=width, backend=be.label, ms=ms, ms_rounds=times,
                       tflops=flops / ms["median"] / 1e9, speedup=speedup(base, times))
            rows.append(row)
            log(f"{label:10s} {be.label:28s} {fmt(ms, '.3f')} ms {row['tflops']:7.0f} TFLOP/s "
                f"{fmt(row['speedup'], '.3f', 'x')}")
    return rows


def to_markdown(rows, title) -> str:
    lines = [f"## {title}", "", "| shape | backend | ms (fwd+bwd), median (min–max) | TFLOP/s | vs bf16 |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['backend']} | {fmt(r['ms'], '.3f')} | {r['tflops']:.0f} | "
                     f"{fmt(r['speedup'], '.3f', 'x')} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds: their median and range (default: %(default)s)")
    p.add_argument("--calls", type=int, default=10, help="calls a round (default: %(default)s)")
    p.add_argument("--out", help="folder for precision_bench.json / .md")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.precision times GEMMs on a CUDA GPU; torch sees none")
    t0 = time.time()
    rows = gemm_bench(a.width, a.tokens, a.rounds, a.calls)
    md = to_markdown(rows, f"GEMM level: width {a.width}, {a.tokens} tokens, {torch.cuda.get_device_name()}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": a.rounds,
              "calls": a.calls, "gemm": rows}
    print(md)
    print(f"bench took {time.time() - t0:.0f} s")
    if a.out:
        d = Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        save_json(result, d / "precision_bench.json", indent=1)
        (d / "precision_bench.md").write_text(md)


if __name__ == "__main__":
    main()
