"""The largest device batch (a halving of --batch) whose training step fits this GPU, for a probe-shaped
model (model/memory_fit.py estimates the step's peak). The GPU recipes in bench/gpu/ ask this before they
start, so a recipe written for a 141 GB H200 runs on an 80 GB H100 too.

    python -m bench.fit_batch --depth 20 --seq-len 2048 --vocab 65536 --batch 32     # prints 16 on an H100
Off a GPU it prints --batch unchanged (nothing to measure).
"""
from __future__ import annotations

import argparse

import torch

from model.gpt import GPT
from model.memory_fit import Shape, available, fit_batch
from model.precision.probe import model_config


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fit_batch", description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--vocab", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True, help="the batch wanted; the largest halving that fits is printed")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(a.batch)
        return
    with torch.device("meta"):  # the shape only: no memory
        shape = Shape.of(GPT(model_config(a.depth, a.seq_len, a.vocab)))
    free, card = available(torch.device(a.device))
    fits = fit_batch(a.batch, shape, free)
    if fits is None:
        raise SystemExit(f"depth {a.depth}, seq {a.seq_len}: not even 1 sequence fits {card} (model/memory_fit.py)")
    print(fits)


if __name__ == "__main__":
    main()
