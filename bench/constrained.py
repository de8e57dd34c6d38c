"""What one constrained row costs the unconstrained rows beside it, in the engine on this device.

A random model of the default profile's shape (d4: 4 layers, 128 wide, 4 heads of 32, 2 KV heads, a
context of 128; random weights, its head's rows of the stop ids zero, so rows run to their length) over a
2048-id tokenizer trained on Shakespeare (bench.grammar.train_tokenizer), through
model.chat_engine as the server builds it. Each round runs, back to back and submitted at once:

  - `plain16`: 16 unconstrained rows (temperature 1, top-k 50, seeded, --new tokens each);
  - `mixed`: the same 16 and one row constrained to a JSON array of at least 50 digits (its mask is
    computed every step it runs; it ends by length, so it runs as long as they do);
  - `plain17`: the same 16 and a 17th unconstrained row of the same length (the extra row's own cost,
    without a grammar).

Per case, the unconstrained 16 rows' tokens/s (their tokens over the time until the last of them ended).
Then, less exposed to a shared machine's swings (`mask_share`): one constrained row's mask a token against
a 17-row decode forward, each timed back to back in the same round.
Reported: each case's median (min-max) over --rounds rounds, and per round the ratios mixed / plain16
(what the issue asks: within 5%) and mixed / plain17 (the grammar's own cost).

    python -m bench.constrained [--rounds 3] [--new 100] [--out bench/results/serving/constrained_row_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from bench.stats import fmt, ratios, save_json, spread

ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 50}


def build(device: str):
    from bench.grammar import train_tokenizer
    from model.chat_engine import chat_engine
    from model.gpt import GPT, GPTConfig
    tok = train_tokenizer(2048)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=4, n_embd=128, n_head=4, n_kv_head=2, seq_len=128))
    model.init_weights(seed=0)
    with torch.no_grad():  # peaked random logits (init_weights leaves the head near zero); stop ids rarely in the top 50
        model.lm_head.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(1))
        for name in ("<|assistant_end|>", "<|bos|>"):
            model.lm_head.weight[tok.special[name]].fill_(0.0)
    model = model.to(device).eval()
    return tok, chat_engine(model, tok, {"tool_use": False}, max_batch=32)


def run(engine, jobs) -> float:
    """Submit every (prompt, params) at once; the tokens/s of the jobs without a grammar."""
    from model.requests import Finished, Token
    plain = [i for i, (_, p) in enumerate(jobs) if p.grammar is None]
    counts, ends, left = [0] * len(jobs), [0.0] * len(jobs), threading.Semaphore(0)

    def sink(ev, i):
        if isinstance(ev, Token):
            counts[i] += 1
        elif isinstance(ev, Finished):
            ends[i] = time.perf_counter()
            left.release()

    t0 = time.perf_counter()
    engine.submit_all([(ids, p, lambda ev, i=i: sink(ev, i)) for i, (ids, p) in enumerate(jobs)])
    for _ in jobs:
        left.acquire()
    return sum(counts[i] for i in plain) / (max(ends[i] for i in plain) - t0)


def mask_share(engine, tok, rounds: int, steps: int = 100) -> dict:
    """Per round: the host time of one constrained row's mask a token (model.grammar.mask_rows, then the
    token accepted, along a valid walk of ARRAY) over the time of one 17-row decode forward (cache at 60
    tokens), each the median of `steps` calls, back to back; their ratio is what a constrained row adds
    to a CPU step, measured without other rows' timing in it."""
    import statistics

    from model.gpt import KVCache
    from model.grammar import json_grammar, mask_rows
    model = engine.model
    walk = tok.encode("[" + ",".join(str(i % 10) for i in range(60)) + "]")[:steps]
    x = torch.zeros((17, 1), dtype=torch.long)
    shares, mask_us, step_us = [], [], []
    with torch.inference_mode():
        for _ in range(rounds):
            c = engine.grammars(json_grammar(ARRAY))
            logits = torch.randn(17, model.config.vocab_size)
            times = []
            for i in walk:
                t = time.perf_counter()
                mask_rows(logits, [(16, c)])
                c.accept(i)
                times.append(time.perf_counter() - t)
            cache = KVCache(model.config, 17, 128, "cpu", torch.float32)
            cache.lengths.fill_(60)
            fwd = []
            for _ in range(len(walk)):
                t = time.perf_counter()
                model(x, kv_cache=cache.view(0, 17), kv_len=61)
                fwd.append(time.perf_counter() - t)
                cache.lengths.fill_(60)
            m, f = statistics.median(times), statistics.median(fwd)
            mask_us.append(m * 1e6)
            step_us.append(f * 1e6)
            shares.append(m / f)
    return {"mask_us": spread(mask_us), "forward17_us": spread(step_us), "mask_over_forward": spread(shares)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=100)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from model.grammar import json_grammar
    from model.requests import SamplingParams
    tok, engine = build(args.device)
    prompt = [tok.bos_id] + tok.encode("Give me a list of digits, please.")

    def params(seed, grammar=None):
        return SamplingParams(temperature=1.0, top_k=50, max_tokens=args.new, seed=seed, grammar=grammar)
    plain16 = [(prompt, params(s)) for s in range(16)]
    cases = {"plain16": plain16, "mixed": plain16 + [(prompt, params(99, json_grammar(ARRAY)))],
             "plain17": plain16 + [(prompt, params(99))]}
    run(engine, plain16)  # warm-up
    rates = {k: [] for k in cases}
    for _ in range(args.rounds):
        for name, jobs in cases.items():
            rates[name].append(run(engine, jobs))
    share = mask_share(engine, tok, args.rounds)
    engine.shutdown()
    res = {"mask_share": share, "device": args.device, "new_tokens": args.new, "rounds": args.rounds, "schema": ARRAY,
           "unconstrained_tokens_per_s": {k: spread(v) for k, v in rates.items()},
           "mixed_vs_plain16": spread(ratios(rates["mixed"], rates["plain16"])),
           "mixed_vs_plain17": spread(ratios(rates["mixed"], rates["plain17"]))}
    for k, v in res["unconstrained_tokens_per_s"].items():
        print(f"{k:8s} the 16 unconstrained rows: {fmt(v, ',.0f', ' tok/s')}")
    print(f"one row's mask a token {fmt(share['mask_us'], '.1f', ' us')}, a 17-row forward "
          f"{fmt(share['forward17_us'], ',.0f', ' us')}: {fmt(share['mask_over_forward'], '.4f')} of it")
    print(f"mixed / plain16 {fmt(res['mixed_vs_plain16'], '.3f')}   mixed / plain17 {fmt(res['mixed_vs_plain17'], '.3f')}")
    save_json(res, args.out)
    print(json.dumps(res["mixed_vs_plain16"]))


if __name__ == "__main__":
    main()
