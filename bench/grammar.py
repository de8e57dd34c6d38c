"""Which grammar library makes the engine's token masks: llguidance, xgrammar and outlines-core, on our
own tokenizer, for the schemas structured outputs and tool calls send.

Each library compiles a nested JSON schema for a byte-level BPE tokenizer trained here on Shakespeare's
text (the default profile's size, 2048 ids, and a GPU profile's, 32768), then walks a valid instance of
it token by token: at each token it computes the mask of allowed next ids and accepts the token. Per
round and library: the compile time (ms) and the walk's time a token (us), each the median over
`--rounds` rounds with its range; the ratios are against llguidance in the same round.

    python -m bench.grammar [--rounds 5] [--out bench/results/serving/grammar_libraries.json]
"""
from __future__ import annotations

import argparse
import json
import time

from bench.stats import fmt, ratios, save_json, spread

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
    },
    "required": ["name", "age", "address", "tags"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Juliet Capulet", "age": 13, "address": {"city": "Verona", "zip": "37121"},
            "tags": ["red", "blue", "green", "red"]}


def train_tokenizer(vocab_size: int):
    from model.tokenizer import SparkTokenizer
    from pipeline.sources import _shakespeare_files
    texts = [p.read_text(errors="replace") for p in _shakespeare_files()[:12]]
    return SparkTokenizer.train(texts + [json.dumps(INSTANCE)] * 4, vocab_size)


def _llguidance(tok, eos: int):
    import llguidance
    import llguidance.torch as lt
    info = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
    mask = lt.allocate_token_bitmask(1, tok.vocab_size)

    def compile_():
        m = llguidance.LLMatcher(info, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
        assert not m.is_error(), m.get_error()
        return m

    def step(m, t):
        lt.fill_next_token_bitmask(m, mask, 0)
        assert m.consume_token(t), m.get_error()
    return compile_, step


def _xgrammar(tok, eos: int):
    import xgrammar as xgr
    info = xgr.TokenizerInfo(tok.bytes_table, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    mask = xgr.allocate_token_bitmask(1, tok.vocab_size)

    def compile_():
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))

    def step(m, t):
        m.fill_next_token_bitmask(mask)
        assert m.accept_token(t)
    return compile_, step


def _outlines(tok, eos: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    by_bytes: dict[bytes, list[int]] = {}
    for i, b in enumerate(tok.bytes_table):
        if i != eos and b and i not in tok.special_ids:
            by_bytes.setdefault(b, []).append(i)
    vocab = Vocabulary(eos, by_bytes)

    def compile_():
        return Guide(Index(build_regex_from_schema(json.dumps(SCHEMA)), vocab))

    def step(g, t):
        assert t in g.get_tokens()
        g.advance(t)
    return compile_, step


LIBRARIES = {"llguidance": _llguidance, "xgrammar": _xgrammar, "outlines-core": _outlines}


def measure(vocab_size: int, rounds: int) -> dict:
    tok = train_tokenizer(vocab_size)
    eos = tok.special["<|assistant_end|>"]
    ids = tok.encode(json.dumps(INSTANCE)) + [eos]
    out = {"vocab_size": tok.vocab_size, "instance_tokens": len(ids), "libraries": {}}
    libs = {name: make(tok, eos) for name, make in LIBRARIES.items()}
    compile_ms = {name: [] for name in libs}
    token_us = {name: [] for name in libs}
    for _ in range(rounds):
        for name, (compile_, step) in libs.items():  # alternated within a round
            t = time.perf_counter()
            m = compile_()
            compile_ms[name].append((time.perf_counter() - t) * 1e3)
            t = time.perf_counter()
            for i in ids[:-1]:
                step(m, i)
            token_us[name].append((time.perf_counter() - t) * 1e6 / (len(ids) - 1))
    for name in libs:
        out["libraries"][name] = {
            "compile_ms": spread(compile_ms[name]), "mask_and_accept_us_per_token": spread(token_us[name]),
            "compile_vs_llguidance": spread(ratios(compile_ms[name], compile_ms["llguidance"])),
            "token_vs_llguidance": spread(ratios(token_us[name], token_us["llguidance"]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vocab", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from importlib.metadata import version
    res = {"schema": SCHEMA, "rounds": args.rounds,
           "versions": {name: version(name) for name in ("llguidance", "xgrammar", "outlines-core")},
           "by_vocab": [measure(v, args.rounds) for v in args.vocab]}
    for r in res["by_vocab"]:
        print(f"vocab {r['vocab_size']}, {r['instance_tokens']} tokens:")
        for name, v in r["libraries"].items():
            print(f"  {name:14s} compile {fmt(v['compile_ms'], '.2f', ' ms')}  a token "
                  f"{fmt(v['mask_and_accept_us_per_token'], '.1f', ' us')}  "
                  f"(vs llguidance: compile {fmt(v['compile_vs_llguidance'], '.2f', 'x')}, "
                  f"token {fmt(v['token_vs_llguidance'], '.2f', 'x')})")
    save_json(res, args.out)


if __name__ == "__main__":
    main()
