"""Where one decode step's GPU time goes: the engine's captured step, part by part, and its kernels.

For a random model of the `h200` shape (bench/serve_gpu.py's `d_model`), captures the engine's own
decode step (`DecodeGraphs`) at a few batch sizes and times its replay with CUDA events, beside graphs
of the same step with one part left out: the sampling (forward only) and the attention (a stand-in of
the same shape that reads no cache), with the whole forward compiled as one instead of block by
block, with the cache read by SDPA's masked kernel over every slot of the bucket instead of
FlexAttention (the engine's attention before bench/results/h200-flex-2026-12-04), with
FlexAttention's own tile sizes instead of `gpt.FLEX_DECODE_OPTIONS`, and with its general kernel
where it would pick its decoding one (one row). Differences give each part's time. Then lists the
kernels of one replay (torch.profiler), and the weight-read bound of bench/serve_gpu.py.

    python -m bench.decode_step [--rows 1,128] [--slots 256] [--variants step,...] [--out bench/results/x.json]
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics

import torch

from bench.serve_gpu import copy_bandwidth, d_model, save
from model import decode_graphs, gpt
from model.engine import Engine, EngineConfig
from model.sampling import RANKED_K, TEMPERATURE, TOP_K, TOP_P, UNIFORM


def replay_ms(graph, reps: int = 5, n: int = 50, before=None) -> float:
    """Median time of one replay: `n` replays back to back, `reps` times, each after `before()`."""
    times = []
    for _ in range(reps):
        if before is not None:
            before()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / n)
    return statistics.median(times)


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def no_sampling(logits, *args, **kwargs):
    """The forward alone: the step's output is the logits' argmax (one small kernel)."""
    return logits.argmax(dim=-1)


def cacheless_attention(self, x, cos, sin, cache, positions, mask=None):
    """The attention layer with the same projections and no cache read or write: q stands in for y."""
    B, T, _ = x.shape
    q, k, v = self.c_qkv(x).split(self.qkv_rows, dim=-1)
    return self.c_proj(q + k + v)


def kernels(graph, lengths: torch.Tensor, start: int, n: int = 10) -> list[dict]:
    """The kernels of one replay (mean of n), longest first."""
    lengths.fill_(start)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            graph.replay()
        torch.cuda.synchronize()
    per = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            p = per[ev.name]
            p[0] += 1
            p[1] += ev.device_time_total
    rows = [{"kernel": k[:110], "count": c / n, "us": round(t / n, 2)} for k, (c, t) in per.items()]
    return sorted(rows, key=lambda r: -r["us"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--rows", default="1,128", help="batch sizes (default: %(default)s)")
    ap.add_argument("--slots", type=int, default=256, help="cache slots attended (default: %(default)s)")
    ap.add_argument("--variants", help="comma-separated names of the variants to run (default: all)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/decode_step.py needs a CUDA GPU")
    dev = torch.device("cuda")
    model = d_model(args.depth, args.vocab, dev)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("wte"))
    bound_ms = 1000 * weight_bytes / copy_bandwidth(dev)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "depth": args.depth,
           "slots": args.slots, "weight_read_bound_ms": round(bound_ms, 4), "rows": {}}
    print(f"{res['device']}, d{args.depth}: weight-read bound {bound_ms:.3f} ms a step", flush=True)
    start = args.slots // 2  # rows hold this many tokens: a replay's writes stay within the slots

    def whole_model(engine):  # one compile of the whole forward (the blocks' compiles inlined in it)
        engine.model.compile(dynamic=True)

    def sdpa_attention(engine):  # SDPA's masked kernel (memory-efficient: the engine keeps cuDNN's off)
        engine.cache.flex = engine.graphs.scratch.flex = False

    # name -> (patches applied before the engine is built, a change to the built engine)
    variants = {"step": ([], None),
                "forward only": ([(decode_graphs, "sample", no_sampling)], None),
                "no attention": ([(gpt.Attention, "forward", cacheless_attention)], None),
                "whole model compiled": ([], whole_model),
                "sdpa attention": ([], sdpa_attention),
                "flex default tiles": ([(gpt, "FLEX_DECODE_OPTIONS", None)], None),
                # one row (a batch size fixed at compile time) otherwise takes the decoding kernel
                "flex general kernel": ([(gpt, "FLEX_DECODE_OPTIONS",
                                          {**gpt.FLEX_DECODE_OPTIONS, "FORCE_USE_FLEX_ATTENTION": True})], None)}
    if args.variants:
        variants = {k: v for k, v in variants.items() if k in args.variants.split(",")}
    rows_list = [int(r) for r in args.rows.split(",")]
    with torch.inference_mode():
        for name, (patches, change) in variants.items():
            torch._dynamo.reset()
            for m in (model, *model.blocks):  # the compiles an earlier variant left on the model
                m._compiled_call_impl = None
            model.__dict__.pop("head", None)
            with contextlib.ExitStack() as stack:
                for obj, attr, value in patches:
                    stack.enter_context(patched(obj, attr, value))
                engine = Engine(model, EngineConfig(max_batch=max(rows_list)))
                if change is not None:
                    change(engine)
                s, lengths = engine.graphs.settings, engine.cache.lengths
                s[:, TEMPERATURE], s[:, TOP_K], s[:, TOP_P], s[:, UNIFORM] = 1.0, 50, 1.0, 0.5
                for rows in rows_list:
                    try:
                        graph = engine.graphs._capture(rows, args.slots, RANKED_K, False)[0]
                    except Exception as e:  # a candidate that does not compile or capture: say so, go on
                        print(f"{rows:4d} rows, {name}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                        continue
                    ms = replay_ms(graph, before=lambda: lengths.fill_(start))  # a replay adds one token a row
                    r = res["rows"].setdefault(str(rows), {})
                    r[name] = {"ms": round(ms, 4)}
                    if name == "step":
                        r["kernels"] = kernels(graph, lengths, start)
                        r[name]["kernels_per_step"] = sum(k["count"] for k in r["kernels"])
                        r[name]["kernel_us_sum"] = round(sum(k["us"] for k in r["kernels"]), 1)
                    print(f"{rows:4d} rows, {name:14s}: {ms:.4f} ms a replay "
                          f"({bound_ms / ms:.1%} of the bound)", flush=True)
                del engine
    for rows, r in res["rows"].items():
        if not {"step", "forward only", "no attention"} <= r.keys():
            continue
        step = r["step"]["ms"]
        r["sampling_ms"] = round(step - r["forward only"]["ms"], 4)
        r["attention_ms"] = round(step - r["no attention"]["ms"], 4)
        print(f"\n{rows} rows: step {step:.4f} ms = sampling {r['sampling_ms']:.4f} + attention "
              f"{r['attention_ms']:.4f} + the rest; {r['step']['kernels_per_step']:.0f} kernels, "
              f"{r['step']['kernel_us_sum']:.0f} us of kernel time", flush=True)
        for k in r["kernels"][:25]:
            print(f"  {k['us']:8.2f} us  x{k['count']:5.1f}  {k['kernel']}", flush=True)
    save(res, args.out)
    return res


if __name__ == "__main__":
    main()
