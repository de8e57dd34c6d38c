"""The server's per-token host work, part by part, each against an alternative, in one run.

Every generated token crosses from the engine process to a front end and leaves as a server-sent event.
The parts measured here (CPU microseconds a token, each side), `--rounds` rounds, median and range:
  - channel: an engine step's tokens for one front end as ONE message on a multiprocessing connection,
    pickled (serve.engine_proc, what the server does), against the same message as JSON
    (send_bytes/recv_bytes), and against one pickled message per token;
  - sse: one content chunk's `data:` line from the precomputed template (serve.serving.TextChunks, what
    the server does) against pydantic's model_dump_json of a chunk object (serve.serving.sse, before).

    python -m bench.serve_path [--rows 128] [--steps 300] [--rounds 3] [--out bench/results/serving/serve_path.json]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import time

from bench.stats import fmt, ratios, save_json, spread
from serve.schemas import ChatCompletionChunk, ChunkChoice, Delta
from serve.serving import TextChunks, sse

CHANNELS = ("pickle_step", "json_step", "pickle_token")  # the first is the server's


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
    batches = [[(rid, (step * 7 + rid) % 65536) for rid in range(rows)] for step in range(steps)]
    wall, t = time.perf_counter(), time.process_time()
    for batch in batches:
        if kind == "pickle_step":
            ours.send(("step", batch))
        elif kind == "json_step":
            ours.send_bytes(json.dumps(["step", batch]).encode())
        else:
            for event in batch:
                ours.send(("step", [event]))
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="streams decoding together (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="decode steps a round (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    runs = {k: [] for k in CHANNELS}
    sse_runs = {"template": [], "model_dump_json": []}
    sse_run(2000, True), sse_run(2000, False)  # warm-up
    for _ in range(args.rounds):  # each round measures every way back to back
        for kind in CHANNELS:
            runs[kind].append(channel_run(kind, args.rows, args.steps))
        sse_runs["template"].append(sse_run(20000, True))
        sse_runs["model_dump_json"].append(sse_run(20000, False))
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
    for kind in CHANNELS:
        c = res["channel"][kind]
        print(f"channel {kind:12s} engine side {fmt(c['sender_us_per_token'], '.2f')} us/token, "
              f"front end {fmt(c['receiver_us_per_token'], '.2f')} us/token")
    print(f"sse chunk: template {fmt(res['sse_us']['template'], '.2f')} us, model_dump_json "
          f"{fmt(res['sse_us']['model_dump_json'], '.2f')} us ({fmt(res['sse_x_template'], '.2f')}x)")
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
