"""Decode speed on a GPU: the engine alone and the whole HTTP server, at 1, 16, 64 and 128 streams.

A random model of the `h200` profile's shape (d20: width 1280, 10 heads of 128, vocab 65,536; bf16)
serves every stream a 64-token prompt and 128 new tokens. For each level it prints tokens/s, time per
decode step, the median time to first token, and the ratio to the weight-read bound: a decode step
must read every weight once (the embedding table aside), so at the device's copy bandwidth, measured
in the same run, one step cannot take less than bytes / bandwidth. Also: TTFT of one 512-token prompt
at idle, and the engine with CUDA graphs off (the eager path) as the reference.

    python -m bench.serve_gpu [--depth 20] [--levels 1,16,64,128] [--http] [--out bench/results/x.json]

On a CPU (`--device cpu`, fp32, no bound, no graphs), a small model (`--depth 2 --vocab 2048`) makes
the engine fast enough that the server's own per-token work weighs on the HTTP rate, measured where it
can be profiled.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from model.engine import Engine, EngineConfig, Finished, SamplingParams, Token
from model.gpt import GPT, GPTConfig



def d_model(depth: int, vocab: int, device: torch.device) -> GPT:
    width = 64 * depth
    cfg = GPTConfig(vocab_size=vocab, n_layer=depth, n_embd=width, n_head=width // 128, n_kv_head=width // 128,
                    seq_len=2048)
    with torch.device(device):
        model = GPT(cfg)
    model.init_weights(seed=0)
    g = torch.Generator(device="cpu").manual_seed(1)
    with torch.no_grad():  # non-zero residual outputs, so every layer's work matters
        for block in model.blocks:
            for lin in (block.attn.c_proj, block.mlp.c_proj):
                lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.02)
    return model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()


def copy_bandwidth(device) -> float:
    """Bytes per second of a large device-to-device copy (read + write)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * 10 / (time.perf_counter() - t)


def run_streams(engine: Engine, prompts: list[list[int]], new: int) -> dict:
    """Submit every prompt at once; time until the last finishes, each one's first token, and the time
    per output token after the first (TPOT: a decode step's time as one stream sees it)."""
    first: list[float] = [0.0] * len(prompts)
    last: list[float] = [0.0] * len(prompts)
    tokens = [0] * len(prompts)
    done = threading.Semaphore(0)
    t0 = time.perf_counter()
    for i, ids in enumerate(prompts):
        def sink(ev, i=i):
            if isinstance(ev, Token):
                last[i] = time.perf_counter() - t0
                if tokens[i] == 0:
                    first[i] = last[i]
                tokens[i] += 1
            elif isinstance(ev, Finished):
                done.release()
        engine.submit(ids, SamplingParams(temperature=1.0, top_k=50, max_tokens=new, seed=i), sink)
    for _ in prompts:
        done.acquire()
    secs = time.perf_counter() - t0
    tpot = [(b - a) / (n - 1) for a, b, n in zip(first, last, tokens) if n > 1]
    return {"tokens": sum(tokens), "seconds": secs, "tokens_per_s": sum(tokens) / secs,
            "ttft_ms_median": 1000 * statistics.median(first),
            "tpot_ms_median": 1000 * statistics.median(tpot) if tpot else None}


def engine_levels(model, levels, prompt_len, new, graphs: bool, vocab: int) -> dict:
    engine = Engine(model, EngineConfig(max_batch=max(levels), max_queue=1024, cuda_graphs=graphs)).start()
    g = torch.Generator().manual_seed(0)
    out = {}
    try:
        for n in levels:
            prompts = torch.randint(0, vocab, (n, prompt_len), generator=g).tolist()
            run_streams(engine, prompts, new)  # warm-up: captures this level's graphs
            steps, cpu = engine.steps, engine.cpu_seconds
            r = run_streams(engine, prompts, new)
            r["ms_per_step"] = 1000 * r["seconds"] / new
            r.update(host_share(r["tokens"], engine.steps - steps, engine.cpu_seconds - cpu, r["seconds"]))
            out[n] = r
        long = torch.randint(0, vocab, (1, 512), generator=g).tolist()
        ttft = [run_streams(engine, long, 1)["ttft_ms_median"] for _ in range(5)]
        out["ttft_512_ms"] = statistics.median(ttft)
    finally:
        engine.shutdown()
    return out


CHAT_PROMPTS = ["What is 37 + 58?", "Spell the word 'garden'.", "How many r's are in 'strawberry'?",
                "What is the capital of France?", "Hello! Who are you?", "What is 12 * 7?",
                "Which is largest: 12, 85, 33 or 41?", "Tell me about the sea.", "What is 100 - 37?",
                "Write a short poem about the moon."]


def greedy_agreement(model, prompts: list[list[int]], new: int = 32) -> dict:
    """Greedy ids of the graph path (all prompts at once, steps launched ahead) against the plain eager
    path (one prompt at a time, each step read back before the next)."""
    n_prompts = len(prompts)
    params = SamplingParams(temperature=0.0, max_tokens=new)
    eager = Engine(model, EngineConfig(max_batch=16, cuda_graphs=False, run_ahead=False, prefill_chunk=10_000)).start()
    try:
        want = [eager.generate(p, params)[0] for p in prompts]
    finally:
        eager.shutdown()
    fast = Engine(model, EngineConfig(max_batch=16)).start()
    try:
        box: dict[int, list[int]] = {}
        threads = [threading.Thread(target=lambda i, p: box.__setitem__(i, fast.generate(p, params)[0]), args=(i, p))
                   for i, p in enumerate(prompts)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        fast.shutdown()
    same = sum(box[i] == w for i, w in enumerate(want))
    return {"prompts": n_prompts, "identical": same,
            "first_difference": [next((k for k, (a, b) in enumerate(zip(box[i], w)) if a != b), None)
                                 for i, w in enumerate(want)]}


def host_share(tokens: int, steps: int, engine_cpu_s: float, seconds: float) -> dict:
    """Tokens per decode step (the mean batch) and the share of the time the engine's scheduler thread
    was on a CPU (near 1: the host, not the device, sets the pace)."""
    return {"tokens_per_step": round(tokens / max(steps, 1), 1), "engine_cpu_share": round(engine_cpu_s / seconds, 3)}


def scrape(base: str) -> dict[str, float]:
    """The server's Prometheus metrics, name -> value (unlabelled ones)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base + "/metrics", timeout=10).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if not s.labels}


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds a thread of another process has used (Linux /proc), waits for the GIL excluded."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def http_levels(model_dir: Path, levels, new: int, device: str, procs: int | None, switch_interval: float | None,
                min_seconds: float = 4.0) -> dict:
    """The same levels through the server in a separate process (the API alone: the chat page adds
    nothing to a request's path) and the OpenAI streaming API for at least `min_seconds` a level, the
    streams spread over client processes (`procs`, or bench.serve.client_processes), each running
    rounds of its share at once (the processes' rounds drift apart). Also the CPU time the server's
    event loop thread (its main thread: HTTP, SSE, detokenizing) spends per generated token, and the
    clients' own. `switch_interval`: the server's `sys.setswitchinterval`, how long the loop thread may
    keep the GIL from the engine's thread (Python's default: 5 ms)."""
    from bench.serve import client_processes, rounds_in_processes, running_server
    # a launcher rather than `python -m serve`: the API without the chat page (which needs gradio)
    launch = ("import sys, uvicorn; from serve.api import Settings, create_app; "
              "sys.setswitchinterval(float(sys.argv[4])) if sys.argv[4] != 'default' else None; "
              "uvicorn.run(create_app(Settings(model_dir=sys.argv[1], device=sys.argv[3], max_batch=int(sys.argv[2]), "
              "max_queue=1024, ui=False)), host='127.0.0.1', port=int(sys.argv[6]), log_level='warning')")
    out = {}
    switch = "default" if switch_interval is None else str(switch_interval)
    with running_server(["-c", launch, str(model_dir), str(max(levels)), device, switch], timeout=300) as (base, pid):
        for n in levels:
            r = rounds_in_processes(base + "/v1/chat/completions", n, new, min_seconds, procs or client_processes(n),
                                    lambda: (scrape(base), thread_cpu_s(pid, pid)))
            (before, cpu), tokens, secs = r.at_start, r.tokens, r.seconds
            cpu, after = thread_cpu_s(pid, pid) - cpu, scrape(base)
            steps, engine_cpu = (after[k] - before[k]
                                 for k in ("sparkchat_decode_steps", "sparkchat_engine_cpu_seconds"))
            out[n] = {"tokens": tokens, "seconds": secs, "tokens_per_s": tokens / secs,
                      "loop_cpu_us_per_token": round(1e6 * cpu / tokens, 1), "client_processes": r.processes,
                      "client_cpu_us_per_token": round(1e6 * r.client_cpu_s / tokens, 1),
                      "busiest_client_cpu_share": round(r.busiest_cpu_share, 3),
                      **host_share(tokens, int(steps), engine_cpu, secs)}
    return out


def positive(kind):
    """An argparse type: a number of `kind` above zero."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value
    return parse


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=20, help="model depth, nanochat's dial (default: %(default)s)")
    ap.add_argument("--vocab", type=int, default=65536, help="vocabulary (default: %(default)s)")
    ap.add_argument("--levels", default="1,16,64,128", help="concurrent streams (default: %(default)s)")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens per stream (default: %(default)s)")
    ap.add_argument("--new", type=int, default=128, help="new tokens per stream (default: %(default)s)")
    ap.add_argument("--http", action="store_true", help="also through the HTTP server")
    ap.add_argument("--eager", action="store_true", help="also the engine without CUDA graphs")
    ap.add_argument("--trained", help="a trained model directory: its greedy ids, graphs against eager")
    ap.add_argument("--agreement-only", action="store_true", help="with --trained: only that comparison")
    ap.add_argument("--switch-interval", type=positive(float),
                    help="the server's sys.setswitchinterval in seconds (default: Python's)")
    ap.add_argument("--client-procs", type=positive(int),
                    help="HTTP client processes, at most one a stream (default: bench.serve.client_processes)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the HTTP path's overhead with a small model (default: %(default)s)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/serve_gpu.py needs a CUDA GPU (or --device cpu)")
    levels = [int(x) for x in args.levels.split(",")]
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    res: dict = {"device": torch.cuda.get_device_name() if gpu else f"cpu ({torch.get_num_threads()} threads)",
                 "torch": torch.__version__}
    if args.trained:  # a trained model's logits are peaked: greedy ids are not decided by rounding
        from model.chat import render
        from model.model_dir import load_model_dir
        trained, tok, _ = load_model_dir(args.trained, device, torch.bfloat16)
        prompts = [render(tok, [{"role": "user", "content": q}], for_completion=True)[0] for q in CHAT_PROMPTS]
        res["greedy_vs_eager_trained"] = greedy_agreement(trained, prompts)
        print(f"greedy ids of {args.trained}, graphs vs eager: {res['greedy_vs_eager_trained']}", flush=True)
        del trained
        if args.agreement_only:
            save(res, args.out)
            return res
    model = d_model(args.depth, args.vocab, device)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("wte"))
    res.update({"depth": args.depth, "params": model.num_params(), "weight_bytes_read_per_step": weight_bytes,
                "prompt_tokens": args.prompt, "new_tokens": args.new})
    bound_ms = None
    if gpu:
        bw = copy_bandwidth(device)
        bound_ms = 1000 * weight_bytes / bw
        res.update({"copy_bandwidth_GBps": round(bw / 1e9, 1), "weight_read_bound_ms_per_step": round(bound_ms, 4)})
        print(f"{res['device']}: d{args.depth}, {res['params'] / 1e6:.0f}M params, {weight_bytes / 1e9:.2f} GB read "
              f"per step, copy {bw / 1e12:.2f} TB/s -> bound {bound_ms:.3f} ms per step", flush=True)
        t = time.perf_counter()
        engine = Engine(model, EngineConfig(max_batch=max(levels))).start()
        engine.shutdown()
        res["warmup_s"] = round(time.perf_counter() - t, 1)
        res["sampler_eager_for_k_max"] = sorted(engine.graphs.eager_k)  # compile failed for these (warned)
        print(f"engine start with compile and graph capture (max_batch {max(levels)}): {res['warmup_s']} s; "
              f"sampler uncompiled for k_max {res['sampler_eager_for_k_max'] or 'none'}", flush=True)
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, args.vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(4, 600, (10,), generator=g)]
        res["greedy_vs_eager_random"] = greedy_agreement(model, prompts)
        print(f"greedy ids of the random d{args.depth}, graphs vs eager (near-ties: its logits are almost flat): "
              f"{res['greedy_vs_eager_random']}", flush=True)
    else:
        print(f"{res['device']}: d{args.depth}, {res['params'] / 1e6:.2f}M params, fp32", flush=True)
    # on a CPU there are no graphs: the one variant is the engine as the server runs it there
    variants = [("graphs", True)] + ([("eager", False)] if args.eager else []) if gpu else [("cpu", False)]
    for name, graphs in variants:
        r = engine_levels(model, levels, args.prompt, args.new, graphs, args.vocab)
        res[f"engine_{name}"] = r
        for n in levels:
            x = r[n]
            of_bound = ""
            if bound_ms:
                x["of_bound"] = round(x["tokens_per_s"] / (n * 1000 / bound_ms), 4)
                of_bound = f", {x['of_bound']:.1%} of the weight-read bound"
            print(f"engine ({name}) {n:4d} streams: {x['tokens_per_s']:9.0f} tok/s, {x['ms_per_step']:6.2f} ms/step, "
                  f"TTFT {x['ttft_ms_median']:7.1f} ms, TPOT {x['tpot_ms_median']:.3f} ms "
                  f"({n * 1000 / x['tpot_ms_median']:.0f} tok/s after the first){of_bound}; "
                  f"{x['tokens_per_step']} tokens a step, scheduler on a CPU {x['engine_cpu_share']:.0%}", flush=True)
        print(f"engine ({name}) TTFT of a 512-token prompt at idle: {r['ttft_512_ms']:.1f} ms", flush=True)
        save(res, args.out)
    if args.http:
        from model.model_dir import save_model_dir
        from model.tokenizer import SparkTokenizer
        texts = [f.read_text(errors="ignore") for f in sorted(Path(os.__file__).parent.glob("*.py"))[:40]]
        tok = SparkTokenizer.train(texts, vocab_size=2048)  # ids past its vocabulary decode to nothing
        with tempfile.TemporaryDirectory() as tmp:
            save_model_dir(Path(tmp) / "m", model.float(), tok, {"temperature": 1.0, "top_k": 50,
                                                                 "max_tokens": args.new, "tool_use": False})
            model.to(torch.bfloat16 if gpu else torch.float32)
            r = http_levels(Path(tmp) / "m", levels, args.new, args.device, args.client_procs,
                            args.switch_interval)
        res["http"] = r
        res["server_switch_interval_s"] = args.switch_interval or sys.getswitchinterval()  # the same Python's default
        for n in levels:
            e = res[f"engine_{variants[0][0]}"][n]["tokens_per_s"]
            r[n]["of_engine"] = round(r[n]["tokens_per_s"] / e, 4)
            print(f"http {n:4d} streams: {r[n]['tokens_per_s']:9.0f} tok/s ({r[n]['tokens_per_s'] / e:.2f}x the engine "
                  f"alone), the server's loop {r[n]['loop_cpu_us_per_token']} us of CPU a token; clients "
                  f"{r[n]['client_cpu_us_per_token']} us a token over {r[n]['client_processes']} processes (busiest on "
                  f"a CPU {r[n]['busiest_client_cpu_share']:.0%}); "
                  f"{r[n]['tokens_per_step']} tokens a step, scheduler on a CPU {r[n]['engine_cpu_share']:.0%}",
                  flush=True)
    save(res, args.out)
    return res


def save(res: dict, out: str | None) -> None:
    """Written after each part, so a later part that fails loses nothing."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
