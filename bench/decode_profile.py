"""Where a decode step's time goes on a GPU: one step of the engine's CUDA graph (d20 shape, random
weights, `--rows` rows, `--slots` cache slots), its wall time by replay, and its kernels by name from
torch.profiler (CUPTI sees the kernels inside a graph replay): count a step, device time a step, and
the step's wall time less the kernels' sum (the gaps between kernels, which a graph does not remove).

Beside it the floor: the bytes of the weights a step reads over the copy bandwidth measured in the same
run (bench.serve_gpu). `--weights fp8` converts the Linears first (model/precision/fp8_weights.py).
`--variants`: ways of running the step, each captured as its own graph and timed in turn, round by round:
`cublas` (each Linear as is), `rows` (model.gpt.ROW_PRODUCTS: one row's products as Inductor reductions).

    python -m bench.decode_profile --rows 1,128 --out /tmp/decode_profile.json
"""
from __future__ import annotations

import argparse
import time

import torch

from bench.stats import save_json, spread


def profile_step(graph: torch.cuda.CUDAGraph, replays: int, lengths: torch.Tensor, start: int) -> tuple[list[dict], float]:
    """Kernels of `replays` replays of `graph`: per name, count and device microseconds a replay."""
    from torch.profiler import ProfilerActivity, profile
    lengths.fill_(start)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            kernels.setdefault(ev.name, []).append(ev.device_time_total)
    rows = [{"kernel": k[:120], "count": len(v) / replays, "us": round(sum(v) / replays, 2)} for k, v in kernels.items()]
    rows.sort(key=lambda r: -r["us"])
    return rows, sum(r["us"] for r in rows)


def wall_us(graph: torch.cuda.CUDAGraph, replays: int, lengths: torch.Tensor, start: int) -> float:
    """Wall microseconds a replay; each replay adds a token to every row, so the rows start at `start`."""
    lengths.fill_(start)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / replays * 1e6


def main(argv=None) -> dict:
    from bench.serve_gpu import copy_bandwidth, d_model
    from model import gpt
    from model.engine import Engine, EngineConfig
    from model.precision import fp8_weights
    from model.sampling import RANKED_K

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depth", type=int, default=20)
    ap.add_argument("--rows", default="1,128", help="rows a step, comma-separated")
    ap.add_argument("--slots", type=int, default=256, help="cache slots each row holds (the step's bucket)")
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp8"])
    ap.add_argument("--variants", default="cublas,rows")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = [int(r) for r in args.rows.split(",")]
    model = d_model(args.depth, 65536, dev)
    if args.weights == "fp8":
        fp8_weights.convert(model, torch.bfloat16)
    bw = copy_bandwidth(dev)
    weight_bytes = fp8_weights.weight_bytes(model)
    res = {"command": "python -m bench.decode_profile " + " ".join(argv or []), "depth": args.depth,
           "weights": args.weights, "slots": args.slots, "copy_bandwidth_GBps": round(bw / 1e9, 1),
           "weight_bytes": weight_bytes, "floor_us": round(weight_bytes / bw * 1e6, 1), "rows": {}}
    engine = Engine(model, EngineConfig(max_batch=max(rows), cuda_graphs=True))
    g = engine.graphs
    variants = args.variants.split(",")
    with torch.inference_mode():
        for n in rows:
            # rows hold half the bucket's slots, so the replays' added tokens stay inside it
            start, replays = args.slots // 2, min(100, args.slots // 2 - 1)
            lengths = engine.cache.lengths[:n]
            lengths.fill_(start)
            graphs = {}
            for v in variants:
                gpt.ROW_PRODUCTS = v == "rows"
                graphs[v], _, _ = g._capture(g._bucket(n, 1, g.max_batch), g._bucket(args.slots, 64, g.max_len),
                                             RANKED_K, False)
            walls = {v: [] for v in variants}
            for _ in range(args.rounds):  # the variants in turn, round by round
                for v in variants:
                    walls[v].append(wall_us(graphs[v], replays, lengths, start))
            res["rows"][n] = {}
            for v in variants:
                kernels, device_us = profile_step(graphs[v], 20, lengths, start)
                w = spread(walls[v])
                r = res["rows"][n][v] = {"wall_us": w, "kernels_us": round(device_us, 1),
                                         "gaps_us": round(w["median"] - device_us, 1),
                                         "kernels_a_step": round(sum(k["count"] for k in kernels), 1),
                                         "floor_fraction": round(res["floor_us"] / w["median"], 3), "top": kernels[:25]}
                print(f"{n} rows, {v}: step {w['median']:.1f} us ({w['min']:.1f}-{w['max']:.1f}), kernels {device_us:.1f} us "
                      f"in {r['kernels_a_step']} kernels, floor {res['floor_us']} us ({r['floor_fraction']:.2f} of it)",
                      flush=True)
                for k in kernels[:25]:
                    print(f"   {k['us']:8.1f} us  x{k['count']:5.1f}  {k['kernel'][:100]}")
    gpt.ROW_PRODUCTS = False
    if args.out:
        save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
