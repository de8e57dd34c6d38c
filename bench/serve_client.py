"""The server as its clients see it, measured as vLLM's `benchmarks/` measure one: time to first token
(TTFT), inter-token latency (ITL) p50/p99 and output tokens/s, through `sparkchat serve` with the
`openai` package as the client, beside the engine alone in the same run.

Loads (each round; `--rounds` rounds, median and range over them, bench/stats.py):
  - closed loop, `--levels` streams (1,16,64,128): each stream sends its next request the moment its
    last ends, for `--seconds`; before it, the engine alone over the same prompts and sampling in this
    process (bench.serve_gpu.engine_round, as the server builds its engine): `of_engine` = HTTP tokens/s
    over the engine's in the same round.
  - Poisson arrivals at `--rates` requests/s (seeded exponential gaps, `--seconds` of arrivals), each
    request its own stream, however many are open at once.
Per request (streamed, `stream_options.include_usage`): TTFT = first content chunk - send; the gaps
between its content chunks are its ITLs (a chunk may carry more than one token when the server paces
its events: `tokens_per_chunk` says how many on average); TPOT = (last chunk - first) / (tokens - 1);
its tokens: the usage chunk's completion_tokens. A level's output tokens/s = its requests' tokens over
the time from the first send to the last end. Every stream i asks the benchmark client's question i
(bench.serve.PROMPTS, cycling) at temperature 1 with seed i, as the engine-alone requests do.

The model: bench/serve_gpu.py's (random weights, `--depth`, the text tokenizer of bench/text_model.py),
bf16 on a GPU. `--weights fp8` converts the engine's Linears (model/precision/fp8_weights.py) and
starts the server with `--weights fp8`. On a GPU also the floor: the bytes of the weights a decode step
reads over the copy bandwidth measured in the same run; `floor_fraction` = the engine's one-stream
tokens/s over the floor's. `--peer`: transformers on the same weights at one stream (bench/hf_peer.py),
`over_transformers`.

The raw JSON (`--out`) carries the keys bench/check_keys.py reads: floor_fraction, tokens_per_s_<n>
(the engine, n streams), of_engine_<n>, over_transformers, commit, date.

    python -m bench.serve_client --out bench/results/serving/client_h100.json --peer   # one GPU
    python -m bench.serve_client --device cpu --depth 2 --levels 1,2 --rates 2 --seconds 2 --rounds 1
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as serve/__main__.py: idle OpenMP workers sleep

import argparse  # noqa: E402
import asyncio  # noqa: E402
import multiprocessing  # noqa: E402
import queue  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from bench.provenance import run_id  # noqa: E402
from bench.stats import fmt, save_json, spread  # noqa: E402

CLIENT_KEYS = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "tpot_ms_p50",
               "tokens_per_chunk", "requests")


# -- the client (its own processes) -------------------------------------------------------------------

async def one_request(client, i: int, new: int) -> dict:
    """One streamed chat completion: its send time, its content chunks' arrival times, its tokens."""
    from bench.serve import PROMPTS
    sent, chunks, tokens = time.monotonic(), [], 0
    stream = await client.chat.completions.create(
        model="sparkchat", messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=new,
        temperature=1.0, seed=i, stream=True, stream_options={"include_usage": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(time.monotonic())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return {"sent": sent, "chunks": chunks, "end": time.monotonic(), "tokens": tokens}


def _client(base: str, job: dict, out, go) -> None:
    """A client process: its share of a closed-loop level's streams, or of a Poisson schedule's arrivals.
    Says it is ready, waits for the start time, runs, sends back its requests' records."""
    import httpx
    from openai import AsyncOpenAI

    async def run() -> list[dict]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

        def client():  # (one a stream: a client shared by many streams times itself, bench/serve.py)
            return AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=600,
                               http_client=httpx.AsyncClient(limits=limits, timeout=600))

        if job["kind"] == "closed":
            clients = [client() for _ in job["streams"]]
        else:
            clients = [client()]
        await one_request(clients[0], 999, 2)  # warm-up: the connection
        out.put(("ready", None))
        start = go.get()
        await asyncio.sleep(max(0.0, start - time.monotonic()))
        records: list[dict] = []
        if job["kind"] == "closed":
            deadline = start + job["seconds"]

            async def stream(c, i):
                while time.monotonic() < deadline:
                    records.append(await one_request(c, i, job["new"]))
            await asyncio.gather(*(stream(c, i) for c, i in zip(clients, job["streams"])))
        else:
            async def arrive(i, at):
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                records.append(await one_request(clients[0], i, job["new"]))
            await asyncio.gather(*(arrive(i, at) for i, at in job["arrivals"]))
        return records

    out.put(("done", asyncio.run(run())))


def run_clients(base: str, jobs: list[dict]) -> list[dict]:
    """Run the jobs in client processes (spawned: the parent holds a CUDA context), started together once
    every one is ready; every request's record."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    gos = [ctx.Queue() for _ in jobs]
    procs = [ctx.Process(target=_client, args=(base, job, out, go), daemon=True) for job, go in zip(jobs, gos)]
    for p in procs:
        p.start()

    def take(kind: str) -> list:
        got = []
        while len(got) < len(procs):
            try:
                k, v = out.get(timeout=5)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    sys.exit("a client process failed (its traceback is above)")
                continue
            assert k == kind, (k, kind)
            got.append(v)
        return got

    try:
        take("ready")
        start = time.monotonic() + 0.2
        for go in gos:
            go.put(start)
        return [r for part in take("done") for r in part]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the nearest ranks; None of no values."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (pos - lo)


def client_stats(records: list[dict]) -> dict:
    """A level's figures from its requests' records (see the module docstring)."""
    done = [r for r in records if r["chunks"]]
    ttft = [1000 * (r["chunks"][0] - r["sent"]) for r in done]
    itl = [1000 * (b - a) for r in done for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [1000 * (r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in records)
    seconds = max(r["end"] for r in records) - min(r["sent"] for r in records)
    r4 = lambda x: None if x is None else round(x, 4)  # noqa: E731
    return {"requests": len(records), "tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 2), "ttft_ms_p50": r4(percentile(ttft, 50)),
            "ttft_ms_p99": r4(percentile(ttft, 99)), "itl_ms_p50": r4(percentile(itl, 50)),
            "itl_ms_p99": r4(percentile(itl, 99)), "tpot_ms_p50": r4(percentile(tpot, 50)),
            "tokens_per_chunk": round(tokens / max(sum(len(r["chunks"]) for r in records), 1), 3)}


def closed_jobs(streams: int, new: int, seconds: float) -> list[dict]:
    from bench.serve import client_processes, shares
    return [{"kind": "closed", "streams": list(ids), "new": new, "seconds": seconds}
            for ids in shares(streams, client_processes(streams))]


def poisson_jobs(rate: float, new: int, seconds: float, seed: int) -> list[dict]:
    """Arrivals at `rate` a second over `seconds` (exponential gaps, seeded), dealt round-robin to the
    client processes (as many as for as many streams as arrive in a second, at least one)."""
    from bench.serve import client_processes
    rng, t, arrivals = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t > seconds:
            break
        arrivals.append((len(arrivals), t))
    procs = min(client_processes(max(1, int(rate))), max(1, len(arrivals)))
    return [{"kind": "poisson", "arrivals": arrivals[p::procs], "new": new} for p in range(procs)]


# -- the run ------------------------------------------------------------------------------------------

def summary(rounds: list[dict], keys) -> dict:
    return {k: spread([r[k] for r in rounds]) for k in keys if rounds and all(r.get(k) is not None for r in rounds)}


def parse_args(argv):
    from model.precision.options import SERVE_WEIGHTS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=20, help="model depth (default: %(default)s)")
    ap.add_argument("--vocab", type=int, help="vocabulary (default: 65536 on cuda, 2048 on cpu)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="(default: %(default)s)")
    ap.add_argument("--weights", default=SERVE_WEIGHTS[0],
                    help=f"the engine's and the server's Linear weights, of {', '.join(SERVE_WEIGHTS)}; several "
                         f"(comma-separated) alternate within each round, each with a server of its own, and the "
                         f"first one's figures get the plain keys, the others' the suffix _<weights> (default: "
                         f"%(default)s)")
    ap.add_argument("--levels", default="1,16,64,128", help="closed-loop streams (default: %(default)s)")
    ap.add_argument("--rates", default="8,64", help="Poisson arrivals, requests a second (default: %(default)s)")
    ap.add_argument("--new", type=int, default=128, help="tokens a reply (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=6.0, help="each level's time in a round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="(default: %(default)s)")
    ap.add_argument("--peer", action="store_true", help="also transformers at one stream (bench/hf_peer.py; bf16)")
    ap.add_argument("--serve-args", default="", help="more flags for `python -m serve`, one string")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    args.weights = args.weights.split(",")
    bad = [w for w in args.weights if w not in SERVE_WEIGHTS]
    if bad or len(set(args.weights)) != len(args.weights):
        ap.error(f"--weights takes each of {', '.join(SERVE_WEIGHTS)} at most once, got {','.join(args.weights)}")
    return args


def main(argv=None) -> dict:
    import contextlib
    import copy

    from bench.serve import running_server
    from bench.serve_gpu import DEFAULT_VOCAB, chat_requests, copy_bandwidth, d_model, engine_round
    from bench.text_model import GENERATION, text_tokenizer, write_model_dir
    from model.chat_engine import chat_engine
    from model.precision import fp8_weights
    from serve.processes import freeze_heap

    args = parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if gpu and not torch.cuda.is_available():
        raise SystemExit("bench/serve_client.py needs a CUDA GPU (or --device cpu)")
    if "fp8" in args.weights:  # refused here as the server would refuse it, before anything is built
        reason = fp8_weights.unavailable_reason(device)
        if reason:
            raise SystemExit(f"bench/serve_client.py: --weights fp8: {reason}")
    if not gpu:  # one intra-op thread, engine and server alike (bench/serve_gpu.py says why)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    levels, rates = [int(x) for x in args.levels.split(",")], [float(x) for x in args.rates.split(",") if x]
    vocab = args.vocab or DEFAULT_VOCAB[args.device]
    res: dict = {"command": "python -m bench.serve_client " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "commit": run_id(), "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "device": torch.cuda.get_device_name() if gpu else f"cpu ({os.cpu_count()} cores)",
                 "torch": torch.__version__, "cuda": torch.version.cuda, "weights": args.weights,
                 "depth": args.depth, "vocab": vocab, "new_tokens": args.new, "rounds": args.rounds,
                 "seconds_per_level": args.seconds}
    tok = text_tokenizer(vocab)
    gen = {**GENERATION, "max_tokens": args.new}
    model = d_model(args.depth, vocab, device)
    res["params"] = model.num_params()
    if args.peer:  # bf16 weights, before any conversion
        from bench.hf_peer import measure as peer
        from model.chat import render
        prompt = render(tok, [{"role": "user", "content": "Tell me about the sea."}], for_completion=True)[0]
        res["transformers"] = peer(copy.deepcopy(model), tok, gen, prompt, args.new, args.rounds,
                                   ["plain", "static", "static_compiled"] if gpu else ["plain", "static"])
        res["over_transformers"] = res["transformers"]["over_transformers"]
        save_json(res, args.out)
    if gpu:
        res["copy_bandwidth_GBps"] = round(copy_bandwidth(device) / 1e9, 1)
        # every engine here compiles the same Block code (the peer's, bf16's, fp8's modules): room for all of
        # their compiles, where one engine's need more than dynamo's default (model/decode_graphs.py)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32 * (len(args.weights) + 1))
    dtype = torch.bfloat16 if gpu else torch.float32
    rounds = {w: {"engine": {n: [] for n in levels}, "http": {n: [] for n in levels}, "poisson": {r: [] for r in rates}}
              for w in args.weights}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        model_dir = write_model_dir(model.float(), tok, Path(tmp) / "m", gen)
        engines, servers = {}, {}
        for w in args.weights:  # each its own engine here and its own server
            m = copy.deepcopy(model)
            if w == "fp8":
                fp8_weights.convert(m, dtype)
            else:
                m.to(dtype)
            res[f"weight_bytes_read_per_step{suffix(w, args)}"] = fp8_weights.weight_bytes(m)
            engines[w] = chat_engine(m, tok, gen, max_batch=max(levels), max_queue=4096, cuda_graphs=gpu)
            stack.callback(engines[w].shutdown)
            servers[w] = stack.enter_context(running_server(
                ["-m", "serve", "--model", str(model_dir), "--device", args.device, "--max-batch", str(max(levels)),
                 "--max-queue", "4096", "--weights", w, *args.serve_args.split()], timeout=600))[0]
        del model
        freeze_heap()
        for r in range(args.rounds):
            for w in args.weights:
                one_round(engines[w], servers[w], tok, gen, levels, rates, args, r, rounds[w], w, chat_requests,
                          engine_round)
            save_json({**res, "unfinished": rounds}, args.out)
    for w in args.weights:
        summarise(res, rounds[w], levels, rates, suffix(w, args), gpu)
    report(res, levels, rates, args.weights, args)
    save_json(res, args.out)
    return res


def suffix(weights: str, args) -> str:
    """The first weights' keys are plain, the others' end in _<weights>."""
    return "" if weights == args.weights[0] else f"_{weights}"


def one_round(engine, base: str, tok, gen: dict, levels: list[int], rates: list[float], args, r: int, rounds: dict,
              weights: str, chat_requests, engine_round) -> None:
    """One round of one weights' engine and server: every level (the engine alone, then HTTP), then every rate."""
    for n in levels:
        prompts, params = chat_requests(tok, gen, n, args.new)
        if r == 0:
            engine_round(engine, prompts, params, 0.0)  # warm-up: this level's graphs
            run_clients(base, closed_jobs(n, args.new, 0.5))  # and the server's
        e = engine_round(engine, prompts, params, args.seconds)
        h = client_stats(run_clients(base, closed_jobs(n, args.new, args.seconds)))
        h["of_engine"] = round(h["tokens_per_s"] / e["tokens_per_s"], 4)
        rounds["engine"][n].append(e)
        rounds["http"][n].append(h)
        print(f"round {r + 1}/{args.rounds} {weights} {n:4d} streams: engine {e['tokens_per_s']:,.0f} tok/s (TTFT "
              f"{e['ttft_ms_median']} ms), http {h['tokens_per_s']:,.0f} tok/s ({h['of_engine']:.2f}x), TTFT p50 "
              f"{h['ttft_ms_p50']} ms, ITL p50/p99 {h['itl_ms_p50']}/{h['itl_ms_p99']} ms", flush=True)
    for rate in rates:
        p = client_stats(run_clients(base, poisson_jobs(rate, args.new, args.seconds, seed=r)))
        rounds["poisson"][rate].append(p)
        print(f"round {r + 1}/{args.rounds} {weights} Poisson {rate:g}/s: {p['requests']} requests, "
              f"{p['tokens_per_s']:,.0f} tok/s, TTFT p50/p99 {p['ttft_ms_p50']}/{p['ttft_ms_p99']} ms, "
              f"ITL p50/p99 {p['itl_ms_p50']}/{p['itl_ms_p99']} ms", flush=True)


def summarise(res: dict, rounds: dict, levels: list[int], rates: list[float], sfx: str, gpu: bool) -> None:
    """One weights' rounds and their summaries into `res`, with the headline keys bench/check_keys.py reads."""
    eng, http, pois = rounds["engine"], rounds["http"], rounds["poisson"]
    res["engine" + sfx] = {n: {"rounds": eng[n], **summary(eng[n], ("tokens_per_s", "ttft_ms_median", "tpot_ms_median"))}
                           for n in levels}
    res["closed_loop" + sfx] = {n: {"rounds": http[n], **summary(http[n], (*CLIENT_KEYS, "of_engine"))} for n in levels}
    res["poisson" + sfx] = {f"{r:g}": {"rounds": pois[r], **summary(pois[r], CLIENT_KEYS)} for r in rates}
    for n in levels:
        res[f"tokens_per_s_{n}{sfx}"] = res["engine" + sfx][n]["tokens_per_s"]
        res[f"of_engine_{n}{sfx}"] = res["closed_loop" + sfx][n]["of_engine"]
    if gpu and 1 in levels:  # the floor: this weights' bytes a step over the copy bandwidth
        floor = res["copy_bandwidth_GBps"] * 1e9 / res["weight_bytes_read_per_step" + sfx]
        res["floor_tokens_per_s" + sfx] = round(floor, 1)
        res["floor_fraction" + sfx] = spread([e["tokens_per_s"] / floor for e in eng[1]])


def report(res: dict, levels: list[int], rates: list[float], weights: list[str], args) -> None:
    print(f"{res['device']}, d{res['depth']}, {res['rounds']} rounds (median (min-max)):", flush=True)
    keys = ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")
    for w in weights:
        sfx = suffix(w, args)
        if "floor_fraction" + sfx in res:
            print(f"{w}: floor {res['weight_bytes_read_per_step' + sfx] / 1e9:.3f} GB a step at {res['copy_bandwidth_GBps']} "
                  f"GB/s = {res['floor_tokens_per_s' + sfx]:,.0f} tok/s at one stream; the engine "
                  f"{fmt(res['floor_fraction' + sfx], '.3f')} of it")
        print(f"| {w}: load | engine tok/s | HTTP tok/s | HTTP/engine | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for n in levels:
            e, h = res["engine" + sfx][n], res["closed_loop" + sfx][n]
            print(f"| {n} streams | {fmt(e['tokens_per_s'], ',.0f')} | {fmt(h['tokens_per_s'], ',.0f')} | "
                  f"{fmt(h['of_engine'], '.2f')} | " + " | ".join(fmt(h[k], '.1f') if k in h else "-" for k in keys) + " |")
        for r in rates:
            p = res["poisson" + sfx][f"{r:g}"]
            print(f"| Poisson {r:g}/s | - | {fmt(p['tokens_per_s'], ',.0f')} | - | " +
                  " | ".join(fmt(p[k], '.1f') if k in p else "-" for k in keys) + " |")
    if "over_transformers" in res:
        print(f"sparkchat over transformers' best at one stream: {fmt(res['over_transformers'], '.2f', 'x')}")


if __name__ == "__main__":
    main()
