"""Where the time to first token goes on a GPU at idle: the engine's TTFT of one prompt, and the prefill
forward alone, timed on the host (until the call returns: launch work) and to the end on the device,
with the CPU operators that take the host's time (torch.profiler), for the forward alone and for the
scheduler's admission of one request.

    python -m bench.ttft_parts [--prompt 64] [--out bench/results/x.json]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.serve_gpu import d_model, save
from model.engine import Engine, EngineConfig, SamplingParams


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    model = d_model(args.depth, 65536, dev)
    engine = Engine(model, EngineConfig(max_batch=16, max_len=2048)).start()
    ids = torch.randint(0, 65536, (1, args.prompt)).tolist()[0]
    ttft = []
    for _ in range(7):
        t = time.perf_counter()
        engine.generate(ids, SamplingParams(temperature=1.0, top_k=50, max_tokens=1))
        ttft.append((time.perf_counter() - t) * 1e3)
    # the scheduler's admission of one request (prefill, first token, its events) run in this thread,
    # where the profiler sees it (it does not follow the engine's own thread)
    engine.shutdown()
    engine._running = True
    events = []
    engine.submit(ids, SamplingParams(temperature=1.0, top_k=50, max_tokens=1), events.append)
    with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        engine._admit()
        admit_ms = (time.perf_counter() - t) * 1e3
    engine._running = False
    assert [type(e).__name__ for e in events] == ["Token", "Finished"], events
    res = {"ttft_ms": round(statistics.median(ttft[2:]), 2), "admit_ms_profiled": round(admit_ms, 2),
           "prefill_graph_replays": engine.graphs.prefill_replays if engine.graphs else 0,
           "engine_profile": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                                       max_name_column_width=70)}
    x = torch.tensor([ids], device=dev)
    host, total = [], []
    with torch.inference_mode():
        view = engine.cache.view(0, 1)
        for _ in range(7):
            view.lengths.zero_()
            torch.cuda.synchronize()
            t = time.perf_counter()
            model(x, kv_cache=view, kv_len=args.prompt)
            host.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            total.append((time.perf_counter() - t) * 1e3)
        view.lengths.zero_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            model(x, kv_cache=view, kv_len=args.prompt)
            torch.cuda.synchronize()
    res.update(prefill_host_ms=round(statistics.median(host[2:]), 2), prefill_ms=round(statistics.median(total[2:]), 2))
    print(f"engine TTFT ({args.prompt}-token prompt, 1 new token): {res['ttft_ms']} ms ({res['prefill_graph_replays']} "
          f"of 8 prefills replayed from a graph); the compiled prefill forward alone: "
          f"{res['prefill_host_ms']} ms on the host until it returns, {res['prefill_ms']} ms to the end", flush=True)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    print("the prefill forward:\n" + table, flush=True)
    print(f"one request's admission (prefill, first token) in {res['admit_ms_profiled']} ms under the profiler:\n"
          + res["engine_profile"], flush=True)
    res["profile"] = table
    save(res, args.out)
    return res


if __name__ == "__main__":
    main()
