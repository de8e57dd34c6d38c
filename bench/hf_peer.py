"""The engine a user would run instead, at one stream: Hugging Face transformers' `generate` on the same
weights, alternated with sparkchat's engine in one process.

The weights go through `model.hf.save_hf_dir` (what `sparkchat export` writes) and load as transformers'
`NanoChatForCausalLM` in the engine's dtype (bf16 on a GPU). Variants (`VARIANTS`):
  plain           `generate` as it comes (its dynamic cache, never compiled)
  static          `cache_implementation="static"`, `disable_compile=True`: the static cache uncompiled
  static_compiled `cache_implementation="static"` with transformers' own compile of the decoding
                  forward, which `generate` turns on by itself for a static cache on a GPU only
Each round times one greedy reply of `new` ids (min_new_tokens = max_new_tokens, so no end token cuts
it short) after the same prompt for each variant and for sparkchat's engine (model.engine.Engine, no
stop ids, so also exactly `new` ids), first token included; a warm-up reply of each comes first
(compiles, CUDA graphs). `over_transformers`: sparkchat's tokens/s over the best variant's (the one
with the highest median), per round, median and range (bench/stats.py).

    python -m bench.hf_peer --device cpu --depth 2 --new 16 --rounds 3   # a smoke run
    bench/serve_client.py --peer runs it inside the client benchmark's call, on the same weights.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.provenance import run_id
from bench.stats import fmt, save_json, spread

VARIANTS = ("plain", "static", "static_compiled")


def hf_model(model, tok, gen: dict, folder: Path, dtype: torch.dtype):
    """`model`'s weights as transformers' NanoChatForCausalLM (through the export's writer), in eval mode."""
    from transformers import AutoModelForCausalLM

    from model.hf import save_hf_dir
    save_hf_dir(folder, model.float(), tok, gen)
    device = next(model.parameters()).device
    return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()


class HfRunner:
    """One variant's greedy replies, timed."""

    def __init__(self, hf, variant: str):
        if variant not in VARIANTS:
            raise ValueError(f"transformers variant must be one of {', '.join(VARIANTS)}; got {variant!r}")
        if variant == "static_compiled" and next(hf.parameters()).device.type != "cuda":
            raise ValueError("static_compiled: transformers compiles generate's forward on a GPU only")
        self.hf, self.variant = hf, variant
        self.kw = {"plain": {}, "static": {"cache_implementation": "static", "disable_compile": True},
                   "static_compiled": {"cache_implementation": "static", "disable_compile": False}}[variant]

    @torch.inference_mode()
    def reply(self, prompt: list[int], new: int) -> list[int]:
        ids = torch.tensor([prompt], device=next(self.hf.parameters()).device)
        out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                               min_new_tokens=new, pad_token_id=0, **self.kw)
        return out[0, len(prompt):].tolist()


def timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def measure(model, tok, gen: dict, prompt: list[int], new: int, rounds: int, variants: list[str]) -> dict:
    """`rounds` rounds, each sparkchat's engine then every variant, one reply of `new` ids each; per side
    its tokens/s rounds and summary, and over_transformers against the best variant."""
    from model.engine import Engine, EngineConfig
    from model.requests import SamplingParams
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_model(model, tok, gen, Path(tmp) / "hf", dtype)
    model.to(dtype)  # hf_model exported it in fp32
    runners = {v: HfRunner(hf, v) for v in variants}
    engine = Engine(model, EngineConfig(max_batch=1)).start()
    greedy = SamplingParams(temperature=0.0, max_tokens=new)
    sides = {"sparkchat": lambda: engine.generate(prompt, greedy),
             **{f"transformers_{v}": (lambda r=r: r.reply(prompt, new)) for v, r in runners.items()}}
    tps: dict[str, list[float]] = {k: [] for k in sides}
    try:
        for fn in sides.values():  # warm-up: compiles and graphs
            fn()
        same = engine.generate(prompt, greedy)[0] == runners[variants[0]].reply(prompt, new)
        for r in range(rounds):
            for name, fn in sides.items():
                tps[name].append(new / timed(fn, device))
            print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1]:,.1f} tok/s" for k, v in tps.items()), flush=True)
    finally:
        engine.shutdown()
    best = max((k for k in tps if k != "sparkchat"), key=lambda k: statistics.median(tps[k]))
    out = {"new_tokens": new, "prompt_tokens": len(prompt), "rounds": rounds, "best_variant": best,
           "greedy_ids_equal_first_variant": same,
           **{f"{k}_tokens_per_s": spread(v, 2) for k, v in tps.items()},
           "over_transformers": spread([a / b for a, b in zip(tps["sparkchat"], tps[best])]),
           "rounds_tokens_per_s": tps}
    print(f"sparkchat {fmt(out['sparkchat_tokens_per_s'], ',.1f')} tok/s at one stream, "
          f"{fmt(out['over_transformers'], '.2f', 'x')} transformers' best ({best}: "
          f"{fmt(out[best + '_tokens_per_s'], ',.1f')} tok/s)", flush=True)
    return out


def main(argv=None) -> dict:
    from bench.serve_gpu import d_model
    from bench.text_model import GENERATION, text_tokenizer
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--vocab", type=int, help="default: 65536 on cuda, 2048 on cpu")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--new", type=int, default=128, help="ids a reply (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="(default: %(default)s)")
    ap.add_argument("--variants", help=f"comma-separated, of {', '.join(VARIANTS)} (default: all on cuda, the "
                                       f"first two on cpu)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    variants = args.variants.split(",") if args.variants else list(VARIANTS if device.type == "cuda" else VARIANTS[:2])
    vocab = args.vocab or (65536 if device.type == "cuda" else 2048)
    tok = text_tokenizer(vocab)
    model = d_model(args.depth, vocab, device)
    from model.chat import render
    prompt = render(tok, [{"role": "user", "content": "Tell me about the sea."}], for_completion=True)[0]
    res = {"command": "python -m bench.hf_peer " + " ".join(argv or __import__("sys").argv[1:]),
           "commit": run_id(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "depth": args.depth, "vocab": vocab,
           **measure(model, tok, {**GENERATION, "max_tokens": args.new}, prompt, args.new, args.rounds, variants)}
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
