"""Serving throughput: generated tokens/s at 1, 4 and 16 concurrent streams, median and range of rounds.

Starts the real server (`python -m serve`, a separate process, on a free loopback port) over a model
directory, then, in each round, keeps N client streams busy for `--seconds` per level (each sends one
request after another) and counts the completion tokens the server reports in each stream's usage
frame. Each level's ratio to the first is taken within a round (both measured back to back), and the
figures are the median (min-max) over the rounds (bench/stats.py); `--out` writes every round:

    python bench/serve.py --levels 1,16          # the pipeline's final model (artifacts/model)
    python bench/serve.py --random-init 4        # no trained model yet: a random depth-4 model

Continuous batching should make 16 streams give several times the tokens/s of one: all active rows
decode in one forward, so the per-step cost grows far slower than the batch. The current figures are
on bench/results/serving.md, "16 streams against 1 on a CPU".
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import queue
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import httpx

try:
    from bench.stats import fmt, ratios, save_json, spread
except ModuleNotFoundError:  # run as a script (python bench/serve.py): the project root is not on the path
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.stats import fmt, ratios, save_json, spread
from sparkchat import paths  # noqa: E402  (after the project root is on the path)

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["Tell me a long story about a dragon.", "What is the capital of France?",
           "Write a poem about the sea.", "Explain how a computer works.", "Hello! How are you today?",
           "List some animals and describe them.", "What is 12 + 30?", "Describe your favourite food."]


def random_model_dir(depth: int, out: Path) -> Path:
    """A random model shaped like the default (CPU) profile: width 32*depth, heads of 32, GQA 2:1, with
    the serving benchmarks' 2,048-id text tokenizer (bench/text_model.py)."""
    sys.path.insert(0, str(ROOT))
    import torch

    from bench.text_model import text_tokenizer, write_model_dir
    from model.gpt import GPT, GPTConfig

    tok = text_tokenizer(2048)
    n_embd = 32 * depth
    cfg = GPTConfig(vocab_size=tok.vocab_size, n_layer=depth, n_embd=n_embd, n_head=n_embd // 32,
                    n_kv_head=max(1, n_embd // 64), seq_len=128)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.init_weights(seed=0)
    return write_model_dir(model, tok, out, {"temperature": 1.0, "top_k": 50, "max_tokens": 100})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(argv: list[str], timeout: float = 120):
    """Start `python <argv> --port P` from the project root (a separate process), wait until /health
    answers, yield (base URL, its pid), and stop the server afterwards. Its output goes to a temporary
    file (a pipe nobody reads would fill with its access log and stop it), shown if it fails to start."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("SPARKCHAT_API_KEY", None)
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen([sys.executable, *argv, "--port", str(port)], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.time() + timeout
            while True:
                try:
                    if httpx.get(base + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None or time.time() > deadline:
                    log.seek(0)
                    sys.exit("the server did not start:\n" + log.read().decode(errors="replace")[-3000:])
                time.sleep(0.2)
            yield base, server.pid
        finally:
            server.terminate()
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                server.kill()


async def one_stream(client: httpx.AsyncClient, url: str, i: int, max_tokens: int, keep: list | None = None) -> int:
    """One streamed chat completion; its completion tokens (from the usage chunk). `keep`: a list that
    gets the response's data lines (one list a response), read after the timed rounds."""
    body = {"model": "sparkchat", "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            "max_tokens": max_tokens, "temperature": 1.0, "seed": i, "stream": True,
            "stream_options": {"include_usage": True}}
    for attempt in (1, 2):
        last, lines = "", []
        try:
            async with client.stream("POST", url, json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        last = line  # parsed once, at the end: a client that parsed every chunk measured itself
                        if keep is not None:
                            lines.append(line)
            break
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # a kept-alive connection the server closed as idle (uvicorn's keep-alive timeout is 5 s; a
            # stream that finished early waits for the rest of its round) can fail as it is reused: sent
            # again once, on a new connection, if nothing came back
            if last or attempt == 2:
                raise
    if keep is not None:
        keep.append(lines)
    usage = json.loads(last[6:]).get("usage") if last else None  # the usage chunk comes last
    return usage["completion_tokens"] if usage else 0


@contextlib.asynccontextmanager
async def stream_clients(n: int):
    """One HTTP client (one kept-alive connection) per stream. A client shared by many streams scans its
    whole connection pool for every request and every response event: at 128 streams that client, not
    the server, set the rate (bench/results/serving.md, "The benchmark's HTTP client against the server")."""
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(httpx.AsyncClient(timeout=600)) for _ in range(n)]


def client_processes(streams: int) -> int:
    """Client processes for `streams`: one per 8 streams, on at most half the cores this process may use.
    A Python client spends more CPU a streamed token than the server's own loop does above one stream
    (bench/results/serving.md, "The benchmark's HTTP client against the server"), so at tens of thousands of tokens/s one process of them would
    time itself, not the server."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(1, min(-(-streams // 8), cores // 2))


def shares(streams: int, procs: int) -> list[range]:
    """The streams' indices split into contiguous shares, one a process, none empty (so prompts mix)."""
    if streams < 1 or procs < 1:
        raise ValueError(f"need at least one stream and one client process, not {streams} and {procs}")
    procs = min(procs, streams)
    return [range(p * streams // procs, (p + 1) * streams // procs) for p in range(procs)]


class Rounds(NamedTuple):
    processes: int
    tokens: int
    seconds: float  # wall time from the start signal until the last process finished
    client_cpu_s: float  # all client processes together
    busiest_cpu_share: float  # the busiest process's CPU seconds / its own seconds
    at_start: object  # what at_start() returned
    at_end: object = None  # what at_end() returned
    text_tokens: int | None = None  # of `tokens`, those that arrived as text (with a tokenizer)
    text_events: int | None = None  # the events that carried them (content_events; with a tokenizer)


def _contents(chunks: list[dict]) -> list[str]:
    """The text of each parsed chunk that has a choice ("" where its delta carries none)."""
    return [c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")]


def text_tokens_of(tok, responses: list[list[str]]) -> int:
    """Of the completion tokens of these streamed chat responses (each its data lines, the usage chunk
    last), those that arrived as text: per response, the tokens its content events stand for
    (bench.text_model.text_tokens), at most its completion tokens."""
    from bench.text_model import text_tokens
    total = 0
    for lines in responses:
        chunks = [json.loads(line[6:]) for line in lines]
        usage = chunks[-1].get("usage") if chunks else None
        if not usage:
            raise RuntimeError("a streamed response without its usage chunk: cannot count its tokens")
        texts = sum(text_tokens(tok, t) for t in _contents(chunks))
        total += min(texts, usage["completion_tokens"])
    return total


def content_events(responses: list[list[str]]) -> int:
    """The SSE events of these streamed chat responses (each its data lines) that carry text: what the
    server pays once an event, however many tokens each carries."""
    return sum(1 for lines in responses for t in _contents([json.loads(line[6:]) for line in lines]) if t)


def _client_rounds(ids: range, url: str, max_tokens: int, seconds: float, out, go, counted, tokenizer) -> None:
    """One client process: a connection per stream (`ids`: the streams' indices), a warm-up round, then,
    once `go` is set, rounds of all of them at once for at least `seconds`. Puts "ready" on `out` after
    the warm-up, then (tokens, CPU seconds, seconds). With `tokenizer` (a tokenizer.json), it keeps the
    responses' lines and, once `counted` is set (every process done timing), puts the tokens that arrived
    as text (text_tokens_of): counting them takes no CPU from a timed round."""
    async def run():
        keep = [] if tokenizer else None
        async with stream_clients(len(ids)) as clients:
            await asyncio.gather(*(one_stream(c, url, i, max_tokens) for c, i in zip(clients, ids)))
            out.put("ready")
            go.wait()
            t, cpu, tokens = time.perf_counter(), time.process_time(), 0
            while not tokens or time.perf_counter() - t < seconds:
                got = sum(await asyncio.gather(*(one_stream(c, url, i, max_tokens, keep) for c, i in zip(clients, ids))))
                if not got:
                    raise RuntimeError(f"a round of {len(ids)} streams got no tokens: no usage chunk from {url}?")
                tokens += got
            out.put((tokens, time.process_time() - cpu, time.perf_counter() - t))
        if tokenizer:
            from model.tokenizer import SparkTokenizer
            counted.wait()
            out.put(("text", text_tokens_of(SparkTokenizer.load(tokenizer), keep), content_events(keep)))
    asyncio.run(run())


def rounds_in_processes(url: str, streams: int, max_tokens: int, seconds: float, procs: int,
                        at_start=None, at_end=None, tokenizer: str | None = None) -> Rounds:
    """`streams` streams spread over `procs` client processes (at most one a stream), each running rounds of
    its share (`_client_rounds`). `at_start()` runs after every process has warmed up and before any
    starts timing, `at_end()` once every process has finished timing. With `tokenizer` (the model's
    tokenizer.json), also the tokens that arrived as text. A process that fails stops the run."""
    ctx = multiprocessing.get_context("spawn")  # the parent may hold a CUDA context: never fork it
    out, go, counted = ctx.Queue(), ctx.Event(), ctx.Event()
    workers = [ctx.Process(target=_client_rounds, args=(ids, url, max_tokens, seconds, out, go, counted, tokenizer),
                           daemon=True)
               for ids in shares(streams, procs)]

    def take(n: int, timeout: float) -> list:
        got, deadline = [], time.monotonic() + timeout
        while len(got) < n:
            try:
                got.append(out.get(timeout=1))
            except queue.Empty:
                if any(w.exitcode not in (None, 0) for w in workers):
                    sys.exit("a client process failed (its traceback is above)")
                if time.monotonic() > deadline:
                    sys.exit(f"the client processes gave no answer in {timeout:.0f} s")
        return got

    for w in workers:
        w.start()
    parts: list = []
    try:
        take(len(workers), 600)  # every process warmed up
        snapshot = at_start() if at_start else None
        go.set()
        t = time.perf_counter()
        parts = take(len(workers), 600 + 10 * seconds)
        wall = time.perf_counter() - t
        ended = at_end() if at_end else None
        counted.set()
        texts = take(len(workers), 600) if tokenizer else None
    finally:
        for w in workers:  # done by now, unless the run failed: then do not wait for them
            w.join(timeout=5 if parts else 0)
            if w.is_alive():
                w.kill()
    tokens, cpu, secs = zip(*parts)
    return Rounds(len(workers), sum(tokens), wall, sum(cpu), max(c / s for c, s in zip(cpu, secs)), snapshot,
                  ended, *([sum(t[1] for t in texts), sum(t[2] for t in texts)] if texts is not None else []))


async def run_level(base: str, streams: int, seconds: float, max_tokens: int) -> tuple[int, int, float]:
    """Each of `streams` workers sends request after request until `seconds` have passed; returns
    (completion tokens, requests, seconds until the last one finished)."""
    url = base + "/v1/chat/completions"
    async with stream_clients(streams) as clients:
        await one_stream(clients[0], url, 999, 4)  # warm-up
        t = time.perf_counter()

        async def worker(w: int) -> list[int]:
            counts = []
            while time.perf_counter() - t < seconds:
                counts.append(await one_stream(clients[w], url, w * 10_000 + len(counts), max_tokens))
            return counts

        counts = [c for per in await asyncio.gather(*(worker(w) for w in range(streams))) for c in per]
        return sum(counts), len(counts), time.perf_counter() - t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(paths.CHAT_MODEL), help="model directory (default: %(default)s)")
    ap.add_argument("--random-init", type=int, metavar="DEPTH", help="bench a random model of this depth instead")
    ap.add_argument("--levels", default="1,4,16", help="concurrent streams to measure (default: %(default)s)")
    ap.add_argument("--seconds", type=float, default=8.0, help="how long each level keeps its streams busy")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every level, one after another (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="write the rounds and their median and range here as JSON")
    args = ap.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    if args.rounds < 1:
        sys.exit(f"--rounds must be at least 1, not {args.rounds}")

    rounds: dict[int, list[float]] = {n: [] for n in levels}
    res: dict = {"model": args.model if not args.random_init else f"random depth {args.random_init}",
                 "device": args.device, "seconds_per_level": args.seconds, "max_tokens": args.max_tokens,
                 "load_average_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_model_dir(args.random_init, Path(tmp) / "model") if args.random_init else Path(args.model)
        if not (model_dir / "config.json").is_file():
            sys.exit(f"{model_dir} is not a model directory: run the pipeline, or pass --random-init DEPTH")
        argv = ["-m", "serve", "--model", str(model_dir), "--device", args.device, "--max-batch", str(max(levels)),
                "--max-queue", "256"]
        with running_server(argv) as (base, _):
            for r in range(args.rounds):
                for n in levels:
                    tokens, requests, secs = asyncio.run(run_level(base, n, args.seconds, args.max_tokens))
                    rounds[n].append(tokens / secs)
                    print(f"round {r + 1}/{args.rounds}: {n:3d} streams: {tokens:6d} tokens ({requests:4d} requests) in "
                          f"{secs:5.2f} s = {tokens / secs:7.1f} tokens/s"
                          + (f"  ({tokens / secs / rounds[levels[0]][r]:.2f}x vs {levels[0]})" if n != levels[0] else ""),
                          flush=True)
    res["load_average_at_end"] = os.getloadavg()
    res["levels"] = {}
    for n in levels:  # the ratio within each round (both levels measured back to back), then its spread
        res["levels"][n] = {"tokens_per_s_rounds": [round(x, 2) for x in rounds[n]],
                            "tokens_per_s": spread(rounds[n], 2),
                            f"vs_{levels[0]}": spread(ratios(rounds[n], rounds[levels[0]]))}
        vs = f"{fmt(res['levels'][n][f'vs_{levels[0]}'], '.2f', 'x')} vs {levels[0]}, " if n != levels[0] else ""
        print(f"{n:3d} streams: {fmt(res['levels'][n]['tokens_per_s'])} tokens/s, {vs}"
              f"median (min-max) of {args.rounds} rounds", flush=True)
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
