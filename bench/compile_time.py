"""Compile time of a backend's model, whole against block by block, as a ratio within one round.

The first training step (forward + backward) includes the compile; the second shows it is done. Each
of `--rounds` rounds compiles both ways from cold; reported: the median and range of the first steps
and of their per-round ratio. Runs on CPU (inductor's C++ backend) or CUDA:

    python -m bench.compile_time --backend nvfp4-emulated --depth 6
"""
from __future__ import annotations

import argparse
import os
import time

# cold compiles for both: a warm on-disk inductor cache would time the cache, not the compile
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import torch  # noqa: E402

from bench.stats import fmt, ratios, spread  # noqa: E402
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
    p.add_argument("--rounds", type=int, default=3, help="cold compiles of each kind (default: %(default)s)")
    a = p.parse_args(argv)
    dev = torch.device(a.device)
    whole, regional = [], []
    for r in range(a.rounds):
        whole.append(first_steps(a.backend, a.depth, False, dev))
        regional.append(first_steps(a.backend, a.depth, True, dev))
        print(f"round {r + 1}/{a.rounds}: first step whole {whole[-1][0]:.1f} s, block by block {regional[-1][0]:.1f} s",
              flush=True)
    first_w, first_r = [w[0] for w in whole], [r[0] for r in regional]
    print(f"{a.backend}, depth {a.depth}, {dev}, median (min–max) of {a.rounds} rounds: first step whole "
          f"{fmt(spread(first_w, 2), '.1f', ' s')}, block by block {fmt(spread(first_r, 2), '.1f', ' s')}, whole / block "
          f"by block {fmt(spread(ratios(first_w, first_r), 3), '.2f', 'x')}; second steps "
          f"{fmt(spread([w[1] for w in whole]), '.3f', ' s')} / {fmt(spread([r[1] for r in regional]), '.3f', ' s')}")


if __name__ == "__main__":
    main()
