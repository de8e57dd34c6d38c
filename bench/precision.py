"""Precision backends timed against bf16 within one run: GEMM level and model level.

GEMM level: one Linear (forward + both backward GEMMs, casts included) at the shapes of a GPT block
(width d: d->d attention projections, d->4d and 4d->d MLP), and one whole MLP (norm + fc + relu^2 + proj),
for bf16 (compiled), our fp8 (compiled), and every TE recipe that runs here (TE eager, as it runs
inside our compiled model). Model level: `model.precision.probe.run_probe` for a few steps.
Everything is reported as a ratio to bf16 measured in the same process.

    python -m bench.precision --width 1280 --tokens 65536 [--model --depth 20 --steps 20] [--out bench/results]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

from model.gpt import MLP, GPTConfig, norm
from model.precision import LayerFilter, get_backend

from .train_step import cuda_time


def _time(fn, iters: int, warmup: int = 3) -> float:
    return statistics.median(cuda_time(fn, iters, warmup))


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


def gemm_bench(width: int, tokens: int, iters: int = 10, log=print) -> list[dict]:
    dev = torch.device("cuda")
    shapes = [("attn d->d", _One, (width, width)), ("mlp d->4d", _One, (width, 4 * width)),
              ("mlp 4d->d", _One, (4 * width, width)), ("whole MLP", _MLP, (width,))]
    rows = []
    for label, cls, args in shapes:
        k = args[0]
        flops = 6 * tokens * (args[0] * args[1] if cls is _One else 8 * width * width)
        base_ms = None
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
                ms = _time(step, iters)
            except Exception as e:
                log(f"{label:10s} {be.label:28s} FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            finally:
                torch._dynamo.reset()
            base_ms = base_ms or ms
            row = dict(shape=label, tokens=tokens, width=width, backend=be.label, ms=ms,
                       tflops=flops / ms / 1e9, speedup=base_ms / ms)
            rows.append(row)
            log(f"{label:10s} {be.label:28s} {ms:8.2f} ms {row['tflops']:7.0f} TFLOP/s {row['speedup']:5.2f}x")
    return rows


def to_markdown(rows, title) -> str:
    lines = [f"## {title}", "", "| shape | backend | ms (fwd+bwd) | TFLOP/s | vs bf16 |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['backend']} | {r['ms']:.2f} | {r['tflops']:.0f} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--model", action="store_true", help="also time whole models through the probe")
    p.add_argument("--depth", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--backends", nargs="+", default=["bf16", "fp8", "te-fp8:current,modules=linear",
                                                      "te-fp8:current,modules=fused"])
    p.add_argument("--out", help="folder for precision_bench.json / .md")
    a = p.parse_args(argv)
    t0 = time.time()
    rows = gemm_bench(a.width, a.tokens, a.iters)
    md = to_markdown(rows, f"GEMM level: width {a.width}, {a.tokens} tokens, {torch.cuda.get_device_name()}")
    result = {"gemm": rows}
    if a.model:
        from model.precision.options import ProbeOptions
        from model.precision.probe import run_probe, to_markdown as probe_md
        probe = run_probe(ProbeOptions(steps=a.steps, depth=a.depth, seq_len=2048, batch=32, vocab=65536,
                                       backends=a.backends))
        result["model"] = probe
        md += "\n" + probe_md(probe)
    print(md)
    print(f"bench took {time.time() - t0:.0f} s")
    if a.out:
        d = Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "precision_bench.json").write_text(json.dumps(result, indent=1) + "\n")
        (d / "precision_bench.md").write_text(md)


if __name__ == "__main__":
    main()
