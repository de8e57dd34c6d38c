"""What a compiled training step keeps for its backward pass, per precision backend: the tensors saved
between forward and backward, grouped by dtype and shape, with their total size.

Peak memory on a GPU is mostly these saved activations, and they depend on what the compiler chooses
to save versus recompute. This tool reads them on any device, including CPU. On CPU it runs the model
under bf16 autocast, so the graph is the one a GPU compiles. Example:

    python -m bench.saved_activations --variants bf16 fp8:cast=inline fp8:cast=kernel

For fp8 it shows where the kernel path's extra memory on the H200 came from. Inline casts are cheap
pointwise code, so the compiler recomputes them in the backward from bf16 tensors it saves anyway. The
cast-transpose op's FP8 output is saved instead: one byte per element of every converted Linear's
input.
"""
from __future__ import annotations

import argparse
import math
from collections import Counter

import torch

from model.precision import LayerFilter
from model.precision.base import compile_model
from model.precision.probe import build_under, entry_filter, expand_entries, model_config


def saved_tensors(variant: str, depth: int, seq_len: int, batch: int, vocab: int, device) -> Counter:
    """(dtype, shape) -> count of the tensors saved for backward in one compiled training step (after
    two warm-up steps, so delayed scaling runs on its history as it does in training)."""
    (entry,) = expand_entries([variant], ["delayed"])
    layer_filter, _ = entry_filter(entry, LayerFilter())
    backend, model, _ = build_under(entry.name, entry.options, layer_filter, model_config(depth, seq_len, vocab, head_dim=64),
                                    0, device)
    run = compile_model(model, backend.compile_regions) if backend.supports_compile else model
    x = torch.randint(0, vocab, (batch, seq_len), device=device)
    saved: Counter = Counter()
    for step in range(3):
        saved.clear()
        hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.update([(t.dtype, tuple(t.shape))]) or t, lambda t: t)
        autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if device.type == "cpu"
                    else backend.autocast(device))  # CPU: the GPU's bf16 graph
        with hooks, autocast:
            loss = run(x, x)
        loss.backward()
        model.zero_grad(set_to_none=True)
    return saved


def nbytes(dtype: torch.dtype, shape: tuple) -> int:
    return math.prod(shape) * dtype.itemsize


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["bf16", "fp8:cast=inline", "fp8:cast=kernel"])
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--device", default="cpu")
    p.add_argument("--top", type=int, default=8, help="largest groups listed per variant")
    a = p.parse_args()
    device = torch.device(a.device)
    ref = None
    for v in a.variants:
        saved = saved_tensors(v, a.depth, a.seq_len, a.batch, a.vocab, device)
        total = sum(n * nbytes(d, s) for (d, s), n in saved.items())
        ref = ref or total
        print(f"{v:24s} {total / 2**20:8.2f} MiB saved for backward ({total / ref:.2f}x the first variant)")
        by_dtype = Counter()
        for (d, s), n in saved.items():
            by_dtype[str(d).removeprefix("torch.")] += n * nbytes(d, s)
        print("    by dtype: " + ", ".join(f"{d} {b / 2**20:.2f} MiB" for d, b in by_dtype.most_common()))
        for (d, s), n in sorted(saved.items(), key=lambda kv: -kv[1] * nbytes(*kv[0]))[:a.top]:
            print(f"    {n:3d} x {str(d).removeprefix('torch.'):14s} {s}")


if __name__ == "__main__":
    main()
