"""Decode speed: the engine alone and the whole HTTP server as a user runs it, at 1, 16, 64 and 128 streams.

A random model (`--depth`, nanochat's dial: width 64 * depth, heads of 128; the default d20 is the
`h200` profile's shape, bf16 on a GPU, fp32 on a CPU) with a byte-level BPE tokenizer trained to exactly
its vocabulary on real text (bench/text_model.py), so every id it samples decodes to text and the
server streams real text. Every stream sends one of the benchmark client's chat questions (rendered as
the server renders it) and asks for `--new` tokens at temperature 1, top-k 50, seeded.

Each round measures every level twice, back to back: the engine alone, in this process
(model.chat_engine, as the server builds it, over the same prompts and sampling), then, with `--http`,
the server, started once as its own process tree (`python -m serve --model DIR`) and driven through
`/v1/chat/completions` streams by client processes (bench.serve.rounds_in_processes), each level at
least `--seconds` long. Per level, the median (min-max) over `--rounds` rounds (bench/stats.py) of:

- `tokens_per_s`: completion tokens (the usage chunks') per second of the level's window.
- `of_engine`: the HTTP rate / the engine-alone rate of the same round.
- `of_steady_engine`: the HTTP rate / the engine alone under a steady load in the same round
  (steady_round: each stream submitted again the moment it ends, the ends spread over a reply's length,
  so streams start and end every step, one prefill a step: the most spread-out form of a busy server's
  load, whose clients' requests come in clumps and are prefilled together; the engine alone above
  runs each level's streams as batches that start and end together).
- `server_cpu_us_per_token`: (the CPU seconds of every process of the server's tree over the window
  (psutil: user + system of each process, and of its children that exited within it) - the engine's
  step CPU over it (the server's counter `sparkchat_engine_step_cpu_seconds_total`)) / completion tokens
  * 1e6: what the server spends a token beside the engine's steps (HTTP, SSE, detokenizing, handoff).
  A server without that counter gets no such figure (`server_cpu_note` says so), only the tree's
  whole CPU a token (`tree_cpu_us_per_token`, always there). Split, when the server also counts its
  engine process's CPU (`sparkchat_engine_process_cpu_seconds_total`): `engine_host_cpu_us_per_token`,
  the engine process beside its steps (scheduling, the channel), and `frontend_cpu_us_per_token`, every
  other process of the tree (the front ends and the supervisor).
- `text_token_share`: of the completion tokens, those that arrived as text: per response, the tokens
  its content events stand for (bench.text_model.text_tokens: each U+FFFD one lone byte, the rest of
  an event's text encoded again), at most its completion tokens, summed and divided by all completion
  tokens, counted after the timed window. A token that sends no text (a control id the model sampled,
  words after a calculator-call opener, which the chat reader hides) is missing from it. The count is
  an estimate, about 1% high (see text_tokens).
- `tokens_per_event`: completion tokens over the SSE events that carried text (bench.serve.content_events):
  the server pays for each event (its frame, its send, its write) whatever it carries.
- the clients' CPU a token and the busiest client process's share of a CPU (is the client the limit?).

The engine alone also gives TTFT/TPOT, and, on a GPU, the ratio to the weight-read bound (a decode step
must read every weight once, the embedding aside: at the copy bandwidth measured in the same run, a
step cannot take less than bytes / bandwidth), TTFT of one 512-token prompt at idle, and with
`--eager` the engine without CUDA graphs (its own rounds, no HTTP).

    python -m bench.serve_gpu [--depth 20] [--levels 1,16,64,128] [--http] [--out bench/results/x.json]
    python -m bench.serve_gpu --device cpu --depth 2 --http   # the server's host work on a 2-core CPU

On a CPU (fp32, no bound, no graphs) the default vocabulary is 2,048 ids, so the small model's engine
is fast enough that the server's own per-token work weighs on the HTTP rate. There torch runs the
engine alone and the server with one intra-op thread (`--threads`): a second one runs part of every
step outside the engine's thread, where its step counter does not see it, so its CPU (about 90 us a
token at 16 streams on 2 cores) would count as the server's. Current figures: bench/results/serving.md.
"""
from __future__ import annotations

import os

# before torch loads, as serve/__main__.py does for the server: idle OpenMP workers sleep, so the engine
# alone here is measured as the server runs it (spinning workers steal a small machine's cores)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.stats import fmt, save_json, spread  # noqa: E402
from model.engine import PHASES, Engine, EngineConfig  # noqa: E402
from model.requests import Finished, SamplingParams, Token  # noqa: E402
from model.gpt import GPT, GPTConfig  # noqa: E402
from serve.processes import freeze_heap  # noqa: E402

STEP_CPU = "sparkchat_engine_step_cpu_seconds_total"
ENGINE_PROCESS_CPU = "sparkchat_engine_process_cpu_seconds_total"
DEFAULT_VOCAB = {"cuda": 65536, "cpu": 2048}


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


def run_streams(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Submit every prompt at once; time until the last finishes, each one's first token, and the time
    per output token after the first (TPOT: a decode step's time as one stream sees it)."""
    first: list[float] = [0.0] * len(prompts)
    last: list[float] = [0.0] * len(prompts)
    tokens = [0] * len(prompts)
    done = threading.Semaphore(0)
    t0 = time.perf_counter()
    for i, (ids, p) in enumerate(zip(prompts, params)):
        def sink(ev, i=i):
            if isinstance(ev, Token):
                last[i] = time.perf_counter() - t0
                if tokens[i] == 0:
                    first[i] = last[i]
                tokens[i] += 1
            elif isinstance(ev, Finished):
                done.release()
        engine.submit(ids, p, sink)
    for _ in prompts:
        done.acquire()
    return {"tokens": sum(tokens), "seconds": time.perf_counter() - t0, "ttft": first,
            "tpot": [(b - a) / (n - 1) for a, b, n in zip(first, last, tokens) if n > 1]}


def engine_round(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], seconds: float) -> dict:
    """Batches of every prompt at once, one after another, for at least `seconds` (as each client process
    runs its streams' rounds); tokens/s over them, TTFT and TPOT medians, the mean batch and the share
    of the time the scheduler thread was on a CPU."""
    steps, cpu, tokens, ttft, tpot = engine.steps, engine.cpu_seconds, 0, [], []
    counters, t = engine_counters(engine), time.perf_counter()
    while not tokens or time.perf_counter() - t < seconds:
        r = run_streams(engine, prompts, params)
        tokens, ttft, tpot = tokens + r["tokens"], ttft + r["ttft"], tpot + r["tpot"]
    secs = time.perf_counter() - t
    return {"tokens": tokens, "seconds": round(secs, 4), "tokens_per_s": round(tokens / secs, 2),
            "ms_per_step": round(1000 * secs / max(engine.steps - steps, 1), 4),
            "ttft_ms_median": round(1000 * statistics.median(ttft), 3),
            "tpot_ms_median": round(1000 * statistics.median(tpot), 4) if tpot else None,
            **host_share(tokens, engine.steps - steps, engine.cpu_seconds - cpu, secs),
            **step_phases(counters, engine_counters(engine))}


def steady_round(engine: Engine, prompts: list[list[int]], params: list[SamplingParams], seconds: float) -> dict:
    """The engine under a server's steady load: each stream submitted again the moment it ends, the ends
    spread evenly over a reply's length (stream i's first request asks for (i + 1) / n of it), so that
    every step about n / `new` streams end and as many start, each prefilled between decode steps (the
    server's clients send theirs in clumps; engine_round's batches start and end together instead).
    Tokens/s over `seconds`, timed once every stream has ended its first request; the mean batch and ms
    a step."""
    n, tokens, stop, left = len(prompts), [0], threading.Event(), threading.Semaphore(0)
    settled = threading.Semaphore(0)

    def submit(i: int, first: bool = False) -> None:
        p = params[i]
        if first:
            p = dataclasses.replace(p, max_tokens=max(1, (i + 1) * p.max_tokens // n))
        engine.submit(prompts[i], p, lambda ev: sink(i, ev, first))

    def sink(i: int, ev, first: bool) -> None:  # the engine's thread
        if isinstance(ev, Token):
            tokens[0] += 1
        elif isinstance(ev, Finished):
            if first:
                settled.release()
            if stop.is_set():
                left.release()
            else:
                submit(i)

    for i in range(n):
        submit(i, first=True)
    for _ in range(n):
        settled.acquire()
    t, steps, before, counters = time.perf_counter(), engine.steps, tokens[0], engine_counters(engine)
    time.sleep(seconds)
    secs, got, steps = time.perf_counter() - t, tokens[0] - before, engine.steps - steps
    phases = step_phases(counters, engine_counters(engine))
    stop.set()
    for _ in range(n):
        left.acquire()
    return {"tokens": got, "seconds": round(secs, 4), "tokens_per_s": round(got / secs, 2),
            "ms_per_step": round(1000 * secs / max(steps, 1), 4), "tokens_per_step": round(got / max(steps, 1), 1),
            **phases}


def engine_counters(engine: Engine) -> dict:
    """The engine's step counters (its phases' wall time: model.engine.PHASES), for step_phases."""
    return {"steps": engine.steps, "steps_ahead": engine.steps_ahead, "admissions": engine.admissions,
            "admitted_rows": engine.admitted_rows, **{f"{p}_s": v for p, v in engine.phase_seconds.items()}}


def served_counters(metrics: dict) -> dict | None:
    """engine_counters' figures from a server's scrape; None from a server that lacks them."""
    names = {"steps": "sparkchat_decode_steps_total", "steps_ahead": "sparkchat_decode_steps_ahead_total",
             "admissions": "sparkchat_engine_admissions_total",
             "admitted_rows": "sparkchat_engine_admitted_requests_total",
             **{f"{p}_s": f'sparkchat_engine_phase_seconds_total{{phase="{p}"}}' for p in PHASES}}
    return {k: metrics[v] for k, v in names.items()} if all(v in metrics for v in names.values()) else None


def step_phases(before: dict, after: dict) -> dict:
    """Where a decode step's wall time went between two counter snapshots: each phase's ms a step, the
    admissions a step, the requests an admission took in, and the share of steps launched ahead."""
    d = {k: after[k] - before[k] for k in before}
    n = max(d["steps"], 1)
    out = {f"{p}_ms_per_step": round(1000 * d[f"{p}_s"] / n, 4) for p in PHASES}
    out.update(admissions_per_step=round(d["admissions"] / n, 3), ahead_share=round(d["steps_ahead"] / n, 3),
               rows_per_admission=round(d["admitted_rows"] / max(d["admissions"], 1), 2))
    return out


def tree_cpu(pid: int) -> dict[tuple[int, float], float]:
    """CPU seconds (user + system, and those of its children that have exited and been waited for) of a
    process and of every process under it, keyed by (pid, start time): a key tells a process from a
    later one that reuses its pid."""
    import psutil
    root = psutil.Process(pid)
    out = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            with p.oneshot():
                t, key = p.cpu_times(), (p.pid, p.create_time())
        except psutil.NoSuchProcess:  # exited while listed: its CPU is its parent's children_* once waited for
            continue
        out[key] = t.user + t.system + t.children_user + t.children_system
    return out


def server_cpu(before: dict, after: dict) -> dict:
    """The server's CPU over a window from two snapshots {"tree": tree_cpu(...), "metrics": scrape(...)}:
    `tree_cpu_s`, the whole process tree's (a process started within the window counts from zero; one
    that exits within it counts its whole life, through its parent's children_* once waited for), and,
    when the server has the engine's step counter (STEP_CPU), `engine_step_cpu_s` and `server_cpu_s`, the
    tree's less the engine's steps; without it those two are None."""
    tree = sum(cpu - before["tree"].get(key, 0.0) for key, cpu in after["tree"].items())
    if STEP_CPU not in before["metrics"] or STEP_CPU not in after["metrics"]:
        return {"tree_cpu_s": tree, "engine_step_cpu_s": None, "server_cpu_s": None}
    step = after["metrics"][STEP_CPU] - before["metrics"][STEP_CPU]
    out = {"tree_cpu_s": tree, "engine_step_cpu_s": step, "server_cpu_s": tree - step}
    if ENGINE_PROCESS_CPU in before["metrics"] and ENGINE_PROCESS_CPU in after["metrics"]:
        engine_process = after["metrics"][ENGINE_PROCESS_CPU] - before["metrics"][ENGINE_PROCESS_CPU]
        out.update(engine_host_cpu_s=engine_process - step, frontend_cpu_s=tree - engine_process)
    return out


def http_round(base: str, pid: int, tokenizer: Path, n: int, new: int, seconds: float, procs: int) -> dict:
    """One level through the server: its rate, its CPU beside the engine's steps, the text share and the
    clients' CPU. The snapshots are taken outside the window (/metrics is scraped first at the start and
    last at the end), while every client waits: the server is idle then."""
    from bench.serve import rounds_in_processes
    at_start = lambda: {"metrics": scrape(base), "tree": tree_cpu(pid), "loop": thread_cpu_s(pid, pid)}  # noqa: E731
    at_end = lambda: {"tree": tree_cpu(pid), "loop": thread_cpu_s(pid, pid), "metrics": scrape(base)}  # noqa: E731
    r = rounds_in_processes(base + "/v1/chat/completions", n, new, seconds, procs, at_start, at_end, str(tokenizer))
    before, after, tokens = r.at_start, r.at_end, r.tokens
    cpu = server_cpu(before, after)
    per_token = lambda s: None if s is None else round(1e6 * s / tokens, 2)  # noqa: E731
    out = {"tokens": tokens, "seconds": round(r.seconds, 4), "tokens_per_s": round(tokens / r.seconds, 2),
           "server_cpu_us_per_token": per_token(cpu["server_cpu_s"]),
           "tree_cpu_us_per_token": per_token(cpu["tree_cpu_s"]),
           "engine_step_cpu_us_per_token": per_token(cpu["engine_step_cpu_s"]),
           # the server's CPU split: the engine process beside its steps, and every other process (front
           # ends, supervisor), when the server counts its engine process's CPU
           "engine_host_cpu_us_per_token": per_token(cpu.get("engine_host_cpu_s")),
           "frontend_cpu_us_per_token": per_token(cpu.get("frontend_cpu_s")),
           # the server's first process's main thread: the event loop of a one-process server
           "loop_cpu_us_per_token": per_token(after["loop"] - before["loop"]),
           "text_token_share": round(r.text_tokens / tokens, 5),
           "tokens_per_event": round(tokens / max(r.text_events, 1), 2),
           "client_processes": r.processes, "client_cpu_us_per_token": per_token(r.client_cpu_s),
           "busiest_client_cpu_share": round(r.busiest_cpu_share, 3),
           # the same client code in every tree: on a machine whose speed drifts (a shared 2-core VM) the
           # server's CPU over the clients' in one round moves less than either alone (serving.md)
           "server_over_client_cpu": None if cpu["server_cpu_s"] is None or not r.client_cpu_s
           else round(cpu["server_cpu_s"] / r.client_cpu_s, 4)}
    m0, m1 = before["metrics"], after["metrics"]
    steps, engine_cpu = "sparkchat_decode_steps_total", "sparkchat_engine_cpu_seconds_total"
    if all(k in m0 and k in m1 for k in (steps, engine_cpu)):
        out.update(host_share(tokens, int(m1[steps] - m0[steps]), m1[engine_cpu] - m0[engine_cpu], r.seconds))
    c0, c1 = served_counters(m0), served_counters(m1)
    if c0 and c1:
        out.update(step_phases(c0, c1))
    return out


def summary(rounds: list[dict], keys: tuple[str, ...]) -> dict:
    """Median, min, max and count of each key over the rounds (keys a round lacks or holds None for are
    left out)."""
    return {k: spread([r[k] for r in rounds]) for k in keys if rounds and all(r.get(k) is not None for r in rounds)}


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
    """The server's Prometheus metrics, name -> value; a labelled sample's name carries its labels in
    Prometheus' form, e.g. `sparkchat_engine_phase_seconds_total{phase="wait"}`."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(base + "/metrics", timeout=10).text
    return {s.name + ("{" + ",".join(f'{k}="{v}"' for k, v in s.labels.items()) + "}" if s.labels else ""): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def thread_cpu_s(pid: int, tid: int) -> float:
    """CPU seconds a thread of another process has used (Linux /proc), waits for the GIL excluded."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def positive(kind):
    """An argparse type: a number of `kind` above zero."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value
    return parse


def chat_requests(tok, gen: dict, n: int, new: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """The prompts and sampling of the HTTP client's `n` streams (bench.serve.one_stream), as the
    server turns them into ids: stream i asks question i (cycling), seed i."""
    from bench.serve import PROMPTS
    from model.chat import render
    from model.requests import sampling_params
    prompts = [render(tok, [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], for_completion=True)[0]
               for i in range(n)]
    return prompts, [sampling_params(gen, temperature=1.0, max_tokens=new, seed=i) for i in range(n)]


def serve_argv(model_dir: Path, args, max_batch: int) -> list[str]:
    """How the server is started: `python -m serve` as a user runs it, plus `--serve-args`; with
    `--switch-interval`, through runpy after setting it."""
    flags = ["--model", str(model_dir), "--device", args.device, "--max-batch", str(max_batch),
             "--max-queue", "1024", *shlex.split(args.serve_args)]
    if args.switch_interval is None:
        return ["-m", "serve", *flags]
    return ["-c", "import runpy, sys; sys.setswitchinterval(float(sys.argv.pop(1))); "
                  "runpy.run_module('serve', run_name='__main__', alter_sys=True)", str(args.switch_interval), *flags]


def measure(engine: Engine, tok, gen: dict, levels: list[int], args, model_dir: Path | None, progress) -> dict:
    """`args.rounds` rounds of every level: the engine alone, then (with a `model_dir`) the same level
    through the server, started once. Every round of each, with the load average at its start;
    `progress(rounds so far)` after each level, so a run cut short keeps them."""
    from bench.serve import client_processes, running_server
    eng: dict = {n: [] for n in levels}
    http: dict = {n: [] for n in levels}
    server = running_server(serve_argv(model_dir, args, max(levels)), timeout=300) if model_dir else None
    with server or contextlib.nullcontext((None, None)) as (base, pid):
        for r in range(args.rounds):
            for n in levels:
                prompts, params = chat_requests(tok, gen, n, args.new)
                if r == 0:
                    run_streams(engine, prompts, params)  # warm-up: on a GPU, captures this level's graphs
                load = round(os.getloadavg()[0], 2)
                e = {**engine_round(engine, prompts, params, args.seconds), "load_average_1m": load}
                e.update({f"steady_{k}": v for k, v in steady_round(engine, prompts, params, args.seconds).items()})
                eng[n].append(e)
                line = (f"round {r + 1}/{args.rounds} {n:4d} streams: engine {e['tokens_per_s']:9.0f} tok/s, "
                        f"steady {e['steady_tokens_per_s']:9.0f} tok/s ({e['steady_tokens_per_step']} rows a step)")
                if base:
                    h = http_round(base, pid, model_dir / "tokenizer.json", n, args.new, args.seconds,
                                   args.client_procs or client_processes(n))
                    h["of_engine"] = round(h["tokens_per_s"] / e["tokens_per_s"], 4)
                    h["of_steady_engine"] = round(h["tokens_per_s"] / e["steady_tokens_per_s"], 4)
                    h["load_average_1m"] = round(os.getloadavg()[0], 2)
                    http[n].append(h)
                    line += (f", http {h['tokens_per_s']:9.0f} tok/s ({h['of_engine']:.2f}x), server "
                             f"{h['server_cpu_us_per_token']} us CPU a token beside the engine's steps (tree "
                             f"{h['tree_cpu_us_per_token']}), text {h['text_token_share']:.3f}, clients "
                             f"{h['client_cpu_us_per_token']} us a token ({h['client_processes']} processes)")
                print(line + f"; load {load}", flush=True)
                progress({"engine": eng, "http": http if model_dir else None})
    return {"engine": eng, "http": http if model_dir else None}


PHASE_KEYS = (*(f"{p}_ms_per_step" for p in PHASES), "admissions_per_step", "rows_per_admission", "ahead_share")
ENGINE_KEYS = ("tokens_per_s", "ms_per_step", "ttft_ms_median", "tpot_ms_median", "tokens_per_step",
               "engine_cpu_share", "steady_tokens_per_s", "steady_ms_per_step", "steady_tokens_per_step",
               *PHASE_KEYS, *("steady_" + k for k in PHASE_KEYS))
HTTP_KEYS = ("tokens_per_s", "of_engine", "of_steady_engine", "server_cpu_us_per_token", "text_token_share", "tokens_per_event",
             "tree_cpu_us_per_token",
             "engine_host_cpu_us_per_token", "frontend_cpu_us_per_token",
             "engine_step_cpu_us_per_token", "loop_cpu_us_per_token", "client_cpu_us_per_token",
             "server_over_client_cpu", "busiest_client_cpu_share", "tokens_per_step", "engine_cpu_share", *PHASE_KEYS)


def phases_line(summary: dict, prefix: str = "") -> str:
    """A summary's step phases, in words."""
    if prefix + "wait_ms_per_step" not in summary:
        return "no phase counters"
    ms = ", ".join(f"{p} {fmt(summary[f'{prefix}{p}_ms_per_step'], '.3f')}" for p in PHASES)
    return (f"ms a step: {ms}; {fmt(summary[prefix + 'admissions_per_step'], '.3f')} admissions a step of "
            f"{fmt(summary[prefix + 'rows_per_admission'], '.2f')} requests, {fmt(summary[prefix + 'ahead_share'], '.2f')} "
            f"of steps launched ahead")


def report(rounds: dict, levels: list[int], name: str, bound_ms: float | None) -> dict:
    """Each level's rounds and their summary (median, min, max), printed."""
    out: dict = {}
    for n in levels:
        e = out[n] = {"rounds": rounds["engine"][n], **summary(rounds["engine"][n], ENGINE_KEYS)}
        if bound_ms:
            e["of_bound"] = spread([x["tokens_per_s"] / (n * 1000 / bound_ms) for x in rounds["engine"][n]])
        print(f"engine ({name}) {n:4d} streams: {fmt(e['tokens_per_s'], ',.0f')} tok/s, {fmt(e['ms_per_step'], '.2f')} "
              f"ms/step" + (f", {fmt(e['of_bound'], '.1%')} of the weight-read bound" if bound_ms else "") +
              f"; steady load {fmt(e['steady_tokens_per_s'], ',.0f')} tok/s, {fmt(e['steady_ms_per_step'], '.2f')} "
              f"ms/step, {fmt(e['steady_tokens_per_step'], '.1f')} rows a step", flush=True)
        print(f"  batches, {phases_line(e)}\n  steady load, {phases_line(e, 'steady_')}", flush=True)
    if rounds.get("http"):
        out["http"] = {}
        for n in levels:
            h = out["http"][n] = {"rounds": rounds["http"][n], **summary(rounds["http"][n], HTTP_KEYS)}
            if "server_cpu_us_per_token" not in h:
                h["server_cpu_note"] = (f"the server has no {STEP_CPU} counter: the engine's step CPU is not "
                                        f"subtracted, see tree_cpu_us_per_token (the whole tree's)")
            print(f"http {n:4d} streams: {fmt(h['tokens_per_s'], ',.0f')} tok/s, {fmt(h['of_engine'], '.2f', 'x')} the "
                  f"engine ({fmt(h['of_steady_engine'], '.2f', 'x')} under steady load), server CPU beside the engine's steps " + (
                      f"{fmt(h['server_cpu_us_per_token'])} us a token" if "server_cpu_us_per_token" in h
                      else "unknown (no step counter)") +
                  f", text share {fmt(h['text_token_share'], '.3f')}, {fmt(h['tokens_per_event'], '.2f')} tokens an "
                  f"event, clients {fmt(h['client_cpu_us_per_token'])} us a token" +
                  (f" (server / clients {fmt(h['server_over_client_cpu'], '.3f')})" if "server_over_client_cpu" in h
                   else "") + f" (median (min-max) of {len(rounds['http'][n])} rounds)", flush=True)
            print(f"  http, {phases_line(h)}", flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=20, help="model depth, nanochat's dial (default: %(default)s)")
    ap.add_argument("--vocab", type=positive(int), help="vocabulary (default: 65536 on cuda, 2048 on cpu)")
    ap.add_argument("--levels", default="1,16,64,128", help="concurrent streams (default: %(default)s)")
    ap.add_argument("--new", type=positive(int), default=128, help="new tokens per stream (default: %(default)s)")
    ap.add_argument("--rounds", type=positive(int), default=3, help="rounds of every level (default: %(default)s)")
    ap.add_argument("--seconds", type=positive(float), default=4.0,
                    help="each level's least time in a round, engine and HTTP each (default: %(default)s)")
    ap.add_argument("--http", action="store_true", help="also through the HTTP server")
    ap.add_argument("--eager", action="store_true", help="also the engine without CUDA graphs")
    ap.add_argument("--trained", help="a trained model directory: its greedy ids, graphs against eager")
    ap.add_argument("--agreement-only", action="store_true", help="with --trained: only that comparison")
    ap.add_argument("--serve-args", default="",
                    help="more flags for `python -m serve`, one string (one flag alone: --serve-args=--no-ui)")
    ap.add_argument("--switch-interval", type=positive(float),
                    help="the server's sys.setswitchinterval in seconds (default: Python's)")
    ap.add_argument("--client-procs", type=positive(int),
                    help="HTTP client processes, at most one a stream (default: bench.serve.client_processes)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu: the HTTP path's overhead with a small model (default: %(default)s)")
    ap.add_argument("--threads", type=positive(int),
                    help="torch's intra-op threads in the engine alone and the server (default: 1 on cpu, torch's "
                         "own on cuda)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench/serve_gpu.py needs a CUDA GPU (or --device cpu)")
    threads = args.threads or (1 if args.device == "cpu" else None)
    if threads:  # the server reads it when its torch loads; this process's engine is told now
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    levels = [int(x) for x in args.levels.split(",")]
    vocab = args.vocab or DEFAULT_VOCAB[args.device]
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    res: dict = {"device": torch.cuda.get_device_name() if gpu else f"cpu ({os.cpu_count()} cores)",
                 "torch": torch.__version__, "command": "python -m bench.serve_gpu " + " ".join(argv or sys.argv[1:]),
                 "load_average_at_start": os.getloadavg(), "cpu_count": os.cpu_count(),
                 "torch_threads": torch.get_num_threads()}  # commit, versions, date: save_json's provenance
    if args.trained:  # a trained model's logits are peaked: greedy ids are not decided by rounding
        from model.chat import render
        from model.model_dir import load_model_dir
        trained, tok, _ = load_model_dir(args.trained, device, torch.bfloat16)
        prompts = [render(tok, [{"role": "user", "content": q}], for_completion=True)[0] for q in CHAT_PROMPTS]
        res["greedy_vs_eager_trained"] = greedy_agreement(trained, prompts)
        print(f"greedy ids of {args.trained}, graphs vs eager: {res['greedy_vs_eager_trained']}", flush=True)
        del trained
        if args.agreement_only:
            save_json(res, args.out)
            return res
    from bench.text_model import GENERATION, text_tokenizer, write_model_dir
    from model.chat_engine import chat_engine
    t = time.perf_counter()
    tok = text_tokenizer(vocab)
    gen = {**GENERATION, "max_tokens": args.new}
    print(f"tokenizer of {vocab} ids trained in {time.perf_counter() - t:.1f} s", flush=True)
    model = d_model(args.depth, vocab, device)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("wte"))
    res.update({"depth": args.depth, "vocab": vocab, "params": model.num_params(), "new_tokens": args.new,
                "rounds": args.rounds, "seconds_per_level": args.seconds, "weight_bytes_read_per_step": weight_bytes})
    bound_ms = gpu_checks(model, args, levels, vocab, weight_bytes, res) if gpu else None
    if not gpu:
        print(f"{res['device']}: d{args.depth}, {res['params'] / 1e6:.2f}M params, fp32", flush=True)
    if gpu and args.eager:  # rounds of its own, no HTTP: on a CPU there are no graphs to compare with
        engine = chat_engine(model, tok, gen, max_batch=max(levels), max_queue=1024, cuda_graphs=False)
        freeze_heap()
        try:
            rounds = measure(engine, tok, gen, levels, args, None, lambda r: save_json({**res, "unfinished_eager": r}, args.out))
            res["engine_eager"] = report(rounds, levels, "eager", bound_ms)
        finally:
            engine.shutdown()
        save_json(res, args.out)
    name = "graphs" if gpu else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(model.float(), tok, Path(tmp) / "m", gen) if args.http else None
        model.to(torch.bfloat16 if gpu else torch.float32)
        engine = chat_engine(model, tok, gen, max_batch=max(levels), max_queue=1024, cuda_graphs=gpu)
        freeze_heap()  # as the server's engine process does: the reference is the engine as it serves
        try:
            rounds = measure(engine, tok, gen, levels, args, model_dir, lambda r: save_json({**res, "unfinished": r}, args.out))
            r = report(rounds, levels, name, bound_ms)
            res["http"] = r.pop("http", None)
            res[f"engine_{name}"] = r
            long = torch.randint(0, vocab, (1, 512), generator=torch.Generator().manual_seed(0)).tolist()
            once = [SamplingParams(temperature=1.0, top_k=50, max_tokens=1, seed=0)]
            r["ttft_512_ms"] = spread([1000 * run_streams(engine, long, once)["ttft"][0] for _ in range(5)], 2)
            print(f"engine ({name}) TTFT of a 512-token prompt at idle: {fmt(r['ttft_512_ms'], '.1f')} ms "
                  f"(5 prompts in a row)", flush=True)
        finally:
            engine.shutdown()
    res["load_average_at_end"] = os.getloadavg()
    save_json(res, args.out)
    return res


def gpu_checks(model, args, levels: list[int], vocab: int, weight_bytes: int, res: dict) -> float:
    """On a GPU: the copy bandwidth and so the weight-read bound (ms a step, returned), the engine's
    start time with compile and graph capture, and greedy ids of the graph path against eager."""
    device = next(model.parameters()).device
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
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in torch.randint(4, 600, (10,), generator=g)]
    res["greedy_vs_eager_random"] = greedy_agreement(model, prompts)
    print(f"greedy ids of the random d{args.depth}, graphs vs eager (near-ties: its logits are almost flat): "
          f"{res['greedy_vs_eager_random']}", flush=True)
    return bound_ms


if __name__ == "__main__":
    main()
