"""The server's per-token host work, part by part, each against the way it was done before, in one run.

At 128 streams a GPU decodes ~40k tokens/s, and every token crosses from the engine thread to the event
loop and leaves as a server-sent event. The two parts measured here (CPU seconds a token, by thread):
  - handoff: the engine thread's events into the streams' asyncio queues, one call_soon_threadsafe per
    event (before) against serve.runtime's batched handoff (one wake-up of the loop per batch);
  - sse: one streamed chunk as JSON text, model_dump() then json.dumps (before) against pydantic's own
    model_dump_json (serve.serving.sse).

    python -m bench.serve_path [--rows 128] [--steps 300] [--out bench/results/x.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

from bench.serve_gpu import save
from serve.runtime import loop_handoff
from serve.schemas import ChatCompletionChunk, ChunkChoice, Delta
from serve.serving import sse


async def handoff_run(rows: int, steps: int, batched: bool, step_s: float) -> dict:
    """An engine-like thread emits one event per row per step (sleeping `step_s` for the device's step)
    while one reader task per row takes them from its queue."""
    loop = asyncio.get_running_loop()
    queues = [asyncio.Queue() for _ in range(rows)]
    handoff, engine_cpu = loop_handoff(loop), []

    def engine():
        t = time.thread_time()
        for step in range(steps):
            for q in queues:
                if batched:
                    handoff.put(q, step)
                else:
                    loop.call_soon_threadsafe(q.put_nowait, step)
            time.sleep(step_s)
        engine_cpu.append(time.thread_time() - t)

    async def reader(q: asyncio.Queue):
        for _ in range(steps):
            await q.get()

    thread = threading.Thread(target=engine)
    wall, loop_cpu = time.perf_counter(), time.thread_time()
    thread.start()
    await asyncio.gather(*(reader(q) for q in queues))
    thread.join()
    n = rows * steps
    return {"events": n, "seconds": time.perf_counter() - wall, "engine_us_per_event": 1e6 * engine_cpu[0] / n,
            "loop_us_per_event": 1e6 * (time.thread_time() - loop_cpu) / n}


def sse_run(n: int, fast: bool) -> float:
    """CPU microseconds a chunk (a content delta, as most chunks are)."""
    t = time.thread_time()
    for i in range(n):
        c = ChatCompletionChunk(id="chatcmpl-x", created=0, model="sparkchat",
                                choices=[ChunkChoice(index=0, delta=Delta(content=f" word{i}"))])
        if fast:
            sse(c, exclude={"usage"})
        else:
            f"data: {json.dumps(c.model_dump(exclude={'usage'}), ensure_ascii=False)}\n\n"
    return 1e6 * (time.thread_time() - t) / n


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=128, help="streams decoding together (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=300, help="decode steps (default: %(default)s)")
    ap.add_argument("--step-ms", type=float, default=0.5, help="the device's time a step (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    res: dict = {"rows": args.rows, "steps": args.steps, "step_ms": args.step_ms}
    for name, batched in (("per_event", False), ("batched", True)):
        runs = [asyncio.run(handoff_run(args.rows, args.steps, batched, args.step_ms / 1000))
                for _ in range(args.repeats)]
        res[f"handoff_{name}"] = min(runs, key=lambda r: r["engine_us_per_event"])  # least disturbed run
    for k in ("engine_us_per_event", "loop_us_per_event"):
        res[f"handoff_{k}_ratio"] = round(res["handoff_per_event"][k] / res["handoff_batched"][k], 2)
    sse_run(2000, True), sse_run(2000, False)  # warm-up
    res["sse_us_dump_then_json"] = min(sse_run(20000, False) for _ in range(args.repeats))
    res["sse_us_model_dump_json"] = min(sse_run(20000, True) for _ in range(args.repeats))
    res["sse_ratio"] = round(res["sse_us_dump_then_json"] / res["sse_us_model_dump_json"], 2)
    b, p = res["handoff_batched"], res["handoff_per_event"]
    print(f"handoff, {args.rows} rows x {args.steps} steps: engine thread {p['engine_us_per_event']:.2f} -> "
          f"{b['engine_us_per_event']:.2f} us CPU an event ({res['handoff_engine_us_per_event_ratio']}x less), "
          f"loop {p['loop_us_per_event']:.2f} -> {b['loop_us_per_event']:.2f} ({res['handoff_loop_us_per_event_ratio']}x less)")
    print(f"sse chunk: {res['sse_us_dump_then_json']:.2f} -> {res['sse_us_model_dump_json']:.2f} us CPU "
          f"({res['sse_ratio']}x less)")
    save(res, args.out)
    return res


if __name__ == "__main__":
    main()
