"""A full collection's pause in the server's processes, with their start-up heap frozen and not.

Python's collector walks every object it tracks in a full (generation 2) pass, and a process that has
imported torch, FastAPI and Gradio tracks hundreds of thousands, none of which serving frees. `sparkchat
serve` freezes each process's start-up heap once it is built (serve.processes.freeze_heap), so later
passes walk only what serving made. Each process is built here as the server builds it, in a fresh
interpreter (spawn), then `--rounds` full passes (gc.collect()) are timed before and after freeze_heap():
  - front end: serve.api.create_app with the chat page (serve.supervisor.frontend_main, before uvicorn);
  - engine: serve.engine_proc.load_engine of a model directory (the model, its tokenizer, the engine).

    python -m bench.gc_pause [--model artifacts/model] [--rounds 5] [--out bench/results/serving/gc_pause.json]
"""
from __future__ import annotations

import argparse
import gc
import multiprocessing
import time
from pathlib import Path

from bench.stats import fmt, save_json, spread


def _passes(rounds: int) -> list[float]:
    """Milliseconds of each of `rounds` full collections."""
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _measure(kind: str, model: str, rounds: int, conn) -> None:
    """In a fresh process: build `kind`'s heap, then time full passes unfrozen and frozen."""
    from serve.engine_proc import load_engine
    from serve.processes import freeze_heap
    if kind == "frontend":
        from serve.api import Settings, create_app
        keep = create_app(Settings(model_dir=Path(model), ui=True))
    else:
        keep = load_engine(model, "cpu", 128, 1024)
    tracked = len(gc.get_objects())
    unfrozen = _passes(rounds)
    freeze_heap()
    frozen = _passes(rounds)
    conn.send({"tracked_objects": tracked, "left_after_freeze": len(gc.get_objects()),
               "unfrozen_ms": unfrozen, "frozen_ms": frozen})
    del keep


def measure(kind: str, model: str, rounds: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    p = ctx.Process(target=_measure, args=(kind, model, rounds, theirs))
    p.start()
    res = ours.recv()
    p.join()
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="artifacts/model", help="the engine's model directory (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="full passes timed each way (default: %(default)s)")
    ap.add_argument("--out", help="write the results here as JSON")
    args = ap.parse_args(argv)
    res: dict = {"model": args.model, "rounds": args.rounds}
    for kind in ("frontend", "engine"):
        r = measure(kind, args.model, args.rounds)
        r["unfrozen"], r["frozen"] = spread(r["unfrozen_ms"], 3), spread(r["frozen_ms"], 3)
        res[kind] = r
        print(f"{kind:9s} {r['tracked_objects']:7,} objects: a full pass {fmt(r['unfrozen'], '.1f')} ms, frozen "
              f"{fmt(r['frozen'], '.2f')} ms ({r['left_after_freeze']:,} objects left to walk)", flush=True)
    save_json(res, args.out)
    return res


if __name__ == "__main__":
    main()
