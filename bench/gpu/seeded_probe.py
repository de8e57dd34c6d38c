"""Where seeded sampling differs between runs of the same requests (the GPU test's, one at a time),
with CUDA graphs and run-ahead, graphs alone, and neither. Run on the H200 (run6 in
bench/results/h200-engine-2026-12-04c); part of bench/gpu/determinism_h200.sh."""
import sys
import time

import torch

sys.path.insert(0, "tests")
from test_engine_gpu import generate_all, gpu_model_bf16, prompts  # noqa: E402

from model.engine import Engine, EngineConfig, SamplingParams  # noqa: E402


def runs(cfg, n=3):
    torch._dynamo.reset()
    engine = Engine(gpu_model_bf16(), cfg).start()
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, max_tokens=40, seed=0)
    out = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            out.append([generate_all(engine, [p], lambda _: params)[0] for p in prompts()])
            print(f"  run in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        engine.shutdown()
    return out


for name, cfg in (("graphs, run ahead", EngineConfig(max_batch=16)),
                  ("graphs, no run ahead", EngineConfig(max_batch=16, run_ahead=False)),
                  ("no graphs (eager, run ahead)", EngineConfig(max_batch=16, cuda_graphs=False, run_ahead=True))):
    print(name, flush=True)
    rs = runs(cfg)
    for j in range(1, len(rs)):
        for i, (a, b) in enumerate(zip(rs[0], rs[j])):
            if a != b:
                pos = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"  run {j} vs 0: prompt {i} (len {len(prompts()[i])}) differs at token {pos}: "
                      f"{a[max(0, pos - 2):pos + 3]} vs {b[max(0, pos - 2):pos + 3]} (lengths {len(a)}, {len(b)})", flush=True)
    print(f"  runs equal: {[rs[0] == r for r in rs]}", flush=True)
