"""Compile time of a backend's model, whole against block by block, as a ratio within one run.

The first training step (forward + backward) includes the compile; the second shows it is done.
Runs on CPU (inductor's C++ backend) or CUDA:

    python -m bench.compile_time --backend nvfp4-emulated --depth 6
"""
from __future__ import annotations

import argparse
import os
import time

# cold compiles for both: a warm on-disk inductor cache would time the cache, not the compile
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

from model.gpt import GPTConfig  # noqa: E402
from model.precision import LayerFilter  # noqa: E402
from model.precision.base import compile_model  # noqa: E402
from model.precision.probe import build_under  # noqa: E402


def first_steps(backend: str, depth: int, regional: bool, device: torch.device) -> tuple[float, float]:
    cfg = GPTConfig(vocab_size=256, n_layer=depth, n_embd=64, n_head=2, n_kv_head=2, seq_len=32)
    _, model, _ = build_under(backend, None, LayerFilter(), cfg, 0, device)
    run = compile_model(model, regional)
    x = torch.randint(0, 256, (2, 32), device=device)
    out = []
    for _ in range(2):
        t = time.perf_counter()
        run(x, x).backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    torch._dynamo.reset()
    return out[0], out[1]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="nvfp4-emulated")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    whole = first_steps(a.backend, a.depth, False, dev)
    regional = first_steps(a.backend, a.depth, True, dev)
    print(f"{a.backend}, depth {a.depth}, {dev}: first step whole {whole[0]:.1f} s, block by block "
          f"{regional[0]:.1f} s ({whole[0] / regional[0]:.1f}x less); second steps {whole[1]:.3f} / {regional[1]:.3f} s")


if __name__ == "__main__":
    main()
