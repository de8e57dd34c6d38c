"""What an SSE event costs a server with nothing of sparkchat in it: a bare ASGI app under uvicorn.

The app streams chat chunks (the shape sparkchat sends) to every open request at once on a fixed tick,
as an engine step would: `--tokens-per-event` words an event, until each request has its `max_tokens`.
The same client processes as bench/serve_gpu.py's HTTP levels read them; the server's CPU a token is
its process's CPU over the level's window. At one token an event this is the least any Python front
end on uvicorn spends a token; more tokens an event divide it. Median (min-max) of the rounds:

    python -m bench.sse_floor --out bench/results/serving/sse_floor.json

Figures: bench/results/serving.md, "What an event costs".
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

CHUNK = ('data: {"id":"chatcmpl-0","object":"chat.completion.chunk","created":0,"model":"sparkchat",'
         '"choices":[{"index":0,"delta":{"content":%s},"finish_reason":null}]}\n\n')


def make_app(tick: float, per_event: int):
    waiting: list[asyncio.Future] = []

    async def ticker():  # the "engine": every tick, every open stream may send its next event
        while True:
            await asyncio.sleep(tick)
            ready, waiting[:] = waiting[:], []
            for f in ready:
                f.set_result(None)

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            await receive()  # startup
            task = asyncio.get_running_loop().create_task(ticker())
            await send({"type": "lifespan.startup.complete"})
            await receive()  # shutdown
            task.cancel()
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            m = await receive()
            body += m.get("body", b"")
            if not m.get("more_body"):
                break
        if scope["path"] != "/v1/chat/completions":  # /health
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        n = json.loads(body)["max_tokens"]
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        loop, sent = asyncio.get_running_loop(), 0
        while sent < n:
            f = loop.create_future()
            waiting.append(f)
            await f
            k = min(per_event, n - sent)
            sent += k
            await send({"type": "http.response.body", "body": (CHUNK % json.dumps(" word" * k)).encode(), "more_body": True})
        usage = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "sparkchat",
                 "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
        await send({"type": "http.response.body", "body": f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode(),
                    "more_body": False})
    return app


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--tokens-per-event", default="1,2,4", help="levels, comma-separated (default: %(default)s)")
    ap.add_argument("--tick", type=float, default=0.017,
                    help="seconds between events, about a CPU decode step at 128 rows (default: %(default)s)")
    ap.add_argument("--new", type=int, default=128, help="tokens a request (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server child: its tokens an event
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        import uvicorn
        uvicorn.run(make_app(args.tick, args.serve), host="127.0.0.1", port=args.port, log_level="warning")
        return {}
    import psutil

    from bench.serve import client_processes, rounds_in_processes, running_server
    from bench.stats import fmt, save_json, spread
    res = {"command": "python -m bench.sse_floor " + " ".join(argv or sys.argv[1:]), "streams": args.streams,
           "tick_s": args.tick, "new_tokens": args.new, "cpu_count": os.cpu_count(), "levels": {}}
    for per in [int(x) for x in args.tokens_per_event.split(",")]:
        rounds = []
        argv_ = ["-m", "bench.sse_floor", "--serve", str(per), "--tick", str(args.tick)]
        with running_server(argv_, timeout=60) as (base, pid):
            proc = psutil.Process(pid)
            cpu = lambda: sum(proc.cpu_times()[:2])  # noqa: E731
            for _ in range(args.rounds):
                r = rounds_in_processes(base + "/v1/chat/completions", args.streams, args.new, args.seconds,
                                        client_processes(args.streams), cpu, cpu)
                rounds.append({"tokens": r.tokens, "seconds": round(r.seconds, 3),
                               "server_cpu_us_per_token": round(1e6 * (r.at_end - r.at_start) / r.tokens, 2),
                               "load_average_1m": os.getloadavg()[0]})
        s = spread(r["server_cpu_us_per_token"] for r in rounds)
        res["levels"][per] = {"rounds": rounds, "server_cpu_us_per_token": s}
        print(f"{per} token(s) an event, {args.streams} streams: {fmt(s, '.1f')} us of server CPU a token", flush=True)
    save_json(res, args.out, indent=1)
    return res


if __name__ == "__main__":
    main()
