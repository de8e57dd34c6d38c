"""The server's per-token host work, part by part, each against an alternative, in one run.

Every generated token crosses from the engine process to a front end and leaves as a server-sent event.
The parts measured here (CPU microseconds a token, each side), `--rounds` rounds, median and range:
  - channel: an engine step's tokens for one front end as ONE message on a multiprocessing connection,
    pickled as a serve.wire.Step (token columns, what the server does), against the same columns as JSON
    (send_bytes/recv_bytes), and against one pickled message per token;
  - sse: one content chunk's `data:` line from the precomputed template (serve.serving.TextChunks, what
    the server does) against pydantic's model_dump_json of a chunk object (serve.serving.sse, before);
  - wake: a front end reading engine steps into its streams (serve.engine_link's protocol pushing each
    token to its serve.runtime.TextStream): a message a step back to back, a message a step each after
    the loop slept `--idle` seconds (a front end between an engine's steps), and one message of
    PACED_STEPS steps after as many steps' sleep (the engine pacing its messages:
    serve.wire.PACE_SHARE).

    python -m bench.serve_path [--rows 128] [--steps 300] [--idle 0.011] [--rounds 3] [--out bench/results/serving/serve_path.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time

import uvloop

from bench.stats import fmt, ratios, save_json, spread
from bench.text_model import text_tokenizer
from serve import wire
from serve.engine_link import EngineLink, _Channel
from serve.metrics import Metrics
from serve.runtime import Runtime, TextStream, Wake
from serve.schemas import ChatCompletionChunk, ChunkChoice, Delta
from serve.serving import TextChunks, sse

CHANNELS = ("pickle_step", "json_step", "pickle_token")  # the first is the server's
# steps a paced message carries: a quarter of a stream's spacing at 128 streams and 1,000 events a second
# (32 ms; serve.wire.PACE_SHARE) is about 3 steps of 11 ms at 128 CPU rows
PACED_STEPS = 3


def _receive(conn, kind: str, messages: int) -> None:
    """The front end's side: read `messages` messages, then send back the CPU seconds it took."""
    t = time.process_time()
    for _ in range(messages):
        if kind == "json_step":
            json.loads(conn.recv_bytes())
        else:
            conn.recv()
    conn.send(time.process_time() - t)


def channel_run(kind: str, rows: int, steps: int) -> dict:
    """The engine's side, here: `steps` steps of `rows` (rid, token) events, sent the `kind` way to a
    receiving process over a pipe."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    per_token = kind == "pickle_token"
    proc = ctx.Process(target=_receive, args=(theirs, kind, steps * rows if per_token else steps))
    proc.start()
    rids = list(range(rows))
    batches = [[(step * 7 + rid) % 65536 for rid in rids] for step in range(steps)]
    wall, t = time.perf_counter(), time.process_time()
    for ids in batches:
        if kind == "pickle_step":
            ours.send(wire.Step([], [], [], rids, ids, None, []))
        elif kind == "json_step":
            ours.send_bytes(json.dumps({"rids": rids, "ids": ids}).encode())
        else:
            for rid, id in zip(rids, ids):
                ours.send(wire.Step([], [], [], [rid], [id], None, []))
    sender = time.process_time() - t
    receiver = ours.recv()
    wall = time.perf_counter() - wall
    proc.join()
    n = rows * steps
    return {"sender_us_per_token": 1e6 * sender / n, "receiver_us_per_token": 1e6 * receiver / n,
            "wall_us_per_token": 1e6 * wall / n}


def sse_run(n: int, template: bool) -> float:
    """CPU microseconds a content chunk's event."""
    def chunk(i: int, text: str) -> ChatCompletionChunk:
        return ChatCompletionChunk(id="chatcmpl-x", created=0, model="sparkchat",
                                   choices=[ChunkChoice(index=i, delta=Delta(content=text))])
    fast = TextChunks(chunk, {"usage"})
    t = time.thread_time()
    for i in range(n):
        if template:
            fast(0, f" word{i}")
        else:
            sse(chunk(0, f" word{i}"), {"usage"})
    return 1e6 * (time.thread_time() - t) / n


def wake_run(tok, rows: int, steps: int, idle: float, per_message: int = 1) -> float:
    """CPU microseconds a token for a front end's channel to take `steps` engine steps of `rows` tokens
    into its streams, `per_message` steps a message, each message after `idle` seconds of sleep a step
    in it (0: back to back)."""
    ours, theirs = multiprocessing.Pipe()  # (the link's connection: never used here)
    messages = [wire.frame(wire.Step([], [], [], list(range(rows)) * per_message,
                                     [(step * 7 + rid) % tok.vocab_size for step in range(m, m + per_message)
                                      for rid in range(rows)], None, []))
                for m in range(0, steps, per_message)]

    async def run() -> float:
        link = EngineLink(ours, {})
        link.loop = asyncio.get_running_loop()
        runtime, channel = Runtime(tok, link, {}, Metrics()), _Channel(link)
        for rid in range(rows):
            s = link.streams[rid] = TextStream(runtime, 8, [], wake=Wake())
            s.loop = link.loop
        cpu = 0.0
        for i, data in enumerate(messages):
            if idle:
                await asyncio.sleep(idle * per_message)
            t = time.thread_time()
            channel.data_received(data)
            cpu += time.thread_time() - t
            if i % (16 // per_message) == 0:  # (a stream's reader takes its events now and then)
                for s in link.streams.values():
                    s.pending.clear()
        return 1e6 * cpu / (rows * len(messages) * per_message)

    try:
        return uvloop.run(run())
    finally:
        ours.close(), theirs.close()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="streams decoding together (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="decode steps a round (default: %(default)s)")
    ap.add_argument("--idle", type=float, default=0.011,
                    help="seconds a front end sleeps between two engine steps (default: a 128-row CPU step)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    runs = {k: [] for k in CHANNELS}
    sse_runs = {"template": [], "model_dump_json": []}
    wake_runs = {"back_to_back": [], "after_idle": [], "paced": []}
    tok = text_tokenizer(2048)
    sse_run(2000, True), sse_run(2000, False), wake_run(tok, args.rows, 20, 0.0)  # warm-up
    for _ in range(args.rounds):  # each round measures every way back to back
        for kind in CHANNELS:
            runs[kind].append(channel_run(kind, args.rows, args.steps))
        sse_runs["template"].append(sse_run(20000, True))
        sse_runs["model_dump_json"].append(sse_run(20000, False))
        wake_runs["back_to_back"].append(wake_run(tok, args.rows, args.steps, 0.0))
        wake_runs["after_idle"].append(wake_run(tok, args.rows, args.steps, args.idle))
        wake_runs["paced"].append(wake_run(tok, args.rows, args.steps, args.idle, PACED_STEPS))
    res: dict = {"rows": args.rows, "steps": args.steps, "rounds": args.rounds, "channel": {}, "raw": runs}
    for kind in CHANNELS:
        res["channel"][kind] = {k: spread([r[k] for r in runs[kind]], 3) for k in runs[kind][0]}
        if kind != CHANNELS[0]:  # how many times the server's way is cheaper, per round
            for k in ("sender_us_per_token", "receiver_us_per_token"):
                res["channel"][kind][k + "_x_ours"] = spread(ratios([r[k] for r in runs[kind]],
                                                                    [r[k] for r in runs[CHANNELS[0]]]), 2)
    res["sse_us"] = {k: spread(v, 3) for k, v in sse_runs.items()}
    res["sse_x_template"] = spread(ratios(sse_runs["model_dump_json"], sse_runs["template"]), 2)
    res["raw_sse_us"] = sse_runs
    res["idle_s"] = args.idle
    res["wake_us_per_token"] = {k: spread(v, 3) for k, v in wake_runs.items()}
    res["wake_after_idle_x_back_to_back"] = spread(ratios(wake_runs["after_idle"], wake_runs["back_to_back"]), 2)
    res["wake_after_idle_x_paced"] = spread(ratios(wake_runs["after_idle"], wake_runs["paced"]), 2)
    res["raw_wake_us_per_token"] = wake_runs
    for kind in CHANNELS:
        c = res["channel"][kind]
        print(f"channel {kind:12s} engine side {fmt(c['sender_us_per_token'], '.2f')} us/token, "
              f"front end {fmt(c['receiver_us_per_token'], '.2f')} us/token")
    print(f"sse chunk: template {fmt(res['sse_us']['template'], '.2f')} us, model_dump_json "
          f"{fmt(res['sse_us']['model_dump_json'], '.2f')} us ({fmt(res['sse_x_template'], '.2f')}x)")
    w = res["wake_us_per_token"]
    print(f"a step's message into {args.rows} streams: back to back {fmt(w['back_to_back'], '.2f')} us/token, "
          f"after {args.idle * 1e3:g} ms idle {fmt(w['after_idle'], '.2f')} us/token "
          f"({fmt(res['wake_after_idle_x_back_to_back'], '.2f')}x), {PACED_STEPS} steps a message after as many "
          f"steps idle {fmt(w['paced'], '.2f')} us/token (a message a step: {fmt(res['wake_after_idle_x_paced'], '.2f')}x)")
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
